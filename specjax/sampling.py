"""Logits processing shared by every sampler: temperature, top-k, top-p, greedy.

`process_logits` returns the normalised distribution that is actually sampled from.
The draft and the target both go through it, so the p and q that verification compares
are exactly the distributions the tokens were drawn from. The parameters are traced
arrays (broadcast against the leading axes of the logits), so one compiled function
serves a whole temperature / top-p sweep. Temperature 0 is exact greedy: a one-hot at
the first argmax of the raw logits, not a small temperature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _param(x, lead_shape, dtype):
  x = jnp.asarray(x, dtype)
  return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(lead_shape) - x.ndim)), lead_shape)


def process_logits(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """logits [..., V] -> probabilities [..., V] (float32) after all processing.

  temperature/top_k/top_p are scalars or arrays whose shape is a prefix of the leading
  axes of `logits` (e.g. per-row [B] for logits [B, T, V]). top_k = 0 and top_p = 1
  disable the filters.
  """
  logits = logits.astype(jnp.float32)
  lead, vocab = logits.shape[:-1], logits.shape[-1]
  temperature = _param(temperature, lead, jnp.float32)[..., None]
  top_k = _param(top_k, lead, jnp.int32)[..., None]
  top_p = _param(top_p, lead, jnp.float32)[..., None]

  greedy = temperature <= 0.0
  scaled = logits / jnp.where(greedy, 1.0, temperature)
  filtered = jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1.0),
                          _filter_top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)
  probs = jax.nn.softmax(filtered, axis=-1)
  one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  return jnp.where(greedy, one_hot, probs)


def _filter_top_k_top_p(scaled, top_k, top_p):
  """Sets logits outside the top-k / top-p support to -inf (ties at the cut are kept)."""
  vocab = scaled.shape[-1]
  # One descending sort serves both filters: top-k cuts at the k-th value, then top-p
  # keeps the smallest head of the sorted distribution whose mass reaches p.
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  kth = jnp.take_along_axis(sorted_desc, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)
  kth = jnp.where(top_k > 0, kth, -jnp.inf)
  sorted_probs = jax.nn.softmax(jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
  pth = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
  cut = jnp.maximum(kth, jnp.where(top_p < 1.0, pth, -jnp.inf))
  return jnp.where(scaled >= cut, scaled, -jnp.inf)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one index per distribution along the last axis (zero-probability entries never)."""
  return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
