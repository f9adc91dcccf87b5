"""Fixed-size KV buffers with a per-row valid length.

Each layer keeps `k`, `v` of shape [B, S, kv_heads, head_dim]. `length[b]` counts the
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
  k: tuple[jax.Array, ...]  # one [B, S, kv_heads, head_dim] buffer per layer
  v: tuple[jax.Array, ...]
  length: jax.Array  # int32[B]

  @property
  def size(self) -> int:
    """S: the number of slots per row."""
    return self.k[0].shape[1]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  def rollback(self, length: jax.Array) -> "KVState":
    """Keep only the first `length[b]` positions of each row valid."""
    return self.replace(length=jnp.asarray(length, jnp.int32))


def init_kv(cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> KVState:
  shape = (batch, size, cfg.kv_heads, cfg.dim_per_head)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVState(k=zeros, v=zeros, length=jnp.zeros((batch,), jnp.int32))


def write(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new[b, t] into buffer[b, start[b] + t]; writes past the end are dropped."""
  b, t = new.shape[:2]
  rows = jnp.arange(b)[:, None]
  cols = start[:, None] + jnp.arange(t)[None, :]
  return buffer.at[rows, cols].set(new.astype(buffer.dtype), mode="drop")
