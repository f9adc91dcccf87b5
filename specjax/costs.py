"""Measurement: the c and v(γ) of the ledger, and paired timing of two methods.

Step costs run many calls inside one jitted `lax.fori_loop` (as the decode loop does),
rolling the cache back after each call so the context length stays fixed, and report
the best of a few repeats in seconds per call.

Speedups are never a ratio of two separate passes: `paired` times a method and its
baseline alternately (A B A B ...) and reports the median of the per-pair ratios with
its min and max, so a shared machine slowing down for a while hits both sides alike.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax import decode as decode_lib
from specjax import kv_cache
from specjax import model as model_lib
from specjax.sampling import Sampling


def best_time(fn, *args, repeats: int = 5) -> float:
  """Minimum wall time of fn(*args) over `repeats` runs, after one compile run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def paired(method: Callable[[], object], baseline: Callable[[], object], pairs: int = 3,
           warmup: int = 1) -> dict:
  """Times `method` and `baseline` alternately; ratio = baseline time / method time.

  Each call must block until its work is done. Returns the per-pair times and the
  median, min and max of the per-pair ratios (> 1: the method is faster).
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
      fn()
      out.append(time.perf_counter() - start)
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


def forward_cost(model, batch: int, tokens_per_call: int, context: int = 128,
                 cache_size: int | None = None, iters: int = 64, repeats: int = 5) -> float:
  """Seconds per cached forward of `tokens_per_call` new tokens per row at `context`."""
  cache_size = cache_size or context + tokens_per_call + 64
  graphdef = model.graphdef

  @jax.jit
  def loop(params, kv, tokens):
    def body(_, carry):
      kv, tokens = carry
      logits, new_kv = model_lib.forward_cached(graphdef, params, tokens, kv)
      # Feeding back the argmax keeps each call dependent on the previous one.
      return new_kv.rollback(kv.length), jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, iters, body, (kv, tokens))

  kv = kv_cache.init_kv(model.config, batch, cache_size)
  kv = kv.rollback(jnp.full((batch,), context, jnp.int32))
  tokens = jnp.zeros((batch, tokens_per_call), jnp.int32)
  return best_time(loop, model.params, kv, tokens, repeats=repeats) / iters


def propose_cost(drafter, draft_params, batch: int, vocab_size: int, context: int = 128,
                 iters: int = 16, repeats: int = 5, temperature: float = 1.0) -> float:
  """Seconds per `drafter.propose` call (γ draft tokens per row), state rolled back each time."""
  tree = getattr(drafter, "tree", None)
  cache_size = context + (drafter.gamma if tree is None else tree.num_nodes) + 66
  sampling = Sampling.create(batch, temperature=temperature)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, cache_size), 0, vocab_size)
  n = jnp.full((batch,), context, jnp.int32)

  @jax.jit
  def loop(params, state, key):
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
    return jax.lax.fori_loop(0, iters, body, (state, key, jnp.zeros((), jnp.int32)))

  heads = getattr(drafter, "uses_features", False)
  state = drafter.init(batch, cache_size)
  if heads:  # random features: the cost does not depend on their values
    d = drafter.config.target.d_model
    feats = jax.random.normal(jax.random.PRNGKey(2), (batch, context, d), jnp.float32)
    verify_feats = feats[:, :drafter.gamma + 1]
    state = drafter.prefill(draft_params, state, tokens, n, feats)
  else:
    state = drafter.prefill(draft_params, state, tokens, n)
  return best_time(loop, draft_params, state, jax.random.PRNGKey(1), repeats=repeats) / iters


def step_costs(target, drafter, draft_params, batch: int, context: int,
               temperature: float = 1.0, repeats: int = 3) -> dict:
  """The ledger's costs, with the one definition of c used everywhere.

  c = (one `drafter.propose` call, γ tokens, sampling included) / γ / (one cached
  1-token target step); v(γ) = (one (γ+1)-token target pass) / (one 1-token step). For a
  token tree γ is its depth and the verify pass has N + 1 tokens (N nodes).
  Both at the same context, batch and cache size.
  """
  gamma = drafter.gamma
  tree = getattr(drafter, "tree", None)
  width = gamma + 1 if tree is None else tree.num_nodes + 1  # tokens in the verify pass
  cache = context + width + 130
  t1 = forward_cost(target, batch, 1, context=context, cache_size=cache, repeats=repeats)
  tv = forward_cost(target, batch, width, context=context, cache_size=cache,
                    repeats=repeats)
  propose = propose_cost(drafter, draft_params, batch, target.config.vocab_size,
                         context=context, repeats=repeats, temperature=temperature)
  return {"target_step_s": t1, "verify_s": tv, "propose_s": propose,
          "c": propose / gamma / t1, "v": tv / t1}


def verify_costs(target, batch: int, gammas, context: int = 128,
                 cache_size: int | None = None, repeats: int = 3) -> dict:
  """v(γ) and achieved GFLOP/s of the (γ+1)-token pass for each γ (and of the 1-token step)."""
  cache_size = cache_size or context + max(gammas) + 65
  cost = lambda t: forward_cost(target, batch, t, context=context, cache_size=cache_size,
                                repeats=repeats)
  t1 = cost(1)
  gflops = lambda t, s: batch * forward_flops(target.config, t, context) / s / 1e9
  out = {"step_ms": t1 * 1e3, "step_gflops": gflops(1, t1), "by_gamma": {}}
  for gamma in gammas:
    tv = cost(gamma + 1)
    out["by_gamma"][int(gamma)] = {"pass_ms": tv * 1e3, "v": tv / t1,
                                   "gflops": gflops(gamma + 1, tv)}
  return out


def round_cost(prepared, rounds: int = 16, repeats: int = 3) -> float:
  """Seconds per decode round (draft + verify + commit) run back to back in one loop.

  `prepared` is `specjax.generation.prepare(...)`'s result; its max_new_tokens must
  leave room for `rounds` rounds. Prefill and host work are excluded.
  """
  state = prepared.prefill(jax.random.PRNGKey(0))

  @jax.jit
  def loop(state):
    step = lambda _, s: decode_lib.decode_round(prepared.engine, prepared.weights, s,
                                                prepared.sampling)
    return jax.lax.fori_loop(0, rounds, step, state)

  return best_time(loop, state, repeats=repeats) / rounds
