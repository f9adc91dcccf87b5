"""Fixed-size KV buffers with a per-row valid length.

Each layer keeps `k`, `v` of shape [B, kv_heads, S, head_dim] (heads before slots, so
attention contracts over slots without transposing the cache). `length[b]` counts the
positions of row b whose KV is valid. Rolling back is just lowering `length`: slots at
or past it are masked out by position when attention reads the cache and are
overwritten by the next write, so no copy or zeroing ever happens.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig


@flax.struct.dataclass
class KVState:
  k: tuple[jax.Array, ...]  # one [B, kv_heads, S, head_dim] buffer per layer
  v: tuple[jax.Array, ...]
  length: jax.Array  # int32[B]

  @property
  def size(self) -> int:
    """S: the number of slots per row."""
    return self.k[0].shape[2]

  def rollback(self, length: jax.Array) -> "KVState":
    """Keep only the first `length[b]` positions of each row valid."""
    return self.replace(length=jnp.asarray(length, jnp.int32))


def init_kv(cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> KVState:
  shape = (batch, cfg.n_kv_heads, size, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVState(k=zeros, v=zeros, length=jnp.zeros((batch,), jnp.int32))


def write(buffer: jax.Array, new: jax.Array, start: jax.Array, count=None) -> jax.Array:
  """Writes new[b, t] at slot start[b] + t of row b, for t < count[b] (default: all).

  Token buffers are [B, S] (or [B, S, n]) with new [B, T] ([B, T, n]); KV buffers
  are [B, H, S, D] with new [B, T, H, D]. Writes past the end are dropped, never
  shifted: a scatter, not dynamic_update_slice. The scatter is written for one row and
  vmapped, so the batch is a batching dimension of the scatter: with rows split over
  devices each device writes its own rows (a batch-indexed scatter made GSPMD gather
  every update first).
  """
  t = new.shape[1]
  cols = start[:, None] + jnp.arange(t)[None, :]
  if count is not None:
    slots = buffer.shape[2 if buffer.ndim == 4 else 1]
    cols = jnp.where(jnp.arange(t)[None, :] < count[:, None], cols, slots)  # dropped

  def row(buf, values, cols):
    if buf.ndim == 3:  # [H, S, D] <- [T, H, D]
      values = jnp.swapaxes(values, 0, 1)
      return buf.at[:, cols].set(values.astype(buf.dtype), mode="drop")
    return buf.at[cols].set(values.astype(buf.dtype), mode="drop")

  return jax.vmap(row)(buffer, new, cols)


def compact(kv: KVState, src, dst_start, count) -> KVState:
  """KV of slots src[b, j] (j < count[b]) moved to dst_start[b] + j, every layer."""
  def move(buf):
    rows = jnp.arange(buf.shape[0])[:, None]
    picked = buf[rows, :, jnp.clip(src, 0, buf.shape[2] - 1)]  # [B, J, H, D]
    return write(buf, picked, dst_start, count)
  return kv.replace(k=tuple(move(k) for k in kv.k), v=tuple(move(v) for v in kv.v))
