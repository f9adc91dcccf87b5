"""Cached attention that reads each row's cache only up to its length: jax's Pallas GPU
decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention`, flash decoding).

XLA's attention over a fixed-size buffer reads every slot, valid or not: at batch 8 with
a 4,096-slot buffer and a few hundred valid slots, most of a step's cache reads are
wasted. The kernel splits the buffer into `k_splits` parts, skips the parts past a row's
length and stops each part's loop at its last valid block. It gives the unnormalised
sums (o, l, m) of a flash-attention pass, which `layers.attend_in_parts` merges with the
chunk's own keys, so a verify pass of γ + 1 tokens (or a tree's nodes) runs the same
kernel as a 1-token step: every new query sees the whole history.

On a GPU it is Triton-compiled; on a CPU it runs interpreted (slow: for the tests only).
`Options.decode_kernel` turns it on; it is off by default until a device run measures it
(`experiments.accel` times it beside XLA's attention in the roofline stage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def splits(size: int):
  """(k_splits, block_k) for a buffer of `size` slots (the kernel needs size divisible by
  k_splits into parts of >= 16 slots, each a whole number of blocks of >= 16), or None
  where no split fits (size not a multiple of 16)."""
  for k in (16, 8, 4, 2, 1):
    part = size // k
    if size % k or part < 16 or part % 16:
      continue
    block = next(b for b in (128, 64, 32, 16) if part % b == 0)
    return k, block
  return None


def fits_head(head_dim: int) -> bool:
  """Whether Triton tiles a head of this size (its products need >= 16, its loads a power
  of 2); other models keep XLA's attention."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def cache_attention(qg, k_buf, v_buf, length, interpret: bool):
  """qg [B, T, KVH, G, D], scaled queries; k_buf, v_buf [B, KVH, S, D]; length int32[B]:
  every query against row b's first length[b] slots, as flash attention leaves it:
  (o [B, T, KVH, G, D] = Σ_s e^(score_s - m) v_s (summed in the cache's dtype by the
  kernel, then cast to float32), l [B, T, KVH, G] = Σ_s e^(score_s
  - m), m, the running maximum; a row with no history gives l = 0 and m far below any
  score)."""
  from jax.experimental.pallas.ops.gpu import decode_attention  # imported where used

  b, t, kvh, g, d = qg.shape
  k_splits, block_k = splits(k_buf.shape[2])
  q = qg.transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d).astype(k_buf.dtype)

  def one(q, k, v, n):  # one (row, kv head): q [T*G, D], k and v [S, D]
    return decode_attention.decode_attn_unbatched(
        q, k, v, None, n, sm_scale=1.0, block_h=16, block_k=block_k, k_splits=k_splits,
        num_warps=None, num_stages=2, grid=None, interpret=interpret, debug=False,
        return_residuals=True, normalize_output=False)

  lengths = jnp.broadcast_to(jnp.asarray(length, jnp.int32)[:, None], (b, kvh))
  o, (l, m) = jax.vmap(jax.vmap(one))(q, k_buf, v_buf, lengths)
  o = o.astype(jnp.float32).reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4)
  l = l.reshape(b, kvh, t, g).transpose(0, 2, 1, 3)
  m = m.reshape(b, kvh, t, g).transpose(0, 2, 1, 3)
  return o, l, m


def cache_attention_dense(qg, k_buf, v_buf, length):
  """`cache_attention`'s sums computed by XLA over every slot: its reference."""
  scores = jnp.einsum("btkgd,bksd->btkgs", qg.astype(jnp.float32), k_buf.astype(jnp.float32))
  valid = (jnp.arange(k_buf.shape[2])[None, :] < length[:, None])[:, None, None, None]
  floor = jnp.finfo(jnp.float32).min
  m = jnp.max(jnp.where(valid, scores, floor), axis=-1)
  e = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
  v = jnp.where(valid[:, 0, 0, 0][:, None, :, None], v_buf, 0.0).astype(jnp.float32)
  return jnp.einsum("btkgs,bksd->btkgd", e, v), jnp.sum(e, axis=-1), m
