"""`prepare`: one batch checked and laid out as the engine's static and traced arguments.

A `Prepared` is what `generate` runs and `stream` resumes chunk by chunk; benchmarks
time it (`specjax.costs`). On a mesh (`distribute`) it carries the mesh and the caller's
row count, pads the batch to the 'data' axis and hands back only the caller's rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import arguments
from specjax import checks
from specjax import decode as decode_lib
from specjax import distribute as distribute_lib
from specjax import drafters as drafters_lib
from specjax import params as params_lib
from specjax import results
from specjax import timing
from specjax import trees as trees_lib
from specjax.models import heads as heads_lib
from specjax.models import sharding
from specjax.models.tensor_layout import host
from specjax.models.model import Model
from specjax.processors import history as processors
from specjax.processors import stops as stops_lib
from specjax.processors.sampling import Sampling
from specjax.verify import rules as rules_lib

@dataclasses.dataclass(frozen=True)
class StopList:
  """What can end a row at a stop, on the host, to name the one that did (the engine
  only flags that one did): the EOS ids, then `stop_sequences` as given (strings or
  bytes as they are, token-id lists as tuples)."""
  eos: tuple[int, ...]
  given: tuple
  min_new: np.ndarray  # int[B]: a stop string completed before this does not count

  def reason(self, row: int, new: list[int], token_bytes) -> int | str | bytes | list[int] | None:
    """The stop that the last of a stopped row's new tokens completed, or None (the
    row ended otherwise); the first in this list's order where several did."""
    if not new:
      return None
    if new[-1] in self.eos:
      return new[-1]
    text = None
    for stop in self.given:
      if not isinstance(stop, (str, bytes)):
        if tuple(new[-len(stop):]) == stop:  # a match lies wholly in the new tokens
          return list(stop)
        continue
      if len(new) <= self.min_new[row] or token_bytes is None:
        continue
      if text is None:
        last = token_bytes[new[-1]] if new[-1] < len(token_bytes) else b""
        text = b"".join(token_bytes[t] if t < len(token_bytes) else b"" for t in new)
      data = stop.encode("utf-8") if isinstance(stop, str) else stop
      # An occurrence ending inside the last token's bytes.
      if text.find(data, max(0, len(text) - len(last) - len(data) + 1)) >= 0:
        return stop
    return None


@dataclasses.dataclass(frozen=True)
class Prepared:
  """Everything the engine needs for one batch, checked: `prepare`'s result."""
  engine: decode_lib.Engine  # static: compiled once per engine and shapes
  weights: decode_lib.Weights
  prompt_width: int
  cache_size: int
  tokens: np.ndarray  # int32[B, cache_size], prompts left-aligned (on a mesh: placed)
  prompt_len: np.ndarray  # int32[B]
  sampling: Sampling
  stops: StopList | None = None  # on the host: names what ended each row (stop_reasons)
  rows: int | None = None  # on a mesh: the caller's rows (the rest is padding)
  # The rounds the call runs where nothing can end a row early (`fixed_rounds`), else
  # None: `run` then compiles a loop of that static trip count where the engine says so
  # (`Engine.static_trip_count`).
  rounds: int | None = None

  @property
  def mesh(self):
    return self.engine.mesh

  def caller_prompt_len(self) -> np.ndarray:
    """The prompt lengths of the caller's rows, on the host."""
    return np.asarray(self.prompt_len if self.mesh is None else host(self.prompt_len)[:self.rows])

  @functools.cached_property
  def laid_out(self) -> decode_lib.Weights:
    """The weights as the engine's kernels read them, looked up once: a stream's every
    chunk reuses them instead of looking each leaf up again."""
    return decode_lib.laid_out(self.engine, self.weights)

  def _key(self, key):
    return key if self.mesh is None else sharding.put(key, NamedSharding(self.mesh, P()))

  def prefill(self, key) -> decode_lib.DecodeState:
    return decode_lib.prefill(self.engine, self.laid_out,
                              self.tokens, self.prompt_len, self.prompt_width,
                              self.cache_size, self._key(key), self.sampling)

  def start(self, key) -> decode_lib.DecodeState:
    """The prefilled state `resume` continues, compiled (`prefill` runs op by op)."""
    return decode_lib.start(self.engine, self.prompt_width, self.cache_size, self.laid_out,
                            self.tokens, self.prompt_len, self.sampling, self._key(key))

  def resume(self, state, max_rounds: int) -> decode_lib.DecodeState:
    """Rounds from `state` (donated) until every row is done or max_rounds rounds in all."""
    return decode_lib.resume(self.engine, self.laid_out, state, self.sampling,
                             int(max_rounds))

  def progress(self, state):
    """(tokens, n, done, stopped, logprobs) of the caller's rows so far, on the host
    (logprobs: a `decode.Logprobs`, None unless asked for)."""
    got = (state.tokens, state.n, state.done, state.stopped, state.logprobs)
    if self.mesh is None:
      return results.on_host(got)
    return jax.tree_util.tree_map(lambda x: host(x)[:self.rows], got)  # across processes

  def finish(self, state) -> decode_lib.DecodeState:
    """The caller's rows of a final state (on a mesh: on the host, the padding dropped)."""
    return state if self.mesh is None else distribute_lib.collect(state, self.rows)

  def run(self, key, max_rounds: int = decode_lib.NO_ROUND_LIMIT) -> decode_lib.DecodeState:
    # A Python int like decode's default: every limit shares one program (it is traced);
    # a static trip count only where the limit cuts none of its rounds.
    rounds = self.rounds if (self.rounds is not None and max_rounds >= self.rounds
                             and self.engine.static_trip_count) else None
    return self.finish(decode_lib.decode(
        self.engine, self.prompt_width, self.cache_size, self.laid_out, self.tokens,
        self.prompt_len, self.sampling, self._key(key), int(max_rounds), rounds=rounds))


def fixed_rounds(drafter, pcfg, stop_lens, max_new: int, max_len: int, prompt_len,
                 cache_size: int) -> int | None:
  """The rounds a decode runs where the host knows them, else None: target-only (one
  token a round), no EOS or stop sequence, no processor that can ban every token or
  finish a constraint or match stop strings, one budget for every row. Each row then
  commits one token a round until `state.room_left` is used up; the loop runs until the
  last row's end."""
  if (not isinstance(drafter, drafters_lib.NoDrafter) or np.any(np.asarray(stop_lens) > 0)
      or pcfg.bans or pcfg.constraint or pcfg.stop_text):
    return None
  prompt_len = np.asarray(prompt_len, np.int64)
  room = np.minimum(np.minimum(max_new, max_len - prompt_len), cache_size - 1 - prompt_len)
  return int(max(1, room.max()))  # a row with no room still takes its one round


def seed_key(seed: int):
  """`jax.random.PRNGKey(seed)` for 0 <= seed < 2**32, built on the host where it is the
  raw threefry key [0, seed] (an eager PRNGKey is a dispatched program of its own)."""
  if jax.config.jax_default_prng_impl == "threefry2x32" and not jax.config.jax_enable_custom_prng:
    return np.array([0, seed], np.uint32)
  return jax.random.PRNGKey(seed)


def prepare(target: Model, prompts, *, mesh=None, sampling=None, stopping=None,
            speculation=None, output=None, **flat) -> Prepared:
  """Checks everything and returns the engine's static and traced arguments: what
  `generate` runs. Takes `generate`'s settings, as groups (`specjax.params`) or flat
  keywords, and its mesh."""
  given = params_lib.resolve(flat, "prepare", sampling=sampling, stopping=stopping,
                             speculation=speculation, output=output)
  return prepare_resolved(target, prompts, given, mesh)


def prepare_resolved(target: Model, prompts, given: params_lib.Params, mesh=None) -> Prepared:
  """`prepare` from settings already sorted into their groups (`params.resolve`)."""
  mesh = arguments.check_mesh(mesh)  # before anything is timed (gamma_policy='ledger')
  prepared = _on_one_device(target, prompts, given)
  return prepared if mesh is None else distribute(prepared, mesh)


def _on_one_device(target: Model, prompts, given: params_lib.Params) -> Prepared:
  smp, stop, spec, out = given.sampling, given.stopping, given.speculation, given.output
  if not isinstance(target, Model):
    kind = "a draft head" if isinstance(target, heads_lib.Head) else type(target).__name__
    raise ValueError(f"target must be a specjax Model (load_pretrained(name)), got {kind}")
  vocab, max_len = target.config.vocab_size, target.config.max_len
  prompts = arguments.check_prompts(prompts, target)
  batch = len(prompts)
  n = checks.int_at_least("n", out.n, 1)
  if batch * n > arguments.MAX_ROWS:
    raise ValueError(f"n={n} samples of {batch} prompt(s) make {batch * n} rows; at most "
                     f"{arguments.MAX_ROWS}")
  logprobs, top_logprobs, prompt_logprobs = arguments.logprob_args(
      out.logprobs, out.top_logprobs, out.prompt_logprobs, out.logprobs_mode, vocab)
  max_new_tokens = checks.int_at_least("max_new_tokens", stop.max_new_tokens, 1)
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > max_len:
    raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                     f"target's context max_len={max_len}")
  temperature, top_k, top_p = arguments.sampling_values(smp, batch, vocab)
  eos_id = arguments.resolve_eos(target, stop.eos_id)
  stop_seqs, stop_lens, stop_strings, stops_given = arguments.stop_table(
      target, eos_id, stop.stop_sequences)
  stop_text = (stops_lib.tokenizer_table(target.tokenizer, stop_strings, vocab)
               if stop_strings else None)
  pcfg, procs = processors.settings_from_args(
      batch, vocab, max_new_tokens, stop_seqs, stop_lens, arguments.eos_list(eos_id),
      repetition_penalty=smp.repetition_penalty, presence_penalty=smp.presence_penalty,
      frequency_penalty=smp.frequency_penalty, no_repeat_ngram_size=smp.no_repeat_ngram_size,
      min_new_tokens=smp.min_new_tokens, logit_bias=smp.logit_bias,
      constraint=smp.constraint, stop_table=stop_text)
  draft, tree = spec.draft, spec.tree
  drafter = arguments.make_drafter(target, draft, spec.drafter, spec.gamma, spec.draft_sample,
                                   spec.ngram_min, spec.ngram_max, tree)
  rule = rules_lib.make_rule(spec.verify_rule, spec.rule_params, drafter.gamma)
  policy = arguments.make_policy(spec.gamma_policy, spec.draft_confidence, spec.draft_cost,
                                 drafter)
  if tree is not None and spec.verify_rule not in ("exact", "traversal"):
    raise ValueError(f"tree= works with the exact rule only or verify_rule='traversal', got "
                     f"verify_rule={spec.verify_rule!r}")
  if tree is None and spec.verify_rule == "traversal":
    raise ValueError("verify_rule='traversal' verifies a token tree: pass tree=...; on a "
                     "chain it is block verification, verify_rule='block'")
  if isinstance(drafter, drafters_lib.ModelDrafter):
    if draft.config.max_len < longest + max_new_tokens:
      raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                       f"draft's context max_len={draft.config.max_len}")

  # Bucketed shapes: nearby prompt lengths and budgets reuse one compiled engine.
  prompt_width = checks.round_up(longest, 16)
  # A round writes the KV of every candidate (all tree nodes) past the committed history.
  span = drafter.tree.num_nodes if tree is not None else drafter.gamma
  cache_size = checks.round_up(prompt_width + max_new_tokens + span + 2, 64)
  tokens = np.zeros((batch, cache_size), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  sampling = Sampling.create(batch, temperature=temperature, top_k=top_k, top_p=top_p,
                             max_new=max_new_tokens, stop_seqs=stop_seqs, stop_lens=stop_lens,
                             procs=procs, pcfg=pcfg, repeat=n)
  if isinstance(draft, heads_lib.Head):
    draft_params = draft.draft_params(target, check=False)  # checked in make_drafter
  else:
    draft_params = draft.params if isinstance(drafter, drafters_lib.ModelDrafter) else None
  if policy.kind == "ledger" and spec.draft_cost is None:  # measure c and v once, here
    sc = timing.step_costs(target, drafter, draft_params, batch * n, longest,
                           temperature=float(np.max(temperature)), repeats=2)
    policy = dataclasses.replace(policy, draft_cost=sc["c"] / sc["v"], verify_cost=sc["v"])
  # Left on the host: the compiled call moves numpy arguments itself for next to nothing,
  # where a `jax.device_put` of them here cost more than the move.
  prompt_len = np.asarray([len(p) for p in prompts], np.int32)
  stop_list = StopList(eos=tuple(int(e) for e in arguments.eos_list(eos_id)), given=stops_given,
                       min_new=np.repeat(np.asarray(procs.min_new), n))
  if n > 1:  # a prompt's n rows are adjacent: the engine prefills one and copies it
    tokens, prompt_len = np.repeat(tokens, n, axis=0), np.repeat(prompt_len, n)
  return Prepared(
      engine=decode_lib.Engine(target=target.config, drafter=drafter, rule=rule,
                               policy=policy, logprobs=logprobs, top_logprobs=top_logprobs,
                               prompt_logprobs=prompt_logprobs,
                               logprobs_mode=out.logprobs_mode, samples=n),
      weights=decode_lib.Weights(target=target.params, draft=draft_params),
      prompt_width=prompt_width, cache_size=cache_size, tokens=tokens,
      prompt_len=prompt_len, sampling=sampling, stops=stop_list,
      rounds=fixed_rounds(drafter, pcfg, stop_lens, max_new_tokens, max_len, prompt_len,
                          cache_size))


def distribute(prepared: Prepared, mesh, shard_draft: bool = False) -> Prepared:
  """`prepared` laid out on `mesh`; its `run` returns the caller's rows only.

  The target is sharded (kept as it is when `shard` already placed it for this mesh);
  a model draft is replicated (on the shipped pair splitting it was not faster on any
  mesh), or sharded with shard_draft=True; the batch is padded to a multiple of the
  'data' axis with copies of the last row (and every row prefilled: `Engine.samples` 1).
  """
  mesh = sharding.check_mesh(mesh)
  dp = mesh.shape[sharding.DATA]
  engine, weights = prepared.engine, prepared.weights
  batch = prepared.tokens.shape[0]
  extra = checks.round_up(batch, dp) - batch
  target = Model(engine.target, weights.target)
  target = target if sharding.is_sharded(target, mesh) else sharding.shard(target, mesh)
  drafter, draft_params = engine.drafter, weights.draft
  if isinstance(drafter, drafters_lib.ModelDrafter):
    draft = Model(drafter.config, draft_params)
    draft = sharding.shard(draft, mesh) if shard_draft else sharding.replicate(draft, mesh)
    drafter, draft_params = dataclasses.replace(drafter, config=draft.config), draft.params
  elif draft_params is not None:
    draft_params = sharding.replicate_tree(draft_params, mesh)
  rows = NamedSharding(mesh, P(sharding.DATA))
  return Prepared(
      engine=dataclasses.replace(engine, target=target.config, drafter=drafter, mesh=mesh,
                                 samples=1),
      weights=decode_lib.Weights(target=target.params, draft=draft_params),
      prompt_width=prepared.prompt_width, cache_size=prepared.cache_size,
      tokens=sharding.put(distribute_lib.pad_rows(prepared.tokens, extra), rows),
      prompt_len=sharding.put(distribute_lib.pad_rows(prepared.prompt_len, extra), rows),
      sampling=distribute_lib.place_sampling(prepared.sampling, extra, mesh),
      stops=prepared.stops, rows=batch, rounds=prepared.rounds)  # padding: copied rows
