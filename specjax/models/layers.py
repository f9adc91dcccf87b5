"""The stateless pieces of attention: RoPE, attention over a KV cache, fused projections.

Pure jnp / numpy functions, no parameters: `specjax.models.model`'s `Attention` and `MLP` call
them (attention through the backend, `specjax.backends`), and profiling code can time
them alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig


def split_fused(x, groups: int, sizes):
  """The parts of a fused projection's output x [..., G * sum(sizes)], each [..., G * size].

  The fused axis holds G consecutive groups [part 0 | part 1 | ...] (`qkv_groups`,
  `mlp_groups`); part i gathers its slice of every group, in order. G = 1 is a plain
  split.
  """
  x = x.reshape(x.shape[:-1] + (groups, sum(sizes)))
  ends = np.cumsum(sizes)
  return [x[..., end - size:end].reshape(x.shape[:-2] + (groups * size,))
          for size, end in zip(sizes, ends)]


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies float32[head_dim // 2], with `cfg.rope_scaling` applied.

  Computed in float64 on the host (a constant of the traced program). 'llama3' scaling
  (Llama 3.1+) divides the low frequencies (wavelengths beyond
  original_max / low_freq_factor) by `factor`, keeps the high ones (wavelengths under
  original_max / high_freq_factor) and interpolates smoothly in between.
  """
  dim = cfg.head_dim
  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  scaling = dict(cfg.rope_scaling or ())
  if scaling.get("rope_type") == "llama3":
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    inv_freq = np.where(wavelen > old_len / low, inv_freq / factor,
                        np.where(wavelen < old_len / high, inv_freq,
                                 (1 - smooth) * inv_freq / factor + smooth * inv_freq))
  elif scaling:
    raise ValueError(f"unsupported rope_scaling {scaling}")
  return inv_freq.astype(np.float32)


def rope_angles(positions: jax.Array, freqs):
  """(cos, sin) float32 [B, T, D // 2] of positions int[B, T] times `rope_frequencies`."""
  angles = positions[..., None].astype(jnp.float32) * freqs
  return jnp.cos(angles), jnp.sin(angles)


def rope(x: jax.Array, positions: jax.Array, freqs) -> jax.Array:
  """Rotary embedding in the rotate-half layout (the one Hugging Face Llama uses).

  x: [B, T, H, D]; positions: int[B, T]; freqs: float32[D // 2], `rope_frequencies`.
  """
  half = x.shape[-1] // 2
  cos, sin = rope_angles(positions, freqs)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attend(q, k, v, cache=None, mask=None, rows_apart=False, values_left=False):
  """Attention of T new queries over the cached keys plus the T new keys.

  q: [B, T, H, D]; k, v: [B, T, KVH, D] for the same T tokens; cache: optional
  (k_buf, v_buf, length) with buffers [B, KVH, S, D] whose first length[b] slots are the
  history. The cache is only read here (it is written after), which lets XLA update it
  in place instead of copying it every step. Heads are grouped for GQA.
  mask: None (causal over the chunk, the first `length` slots of the cache) or, for
  token trees, (chunk bool[T, T] or, one tree per row, [B, T, T]; slots bool[B, T, S] or
  None): which new tokens and which cache slots each query sees.
  rows_apart: score and sum the cache for one query row at a time. For a few rows on a
  CPU each row then gets the 1-token step's kernels instead of a general multiply that
  packs the cache (`backends.CpuBackend.rowwise` does the same for the projections).
  values_left: a 1-token step's sum over the cached values with V as the left operand
  (`_weighted_cache`; the CPU backend's choice). The backend passes both
  (`Backend.attend`), or runs a kernel of its own instead.
  """
  b, t, h, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d) * (d ** -0.5)
  chunk, slots = (jnp.tril(jnp.ones((t, t), bool)), None) if mask is None else mask
  if chunk.ndim == 3:  # one tree per row (a dynamic tree): [B, T, T]
    chunk = chunk[:, None, None]
  scores = [jnp.where(chunk, jnp.einsum("btkgd,bukd->bkgtu", qg, k), -1e30)]
  if cache is not None:
    k_buf, v_buf, length = cache
    if slots is None:
      valid = jnp.arange(k_buf.shape[2])[None, :] < length[:, None]  # [B, S]
      seen = valid[:, None, None, None, :]
    else:
      valid, seen = jnp.any(slots, axis=1), slots[:, None, None]  # seen by some query
    # Invalid slots may hold anything (stale drafts, NaN): zero them so 0 * NaN never
    # reaches the weighted sum.
    v_buf = jnp.where(valid[:, None, :, None], v_buf, 0.0)
    rows = [qg[:, i:i + 1] for i in range(t)] if rows_apart else [qg]
    cached = jnp.concatenate([jnp.einsum("btkgd,bksd->bkgts", r, k_buf) for r in rows], axis=3)
    scores.insert(0, jnp.where(seen, cached, -1e30))
  weights = jax.nn.softmax(jnp.concatenate(scores, axis=-1).astype(jnp.float32), axis=-1)
  weights = weights.astype(v.dtype)
  out = jnp.einsum("bkgtu,bukd->btkgd", weights[..., -t:], v)
  if cache is not None:
    w = weights[..., :-t]
    rows = [w[..., i:i + 1, :] for i in range(t)] if rows_apart else [w]
    out = out + jnp.concatenate([_weighted_cache(r, v_buf, values_left) for r in rows],
                                axis=1)
  return out.reshape(b, t, h * d)


def attend_written(q, k_buf, v_buf, length, mask=None):
  """`attend` after the T new keys and values were written at slots length..length+T-1:
  one masked attention over the buffers [B, KVH, S, D] instead of a product over the
  cache, one over the chunk, their concatenation and a second sum. mask as `attend`'s;
  slots at or past length + T (stale) are never seen and their V is zeroed (NaN-safe).
  The accelerators' order (`Backend.writes_first`); on XLA:CPU writing first made it
  copy both caches every step."""
  b, t, h, d = q.shape
  kvh, s = k_buf.shape[1], k_buf.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d) * (d ** -0.5)
  slot = jnp.arange(s)[None, None, :]  # [1, 1, S]
  old = slot < length[:, None, None]  # the history, before this chunk
  u = slot - length[:, None, None]  # this chunk's token at the slot
  in_chunk = (u >= 0) & (u < t)
  chunk, slots = (jnp.tril(jnp.ones((t, t), bool)), None) if mask is None else mask
  at = jnp.broadcast_to(jnp.clip(u, 0, t - 1), (b, t, s))
  if chunk.ndim == 3:  # one tree per row (a dynamic tree): [B, T, T]
    seen_chunk = in_chunk & jnp.take_along_axis(chunk, at, axis=2)  # [B, T, S]
  else:
    seen_chunk = in_chunk & chunk[jnp.arange(t)[None, :, None], at]
  seen_old = old if slots is None else old & slots
  seen = seen_old | seen_chunk
  valid = jnp.any(seen, axis=1)  # [B, S]: seen by some query
  v_buf = jnp.where(valid[:, None, :, None], v_buf, 0.0)
  scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_buf)
  scores = jnp.where(seen[:, None, None], scores, -1e30)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v_buf.dtype)
  return jnp.einsum("bkgts,bksd->btkgd", weights, v_buf).reshape(b, t, h * d)


def attend_in_parts(q, k, v, cache, mask, cache_part):
  """`attend` with the cache's part from a kernel: cache_part(qg, k_buf, v_buf, length)
  gives flash attention's unnormalised sums (o, l, m) of every query over each row's
  history (`backends.pallas.cache_attention`), merged here with the chunk's own keys by
  their maxima. mask as `attend`'s with slots None: every new query sees the whole
  history, and the chunk mask (causal, or a tree's) only the chunk."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  k_buf, v_buf, length = cache
  qg = q.reshape(b, t, kvh, h // kvh, d) * (d ** -0.5)
  chunk = jnp.tril(jnp.ones((t, t), bool)) if mask is None else mask[0]
  chunk = chunk[:, :, None, None] if chunk.ndim == 3 else chunk[None, :, None, None]
  scores = jnp.einsum("btkgd,bukd->btkgu", qg, k).astype(jnp.float32)
  scores = jnp.where(chunk, scores, -1e30)  # a query always sees itself
  o_c, l_c, m_c = cache_part(qg, k_buf, v_buf, length)
  m = jnp.maximum(m_c, jnp.max(scores, axis=-1))
  e = jnp.exp(scores - m[..., None])
  carry = jnp.exp(m_c - m)
  l = l_c * carry + jnp.sum(e, axis=-1)
  o = o_c * carry[..., None] + jnp.einsum("btkgu,bukd->btkgd", e, v.astype(jnp.float32))
  return (o / l[..., None]).astype(v.dtype).reshape(b, t, h * d)


def _weighted_cache(weights, v_buf, values_left=False):
  """Σ_s weights[b, k, g, t, s] · v_buf[b, k, s, :] -> [B, T, KVH, G, D].

  For one new token XLA:CPU emits the plain product as a transposed copy of the masked
  V cache for every layer and step, then a matrix-vector dot. Written as Vᵀ·w, summed
  over the slots with V on the left, it reads the cache as it lies, and the 1-token step
  is shorter (docs/ARCHITECTURE.md, "Why a step costs what it does"). A pass of more tokens runs a general multiply either way, and
  keeps the plain product.
  """
  b, k, g, t, s = weights.shape
  if t > 1 or not values_left:
    return jnp.einsum("bkgts,bksd->btkgd", weights, v_buf)
  w = weights.reshape(b, k, g, s).transpose(0, 1, 3, 2)  # [B, KVH, S, G]
  out = jnp.einsum("bksd,bksg->bkdg", v_buf, w)
  return out.transpose(0, 1, 3, 2)[:, None]
