"""`specjax.generate`: checks its inputs on the host, then runs the jitted engine once."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from specjax import checks
from specjax import decode as decode_lib
from specjax.processors import history as processors
from specjax.processors import stops as stops_lib
from specjax import trees
from specjax import drafters as drafters_lib
from specjax.models import heads as heads_lib
from specjax.models import tokenizer as tokenizer_lib
from specjax import policies
from specjax.models.model import Model
from specjax.processors.sampling import Sampling
from specjax.verify import rules as rules_lib

DRAFTERS = ("model", "ngram", "eagle", "medusa")
MAX_ROWS = 2 ** 20  # prompts x n: far past any batch that fits, short of numpy's overflow
DRAFT_SAMPLE_MODES = ("probabilistic", "greedy")
HEAD_DRAFTERS = ("eagle", "medusa")


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

  @functools.cached_property
  def laid_out(self) -> decode_lib.Weights:
    """The weights as the engine's kernels read them, looked up once: a stream's every
    chunk reuses them instead of hashing ~80 leaves again (docs/ARCHITECTURE.md)."""
    return decode_lib.laid_out(self.engine, self.weights)

  def prefill(self, key) -> decode_lib.DecodeState:
    return decode_lib.prefill(self.engine, self.laid_out,
                              self.tokens, self.prompt_len, self.prompt_width,
                              self.cache_size, key, self.sampling)

  def start(self, key) -> decode_lib.DecodeState:
    """The prefilled state `resume` continues, compiled (`prefill` runs op by op)."""
    return self._checked(lambda: decode_lib.start(
        self.engine, self.prompt_width, self.cache_size, self.laid_out, self.tokens,
        self.prompt_len, self.sampling, key))

  def resume(self, state, max_rounds: int) -> decode_lib.DecodeState:
    """Rounds from `state` (donated) until every row is done or max_rounds rounds in all."""
    return self._checked(lambda: decode_lib.resume(
        self.engine, self.laid_out, state, self.sampling, int(max_rounds)))

  def progress(self, state):
    """(tokens, n, done, stopped, logprobs) of a state so far, on the host (logprobs:
    a `decode.Logprobs`, None unless asked for)."""
    return on_host((state.tokens, state.n, state.done, state.stopped, state.logprobs))

  def finish(self, state) -> decode_lib.DecodeState:
    """The caller's rows of a final state (a mesh's `Prepared` drops its padding)."""
    return state

  def _checked(self, call):
    programs = decode_lib.compiled_programs()
    state = call()
    if programs is not None and decode_lib.compiled_programs() != programs:  # it compiled
      decode_lib.release_near_map_limit(state)  # too many programs in one process?
    return state

  def run(self, key, max_rounds: int = decode_lib.NO_ROUND_LIMIT) -> decode_lib.DecodeState:
    # A Python int like decode's default: every limit shares one program (it is traced).
    return self._checked(lambda: decode_lib.decode(
        self.engine, self.prompt_width, self.cache_size, self.laid_out, self.tokens,
        self.prompt_len, self.sampling, key, int(max_rounds)))


@dataclasses.dataclass
class GenerateResult:
  tokens: list[list[int]]  # the new tokens of each prompt
  stats: dict[str, Any]
  # The new tokens as text, when the target has a tokenizer: special tokens (EOS) and
  # ids past the tokenizer's table left out, as vLLM's text (`Tokenizer.decode_text`).
  texts: list[str] | None = None
  # Why each row ended: 'stop' (EOS, a stop sequence or string, a finished constraint,
  # a prefix where the processors ban every token) or 'length' (max_new_tokens).
  finish_reasons: list[str] | None = None
  # Which stop ended each row (vLLM's stop_reason): the EOS id (an int), the stop string
  # or token-id list as given in stop_sequences; None for any other end.
  stop_reasons: list[int | str | bytes | list[int] | None] | None = None
  prompt_tokens: list[list[int]] | None = None  # each row's prompt ids (strings encoded)
  # logprobs=True: log p(token | all before it) under the target's raw logits (no
  # temperature, top-k/p or processors; with logprobs_mode='processed', after them).
  logprobs: list[list[float]] | None = None
  # top_logprobs=n: at each new token's position, the n most likely (token, logprob)
  # pairs under the same distribution, most likely first.
  top_logprobs: list[list[list[tuple[int, float]]]] | None = None
  # prompt_logprobs=True: the same for each prompt's tokens (None for the first, which
  # nothing comes before), and their top n where top_logprobs=n.
  prompt_logprobs: list[list[float | None]] | None = None
  prompt_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None

  def __eq__(self, other):
    # A rate with nothing to count is NaN (`_summary`): equal results compare equal.
    if not isinstance(other, GenerateResult):
      return NotImplemented
    return all(_same(getattr(self, f.name), getattr(other, f.name))
               for f in dataclasses.fields(self))


def _same(a, b) -> bool:
  """a == b, where NaN equals NaN, through dicts, lists and tuples."""
  if isinstance(a, float) and isinstance(b, float):
    return a == b or (math.isnan(a) and math.isnan(b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
  return a == b


def check_prompts(prompts, model: Model) -> list[list[int]]:
  """Token-id lists from token-id lists, a 2-D array or strings; ValueError otherwise."""
  prompts = checks.host_array(prompts)
  if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
    prompts = list(prompts)
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError("prompts must be a non-empty list of prompts (lists of token ids, "
                     "or strings when the target has a tokenizer)")
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if model.tokenizer is None:
        raise ValueError(f"prompt {i} is a string but the target has no tokenizer")
      checks.utf8(f"prompt {i}", prompt)
      prompt = tokenizer_lib.encode_prompt(model.tokenizer, prompt)
    prompt = checks.token_ids(f"prompt {i}", prompt, model.config.vocab_size)
    if not prompt:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    out.append(prompt)
  return out


def make_tree(tree, gamma, max_len: int | None = None):
  """`tree=` as a `trees.Tree`: branching factors (k_1, ..., k_d) or a list of paths;
  max_len: the target's context, which the tree's nodes must fit in."""
  if isinstance(tree, trees.Tree):
    out = tree
  elif isinstance(tree, (tuple, list)) and tree and all(checks.is_int(k) for k in tree):
    out = trees.Tree.from_branching(tree)
  elif isinstance(tree, (tuple, list)) and tree and all(isinstance(p, (tuple, list))
                                                         for p in tree):
    out = trees.Tree.from_paths(tree)
  else:
    raise ValueError(f"tree must be branching factors like (2, 2, 1) or a list of paths "
                     f"like [(0,), (1,), (0, 0)], got {tree!r}")
  if gamma is not None and gamma != out.depth:
    raise ValueError(f"tree has depth {out.depth} but gamma={gamma}: leave gamma unset "
                     "with a tree (the depth is the draft length)")
  if max_len is not None and out.num_nodes > max_len:  # one pass scores every node
    raise ValueError(f"tree has {out.num_nodes} nodes, more than the target's context "
                     f"max_len={max_len}")
  return out


def make_drafter(target: Model, draft: Model | None, drafter: str | None, gamma: int | None,
                 draft_sample: str, ngram_min: int, ngram_max: int, tree=None):
  """Validates the speculative settings and builds the static drafter object."""
  is_head = isinstance(draft, heads_lib.Head)
  if draft is not None and not (isinstance(draft, Model) or is_head):
    raise ValueError(f"draft must be a specjax Model (from load_pretrained, init_model or "
                     f"load_hf_model) or a draft head (heads.Head, e.g. "
                     f"load_pretrained('stdlib-eagle')), got {type(draft).__name__}")
  if drafter is None and draft is not None:
    drafter = draft.kind if is_head else "model"
  if drafter is None:
    if tree is not None:
      raise ValueError("tree= needs a drafter: draft=<a draft model or a Medusa head> or "
                       "drafter='ngram'")
    if gamma is not None:  # unused (draft=None toggles speculation off), but still checked
      checks.int_at_least("gamma (draft length)", gamma, 1)
    return drafters_lib.NoDrafter(vocab_size=target.config.vocab_size)
  if drafter not in DRAFTERS:
    raise ValueError(f"drafter must be one of {DRAFTERS} (or None), got {drafter!r}")
  if drafter == "model" and is_head:
    raise ValueError(f"drafter='model' needs draft=<a draft Model>, got the {draft.kind} head "
                     f"(pass drafter={draft.kind!r}, or leave drafter out)")
  if drafter == "ngram" and draft is not None:
    raise ValueError("drafter='ngram' (prompt lookup) drafts from the context and uses no "
                     f"draft model; got draft={type(draft).__name__} as well (drop one)")
  if drafter in HEAD_DRAFTERS or is_head:
    if not is_head or draft.kind != drafter:
      got = f"a {draft.kind} head" if is_head else type(draft).__name__
      raise ValueError(f"drafter={drafter!r} needs draft=<a {drafter} head> (e.g. "
                       f"load_pretrained('stdlib-{drafter}')), got {got}")
    if tree is not None and drafter != "medusa":
      raise ValueError(f"tree= needs drafter='model', 'ngram' or 'medusa'; the {drafter} head "
                       "proposes chains only")
    if draft_sample not in DRAFT_SAMPLE_MODES:
      raise ValueError(f"draft_sample must be one of {DRAFT_SAMPLE_MODES}, "
                       f"got {draft_sample!r}")
    draft.check_target(target)  # ValueError naming what differs
    if tree is not None:  # head d drafts every node at depth d
      tree = make_tree(tree, gamma, target.config.max_len)
      return trees.TreeMedusaDrafter(draft.config, tree.depth, draft_sample, tree=tree)
    gamma = checks.int_at_least("gamma (draft length)", 4 if gamma is None else gamma, 1)
    return draft.drafter(gamma, draft_sample)
  if tree is not None:
    tree = make_tree(tree, gamma, target.config.max_len)
    gamma = tree.depth
    if drafter not in ("model", "ngram"):
      raise ValueError(f"tree= needs drafter='model' (a draft model) or 'ngram'; the "
                       f"{drafter!r} drafter proposes chains only")
  gamma = checks.int_at_least("gamma (draft length)", 4 if gamma is None else gamma, 1)
  max_len = target.config.max_len
  if gamma > max_len:  # a draft the context cannot hold (its pass would not fit either)
    raise ValueError(f"gamma (draft length) {gamma} is longer than the target's context "
                     f"max_len={max_len}")
  if drafter == "ngram":
    if not (checks.is_int(ngram_min) and checks.is_int(ngram_max) and 1 <= ngram_min <= ngram_max):
      raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
    if ngram_max > max_len:  # no longer n-gram fits the context (each size is traced)
      raise ValueError(f"ngram_max {ngram_max} is longer than the target's context "
                       f"max_len={max_len}")
    if tree is not None:  # several earlier matches: distinct continuations as a tree
      return trees.NgramTreeDrafter(vocab_size=target.config.vocab_size, gamma=gamma,
                                    min_n=int(ngram_min), max_n=int(ngram_max), tree=tree)
    return drafters_lib.NgramDrafter(vocab_size=target.config.vocab_size, gamma=gamma,
                                     min_n=int(ngram_min), max_n=int(ngram_max))
  if draft is None:
    raise ValueError("drafter='model' needs a draft model: pass draft=<Model>")
  if draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft and target vocabularies differ: draft vocab_size="
                     f"{draft.config.vocab_size}, target vocab_size={target.config.vocab_size}")
  _check_same_tokens(draft.tokenizer, target.tokenizer, target.config.vocab_size)
  if draft_sample not in DRAFT_SAMPLE_MODES:
    raise ValueError(f"draft_sample must be one of {DRAFT_SAMPLE_MODES}, got {draft_sample!r}")
  if tree is not None:
    return trees.TreeModelDrafter(config=draft.config, gamma=gamma, sample_mode=draft_sample,
                                  tree=tree)
  return drafters_lib.ModelDrafter(config=draft.config, gamma=gamma, sample_mode=draft_sample)


# Draft tokenizers seen to agree with a target's (a check costs ~0.5 ms: once per pair).
_AGREE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
TOKEN_PROBES = 48


def _check_same_tokens(draft_tok, target_tok, vocab: int) -> None:
  """ValueError where both models carry tokenizers that read ids differently: the same
  vocabulary size with other tokens would draft tokens the target never meant. Compares
  the text of `TOKEN_PROBES` ids spread over the vocabulary."""
  if draft_tok is None or target_tok is None or draft_tok is target_tok:
    return
  try:
    seen = _AGREE.setdefault(draft_tok, weakref.WeakSet())
  except TypeError:  # not weakly referenceable: check every time
    seen = weakref.WeakSet()
  if target_tok in seen:
    return
  for i in np.unique(np.linspace(0, vocab - 1, TOKEN_PROBES).astype(int)).tolist():
    a, b = _token_text(draft_tok, i), _token_text(target_tok, i)
    if a != b:
      raise ValueError(f"draft and target tokenizers differ: token {i} is {a!r} in the "
                       f"draft's and {b!r} in the target's (one vocabulary size, not one "
                       "vocabulary)")
  seen.add(target_tok)


def _token_text(tokenizer, i: int):
  try:
    return tokenizer.decode([i])
  except Exception:  # an id past the tokenizer's own table (a padded embedding) # noqa: BLE001
    return None


def make_policy(kind, confidence, draft_cost, drafter) -> policies.GammaPolicy:
  """`gamma_policy=` and its settings as a `policies.GammaPolicy`; ValueError if unfit."""
  if kind not in policies.POLICIES:
    raise ValueError(f"gamma_policy must be one of {policies.POLICIES}, got {kind!r}")
  if kind != "fixed" and drafter.gamma == 0:
    raise ValueError(f"gamma_policy={kind!r} needs a drafter (draft=... or drafter='ngram')")
  if kind != "fixed" and getattr(drafter, "tree", None) is not None:
    raise ValueError(f"gamma_policy={kind!r} drafts chains; a tree has a fixed shape")
  if kind == "confidence" and not hasattr(drafter, "propose_until"):
    raise ValueError("gamma_policy='confidence' needs a drafter that drafts token by token "
                     "(a draft model or an EAGLE head); this one proposes all γ at once")
  if confidence is not None and kind != "confidence":
    raise ValueError(f"draft_confidence is for gamma_policy='confidence', got {kind!r}")
  if draft_cost is not None and kind != "ledger":
    raise ValueError(f"draft_cost is for gamma_policy='ledger', got {kind!r}")
  number = lambda v: not isinstance(v, bool) and isinstance(v, (int, float, np.floating))
  verify_cost = 0.0
  if isinstance(draft_cost, (tuple, list)):  # measured (c, v(γ)), both in target steps
    if len(draft_cost) != 2 or not all(number(v) for v in draft_cost):
      raise ValueError(f"draft_cost must be c / v or the pair (c, v), got {draft_cost!r}")
    c, verify_cost = (float(v) for v in draft_cost)
    if not (np.isfinite(verify_cost) and verify_cost > 0):
      raise ValueError(f"draft_cost's v (the verify pass, in target steps) must be a "
                       f"finite number > 0, got {draft_cost!r}")
    draft_cost = c / verify_cost
  for name, value in (("draft_confidence", confidence), ("draft_cost", draft_cost)):
    if value is not None and not number(value):
      raise ValueError(f"{name} must be a number, got {value!r}")
  return policies.GammaPolicy(
      kind=kind, confidence=float(0.4 if confidence is None and kind == "confidence"
                                  else confidence or 0.0),
      draft_cost=float(draft_cost or 0.0), verify_cost=verify_cost)


COUNTERS = ("rows", "rounds", "target_calls", "drafted", "accepted", "committed",
            "overlap_sum", "overlap_count", "accepted_at", "verified_at", "committed_hist",
            "length_hist", "pass_hist",
            "draft_steps", "sibling_tried", "sibling_accepted", "sibling_chance")


def with_rates(counts: dict[str, Any]) -> dict[str, Any]:
  """The counters plus every rate derived from them (also used to pool several runs)."""
  rounds, drafted, committed = counts["rounds"], counts["drafted"], counts["committed"]
  accepted_at = counts["accepted_at"]
  # Rows written before verified_at existed drafted fixed chains: reached i = accepted i-1.
  verified_at = counts.get("verified_at") or [rounds] + list(accepted_at[:-1])
  nan = float("nan")
  return dict(
      counts,
      acceptance_rate=counts["accepted"] / drafted if drafted else nan,
      alpha_hat=counts["overlap_sum"] / counts["overlap_count"] if counts["overlap_count"]
      else nan,
      # Per sequence: every round is one target call for each live row.
      tokens_per_target_call=committed / rounds if rounds else nan,
      # P(position i accepted | the round reached it)
      acceptance_by_position=[a / r if r else nan for a, r in zip(accepted_at, verified_at)],
      # Per sibling rank r (tried only once every earlier sibling was rejected): how
      # often a try was accepted, and α̂ (its mean acceptance probability). A chain: K = 1.
      acceptance_by_sibling=[a / t if t else nan for a, t in zip(
          counts.get("sibling_accepted", ()), counts.get("sibling_tried", ()))],
      alpha_by_sibling=[c / t if t else nan for c, t in zip(
          counts.get("sibling_chance", ()), counts.get("sibling_tried", ()))],
  )


def on_host(tree):
  """`jax.device_get(tree)`, without its copies on a CPU.

  On a CPU `np.asarray` reads a result's buffer where it lies (~1.5 µs a leaf), where
  `device_get` first starts a copy of every leaf (~15 µs each: 0.3 ms of a `generate`
  call's ~20 leaves, docs/CPU_VERIFY.md, "Thirteenth pass"). Off a CPU, those copies overlap: kept.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if all(d.platform == "cpu" for x in leaves if isinstance(x, jax.Array) for d in x.devices()):
    return jax.tree_util.tree_map(np.asarray, tree)
  return jax.device_get(tree)


def fetch(state: decode_lib.DecodeState, gamma: int):
  """(tokens, n, prompt_len, stats, logprobs, stopped) on the host, fetched together
  (each separate fetch waits on its own); stats: the run's counters summed over rows,
  and every rate (`with_rates`); logprobs: a `decode.Logprobs`, None unless the engine
  kept them; stopped: bool[B], the row ended at a stop (`DecodeState.stopped`)."""
  tokens, n, prompt_len, logprobs, stopped, *counters = on_host(
      (state.tokens, state.n, state.prompt_len, state.logprobs, state.stopped, state.stats,
       state.target_calls, state.draft_steps))
  return tokens, n, prompt_len, _summary(*counters, gamma), logprobs, stopped


def _summary(s, target_calls, draft_steps, gamma: int) -> dict[str, Any]:
  """`fetch`'s stats from the counters it got on the host."""
  counts = {key: int(np.sum(getattr(s, key))) for key in
            ("rounds", "drafted", "accepted", "committed", "overlap_count")}
  counts.update(rows=int(s.rounds.shape[0]), target_calls=int(target_calls),
                overlap_sum=float(np.sum(s.overlap_sum)),
                accepted_at=[int(x) for x in np.sum(s.accepted_at, axis=0)],
                verified_at=[int(x) for x in np.sum(s.verified_at, axis=0)],
                sibling_tried=[int(x) for x in np.sum(s.sibling_tried, axis=0)],
                sibling_accepted=[int(x) for x in np.sum(s.sibling_accepted, axis=0)],
                sibling_chance=[float(x) for x in np.sum(s.sibling_chance, axis=0)],
                # Draft steps run (an adaptive loop may stop early); fixed: γ per round.
                draft_steps=int(draft_steps) if draft_steps is not None
                else gamma * int(target_calls),
                committed_hist=[int(x) for x in np.sum(s.committed_hist, axis=0)],
                # Rounds by draft length 0..γ (fixed chains: all at γ; the n-gram drafter
                # drafts 0 without a match; adaptive policies anything up to γ).
                length_hist=[int(x) for x in np.sum(s.length_hist, axis=0)],
                # Rounds by the draft tokens the batch's verify pass computed (on a CPU
                # the longest draft of the batch, else γ): what the pass cost.
                pass_hist=[int(x) for x in np.sum(s.pass_hist, axis=0)])
  return dict(gamma=gamma, **with_rates(counts))


def seed_key(seed: int):
  """`jax.random.PRNGKey(seed)` for 0 <= seed < 2**32, built on the host where it is the
  raw threefry key [0, seed] (an eager PRNGKey cost ~0.2 ms of every call)."""
  if jax.config.jax_default_prng_impl == "threefry2x32" and not jax.config.jax_enable_custom_prng:
    return np.array([0, seed], np.uint32)
  return jax.random.PRNGKey(seed)


def _resolve_eos(target: Model, eos_id):
  """generate's default 'auto' is the target's end-of-text ids (its tokenizer's, or its
  config's without one, as transformers' generation config and vLLM stop); None is no EOS."""
  if isinstance(eos_id, str):
    if eos_id != "auto":
      raise ValueError(f"eos_id must be 'auto' (the tokenizer's), None (no EOS), a token id or "
                       f"a list of ids, got {eos_id!r}")
    return target.eos_ids
  return eos_id


def _eos_ids(eos_id) -> list:
  return [] if eos_id is None else ([eos_id] if np.ndim(eos_id) == 0 else list(eos_id))


def _stop_table(target: Model, eos_id, stop_sequences):
  """EOS ids and token-id stop sequences as one right-aligned table [K, L] plus lengths
  [K]; the stop strings (as UTF-8 bytes), which match on the text; and every stop
  sequence as given (token-id lists as tuples), in order."""
  vocab = target.config.vocab_size
  eos = _eos_ids(eos_id)
  seqs = [checks.token_ids("eos_id", [e], vocab) for e in eos]
  strings, given = [], []
  if isinstance(stop_sequences, (str, bytes)):  # one stop string, not a list of characters
    stop_sequences = [stop_sequences]
  if stop_sequences is not None and not isinstance(stop_sequences, Sequence):
    raise ValueError("stop_sequences must be a list of strings or token-id lists, got "
                     f"{stop_sequences!r}")
  for i, stop in enumerate([] if stop_sequences is None else list(stop_sequences)):
    if isinstance(stop, (str, bytes)):
      if target.tokenizer is None:
        raise ValueError(f"stop sequence {i} is a string but the target has no tokenizer")
      if not stop:
        raise ValueError(f"stop sequence {i} is empty")
      strings.append(checks.utf8(f"stop sequence {i}", stop) if isinstance(stop, str)
                     else bytes(stop))
      given.append(stop)
      continue
    stop = checks.token_ids(f"stop sequence {i}", stop, vocab)
    if not stop:
      raise ValueError(f"stop sequence {i} is empty")
    seqs.append(stop)
    given.append(tuple(stop))
  # The text automaton has a state per stop-string byte, each a row over the vocabulary.
  if (sum(map(len, strings)) + 1) * vocab > 2 ** 27:
    raise ValueError(f"stop strings too long: {sum(map(len, strings))} bytes in all; their "
                     f"table over {vocab} tokens would pass 2**27 entries")
  span = max([len(s) for s in seqs] + [1])
  table = np.zeros((max(len(seqs), 1), span), np.int32)
  lens = np.zeros((max(len(seqs), 1),), np.int32)
  for k, stop in enumerate(seqs):
    table[k, span - len(stop):] = stop
    lens[k] = len(stop)
  return table, lens, strings, tuple(given)


def prepare(target: Model, prompts, *, max_new_tokens, temperature, top_k, top_p, eos_id,
            stop_sequences=None, draft=None, gamma=None, drafter=None,
            draft_sample="probabilistic", tree=None,
            ngram_min=1, ngram_max=4, repetition_penalty=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, no_repeat_ngram_size=0, min_new_tokens=0, logit_bias=None,
            constraint=None, verify_rule="exact", rule_params=None, gamma_policy="fixed",
            draft_confidence=None, draft_cost=None, logprobs=False, top_logprobs=0,
            prompt_logprobs=False, logprobs_mode="raw", n=1) -> Prepared:
  """Validates everything and returns the engine's static and traced arguments."""
  if not isinstance(target, Model):
    kind = "a draft head" if isinstance(target, heads_lib.Head) else type(target).__name__
    raise ValueError(f"target must be a specjax Model (load_pretrained(name)), got {kind}")
  prompts = check_prompts(prompts, target)
  batch = len(prompts)
  n = checks.int_at_least("n", n, 1)
  if batch * n > MAX_ROWS:
    raise ValueError(f"n={n} samples of {batch} prompt(s) make {batch * n} rows; at most "
                     f"{MAX_ROWS}")
  logprobs, top_logprobs, prompt_logprobs = _logprob_args(
      logprobs, top_logprobs, prompt_logprobs, logprobs_mode, target.config.vocab_size)
  max_new_tokens = checks.int_at_least("max_new_tokens", max_new_tokens, 1)
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > target.config.max_len:
    raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                     f"target's context max_len={target.config.max_len}")
  temperature = checks.per_row("temperature", temperature, batch, "iuf").astype(np.float64)
  if not np.all(np.isfinite(temperature)) or np.any(temperature < 0):
    raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), "
                     f"got {temperature.tolist()}")
  if np.any(temperature > np.finfo(np.float32).max):
    raise ValueError(f"temperature must fit in float32 (<= 3.4e38), got {temperature.tolist()}")
  given_p = checks.per_row("top_p", top_p, batch, "iuf").astype(np.float64)
  top_p = given_p.astype(np.float32)  # checked as given and as the engine reads it
  if not np.all((given_p > 0) & (given_p <= 1) & (top_p > 0)):
    raise ValueError(f"top_p must be in (0, 1] (and > 0 in float32), got {given_p.tolist()}")
  top_k = checks.per_row("top_k", top_k, batch, "iu")
  if np.any(top_k < 0):
    raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k.tolist()}")
  # k >= vocab keeps everything; clipping first keeps huge k from wrapping in int32.
  top_k = np.minimum(top_k, target.config.vocab_size).astype(np.int32)
  eos_id = _resolve_eos(target, eos_id)
  stop_seqs, stop_lens, stop_strings, given = _stop_table(target, eos_id, stop_sequences)
  stop_text = (stops_lib.tokenizer_table(target.tokenizer, stop_strings, target.config.vocab_size)
               if stop_strings else None)
  pcfg, procs = processors.settings_from_args(
      batch, target.config.vocab_size, max_new_tokens, stop_seqs, stop_lens,
      _eos_ids(eos_id), repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
      no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens,
      logit_bias=logit_bias, constraint=constraint, stop_table=stop_text)
  drafter_obj = make_drafter(target, draft, drafter, gamma, draft_sample, ngram_min, ngram_max,
                             tree)
  rule = rules_lib.make_rule(verify_rule, rule_params, drafter_obj.gamma)
  policy = make_policy(gamma_policy, draft_confidence, draft_cost, drafter_obj)
  if tree is not None and verify_rule != "exact":
    raise ValueError(f"tree= works with the exact rule only, got verify_rule={verify_rule!r}")
  if isinstance(drafter_obj, drafters_lib.ModelDrafter):
    if draft.config.max_len < longest + max_new_tokens:
      raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                       f"draft's context max_len={draft.config.max_len}")

  # Bucketed shapes: nearby prompt lengths and budgets reuse one compiled engine.
  prompt_width = checks.round_up(longest, 16)
  # A round writes the KV of every candidate (all tree nodes) past the committed history.
  span = drafter_obj.tree.num_nodes if tree is not None else drafter_obj.gamma
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
    draft_params = draft.params if isinstance(drafter_obj, drafters_lib.ModelDrafter) else None
  if policy.kind == "ledger" and draft_cost is None:  # measure c and v once, here
    from specjax import costs
    sc = costs.step_costs(target, drafter_obj, draft_params, batch * n, longest,
                          temperature=float(np.max(temperature)), repeats=2)
    policy = dataclasses.replace(policy, draft_cost=sc["c"] / sc["v"], verify_cost=sc["v"])
  # Left on the host: the compiled call moves numpy arguments itself for next to nothing,
  # where a `jax.device_put` of them here took 0.3-0.6 ms (docs/CPU_VERIFY.md, "Thirteenth pass").
  prompt_len = np.asarray([len(p) for p in prompts], np.int32)
  stop_list = StopList(eos=tuple(int(e) for e in _eos_ids(eos_id)), given=given,
                       min_new=np.repeat(np.asarray(procs.min_new), n))
  if n > 1:  # a prompt's n rows are adjacent: the engine prefills one and copies it
    tokens, prompt_len = np.repeat(tokens, n, axis=0), np.repeat(prompt_len, n)
  return Prepared(
      engine=decode_lib.Engine(target=target.config, drafter=drafter_obj, rule=rule,
                               policy=policy, logprobs=logprobs, top_logprobs=top_logprobs,
                               prompt_logprobs=prompt_logprobs, logprobs_mode=logprobs_mode,
                               samples=n),
      weights=decode_lib.Weights(target=target.params, draft=draft_params),
      prompt_width=prompt_width, cache_size=cache_size, tokens=tokens,
      prompt_len=prompt_len, sampling=sampling, stops=stop_list)


def _logprob_args(logprobs, top, prompt, mode, vocab: int):
  for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt)):
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f"{name} must be True or False, got {value!r}")
  if mode not in ("raw", "processed"):
    raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {mode!r}")
  top = checks.int_at_least("top_logprobs", 0 if top is None else top, 0)
  if top > vocab:
    raise ValueError(f"top_logprobs must be <= the vocabulary size {vocab}, got {top}")
  given = [name for name, on in (("top_logprobs", top), ("prompt_logprobs", prompt),
                                  ("logprobs_mode", mode != "raw")) if on]
  if given and not logprobs:
    raise ValueError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} logprobs=True")
  return bool(logprobs), top, bool(prompt)


def generate(target: Model, prompts, *, max_new_tokens: int = 32, temperature=0.0, top_k=0,
             top_p=1.0, seed: int = 0, eos_id="auto", stop_sequences=None,
             draft: Model | heads_lib.Head | None = None,
             gamma: int | None = None, drafter: str | None = None, tree=None,
             draft_sample: str = "probabilistic", ngram_min: int = 1,
             ngram_max: int = 4, verify_rule: str = "exact",
             rule_params: dict | None = None, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, no_repeat_ngram_size=0, min_new_tokens=0,
             logit_bias=None, constraint=None, gamma_policy: str = "fixed",
             draft_confidence: float | None = None,
             draft_cost: float | tuple[float, float] | None = None,
             logprobs: bool = False, top_logprobs: int = 0, prompt_logprobs: bool = False,
             logprobs_mode: str = "raw", n: int = 1, mesh=None) -> GenerateResult:
  """Generates up to `max_new_tokens` new tokens for each prompt.

  With no `draft` and `drafter=None` this is plain autoregressive decoding. With a draft
  model (or `drafter='ngram'`) it is lossless speculative decoding with draft length
  `gamma`: at any temperature the output follows the target's distribution, and at
  temperature 0 it equals the target's greedy output.

  Args:
    target: the model whose distribution the output follows.
    prompts: list of prompts, each a list of token ids (or a string when the target has a
      tokenizer, encoded as transformers' tokenizer(text) and vLLM encode a prompt: with
      the BOS a Llama tokenizer's post-processor adds). Prompts may differ in length: pass
      them unpadded (a 2-D array is a batch of equal-length prompts, every id a prompt
      token: there is no attention mask).
    max_new_tokens: budget of new tokens per prompt.
    temperature, top_k, top_p: logits processing, applied identically to target and
      draft; scalars or one value per prompt. temperature 0 is exact greedy.
    seed: PRNG seed for the whole batch; rows draw independent random numbers from it,
      by their index in the batch (the verify rule folds the row in; a draft step draws
      all rows at once). So with temperature > 0 a prompt's sample depends on its row
      and the batch's size, not on the seed alone as a per-request seed in vLLM does;
      a greedy row's tokens depend on neither (up to the rounding of another batch
      shape's kernels).
    eos_id: an id (or list of ids) that ends a row; it is emitted, nothing after it.
      The default 'auto' is the target's `eos_ids` (`<|endoftext|>` for the shipped
      pair; for a Hugging Face model, the eos_token_id lists of config.json and
      generation_config.json, as vLLM stops, with or without tokenizer.json),
      or none for a model that names none.
      None stops at no EOS (vLLM's ignore_eos): rows run to max_new_tokens.
    stop_sequences: token-id lists, or strings, that end a row once generated; the
      tokens that complete one are emitted, like EOS. A match must lie in the new text.
      A string matches the text however it was split into tokens: the row stops at the
      first token whose text completes it, and that token's text may run past the string
      (")" stops a row at ")[" ). A match completed within the first `min_new_tokens`
      tokens does not count. `GenerateResult.stop_reasons` names the one that ended
      each row (or the EOS id).
    draft: the draft model (same vocabulary as the target), or a draft head trained on
      this target (`load_pretrained('stdlib-eagle')`, 'stdlib-medusa'; `specjax.models.heads`),
      which drafts from the target's own hidden states.
    gamma: draft tokens proposed per round (default 4; with a tree, its depth). Without a
      drafter it is unused, but an invalid one is still refused.
    tree: a token tree for the model, n-gram or Medusa drafter: branching factors
      (k_1, ..., k_d) (every node at depth j-1 gets k_j children; (1,)*γ is the chain)
      or Medusa-style paths of child ranks, e.g. [(0,), (1,), (0, 0)]. The target scores
      every node in one pass and the walk down from the root keeps the output exactly
      the target's.
      The n-gram drafter's children are the distinct continuations of different earlier
      matches (best match first); Medusa head d drafts every node at depth d (the tree's
      depth at most the head count).
    drafter: 'model', 'ngram' (prompt lookup, no draft model), 'eagle' / 'medusa' (with
      draft=<that head>) or None (infer from draft).
    draft_sample: 'probabilistic' (sample from q) or 'greedy' (argmax, one-hot q).
    ngram_min, ngram_max: suffix lengths the n-gram drafter tries.
    verify_rule: 'exact' (lossless, the default) or a research rule that is NOT lossless:
      'typical', 'threshold', 'synthetic' (`specjax.verify.rules`; stats['lossless'] says which).
    rule_params: keyword arguments of that rule, e.g. {'epsilon': 0.09, 'delta': 0.3}
      (typical), {'ratio': 0.5, 'floor': 0.3} (threshold), {'rates': (0.9, 0.8, ...)}
      (synthetic: one unconditional acceptance probability per draft position).
    repetition_penalty: Hugging Face/CTRL rule over prompt + generated tokens (1 = off).
    presence_penalty, frequency_penalty: OpenAI rule over generated tokens (0 = off).
    no_repeat_ngram_size: bans a token that would repeat an n-gram of prompt + generated.
    min_new_tokens: EOS and one-token stop sequences are banned before this (vLLM's
      min_tokens); a longer stop sequence or a stop string completed before it does not
      count, and its tokens are not banned.
    logit_bias: {token_id: bias} (or one dict per prompt) added to the raw logits.
    constraint: a `specjax.constraints.TokenAutomaton` (e.g. `constraints.regex(...)`):
      tokens leaving its language are masked; EOS only where it accepts; a row whose
      text is complete with nothing to follow stops.
    The processors act on the raw logits, per candidate prefix, for target and draft
    alike, before temperature / top-k / top-p; speculation stays lossless with them.
    Where together they ban every token (no_repeat_ngram_size=1 once every token has
    appeared), the row ends there.
    gamma_policy: how many of its γ tokens each row drafts per round (`specjax.policies`;
      all lossless): 'fixed' (γ), 'heuristic' (+2 after a fully accepted round, -1
      otherwise), 'confidence' (stop after a draft token whose top probability is below
      `draft_confidence`, default 0.4), 'ledger' (the length maximising E(α̂, L) /
      (L·c + v) for the row's running α̂; `draft_cost` = c / v, or the pair (c, v(γ))
      in target steps, which on a CPU also prices the pass by the drafts it computes;
      measured (the pair) if None).
    logprobs: also return (`GenerateResult.logprobs`) each new token's log-probability
      under the target's raw logits given every token before it: before temperature,
      top-k/top-p and the processors, so the same numbers at any temperature and what a
      teacher-forced forward of the output gives, to the matmuls' precision (float32 on
      a CPU: ~1e-5; a model computing in bfloat16, or a TPU's default float32 passes,
      rounds the cached and the full forward apart: up to ~0.1 nats on the shipped
      target in bfloat16). From the verify pass's own logits.
    top_logprobs: with logprobs (0 or None: none), also the n most likely tokens at each new token's
      position and their log-probabilities, under the same distribution, most likely
      first (ties: the lower id first) (`GenerateResult.top_logprobs`, (token,
      logprob) tuples; OpenAI's top_logprobs). Costs a top-n over the vocabulary at
      each verified position and 8n bytes of state per slot of the [B, S] buffer (n
      may be as large as the vocabulary: mind the memory). In bfloat16, near-tied
      entries may order differently from a full forward.
    prompt_logprobs: with logprobs, also the log-probability of each prompt token
      given the tokens before it (`GenerateResult.prompt_logprobs`, None first, aligned
      with `GenerateResult.prompt_tokens`) and,
      with top_logprobs, its position's top n (`GenerateResult.prompt_top_logprobs`),
      from the prefill's logits (like vLLM's prompt_logprobs, but a bool: the n is
      top_logprobs'). Scoring a text needs no generation beyond max_new_tokens=1 (so
      at most max_len - 1 tokens). The prefill then computes the LM head at every
      prompt position, not only the last. A stream hands them out in its first chunk
      (and in its `result`).
    logprobs_mode: 'raw' (the default, above) or 'processed': the new tokens' logprobs
      and top n under the distribution they were sampled from, after the processors,
      temperature, top-k and top-p (vLLM's processed_logprobs; what an RL update needs
      as the behaviour policy's). Tokens those exclude get -inf; a greedy row's token
      gets 0. The output follows that distribution under the exact verify rule (not
      under a lossy one, where a drawn token may even get -inf). The prompt's logprobs
      stay raw: it was not sampled.
      Each value of top_logprobs, prompt_logprobs, logprobs_mode and n is its own
      compiled program (static settings of the engine).
    n: samples per prompt (OpenAI's and vLLM's n, transformers' num_return_sequences):
      the result's rows i*n .. i*n + n - 1 are prompt i's; per-row settings take one
      value per prompt. They are the rows of the prompt repeated n times with the same
      seed, each drawing its own random numbers, up to floating-point rounding: the
      prompt is prefilled once and its caches copied to its n rows, so n samples pay
      one prefill, where n copies' larger prefill may take another kernel (on a mesh
      every row is prefilled). At most 2**20 rows in all.
    mesh: a jax Mesh with axes ('data', 'model') (`jax.make_mesh((dp, tp), ('data',
      'model'))`) to run on several devices (`specjax.models.sharding`): the target split over
      'model' (pass `specjax.shard(target, mesh)` to place it once, not every call), the
      draft replicated, the batch over 'data', padded with copies of the last prompt to
      a multiple of dp (the copies are dropped). Same seed, same tokens as one device.
  """
  seed = _check_seed(seed)
  mesh = _check_mesh(mesh)
  args = prepare(target, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_k=top_k, top_p=top_p, eos_id=eos_id, stop_sequences=stop_sequences,
                 draft=draft, gamma=gamma, tree=tree,
                 drafter=drafter, draft_sample=draft_sample, ngram_min=ngram_min,
                 ngram_max=ngram_max, verify_rule=verify_rule, rule_params=rule_params,
                 repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                 frequency_penalty=frequency_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                 min_new_tokens=min_new_tokens, logit_bias=logit_bias, constraint=constraint,
                 gamma_policy=gamma_policy, draft_confidence=draft_confidence,
                 draft_cost=draft_cost, logprobs=logprobs, top_logprobs=top_logprobs,
                 prompt_logprobs=prompt_logprobs, logprobs_mode=logprobs_mode, n=n)
  if mesh is not None:
    from specjax.models import sharding
    args = sharding.distribute(args, mesh)  # its run() returns the caller's rows, on the host
  return _result(target, args.engine, args.run(seed_key(seed)), args.stops)


def _check_mesh(mesh):
  """`sharding.check_mesh` of a mesh given, before `prepare` (which may time the pair,
  gamma_policy='ledger'); None stays None."""
  if mesh is None:
    return None
  from specjax.models import sharding
  return sharding.check_mesh(mesh)


def _spans(x, start, end):
  """Row i's x[i, start[i]:end[i]] as a list, for each row (None stays None)."""
  return None if x is None else [x[i, start[i]:end[i]].tolist() for i in range(len(end))]


def _top_spans(lp, start, end):
  """`_spans` of a `decode.Logprobs`' top n as (token, logprob) pairs per position."""
  if lp is None or lp.top_ids is None:
    return None
  return [[list(zip(i, v)) for i, v in zip(ids, values)]
          for ids, values in zip(_spans(lp.top_ids, start, end),
                                 _spans(lp.top_values, start, end))]


def _reasons(done, stopped):
  """Each row's finish reason: 'stop', 'length', or None while it runs."""
  return [("stop" if s else "length") if d else None for d, s in zip(done, stopped)]


def _stop_reasons(target: Model, stops: StopList | None, new, at_stop, rows=None):
  """`StopList.reason` of each row in `new` that ended at a stop, else None (rows: their
  indices in the batch, where `new` is not all of it)."""
  if stops is None:
    return None
  token_bytes = None
  if target.tokenizer is not None and any(isinstance(g, (str, bytes)) for g in stops.given):
    token_bytes = stops_lib.token_bytes(target.tokenizer)
  rows = range(len(new)) if rows is None else rows
  return [stops.reason(i, row, token_bytes) if s else None
          for i, row, s in zip(rows, new, at_stop)]


def _result(target: Model, engine: decode_lib.Engine, state,
            stops: StopList | None = None) -> GenerateResult:
  tokens, n, prompt_len, stats, lp, stopped = fetch(state, engine.gamma)
  new = _spans(tokens, prompt_len, n)
  texts = None
  if target.tokenizer is not None:
    text_of = tokenizer_lib.output_text(target.tokenizer)
    texts = [text_of(t) for t in new]
  stats = dict(stats, lossless=engine.rule.lossless, gamma_policy=engine.policy.kind)
  done = [True] * len(new)
  out = GenerateResult(tokens=new, stats=stats, texts=texts,
                       finish_reasons=_reasons(done, stopped),
                       stop_reasons=_stop_reasons(target, stops, new, stopped),
                       prompt_tokens=_spans(tokens, np.zeros_like(prompt_len), prompt_len))
  if lp is None:
    return out
  out.logprobs = _spans(lp.chosen, prompt_len, n)
  out.top_logprobs = _top_spans(lp, prompt_len, n)
  if engine.prompt_logprobs:
    out.prompt_logprobs, out.prompt_top_logprobs = _prompt_logprobs(lp, prompt_len)
  return out


def _prompt_logprobs(lp, prompt_len):
  """`GenerateResult`'s prompt_logprobs and prompt_top_logprobs (None without a top n),
  read off the prefill's slots; slot 0 has nothing before it."""
  ones = np.ones_like(prompt_len)
  top = _top_spans(lp, ones, prompt_len)
  return ([[None] + x for x in _spans(lp.chosen, ones, prompt_len)],
          None if top is None else [[None] + x for x in top])


@dataclasses.dataclass
class Chunk:
  """What a stream's step added to each row."""
  tokens: list[list[int]]  # the row's tokens committed since the previous chunk
  # Their text, when the target has a tokenizer. A character whose bytes are split over
  # tokens waits for its last byte, so the texts of all chunks add up to the row's text
  # (where decoding more tokens never rewrites the text of earlier ones).
  texts: list[str] | None
  done: list[bool]  # the row has finished: nothing more will come
  finish_reasons: list[str | None] | None = None  # as GenerateResult's; None: running
  stop_reasons: list | None = None  # as GenerateResult's (None while running)
  logprobs: list[list[float]] | None = None  # as GenerateResult.logprobs, for these tokens
  top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # and top_logprobs
  # With prompt_logprobs, the first chunk carries GenerateResult's two prompt fields (as
  # vLLM's first output does); later chunks have None.
  prompt_logprobs: list[list[float | None]] | None = None
  prompt_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None


class Stream:
  """`stream`'s chunks, in order, as rounds finish; then `result`, what `generate` with
  the same arguments returns."""

  def __init__(self, target: Model, prepared: Prepared, key, rounds: int, prompt_len):
    self._chunks = self._run(target, prepared, key, rounds, prompt_len)
    self._result = None

  def __iter__(self):
    return self._chunks

  @property
  def result(self) -> GenerateResult:
    if self._result is None:
      raise RuntimeError("the stream has chunks left: read them all before its result")
    return self._result

  def _run(self, target: Model, prepared: Prepared, key, rounds: int, prompt_len):
    engine = prepared.engine
    batch = len(prompt_len)  # the caller's rows (a mesh pads the batch)
    sent = np.asarray(prompt_len, np.int64)  # tokens handed out, per row
    detok = None
    if target.tokenizer is not None:
      detok = [_TextStream(target.tokenizer) for _ in range(batch)]
    state = prepared.start(key)
    limit = 0
    reasons, named = [None] * batch, np.zeros(batch, bool)
    while True:
      limit += rounds
      state = prepared.resume(state, limit)
      tokens, n, done, stopped, lp = jax.tree_util.tree_map(lambda x: x[:batch],
                                                            prepared.progress(state))
      chunk = _spans(tokens, sent, n)
      logprobs = None if lp is None else _spans(lp.chosen, sent, n)
      top = _top_spans(lp, sent, n)
      sent = np.asarray(n, np.int64)
      finished = bool(np.all(done)) or limit >= decode_lib.NO_ROUND_LIMIT - rounds
      texts = None if detok is None else [
          t.add(c, bool(d)) for t, c, d in zip(detok, chunk, done)]
      ended = np.flatnonzero(done & stopped & ~named)  # each row's once, as it ends
      if ended.size and prepared.stops is not None:
        new = _spans(tokens[ended], np.asarray(prompt_len)[ended], n[ended])
        for i, reason in zip(ended, _stop_reasons(target, prepared.stops, new,
                                                  [True] * len(new), ended)):
          reasons[i] = reason
      named |= done & stopped
      first = limit == rounds
      prompt_lp, prompt_top = (_prompt_logprobs(lp, np.asarray(prompt_len))
                               if first and engine.prompt_logprobs else (None, None))
      yield Chunk(tokens=chunk, texts=texts, done=[bool(d) for d in done],
                  finish_reasons=_reasons(done, stopped), stop_reasons=list(reasons),
                  logprobs=logprobs, top_logprobs=top, prompt_logprobs=prompt_lp,
                  prompt_top_logprobs=prompt_top)
      if finished:
        break
    self._result = _result(target, engine, prepared.finish(state), prepared.stops)


class _TextStream:
  """A row's text as its tokens come, decoding a window of the last chunks' tokens
  rather than the whole row each time (which made a long stream quadratic), as vLLM's
  incremental detokenizer does.

  The window opens on the last chunk whose text was handed out whole (or earlier, while
  the tokens since render nothing: a skipped special token), so a decoder that treats
  a text's first token apart (SentencePiece drops its space, WordPiece keeps a '##')
  decodes the new tokens as it would inside the row: what is handed out is
  `decode(window)` past what was sent of it. A text ending in U+FFFD (a character whose
  last byte has not come) is held back from there until it ends cleanly or the row is
  done.
  """

  def __init__(self, tokenizer):
    self._decode = tokenizer_lib.output_text(tokenizer)
    self._ids: list[int] = []
    self._start = 0  # the window: tokens before it are sent and never decoded again
    self._clean = 0  # tokens up to here are sent and end on a whole character
    self._sent = 0  # characters of decode(ids[start:]) handed out

  def add(self, ids: list[int], done: bool) -> str:
    if not ids and not done:
      return ""  # keep the window: the next tokens decode after it
    self._ids += ids
    text = self._decode(self._ids[self._start:])
    final = done or not text.endswith("\ufffd")
    # Past what was sent (a tokenizer that rewrites earlier text on a longer decode,
    # say a cleanup of spaces before punctuation, cannot take it back).
    delta = (text if final else text.rstrip("\ufffd"))[self._sent:]
    self._sent += len(delta)
    if final:
      self._advance(len(self._ids), len(text))
      return delta
    # A character cut at the end began at most 3 bytes back (UTF-8 takes 4 at most), so
    # in the last 3 tokens: move the window to the latest boundary among them whose text
    # ends on a whole character and was sent, where there is one (else a row whose
    # chunks end mid-character decodes from its last clean chunk every time).
    for end in range(len(self._ids) - 1, max(self._clean, len(self._ids) - 4), -1):
      head = self._decode(self._ids[self._start:end])
      if head and not head.endswith("\ufffd") and len(head) <= self._sent:
        self._advance(end, len(head))
        break
    return delta

  def _advance(self, end: int, width: int):
    """Tokens up to `end` are sent; `width`: their characters in the window's text."""
    tail = self._decode(self._ids[self._clean:end])
    if tail:  # the next window opens on the tokens since the last clean point
      self._start, self._sent = self._clean, self._sent - width + len(tail)
    # (else they render nothing, a skipped special token: keep the older tokens before)
    self._clean = end


def stream(target: Model, prompts, *, rounds_per_chunk: int = 1, seed: int = 0,
           **kwargs) -> Stream:
  """`generate`, handing out each row's new tokens (and text) as the rounds commit them.

  Takes `generate`'s arguments and `rounds_per_chunk`: how many rounds
  run between two chunks (each chunk is one call of a program compiled once, and a
  host read). Iterate for `Chunk`s; afterwards `.result` is what `generate` returns for
  the same arguments and seed: the same tokens, the same stats (rounds in chunks draw
  the same random numbers as in one call). Everything is checked before anything runs.

      for chunk in specjax.stream(target, ["def f(x):"], draft=draft, gamma=4):
        print(chunk.texts[0], end="", flush=True)
  """
  rounds = checks.int_at_least("rounds_per_chunk", rounds_per_chunk, 1)
  if rounds > 2 ** 30:  # the round limit is an int32 in the compiled loop
    raise ValueError(f"rounds_per_chunk must be <= 2**30, got {rounds}")
  key = seed_key(_check_seed(seed))
  params = inspect.signature(generate).parameters
  unknown = sorted(set(kwargs) - set(params) | set(kwargs) & {"target", "prompts"})
  if unknown:
    raise TypeError(f"stream() got unexpected keyword arguments {unknown}; it takes "
                    "generate's and rounds_per_chunk")
  mesh = _check_mesh(kwargs.pop("mesh", None))
  defaults = {k: p.default for k, p in params.items()  # generate's, so the two agree
              if p.kind is p.KEYWORD_ONLY and k not in ("seed", "mesh")}
  prepared = prepare(target, prompts, **{**defaults, **kwargs})
  prompt_len = prepared.prompt_len
  if mesh is not None:
    from specjax.models import sharding
    prepared = sharding.distribute(prepared, mesh)
  return Stream(target, prepared, key, rounds, prompt_len)


def _check_seed(seed) -> int:
  seed = checks.int_at_least("seed", seed, 0)
  if seed >= 2 ** 32:  # PRNGKey keeps 32 bits: larger seeds would collide with small ones
    raise ValueError(f"seed must be < 2**32, got {seed}")
  return seed
