"""Step timing: the c and v(γ) of the ledger, and paired timing of two methods.

Step costs run many calls inside one jitted `lax.fori_loop` (as the decode loop does),
rolling the cache back after each call so the context length stays fixed; each timer
differences a loop of `many` calls and one of `few` (`loop_timer`), so what a jitted
call costs besides its iterations is not spread over them. c and v(γ)
are ratios of such loops timed in turn, round after round (the 1-token step right
before the pass it divides), and reported as the median of the per-round ratios.

Speedups are never a ratio of two separate passes: `paired` times a method and its
baseline alternately (A B A B ...) and reports the median of the per-pair ratios with
its min and max, so a shared machine slowing down for a while hits both sides alike.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.processors.sampling import Sampling, argmax


def paired(method: Callable[[], object], baseline: Callable[[], object], pairs: int = 3,
           warmup: int = 1, timers: bool = False) -> dict:
  """Times `method` and `baseline` alternately; ratio = baseline time / method time.

  Each call must block until its work is done. timers=True: each call returns its own
  time (a `loop_timer`), which is used instead of the call's wall time. Returns the
  per-pair times and the median, min and max of the per-pair ratios (> 1: the method is
  faster).
  """
  for _ in range(warmup):
    method()
    baseline()
  method_s, baseline_s = [], []
  for i in range(max(pairs, 1)):
    # Alternate which side goes first, so neither always runs on a warm cache.
    order = ((method, method_s), (baseline, baseline_s))
    for fn, out in (order if i % 2 == 0 else order[::-1]):
      start = time.perf_counter()
      got = fn()
      out.append(got if timers else time.perf_counter() - start)
  ratios = [b / m for m, b in zip(method_s, baseline_s)]
  return {"method_s": method_s, "baseline_s": baseline_s,
          "ratio": statistics.median(ratios), "ratio_min": min(ratios),
          "ratio_max": max(ratios)}


def machine_info() -> dict:
  """Where a measurement ran: recorded with every result."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                 cpu)
  except OSError:
    pass
  devices = jax.devices()
  return {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "cpu_count": os.cpu_count(),
          "platform": platform.platform(), "jax": jax.__version__,
          "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
          "device_count": len(devices), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def forward_flops(config, tokens: int, context: int) -> float:
  """Multiply-adds x 2 of one cached forward of `tokens` new tokens per row at `context`."""
  d, layers = config.d_model, config.n_layers
  q_width = config.n_heads * config.head_dim
  kv_width = config.n_kv_heads * config.head_dim
  ff = config.d_ff * (2 if config.mlp == "swiglu" else 1)
  per_token = layers * (d * (q_width + 2 * kv_width) + q_width * d + d * ff + config.d_ff * d
                        + 2 * q_width * (context + tokens)) + d * config.vocab_size
  return 2.0 * per_token * tokens


# The shortest run of `many` calls `loop_timer` takes by default.
MIN_LOOP_SECONDS = 0.01
# Runs `loop_timer` times again after a difference <= 0 before it returns one.
LOOP_RETRIES = 3


def loop_timer(loop, *args, many: int, few: int | None = None,
               min_seconds: float = MIN_LOOP_SECONDS) -> Callable[[], float]:
  """Compiles and warms loop(count, *args), a jitted loop of `count` iterations (count a
  traced int32); returns () -> seconds per iteration.

  Each run times `few` iterations (default many // 4), `many`, and `few` again, and
  differences the long run and the faster short one, so what a call costs besides its
  iterations cancels: dispatch, copying the arguments into the loop's carry, and the
  first few dozen iterations of every call running slower than later ones. Undifferenced,
  that overstates a short loop's step by a tenth or more; a decode call pays it once,
  not every round. `many` and `few` grow together (up to
  64-fold) until a run of `many` takes min_seconds (0: as given): a fast loop's
  difference would otherwise be within the call's own jitter (a tiny model's could come
  out below 0). A run whose difference is <= 0 was disturbed and is timed again, up to
  LOOP_RETRIES times; a loop of nearly nothing (prompt lookup's proposals) can still
  return one, which c counts as 0. The returned function carries `.loop` and `.args`
  (count = many first), to lower or profile the same program.
  """
  few = many // 4 if few is None else few
  if not 0 <= few < many:
    raise ValueError(f"loop_timer needs 0 <= few < many, got few={few}, many={many}")
  jax.block_until_ready(loop(jnp.int32(many), *args))
  if min_seconds > 0:
    start = time.perf_counter()
    jax.block_until_ready(loop(jnp.int32(many), *args))
    spent = time.perf_counter() - start
    if spent < min_seconds:
      grow = min(math.ceil(min_seconds / max(spent, 1e-9)), 64)
      many, few = many * grow, few * grow
  counts = jnp.int32(few), jnp.int32(many)

  def timed(count) -> float:
    start = time.perf_counter()
    jax.block_until_ready(loop(count, *args))
    return time.perf_counter() - start

  def run() -> float:
    # The short run before and after the long one, the faster kept: a stall (another
    # process, a page fault) only adds time, and one in the short run would otherwise
    # turn the difference negative. Stalls in both (two test files on two cores) still
    # did: an iteration takes time, so a difference <= 0 is timed again.
    for _ in range(1 + LOOP_RETRIES):
      t_few = timed(counts[0])
      t_many = timed(counts[1])
      per = (t_many - min(t_few, timed(counts[0]))) / (many - few)
      if per > 0:
        break
    return per

  run.loop, run.args = loop, (counts[1],) + args
  return run


def forward_timer(model, batch: int, tokens_per_call: int, context: int = 128,
                  cache_size: int | None = None, iters: int = 128,
                  live: int | None = None) -> Callable[[], float]:
  """`loop_timer` of `iters` cached forwards of `tokens_per_call` new tokens at `context`;
  with `live`, passes that compute only their first `live` tokens where the CPU kernels
  run the layers (a narrowed verify pass, `decode._verify_pass`)."""
  cache_size = cache_size or context + tokens_per_call + 64
  graphdef = model.graphdef

  @jax.jit
  def loop(count, params, kv, tokens):
    def body(_, carry):
      kv, tokens = carry
      logits, new_kv = model_lib.forward_cached(
          graphdef, params, tokens, kv, live=None if live is None else jnp.int32(live))
      # Feeding back the argmax keeps each call dependent on the previous one.
      return new_kv.rollback(kv.length), argmax(logits).astype(jnp.int32)
    return jax.lax.fori_loop(0, count, body, (kv, tokens))

  # The cache in the weights' dtype, as `decode.prefill` keeps it.
  kv = kv_cache.init_kv(model.config, batch, cache_size, model_lib.compute_dtype(model.params))
  kv = kv.rollback(jnp.full((batch,), context, jnp.int32))
  tokens = jnp.zeros((batch, tokens_per_call), jnp.int32)
  # The layout `decode.decode` runs with, made once here so no timed call pays for it.
  params = model_lib.host_layout(model.params)
  return loop_timer(loop, params, kv, tokens, many=iters)


def forward_cost(model, batch: int, tokens_per_call: int, context: int = 128,
                 cache_size: int | None = None, iters: int = 128, repeats: int = 5) -> float:
  """Seconds per cached forward of `tokens_per_call` new tokens per row (median of
  `repeats` differenced runs, `loop_timer`)."""
  run = forward_timer(model, batch, tokens_per_call, context, cache_size, iters)
  return statistics.median(run() for _ in range(repeats))


def propose_timer(drafter, draft_params, batch: int, vocab_size: int, context: int = 128,
                  iters: int = 128, temperature: float = 1.0) -> Callable[[], float]:
  """`loop_timer` of `iters` `drafter.propose` calls (γ tokens per row), rolled back each time."""
  tree = getattr(drafter, "tree", None)
  cache_size = context + (drafter.gamma if tree is None else tree.num_nodes) + 66
  sampling = Sampling.create(batch, temperature=temperature)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, cache_size), 0, vocab_size)
  n = jnp.full((batch,), context, jnp.int32)
  draft_params = model_lib.host_layout(draft_params)  # as `generate` runs them

  @jax.jit
  def loop(count, params, state, key):
    def body(i, carry):
      state, key, total = carry
      key, sub = jax.random.split(key)
      # A token that changes every iteration, and a use of the proposal, stop XLA from
      # hoisting or deleting a stateless drafter.
      seq = tokens.at[:, 0].set(i % vocab_size)
      ys, _, new_state = drafter.propose(params, state, seq, n, sub, sampling)
      if heads:  # a head reads the verify pass's features: γ+1 of them from n-1
        new_state = drafter.rollback(new_state, n, verify_feats, n - 1)
      else:
        new_state = drafter.rollback(new_state, n)
      return new_state, key, total + jnp.sum(ys)
    return jax.lax.fori_loop(0, count, body, (state, key, jnp.zeros((), jnp.int32)))

  heads = getattr(drafter, "uses_features", False)
  state = drafter.init(batch, cache_size)
  if heads:  # random features: the cost does not depend on their values
    d = drafter.config.feature_dim
    feats = jax.random.normal(jax.random.PRNGKey(2), (batch, context, d), jnp.float32)
    # Drawn apart: a context shorter than γ + 1 (a short prompt) would cut a slice short.
    verify_feats = jax.random.normal(jax.random.PRNGKey(3), (batch, drafter.gamma + 1, d),
                                     jnp.float32)
    state = drafter.prefill(draft_params, state, tokens, n, feats)
  else:
    state = drafter.prefill(draft_params, state, tokens, n)
  return loop_timer(loop, draft_params, state, jax.random.PRNGKey(1), many=iters)


def propose_cost(drafter, draft_params, batch: int, vocab_size: int, context: int = 128,
                 iters: int = 128, repeats: int = 5, temperature: float = 1.0) -> float:
  """Seconds per `drafter.propose` call (median of `repeats` differenced runs)."""
  run = propose_timer(drafter, draft_params, batch, vocab_size, context, iters, temperature)
  return statistics.median(run() for _ in range(repeats))


def _median_range(values, name: str) -> dict:
  return {name: statistics.median(values), f"{name}_min": min(values),
          f"{name}_max": max(values)}


def verify_width(drafter) -> int:
  """Tokens in the drafter's verify pass: γ + 1, or N + 1 for a tree of N nodes."""
  tree = getattr(drafter, "tree", None)
  return drafter.gamma + 1 if tree is None else tree.num_nodes + 1


def step_costs(target, drafter, draft_params, batch: int, context: int,
               temperature: float = 1.0, repeats: int = 5) -> dict:
  """The ledger's costs, with the one definition of c used everywhere.

  c = (one `drafter.propose` call, γ tokens, sampling included) / γ / (one cached
  1-token target step); v(γ) = (one (γ+1)-token target pass) / (one 1-token step). For a
  token tree γ is its depth and the verify pass has N + 1 tokens (N nodes).
  Both at the same context, batch and cache size. The three loops are timed in turn,
  `repeats` rounds; c and v are medians of the per-round ratios (with `c_min`, `c_max`,
  `v_min`, `v_max`), so a machine that slows down for a while moves both sides alike.
  Each loop is differenced (`loop_timer`): what a call costs besides its iterations is
  in none of them.
  """
  gamma = drafter.gamma
  width = verify_width(drafter)
  cache = context + width + 130
  step = forward_timer(target, batch, 1, context=context, cache_size=cache)
  verify = forward_timer(target, batch, width, context=context, cache_size=cache)
  propose = propose_timer(drafter, draft_params, batch, target.config.vocab_size,
                          context=context, temperature=temperature)
  times = {"step": [], "verify": [], "propose": []}
  for _ in range(max(repeats, 1)):
    for name, run in (("step", step), ("verify", verify), ("propose", propose)):
      times[name].append(run())
  v = [tv / t1 for tv, t1 in zip(times["verify"], times["step"])]
  # A differenced time can come out below 0 where the cost is below what the loops
  # resolve (a lookup's `propose`): it counts as 0.
  c = [max(tp, 0.0) / gamma / t1 for tp, t1 in zip(times["propose"], times["step"])]
  return {"target_step_s": statistics.median(times["step"]),
          "verify_s": statistics.median(times["verify"]),
          "propose_s": statistics.median(times["propose"]),
          **_median_range(c, "c"), **_median_range(v, "v")}


def verify_costs(target, batch: int, gammas, context: int = 128,
                 cache_size: int | None = None, repeats: int = 5) -> dict:
  """v(γ) and achieved GFLOP/s of the (γ+1)-token pass for each γ (and of the 1-token step).

  Each round times the 1-token step right before every pass; v(γ) is the median of the
  per-round ratios, with its min and max.
  """
  cache_size = cache_size or context + max(gammas) + 65
  timer = lambda t: forward_timer(target, batch, t, context=context, cache_size=cache_size)
  step = timer(1)
  passes = {int(g): timer(int(g) + 1) for g in gammas}
  t1s, tvs, ratios = [], {g: [] for g in passes}, {g: [] for g in passes}
  for _ in range(max(repeats, 1)):
    for g, run in passes.items():
      t1 = step()
      tv = run()
      t1s.append(t1)
      tvs[g].append(tv)
      ratios[g].append(tv / t1)
  gflops = lambda t, s: batch * forward_flops(target.config, t, context) / s / 1e9
  t1 = statistics.median(t1s)
  out = {"step_ms": t1 * 1e3, "step_gflops": gflops(1, t1), "by_gamma": {}}
  for g in passes:
    tv = statistics.median(tvs[g])
    out["by_gamma"][g] = {"pass_ms": tv * 1e3, "gflops": gflops(g + 1, tv),
                          **_median_range(ratios[g], "v")}
  return out
