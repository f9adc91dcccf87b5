"""Step-cost measurement: the c and v(γ) of the ledger, timed as the engine runs them.

Each measurement runs many calls inside one jitted `lax.fori_loop` (as the decode loop
does), rolling the cache back after each call so the context length stays fixed, and
reports the best of a few repeats in seconds per call.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from specjax import decode as decode_lib
from specjax import kv_cache
from specjax import model as model_lib


def best_time(fn, *args, repeats: int = 5) -> float:
  """Minimum wall time of fn(*args) over `repeats` runs, after one compile run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


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
  cache_size = context + drafter.gamma + 66
  sampling = decode_lib.Sampling(
      temperature=jnp.full((batch,), temperature, jnp.float32),
      top_k=jnp.zeros((batch,), jnp.int32), top_p=jnp.ones((batch,)),
      max_new=jnp.zeros((batch,), jnp.int32), stop_seqs=jnp.zeros((1, 1), jnp.int32),
      stop_lens=jnp.zeros((1,), jnp.int32))
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
      return drafter.rollback(new_state, n), key, total + jnp.sum(ys)
    return jax.lax.fori_loop(0, iters, body, (state, key, jnp.zeros((), jnp.int32)))

  state = drafter.prefill(draft_params, drafter.init(batch, cache_size), tokens, n)
  return best_time(loop, draft_params, state, jax.random.PRNGKey(1), repeats=repeats) / iters


def round_cost(target, prepared: dict, draft_params=None, rounds: int = 16,
               repeats: int = 3) -> float:
  """Seconds per decode round (draft + verify + commit) run back to back in one loop.

  `prepared` is `specjax.generation.prepare(...)`'s output; its max_new_tokens must leave
  room for `rounds` rounds. Prefill and host work are excluded.
  """
  drafter, sampling = prepared["drafter"], prepared["sampling"]
  state = decode_lib.prefill(target.config, drafter, target.params, draft_params,
                             prepared["tokens"], prepared["prompt_len"],
                             prepared["prompt_width"], prepared["cache_size"],
                             jax.random.PRNGKey(0))

  @jax.jit
  def loop(state):
    step = lambda _, s: decode_lib.decode_round(target.config, drafter, target.params,
                                                draft_params, s, sampling)
    return jax.lax.fori_loop(0, rounds, step, state)

  return best_time(loop, state, repeats=repeats) / rounds
