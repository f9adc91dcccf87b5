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

from specjax.config import ModelConfig


@flax.struct.dataclass
class KVState:
  k: tuple[jax.Array, ...]  # one [B, kv_heads, S, head_dim] buffer per layer
  v: tuple[jax.Array, ...]
  length: jax.Array  # int32[B]

  @property
  def size(self) -> int:
    """S: the number of slots per row."""
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  def rollback(self, length: jax.Array) -> "KVState":
    """Keep only the first `length[b]` positions of each row valid."""
    return self.replace(length=jnp.asarray(length, jnp.int32))


def init_kv(cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> KVState:
  shape = (batch, cfg.kv_heads, size, cfg.dim_per_head)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVState(k=zeros, v=zeros, length=jnp.zeros((batch,), jnp.int32))


def write(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new[b, t] into buffer[b, start[b] + t]; writes past the end are dropped."""
  b, t = new.shape[:2]
  rows = jnp.arange(b)[:, None]
  cols = start[:, None] + jnp.arange(t)[None, :]
  return buffer.at[rows, cols].set(new.astype(buffer.dtype), mode="drop")


def write_kv(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """buffer [B, H, S, D] gets new [B, T, H, D] at slots start[b]..; overflow is dropped."""
  b, t = new.shape[:2]
  rows = jnp.arange(b)[:, None]
  cols = start[:, None] + jnp.arange(t)[None, :]
  # Advanced indices split by a slice index as [B, T, H, D]: the layout `new` has.
  # A scatter, not dynamic_update_slice, which would shift an overflowing write left.
  return buffer.at[rows, :, cols].set(new.astype(buffer.dtype), mode="drop")
