"""Measurement of whole rounds and calls, on top of the engine: what the sweep records.

The step timers (`forward_timer`, `propose_timer`, `step_costs`, `verify_costs`) and
`paired` live in `specjax.timing`, below the engine, since `prepare` measures c and v
for gamma_policy='ledger'; this module adds a round inside the compiled loop
(`round_timer`, `round_parts`) and a whole `generate` call (`call_timer`, `call_costs`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax import decode as decode_lib
from specjax import results
from specjax.prepare import prepare
from specjax.timing import (  # noqa: F401  (the measurement API in one place)
    LOOP_RETRIES, MIN_LOOP_SECONDS, _median_range, forward_cost, forward_flops, forward_timer,
    loop_timer, machine_info, paired, propose_cost, propose_timer, step_costs, verify_costs,
    verify_width)


def round_timer(prepared, rounds: int = 16, few: int | None = None) -> Callable[[], float]:
  """`loop_timer` of `rounds` decode rounds (draft + verify + commit) back to back,
  differenced against `few` (default rounds // 4).

  `prepared` is `specjax.prepare.prepare(...)`'s result; its max_new_tokens must
  leave room for `rounds` rounds. Every run starts from the same prefilled state, so
  prefill and host work are excluded.
  """
  state = prepared.prefill(jax.random.PRNGKey(0))
  # The weights as `Prepared.run` passes them (laid out by `prefill` above).
  weights = decode_lib.laid_out(prepared.engine, prepared.weights)

  @jax.jit
  def loop(count, state):
    step = lambda _, s: decode_lib.decode_round(prepared.engine, weights, s,
                                                prepared.sampling)
    return jax.lax.fori_loop(0, count, step, state)

  # Counts as given: the prefilled state has room for `rounds` rounds only.
  return loop_timer(loop, state, many=rounds, few=few, min_seconds=0)


def round_parts(target, prepared, context: int, repeats: int = 5, rounds: int = 64) -> dict:
  """A decode round against its parts, in 1-token steps of the target.

  round: a decode round (draft, verify, commit; `round_timer` of `rounds` rounds less
  `rounds` // 3); propose: one `drafter.propose` (γ tokens, sampling included, at the
  call's highest temperature);
  verify: the (γ+1)-token pass (N + 1 for a tree); rest = round - propose - verify:
  the round's own verification, sampling and commit, and whatever the parts cost more
  together than apart (their weights sharing the cache), less what the timing loops add
  to the parts (each forward's argmax and rollback), so it can come out below 0.
  The loops are timed in turn, `repeats` rounds, each at `context` tokens of history;
  every value is the median of per-round ratios to that round's step (with `_min` and
  `_max`). Target-only (γ = 0): propose 0, and the pass is the step itself.
  """
  drafter = prepared.engine.drafter
  cache = prepared.cache_size
  timers = {"step": forward_timer(target, 1, 1, context=context, cache_size=cache),
            "round": round_timer(prepared, rounds, rounds // 3)}
  if drafter.gamma > 0:
    timers["verify"] = forward_timer(target, 1, verify_width(drafter), context=context,
                                     cache_size=cache)
    timers["propose"] = propose_timer(
        drafter, prepared.weights.draft, 1, target.config.vocab_size, context=context,
        temperature=float(jnp.max(jnp.asarray(prepared.sampling.temperature))))
  times = {name: [] for name in timers}
  for _ in range(max(repeats, 1)):
    for name, run in timers.items():
      times[name].append(run())
  times.setdefault("verify", times["step"])
  times.setdefault("propose", [0.0] * len(times["step"]))
  out = {"step_s": statistics.median(times["step"])}
  for name in ("round", "propose", "verify"):
    out.update(_median_range([t / s for t, s in zip(times[name], times["step"])], name))
  rest = [(r - p - v) / s for r, p, v, s in zip(times["round"], times["propose"],
                                               times["verify"], times["step"])]
  return {**out, **_median_range(rest, "rest")}


# No EOS unless the caller names one: a timed row that ended early would make the later
# rounds cheaper than the ones timed beside them (the sweep's stop_at_eos names one).
TIMED_DEFAULTS = dict(eos_id=None)


def _prepare(target, prompts, kwargs: dict):
  """`prepare` of `specjax.generate` keyword arguments (seed aside), no EOS by default."""
  kwargs = {k: v for k, v in kwargs.items() if k != "seed"}
  return prepare(target, prompts, **{**TIMED_DEFAULTS, **kwargs})


def call_timer(target, prompts, kwargs: dict) -> Callable[[int], tuple[float, int]]:
  """rounds -> (seconds, rounds run) of a `generate` call stopped after that many rounds.

  The call is `generate`'s work: `prepare` (host), the compiled engine's prefill and
  rounds (`Prepared.run(key, max_rounds)`, the limit traced, so every limit runs one
  program: the while loop's, the static trip count dropped) and the fetch of the tokens
  and stats.
  """
  # Without the static trip count a call running the whole budget would take (`Prepared.
  # rounds`): 1 and R rounds then run one program, the while loop's.
  prepared = lambda: dataclasses.replace(_prepare(target, prompts, kwargs), rounds=None)
  prepared().run(jax.random.PRNGKey(0), 1)  # compile, if not yet

  def call(rounds: int) -> float:
    start = time.perf_counter()
    args = prepared()
    state = args.run(jax.random.PRNGKey(0), rounds)
    results.fetch(state, args.engine.gamma)  # what generate fetches
    # Fewer rounds than asked when every row is done first (EOS, a stop sequence).
    return time.perf_counter() - start, int(state.target_calls)

  return call


def call_costs(target, prompts, method: dict, baseline: dict, rounds: int = 64,
               repeats: int = 9) -> dict:
  """What a whole `generate` call costs beyond the ledger's γc + v(γ), in target-only rounds.

  method, baseline: `specjax.generate` keyword arguments. Each side's call is timed
  stopped after 1 and after R rounds (`call_timer`; R ≤ rounds, few enough that no row
  reaches its budget first; R counts the rounds that ran, fewer if every row stopped at
  EOS), so one round costs t = (W_R − W_1) / (R − 1) and the rest of a call,
  F = W_1 − t, is its fixed part: host work and the prefill of both models. Returns, as medians of per-repeat ratios with
  min and max:
    round: t of the method / t of target-only (drafting, the verify pass, verification,
      sampling and commit, as the compiled loop runs them);
    fixed_method, fixed_baseline: F of each side / t of target-only;
    round_method_s, round_baseline_s: t of each side (seconds);
  new_tokens, the method's budget, and repeats_kept: a repeat where either side's R rounds
  took no longer than one is timed again, up to three times, then dropped (rounds of a
  tiny model, lost in the host's jitter), and with none kept the values are NaN. `ledger.predicted_call_speedup` turns these and
  E(α̂, γ) into a whole-call prediction. Each repeat times both sides in alternating
  order, so a machine that slows down moves a ratio's two sides alike.
  """
  gamma = _prepare(target, prompts, method).engine.gamma
  # A round commits at most γ + 1 tokens (target-only: 1): R rounds leave every row short
  # of its budget, so none stops early.
  r = {"m": max(2, min(rounds, int(method["max_new_tokens"]) // (gamma + 1))),
       "b": max(2, min(rounds, int(baseline["max_new_tokens"])))}
  sides = (("m", call_timer(target, prompts, method)),
           ("b", call_timer(target, prompts, baseline)))
  out = {k: [] for k in ("round", "fixed_method", "fixed_baseline", "round_method_s",
                         "round_baseline_s")}
  for i in range(max(repeats, 1)):
    for _ in range(3):  # a stall in a 1-round call (a loaded machine): time it again
      t, fixed = {}, {}
      for name, call in (sides if i % 2 == 0 else sides[::-1]):
        (w1, _), (wr, ran) = call(1), call(r[name])
        t[name] = (wr - w1) / (ran - 1) if ran > 1 else 0.0
        fixed[name] = max(w1 - t[name], 0.0)
      if min(t.values()) > 0:
        break
    else:  # rounds too short to see past the host's jitter: no ratio
      continue
    out["round"].append(t["m"] / t["b"])
    out["fixed_method"].append(fixed["m"] / t["b"])
    out["fixed_baseline"].append(fixed["b"] / t["b"])
    out["round_method_s"].append(t["m"])
    out["round_baseline_s"].append(t["b"])
  result = {"new_tokens": int(method["max_new_tokens"]), "rounds_timed": r["m"],
            "repeats_kept": len(out["round"])}
  for name, values in out.items():
    result.update(_median_range(values or [float("nan")], name))
  return result
