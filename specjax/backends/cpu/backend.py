"""The CPU backend: a forward's few-row products and attention through specjax's kernels.

On a CPU the weights are first laid out in 16-column panels (`layout`, once per compiled
call, or `host_layout` before it, in bfloat16 panels where every weight is a bfloat16
value), which `kernels.panel_matmul` reads once for every group of up to 9 rows; a tied
embedding becomes panels of its transpose, the LM head and, by `panel_lookup`, the
embedding. A Llama-shaped layer of a cached pass runs as five kernel calls (`block`),
its norms, RoPE, SwiGLU, residual adds and KV write inside them. Without the kernels
(no compiler, SPECJAX_CPU_KERNELS=0, `Options(kernels=False)`, a device mesh) XLA's own
products run, a few rows one at a time (`rowwise`). docs/ARCHITECTURE.md, "Why the
verify pass costs what it does on a CPU", says why each piece is there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.backends.base import Backend, LayerWeights
from specjax.backends.cpu import kernels as kern


class CpuBackend(Backend):
  """specjax's kernels where they are built (`kernels.available`), XLA's products row by
  row elsewhere; `options` says which parts run (static: a field of `decode.Engine`)."""

  name = "cpu"

  @property
  def kernels(self) -> bool:
    return self.options.kernels and not self.whole_rows and kern.available()

  # --- the weights' layout -------------------------------------------------------

  def layout(self, params):
    """Every float32 Dense kernel [K, N] as panels [N / 16, K, 16] (`kernels.pack`), and a
    tied embedding as panels of its transpose; params unchanged without the kernels.
    (`host_layout` lays out bfloat16 panels where that is exact.)

    Call it inside the compiled program, once, outside any loop (`decode.decode`): the
    panels are a copy of the weights, laid out per call; XLA would not hoist it out of
    the decode loop.
    """
    if not self.kernels:
      return params
    return _layout(params, False)

  def host_layout(self, params):
    """`layout` of params before a compiled call: in bfloat16 panels where every weight
    it packs is a bfloat16 value (the shipped checkpoints) and `options.bf16_panels`, so
    each product reads half the bytes for the same float32 result; float32 panels for
    traced params, whose values are unknown."""
    if not self.kernels:
      return params
    packed = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
              if _packed_as(params, path, leaf)]
    bf16 = self.options.bf16_panels and bool(packed) and kern.bf16_exact(packed)
    return _compiled_layout(params, bf16)

  def laid_out(self, w) -> bool:
    return w.ndim == 3  # panels [N / 16, K, 16]

  # --- the ops ---------------------------------------------------------------------

  def rows_apart(self, rows: int) -> bool:
    """Whether a pass of `rows` rows (batch x tokens) goes one row at a time."""
    return 1 < rows <= self.options.rowwise_max_rows and not self.whole_rows

  def rowwise(self, fn, x):
    """fn(x) for a row-wise fn over x [..., d], a few rows one at a time.

    XLA:CPU multiplies one row by a weight matrix with a streaming matrix-vector kernel
    and two or more rows with a general matrix multiply (YNNPACK) that packs the weights
    on every call. A forward visits every weight once, so they arrive cold: one
    matrix-vector pass brings them into cache and the next rows find them there, which
    shortens a few-token verify pass (docs/ARCHITECTURE.md, "Why a step costs what it
    does"). Each row gets the same dot as a 1-token step.
    """
    rows = int(np.prod(x.shape[:-1]))
    if not self.rows_apart(rows):
      return fn(x)
    flat = x.reshape(rows, 1, x.shape[-1])
    out = jnp.concatenate([fn(flat[i]) for i in range(rows)])
    return out.reshape(x.shape[:-1] + out.shape[-1:])

  def dense(self, x, kernel, bias, plain):
    if self.laid_out(kernel):
      y = panel_product(x, kernel)
      return y if bias is None else y + bias
    return self.rowwise(plain, x)

  def lookup(self, table, tokens, plain):
    if self.laid_out(table):  # panels [V / 16, d, 16]: token t is column t % 16 of panel t // 16
      return kern.panel_lookup(table, tokens)
    return plain(tokens)

  def attend(self, plain, q, k, v, cache, mask, laid_out: bool = False):
    """With laid-out weights, a cache and no mask, `kernels.cached_attention` (head dims
    a multiple of 8); otherwise XLA's, a few query rows apart and V-first."""
    if laid_out and cache is not None and mask is None and q.shape[-1] % 8 == 0:
      out = kern.cached_attention(q, k, v, *cache)
      return out.reshape(q.shape[0], q.shape[1], -1)
    b, t = q.shape[:2]
    return plain(q, k, v, cache, mask, rows_apart=t > 1 and self.rows_apart(b * t),
                 values_left=self.options.values_left)

  def fuses_attention(self, cfg, qkv_kernel, cache, mask, tokens: int) -> bool:
    """Weights laid out, float32 caches, RoPE, one qkv group, no q/k norm, no tree mask,
    head dims in multiples of 8, at most `fused_max_tokens` new tokens. A short prefill
    too: it reads the cache's first `length` slots, 0 there (`forward_cached(empty=)`
    promises it), so ignoring read_cache=False reads nothing."""
    opts = self.options
    return (opts.fused_layers and cache is not None and mask is None
            and tokens <= opts.fused_max_tokens and self.laid_out(qkv_kernel)
            and cache[0].dtype == jnp.float32 and cfg.position == "rope"
            and cfg.qkv_groups == 1 and not cfg.qk_norm and cfg.head_dim % 8 == 0)

  def rope_attention(self, qkv, cos, sin, cache, n_heads: int, live=None):
    """RoPE, attention and the KV write of a layer in one call, the caches updated in
    place: (out [B, T, H D], k_buf, v_buf)."""
    k_buf, v_buf, length = cache
    return kern.rope_attention(qkv, cos, sin, k_buf, v_buf, length, n_heads, live)

  def fuses_block(self, cfg, weights: LayerWeights, cache, mask, tokens: int) -> bool:
    """Where the layer's attention is fused, with RMSNorm, SwiGLU in one group, no biases."""
    return (self.fuses_attention(cfg, weights.qkv, cache, mask, tokens)
            and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.mlp_groups == 1
            and not (cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias)
            and all(map(self.laid_out, (weights.out, weights.up, weights.down))))

  def block(self, cfg, weights: LayerWeights, x, cos, sin, cache, live=None):
    """A layer as five calls: norm + qkv, RoPE + attention + KV write, out + residual,
    norm + up, SwiGLU + down + residual.

    Each norm, the SwiGLU product and each residual add is done by the product next to
    it, on its rows: a few-token pass of a small model otherwise spends as long in those
    small XLA ops as in its matrix products. live: each row's first `live` tokens are
    computed (and their KV written), the rest are zeros.
    """
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    qkv = kern.panel_matmul(flat, weights.qkv, weights.attn_norm, cfg.norm_eps, live=live,
                            period=t)
    return self._after_qkv(cfg, weights, qkv, flat, (b, t, d), cos, sin, cache, live)

  def fuses_joint_block(self, cfg, weights: LayerWeights, cache, mask, tokens: int) -> bool:
    """`fuses_block`'s conditions, with the qkv panels 2 d deep and in bfloat16. The two
    halves are slices of the panels, which XLA leaves inside the decode loop: a copy
    every call. Over bfloat16 panels (`host_layout` of the shipped heads) the fused
    layer is still the faster (docs/ARCHITECTURE.md); float32 panels keep the unfused
    layer, one product over the panels."""
    return (self.fuses_block(cfg, weights, cache, mask, tokens)
            and weights.qkv.shape[1] == 2 * cfg.d_model and weights.qkv.dtype == jnp.bfloat16)

  def joint_block(self, cfg, weights: LayerWeights, embed_norm, h, e, cos, sin, cache,
                  live=None):
    """EAGLE-3's layer (`heads.Eagle3Layer`) as six calls: its attention reads
    [RMSNorm(e) | RMSNorm(h)] as two products into one sum (the qkv panels' first d rows
    take e, with `embed_norm`; the rest h, with `weights.attn_norm`), so neither norm
    nor the concatenation is an op of its own; then `block`'s last four, on the residual
    stream h. h and e [B, T, d]."""
    b, t, d = h.shape
    rows = dict(live=live, period=t)
    flat = h.reshape(b * t, d).astype(jnp.float32)
    qkv = kern.panel_matmul(e.reshape(b * t, d).astype(jnp.float32), weights.qkv[:, :d],
                            embed_norm, cfg.norm_eps, **rows)
    qkv = kern.panel_matmul(flat, weights.qkv[:, d:], weights.attn_norm, cfg.norm_eps,
                            add=qkv, **rows)
    return self._after_qkv(cfg, weights, qkv, flat, (b, t, d), cos, sin, cache, live)

  def _after_qkv(self, cfg, weights, qkv, flat, shape, cos, sin, cache, live):
    """A layer's last four calls from its qkv projection [B T, ...] and residual stream
    `flat` [B T, d]: RoPE + attention + KV write, out + residual, norm + up,
    SwiGLU + down + residual."""
    b, t, d = shape
    rows = dict(live=live, period=t)
    out, k_buf, v_buf = self.rope_attention(qkv.reshape(b, t, -1), cos, sin, cache,
                                            cfg.n_heads, live)
    flat = kern.panel_matmul(out.reshape(b * t, -1), weights.out, add=flat, **rows)
    hidden = kern.panel_matmul(flat, weights.up, weights.mlp_norm, cfg.norm_eps, **rows)
    flat = kern.panel_matmul(hidden, weights.down, gated=True, add=flat, **rows)
    return flat.reshape(b, t, d), (k_buf, v_buf)

  def head(self, x, kernel, norm_scale, eps, live=None):
    """RMSNorm(x) times the head's panels in one product, on the first `live`
    positions of x [B, T, d] (None: all): float32 logits [B, T, V]."""
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    rows = {} if live is None else dict(live=live, period=x.shape[-2])
    logits = kern.panel_matmul(flat, kernel, norm_scale, eps, **rows)
    return logits.reshape(x.shape[:-1] + logits.shape[-1:])

  def argmax(self, logits):
    """With the kernels one call (`kernels.top`): XLA:CPU splits each reduction over a
    vocabulary into three thunks. Without them, a max and a min, two reductions XLA:CPU
    vectorises: its argmax is one reduction over (value, index) pairs that it runs a
    scalar at a time, several times slower, once per draft step and per verify pass."""
    if self.kernels:
      return kern.top(logits)[0]
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    at_top = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(at_top, index, logits.shape[-1] - 1), axis=-1)

  def point_masses(self, ps):
    if self.kernels:
      return jnp.all(kern.top(ps)[1] == 1)  # one call, not three thunks
    return super().point_masses(ps)

  @property
  def narrow_pass(self) -> bool:
    return self.options.narrow_pass and self.kernels


def panel_product(x, panels):
  """x [..., K] times the [K, N] weight laid out as `panels` -> float32 [..., N].

  specjax's kernel for any number of rows: a prefill too (faster there than XLA's
  multiply over the panels or over the weights as they lie).
  """
  rows = int(np.prod(x.shape[:-1]))
  y = kern.panel_matmul(x.reshape(rows, x.shape[-1]).astype(jnp.float32), panels)
  return y.reshape(x.shape[:-1] + y.shape[-1:])


def _layout(params, bf16: bool):
  pack = kern.pack_bf16 if bf16 else kern.pack

  def lay(path, leaf):
    kind = _packed_as(params, path, leaf)
    return leaf if kind is None else pack(leaf if kind == "kernel" else leaf.T)

  return jax.tree_util.tree_map_with_path(lay, params)


def _packed_as(params, path, leaf):
  """How `layout` packs a leaf: "kernel" (a Dense kernel), "tied" (a tied embedding, as
  the LM head's [d, V] that the model's `Embed` reads), or None (left as it is)."""
  names = tuple(getattr(p, "key", None) for p in path[-2:])
  if names[-1] == "kernel" and kern.packable(leaf):
    return "kernel"
  tied = "lm_head" not in (params or {})
  if tied and names == ("embed", "embedding") and kern.packable(leaf.T):
    return "tied"
  return None


@functools.partial(jax.jit, static_argnames="bf16")
def _compiled_layout(params, bf16):
  return _layout(params, bf16)
