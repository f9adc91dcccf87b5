"""The jitted decode engine: prefill, then the rounds in compiled loops (`run_loop`).

One round (γ ≥ 0; γ = 0 is plain autoregressive decoding), numbered as in
docs/ARCHITECTURE.md:
  1. draft: the drafter proposes y_1..y_γ with their distributions q (inside the jit);
  2. verify pass: the target scores [x_{n-1}, y_1..y_γ] in one cached pass -> p_1..p_{γ+1};
  3. verify rule: the candidates' layout (`verify.layouts`: a chain runs `engine.rule`,
     then `policy.settle` applies the row's draft length; a tree walks down from its
     root) accepts a path per row and draws the correction/bonus token;
  4. commit: the accepted prefix plus that token, cut by the budget, the context limit
     and stop sequences;
  5. rollback: both caches return to the committed history; the token just committed
     has no KV yet, it is the first input of the next round.
Rows accept different counts; each row's own `n` and KV `length` absorb it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax import backends
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax import policies
from specjax import distribute
from specjax.processors import history as processors
from specjax import trees
from specjax.verify import layouts
from specjax.models.config import ModelConfig
from specjax.processors import sampling as processing
from specjax.processors.sampling import Sampling
from specjax.verify.exact import ExactRule
from specjax.state import (DecodeState, Logprobs, Stats, Weights,  # noqa: F401  (the engine's API)
                           commit_count, room_left, stop_hits, update_stats)


@dataclasses.dataclass(frozen=True)
class Engine:
  """The static half of a decode: what one compiled program is specialised to.

  A frozen dataclass of configs hashes in microseconds (an NNX graphdef takes about a
  millisecond on every call), so it is the jit's static argument.
  """
  target: ModelConfig
  drafter: Any  # a drafter from `specjax.drafters` (frozen dataclass)
  rule: Any = ExactRule()  # a verify rule from `specjax.verify` (frozen dataclass)
  policy: policies.GammaPolicy = policies.GammaPolicy()  # draft length per row and round
  # The jax Mesh ('data', 'model') the state is laid out on (`specjax.distribute`); None:
  # wherever the inputs are (one device), and no constraint is traced.
  mesh: Any = None
  # Keep the target's log-probability of every committed token (`DecodeState.logprobs`),
  # with the `top_logprobs` most likely tokens at each position, and the prompt's too;
  # of the raw logits ("raw") or of the distribution sampled from ("processed").
  logprobs: bool = False
  top_logprobs: int = 0
  prompt_logprobs: bool = False
  logprobs_mode: str = "raw"
  # Rows per prompt: `samples` adjacent rows hold the same prompt, and the prefill
  # computes each prompt once and copies its caches (`generate`'s n).
  samples: int = 1
  # What the forwards may do on this platform (`specjax.backends.Options`: the CPU
  # kernels, fused layers, row-by-row products, the narrow pass, bfloat16 panels);
  # None: the process's (`backends.default_options`, fixed once used).
  backend_options: backends.Options | None = None
  # A tree walk's loops unrolled (True), rolled (False), or by platform (None: unrolled
  # but on a CPU, where unrolled loops compile slower and run no faster); the same
  # numbers either way.
  unroll_walk: bool | None = None
  # Rounds between the loop's tests of `done` (`run_loop`): an inner loop of this many
  # rounds, in which a finished row commits nothing. None: by platform (`check_period`).
  check_every: int | None = None
  # Where the host knows the rounds (`Prepared.rounds`), run a loop of that static trip
  # count (True) or the while loop (False); None: by platform (`static_trip_count`).
  static_trip: bool | None = None

  def __post_init__(self):
    if self.check_every is not None and (
        isinstance(self.check_every, bool) or not isinstance(self.check_every, int)
        or self.check_every < 1):
      raise ValueError(f"check_every must be an int >= 1 or None, got {self.check_every!r}")
    if not (self.static_trip is None or isinstance(self.static_trip, bool)):
      raise ValueError(f"static_trip must be True, False or None, got {self.static_trip!r}")

  @property
  def static_trip_count(self) -> bool:
    """`static_trip`, or by platform: off on a CPU, where the while loop's test costs
    nothing and a static count would compile a program per budget (the count is the
    budget); on elsewhere, where it saves the host a wait per round."""
    if self.static_trip is not None:
      return self.static_trip
    return jax.default_backend() != "cpu"

  @property
  def check_period(self) -> int:
    """`check_every`, or by platform: 1 on a CPU, where a test of `done` costs nothing
    (no device to wait for) and each round run past the last row's end is a real
    forward; 8 elsewhere, where XLA brings a while loop's predicate to the host every
    iteration: 8 rounds per wait, at most 7 rounds run past the end of a call."""
    if self.check_every is not None:
      return self.check_every
    return 1 if jax.default_backend() == "cpu" else 8

  @property
  def gamma(self) -> int:
    return self.drafter.gamma

  @property
  def backend(self) -> backends.Backend:
    """What every forward of this engine runs on (on a mesh, its rows kept together)."""
    return backends.select(self.backend_options, whole_rows=self.mesh is not None)


# fn(engine, ...) traced on `engine.backend`, wherever it is called (`costs.round_timer`).
_on_backend = backends.traced_on(lambda engine, *args, **kwargs: engine.backend)


def _target_pass(engine: Engine, params, tokens, kv, empty=False, **layout):
  """Cached target forward; also returns hidden states when the drafter reads them."""
  graphdef = model_lib.graphdef_for(engine.target)
  if getattr(engine.drafter, "uses_features", False):
    hidden = getattr(engine.drafter, "feature_layers", None) or True
    return model_lib.forward_cached(graphdef, params, tokens, kv, empty=empty, hidden=hidden,
                                    **layout)
  logits, kv = model_lib.forward_cached(graphdef, params, tokens, kv, empty=empty, **layout)
  return logits, kv, None


def narrows(engine: Engine, params, kv, width: int) -> bool:
  """Whether a chain's verify pass of `width` tokens computes only the longest draft
  (`_verify_pass`): where the backend runs the target's layers in its own calls and
  `backend_options.narrow_pass` (static)."""
  backend = engine.backend
  return (backend.narrow_pass and model_lib.runs_fused(
      model_lib.graphdef_for(engine.target), params, kv, width, backend))


def _verify_pass(engine: Engine, params, tokens, kv, lengths, done, narrow, **layout):
  """The chain's verify pass over tokens [B, γ+1]: logits [B, γ+1, V], kv, features.

  With draft lengths (int32[B]), only each row's first max(lengths) + 1 tokens are
  computed where the CPU kernels run the layers (`model.forward_cached`'s `live`): a
  CPU's pass costs about its arithmetic, so a round whose rows all drafted less (an
  adaptive policy, an n-gram row without a match, finished rows) costs less. The rule
  reads no position past a row's length (`policies.cut`); the logits and features
  past the longest repeat its last position (a point mass stays one). Also returns the
  draft tokens computed (int32), or None where every token is. narrow: `narrows` of
  this pass (decode_round's, decided once). A tree's pass (its `layout`, no lengths)
  computes every node.
  """
  if lengths is None or not narrow:
    return (*_target_pass(engine, params, tokens, kv, **layout), None)
  live = jnp.max(jnp.where(done, 0, lengths)) + 1
  logits, kv, features = _target_pass(engine, params, tokens, kv, live=live)
  keep = (jnp.arange(tokens.shape[1]) < live)[None, :, None]

  def pad(x):
    return None if x is None else jnp.where(keep, x, jax.lax.dynamic_slice_in_dim(
        x, live - 1, 1, axis=1))
  return pad(logits), kv, pad(features), live - 1


def _first_blocked(banned, n_accepted, before, default):
  """int32[B]: the first committed prefix (after 0..a tokens) where the processors ban
  every token, else `default`, from the bans p was processed with ([B, prefixes, V]).
  The prefix after the bonus token is the next round's prefix 0."""
  blocked = jnp.all(banned, axis=-1)
  if before is not None:
    blocked = jnp.take_along_axis(blocked, before, axis=1)
  blocked &= jnp.arange(blocked.shape[1])[None, :] <= n_accepted[:, None]
  return jnp.where(jnp.any(blocked, axis=1), jnp.argmax(blocked, axis=1), default)


def _logprobs(logits, before, new, top: int) -> Logprobs:
  """`Logprobs` [B, T] of new[:, j] under log-softmax(logits) at the prefix before it
  (position j for a chain; `before` for a tree); with the `top` most likely tokens
  there. Raw logits give what a teacher-forced forward gives, whatever the sampling
  settings; log p of the processed p, the distribution the output follows."""
  if before is not None:
    logits = jnp.take_along_axis(logits, before[:, :, None], axis=1, mode="clip")
  logits = logits.astype(jnp.float32)
  norm = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, new[:, :, None], axis=2)[:, :, 0]
  if not top:
    return Logprobs(chosen=picked - norm)
  values, ids = jax.lax.top_k(logits, top)
  return Logprobs(chosen=picked - norm, top_values=values - norm[..., None], top_ids=ids)


@_on_backend
def decode_round(engine: Engine, weights: Weights, state: DecodeState,
                 sampling: Sampling) -> DecodeState:
  """One draft + verify round for every row: a pure function of its inputs."""
  drafter, policy = engine.drafter, engine.policy
  layout = layouts.for_drafter(drafter)  # a chain or a token tree (static)
  key, draft_key, verify_key = jax.random.split(state.key, 3)

  # 1. Draft (an adaptive γ policy lets each row stop early: `specjax.policies`). Whether
  # step 2's pass computes only the longest draft is static: a policy may price by it.
  narrow = layout.narrowable and narrows(engine, weights.target, state.target_kv,
                                         drafter.gamma + 1)
  ys, qs, draft_state, lengths, steps = policy.draft(
      drafter, weights.draft, state, draft_key, sampling.replace(history=state.history),
      narrow)
  layout = layout.bind(draft_state)  # a dynamic tree's parents come with the proposal

  # 2. Verify pass: the pending token and the γ drafts (or every tree node), one call.
  # Position i is processed with the history of the committed prefix + y_1..y_{i-1} (a
  # tree node: + its root-to-node path); the commit reads the same histories.
  pending = jnp.take_along_axis(state.tokens, (state.n - 1)[:, None], axis=1)
  logits, target_kv, features, width = _verify_pass(
      engine, weights.target, jnp.concatenate([pending, ys], axis=1), state.target_kv,
      lengths, state.done, narrow, **layout.pass_layout(state.n))
  prefixes = layout.prefixes(sampling, state.history, ys)
  ps, banned, top = _target_dists(sampling, logits, prefixes)

  # 3. Verify rule, one row at a time: the accepted path and the correction/bonus token.
  row_keys = jax.vmap(jax.random.fold_in, (None, 0))(verify_key, jnp.arange(ys.shape[0]))
  n_accepted, next_token, overlap, path, siblings, ys = layout.verify(
      engine, row_keys, ys, qs, ps, lengths, verify_key, sampling.paths.greedy, top)

  # 4. Commit y_1..y_a and the correction/bonus token (at index a), cut by the budget,
  # the context, stops and a prefix where the processors ban every token.
  idx = jnp.arange(drafter.gamma + 1)[None, :]
  new = jnp.where(idx == n_accepted[:, None], next_token[:, None],
                  jnp.concatenate([ys, next_token[:, None]], axis=1))  # [B, γ+1]
  before = layout.before_each(path)  # the prefix before new[:, j] (None: j)
  budget = room_left(state.n, state.prompt_len, sampling.max_new, engine.target.max_len,
                     state.tokens.shape[1], layout.slots())
  hits = _stops(sampling, state, new, prefixes, before)
  room = budget
  if banned is not None:
    room = jnp.minimum(room, _first_blocked(banned, n_accepted, before, room))
  count, stop, at_hit = commit_count(n_accepted, room, hits, state.done)
  at_stop = at_hit | (stop & (room < budget) & ~state.done)  # else at the budget
  tokens = kv_cache.write(state.tokens, new, state.n, count)
  logprobs = state.logprobs
  if logprobs is not None:
    scores = logits if engine.logprobs_mode == "raw" else jnp.log(ps)  # -inf: excluded
    logprobs = logprobs.write(_logprobs(scores, before, new, engine.top_logprobs), state.n,
                              count)
  n = state.n + count

  # 5. Rollback both caches (and the processors' history) to the committed history.
  history = None if prefixes is None else processors.committed(
      sampling.pcfg, sampling.procs, prefixes, before, new, count)
  target_kv, draft_state = layout.rollback(drafter, target_kv, draft_state, n, features,
                                           state.n - 1, path, n_accepted)
  return state.replace(
      history=history, logprobs=logprobs,
      tokens=tokens, n=n, done=state.done | stop, stopped=state.stopped | at_stop,
      target_kv=target_kv.rollback(n - 1),
      draft_state=draft_state,
      key=key, target_calls=state.target_calls + 1,
      stats=update_stats(state.stats, ~state.done, n_accepted, count, overlap, lengths,
                         siblings, width),
      **policy.carry(state, lengths, n_accepted, steps, drafter.gamma))


def _target_dists(sampling: Sampling, logits, prefixes):
  """p at every candidate position, processed with its prefix's history; the bans
  ([B, prefixes, V]) where a processor bans tokens (the commit ends a row at a prefix
  that bans every token), else None; and where the host knows every row is greedy and
  nothing adjusts the logits, each p's token (int32[B, γ+1]), else None: the rule reads
  it, so a greedy round takes one argmax and XLA drops the one-hot p nothing else reads."""
  if not sampling.pcfg.adjusts:
    if sampling.paths.greedy:
      top = processing.argmax(logits.astype(jnp.float32)).astype(jnp.int32)
      return jax.nn.one_hot(top, logits.shape[-1], dtype=jnp.float32), None, top
    return sampling.process(logits), None, None
  banned = None
  if sampling.pcfg.bans:
    banned = jax.vmap(functools.partial(processors.banned, sampling.pcfg, sampling.procs),
                      in_axes=1, out_axes=1)(prefixes)
  return jax.vmap(sampling.process, in_axes=(1, 1, 1), out_axes=1)(logits, prefixes,
                                                                   banned), banned, None


def _stops(sampling: Sampling, state: DecodeState, new, prefixes, before):
  """bool[B, γ+1]: committing new[:, :j+1] completes a stop: an EOS or token-id stop
  sequence, a stop string (on the text), or a finished constraint; none completed
  within min_new_tokens but EOS and one-token stops (banned there instead)."""
  hits = stop_hits(state.tokens, state.n, state.prompt_len, new, sampling.stop_seqs,
                   sampling.stop_lens)
  if prefixes is None:
    return hits
  light = prefixes if before is None else processors.at(prefixes, before, counts=False)
  if sampling.pcfg.min_new:
    hits &= processors.past_min_new(sampling.procs, light)
  if sampling.pcfg.constraint:  # a finished constrained text stops like a stop sequence
    hits |= processors.terminal(sampling.procs,
                                processors.fsm_after(sampling.procs, light.fsm, new))
  if sampling.pcfg.stop_text:  # stop strings, matched on the text
    hits |= processors.stop_string_hits(sampling.procs, light, new)
  return hits


@_on_backend
def prefill(engine: Engine, weights: Weights, tokens, prompt_len, prompt_width, cache_size,
            key, sampling: Sampling) -> DecodeState:
  """Builds both caches from the prompts; the last prompt token stays pending.

  Each prompt's `engine.samples` rows are prefilled once: the caches are computed for
  one row of each and copied to the others.
  """
  batch, copies = tokens.shape[0], engine.samples
  head, lens = tokens[::copies, :prompt_width], prompt_len[::copies]
  target_kv = kv_cache.init_kv(engine.target, batch // copies, cache_size,
                              model_lib.compute_dtype(weights.target))
  logits, target_kv, features = _target_pass(engine, weights.target, head, target_kv,
                                             empty=True)
  draft_state = engine.drafter.init(batch // copies, cache_size)
  draft_state = engine.drafter.prefill(weights.draft, draft_state, head, lens, features)
  scored = None  # prompt token t given tokens[:t], t = 1..prompt_len-1
  if engine.prompt_logprobs:
    scored = _logprobs(logits[:, :-1], None, head[:, 1:], engine.top_logprobs)
  if copies > 1:  # every leaf of the caches (and `scored`) is per row
    target_kv, draft_state, scored = jax.tree_util.tree_map(
        lambda x: jnp.repeat(x, copies, axis=0), (target_kv, draft_state, scored))
  logprobs = None
  if engine.logprobs:
    logprobs = Logprobs.zeros(tokens.shape, engine.top_logprobs)
    if scored is not None:
      logprobs = logprobs.write(scored, jnp.ones_like(prompt_len), prompt_len - 1)
  return DecodeState(
      tokens=tokens, n=prompt_len, prompt_len=prompt_len,
      done=jnp.zeros((batch,), bool), stopped=jnp.zeros((batch,), bool),
      target_kv=target_kv.rollback(prompt_len - 1),
      draft_state=draft_state, key=key, target_calls=jnp.zeros((), jnp.int32),
      stats=Stats.zeros(batch, engine.gamma, trees.siblings(engine.drafter)),
      history=processors.init_history(sampling.pcfg, sampling.procs, tokens, prompt_len,
                                      prompt_len, engine.target.vocab_size)
      if sampling.has_processors else None,
      logprobs=logprobs,
      **engine.policy.init_state(batch, engine.gamma))


def cpu_layout(engine: Engine, weights: Weights) -> Weights:
  """Both parameter sets as `engine.backend` lays them out (`Backend.layout`: unchanged
  but on a CPU with the kernels, and not on a mesh, whose rows stay together)."""
  backend = engine.backend
  return Weights(target=backend.layout(weights.target), draft=backend.layout(weights.draft))


# The last laid-out parameter sets (`laid_out`). Each entry keeps the arrays it was made
# from, so no id in its key can be reused while it lives. Three: a target and two drafts
# compared call after call (target-only, a draft model, a head) lay nothing out again;
# with two, each switch laid a draft out anew.
_LAYOUTS: collections.OrderedDict = collections.OrderedDict()
_LAYOUTS_KEPT = 3


def laid_out(engine: Engine, weights: Weights) -> Weights:
  """`cpu_layout(engine, weights)`, kept for the next call with the same arrays.

  `decode` lays the weights out inside the compiled call (a copy of every weight); done
  once here instead, a call skips that copy (a large share of a short call's first
  round on the shipped target). The three most recent parameter sets stay laid out, a
  second copy of their weights in memory (and any set a live `Prepared`, a stream's,
  still holds); `decode` leaves weights laid out already as they are.
  A draft head's leaves that are the target's own arrays get the target's laid-out
  copies (`_shared`), not a second layout of their own.
  """
  backend = engine.backend
  if not backend.kernels:
    return weights
  out, ids = [], []
  for params in (weights.target, weights.draft):
    leaves = jax.tree_util.tree_leaves(params)
    ids.append({id(leaf) for leaf in leaves})
    if not leaves:
      out.append(params)
      continue
    key = (backend,) + tuple(id(leaf) for leaf in leaves)  # bf16_panels lays out others
    entry = _LAYOUTS.pop(key, None) or (leaves, backend.host_layout(params))
    _LAYOUTS[key] = entry  # the most recent last
    while len(_LAYOUTS) > _LAYOUTS_KEPT:
      _LAYOUTS.popitem(last=False)
    out.append(entry[1])
  draft = out[1]
  if ids[0] & ids[1]:  # a draft head holding the target's own arrays
    key = (id(out[0]), id(out[1]))
    hit = _SHARED.get(key)
    if hit is None or hit[0] is not out[0] or hit[1] is not out[1]:
      hit = _SHARED[key] = (out[0], out[1], _shared(weights, out[0], out[1]))
      while len(_SHARED) > _LAYOUTS_KEPT:
        _SHARED.pop(next(iter(_SHARED)))
    draft = hit[2]
  return Weights(target=out[0], draft=draft)


# laid_out's draft params with the target's arrays shared, per pair of laid-out sets
# (kept with them, so their ids stay theirs): a call skips rebuilding it.
_SHARED: dict = {}


def _shared(weights: Weights, target_out, draft_out):
  """draft_out with each leaf that is one of the target's own arrays (a draft head's
  embedding, final norm, LM head: `heads.shared_params`) replaced by the target's laid-out
  copy, where the two copies are alike: one panel array in memory instead of two,
  which both models' products then read from the same cache lines (docs/ARCHITECTURE.md,
  "Why a step costs what it does")."""
  flat = jax.tree_util.tree_flatten_with_path
  target_in = {path: leaf for path, leaf in flat(weights.target)[0]}
  target_laid = {path: leaf for path, leaf in flat(target_out)[0]}
  draft_in = {path: leaf for path, leaf in flat(weights.draft)[0]}

  def pick(path, leaf):
    mine, theirs = draft_in.get(path), target_laid.get(path)
    if (mine is not None and target_in.get(path) is mine and theirs is not None
        and theirs.shape == leaf.shape and theirs.dtype == leaf.dtype):
      return theirs
    return leaf

  return jax.tree_util.tree_map_with_path(pick, draft_out)


# `decode`'s round limit when none is given: every row runs until it is done.
NO_ROUND_LIMIT = 2 ** 31 - 1


def _live_round(engine: Engine, weights: Weights, state: DecodeState,
                sampling: Sampling) -> DecodeState:
  """`decode_round`, counted only where some row is still running: a round after every
  row is done (inside `run_loop`'s inner loop) changes nothing the caller reads. Its
  finished rows commit nothing (tokens, n, logprobs, stats, done, stopped as they were);
  the batch's counters, the key and the policy's carry are kept as they were here."""
  new = distribute.constrain(engine, decode_round(engine, weights, state, sampling))
  live = ~jnp.all(state.done)
  keep = lambda a, b: None if a is None else jnp.where(live, a, b)
  return new.replace(target_calls=state.target_calls + live.astype(jnp.int32),
                     key=keep(new.key, state.key),
                     draft_len=keep(new.draft_len, state.draft_len),
                     draft_steps=keep(new.draft_steps, state.draft_steps))


def run_loop(engine: Engine, weights: Weights, state: DecodeState, sampling: Sampling,
             max_rounds=NO_ROUND_LIMIT, rounds: int | None = None):
  """Every round in compiled loops; no host sync until every row is done.

  max_rounds (traced) stops the loop earlier: `costs.call_costs` times the compiled
  engine for 1 and R rounds without compiling another program; no loop runs a round
  past it. rounds (static): the host knows every row ends within exactly this many
  rounds and nothing ends one earlier (`Prepared.rounds`): one loop of that trip count,
  with no predicate to test (the caller passes it only where max_rounds ≥ rounds).
  Otherwise a while loop tests `done` once every `engine.check_period` rounds (an inner
  loop of that static count); the last rounds before max_rounds, fewer than a period,
  run one test each.
  """
  step = lambda s: _live_round(engine, weights, s, sampling)
  if rounds is not None:
    return jax.lax.fori_loop(0, rounds, lambda i, s: step(s), state)
  period = engine.check_period
  running = lambda s: ~jnp.all(s.done) & (s.target_calls < max_rounds)
  if period > 1:
    state = jax.lax.while_loop(
        lambda s: ~jnp.all(s.done) & (s.target_calls <= max_rounds - period),
        lambda s: jax.lax.fori_loop(0, period, lambda i, c: step(c), s), state)
  return jax.lax.while_loop(running, step, state)


@functools.partial(jax.jit, static_argnames=("engine", "prompt_width", "cache_size", "rounds"))
def decode(engine: Engine, prompt_width: int, cache_size: int, weights: Weights, tokens,
           prompt_len, sampling: Sampling, key, max_rounds=NO_ROUND_LIMIT,
           rounds: int | None = None) -> DecodeState:
  """Prefill + every round (at most max_rounds), compiled once per (engine, shapes).
  rounds (static): `run_loop`'s static trip count, where the host knows it."""
  # Once per call, outside the loop: XLA does not hoist the copy out of it.
  weights = cpu_layout(engine, weights)
  state = prefill(engine, weights, tokens, prompt_len, prompt_width, cache_size, key,
                  sampling)
  return run_loop(engine, weights, distribute.constrain(engine, state), sampling,
                  jnp.asarray(max_rounds, jnp.int32), rounds)


@functools.partial(jax.jit, static_argnames=("engine", "prompt_width", "cache_size"))
def start(engine: Engine, prompt_width: int, cache_size: int, weights: Weights, tokens,
          prompt_len, sampling: Sampling, key) -> DecodeState:
  """`decode`'s prefill alone: the state `resume` continues (`generation.stream`)."""
  return distribute.constrain(engine, prefill(engine, cpu_layout(engine, weights), tokens,
                                            prompt_len, prompt_width, cache_size, key,
                                            sampling))


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def resume(engine: Engine, weights: Weights, state: DecodeState, sampling: Sampling,
           max_rounds) -> DecodeState:
  """`decode`'s rounds from `state` until every row is done or `state.target_calls`
  reaches max_rounds (traced: one program for every chunk). The state's key is split
  every round, so rounds run in chunks draw what one call draws."""
  return run_loop(engine, cpu_layout(engine, weights), state, sampling,
                  jnp.asarray(max_rounds, jnp.int32))
