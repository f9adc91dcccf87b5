"""The backend interface, and its XLA default: every op as the model's own jnp code.

A `Backend` is what a forward's heavy ops run on: the dense products, the embedding
lookup, cached attention, a row's argmax, and the layout of the weights they read. The
model (`specjax.models.model`) hands each op its own jnp form (`plain`); this default runs
it, as every accelerator does. `specjax.backends.cpu.CpuBackend` runs a CPU's few-row
products and attention through specjax's kernels instead.

A backend is a frozen dataclass: the options it holds change the traced program, so
they are static (`Options` is a field of `decode.Engine`, hashed by jit), never module
globals an experiment flips between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax.backends import pallas


@dataclasses.dataclass(frozen=True)
class Options:
  """What a CPU's forward may do (read when a program is traced; static, hashed).

  Every field is a switch for measurement: none is needed for exact output, and off a
  CPU none changes anything.
  """
  # specjax's C++ kernels for the products and attention (with SPECJAX_CPU_KERNELS=0 or
  # no compiler they are off whatever this says). False: XLA's products, row by row.
  kernels: bool = True
  # With the kernels, a cached pass of at most fused_max_tokens new tokens runs a
  # Llama-shaped layer as five kernel calls (`CpuBackend.block`) and the final norm
  # inside the LM head's product. Longer passes (long prefills) keep XLA's attention:
  # the kernel's is O(T^2) on two threads, and its per-thread scratch grows with T^2.
  fused_layers: bool = True
  fused_max_tokens: int = 64
  # Without the kernels, passes of 2..this many rows (batch x tokens) multiply by each
  # weight one row at a time and attend one query row at a time (`CpuBackend.rowwise`);
  # 0 turns it off.
  rowwise_max_rows: int = 9
  # A 1-token step's weighted sum over the cached values with V as the left operand
  # (`layers._weighted_cache`), XLA's attention only.
  values_left: bool = True
  # A chain's verify pass computes only the round's longest draft where the kernels run
  # the target's layers (`decode.narrows`).
  narrow_pass: bool = True
  # Weights that hold only bfloat16 values get bfloat16 panels before a call
  # (`CpuBackend.host_layout`); False: float32 panels.
  bf16_panels: bool = True
  # A cached pass writes its new K/V first, then runs one masked attention over the
  # buffers (`layers.attend_written`); None: off a CPU only (`Backend.writes_first`).
  # Off a CPU the one field but decode_kernel that acts there.
  write_first: bool | None = None
  # Cached attention reads each row's cache only up to its length, through jax's Pallas
  # GPU decode kernel (`backends.pallas`; on a CPU interpreted, for the tests). Off by
  # default: its speed on a GPU has not been measured (`experiments.accel` roofline).
  decode_kernel: bool = False


class LayerWeights(NamedTuple):
  """One decoder layer's arrays, as a fused layer reads them (`CpuBackend.block`)."""
  attn_norm: Any  # the norm's scale [d]
  qkv: Any
  out: Any
  mlp_norm: Any
  up: Any
  down: Any


@dataclasses.dataclass(frozen=True)
class Backend:
  """XLA's own ops: each call runs the model's `plain` jnp form as it is."""
  options: Options = Options()
  # A decode on a device mesh (`decode.Engine.mesh`): the batch is split over devices,
  # so no op may take it apart row by row.
  whole_rows: bool = False

  name = "xla"

  @property
  def kernels(self) -> bool:
    """Whether specjax's kernels run this backend's ops."""
    return False

  @property
  def writes_first(self) -> bool:
    """Whether a cached pass (not fused) writes its K/V before attending
    (`Options.write_first`; by platform: not on a CPU, where XLA then copied both caches
    every step, docs/ARCHITECTURE.md "Attention reads the cache, then writes it")."""
    if self.options.write_first is not None:
      return self.options.write_first
    return jax.default_backend() != "cpu"

  # --- the weights' layout -------------------------------------------------------

  def layout(self, params):
    """params as this backend's ops read them, inside a compiled call (traced)."""
    return params

  def host_layout(self, params):
    """`layout` of concrete params before a compiled call (may use their values)."""
    return params

  def laid_out(self, w) -> bool:
    """Whether the array w is in this backend's own layout (not [K, N] as it came)."""
    return False

  # --- the ops ---------------------------------------------------------------------

  def dense(self, x, kernel, bias, plain: Callable):
    """x [..., K] times kernel (+ bias): plain(x) is the module's own product."""
    return plain(x)

  def lookup(self, table, tokens, plain: Callable):
    """The embedding rows of tokens: plain(tokens) is the module's own lookup."""
    return plain(tokens)

  def attend(self, plain: Callable, q, k, v, cache, mask, laid_out: bool = False):
    """`layers.attend(q, k, v, cache, mask)`, passed as plain (the model's)."""
    return plain(q, k, v, cache, mask)

  def reads_valid_blocks(self, cache, mask) -> bool:
    """Whether this cached attention runs `cache_attention` (`Options.decode_kernel`):
    a buffer the kernel can split, a head size Triton tiles, no per-slot mask, rows not
    split over a mesh."""
    if not self.options.decode_kernel or cache is None or self.whole_rows:
      return False
    if jax.default_backend() == "tpu":
      raise ValueError("Options(decode_kernel=True) runs jax's Pallas GPU decode kernel: "
                       "on a TPU leave it off")
    k_buf = cache[0]
    return ((mask is None or mask[1] is None) and pallas.splits(k_buf.shape[2]) is not None
            and pallas.fits_head(k_buf.shape[3]))

  def cache_attention(self, qg, k_buf, v_buf, length):
    """`pallas.cache_attention` on this platform (interpreted but on a GPU)."""
    return pallas.cache_attention(qg, k_buf, v_buf, length,
                                  interpret=jax.default_backend() != "gpu")

  def fuses_attention(self, cfg, qkv_kernel, cache, mask, tokens: int) -> bool:
    """Whether `rope_attention` runs this layer's cached attention."""
    return False

  def rope_attention(self, qkv, cos, sin, cache, n_heads: int, live=None):
    raise NotImplementedError(f"{self.name} has no fused attention")

  def fuses_block(self, cfg, weights: LayerWeights, cache, mask, tokens: int) -> bool:
    """Whether `block` runs the whole layer (and the head `head`)."""
    return False

  def block(self, cfg, weights: LayerWeights, x, cos, sin, cache, live=None):
    raise NotImplementedError(f"{self.name} has no fused layer")

  def fuses_joint_block(self, cfg, weights: LayerWeights, cache, mask, tokens: int) -> bool:
    """Whether `joint_block` runs EAGLE-3's layer."""
    return False

  def joint_block(self, cfg, weights: LayerWeights, embed_norm, h, e, cos, sin, cache,
                  live=None):
    raise NotImplementedError(f"{self.name} has no fused EAGLE-3 layer")

  def head(self, x, kernel, norm_scale, eps, live=None):
    raise NotImplementedError(f"{self.name} has no fused head")

  def argmax(self, logits):
    """jnp.argmax(logits, axis=-1) (the first maximum; the first NaN if there is one)."""
    return jnp.argmax(logits, axis=-1)

  def point_masses(self, ps) -> jax.Array:
    """Whether every distribution in ps [..., V] has one token of nonzero probability."""
    return jnp.all(jnp.sum(ps > 0, axis=-1) == 1)

  @property
  def narrow_pass(self) -> bool:
    """Whether a verify pass may compute only its live rows (`decode.narrows`)."""
    return False
