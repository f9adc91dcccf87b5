"""Few-row matrix products for XLA:CPU (`fewrow.cc`), built with the system C++ compiler.

A decode step multiplies 1 row by each weight matrix, a verify pass γ+1 rows. XLA:CPU
runs one row as a matrix-vector product and 2..9 rows as a general multiply that
repacks the weights on every call, so a few-token pass cost several 1-token steps
although its extra arithmetic is a fraction of one (docs/ARCHITECTURE.md, "Why a step
costs what it does"). These
kernels read each weight element once, from panels laid out once per call by `pack`,
and use it for every row; the columns are split between the calling thread and one
XLA pool thread. `cached_attention` does the same for attention over the KV cache: it
reads each valid cached key and value once for all new queries, and no stale slot.
`rope_attention` is a layer's RoPE, attention and KV write in one call, and
`panel_matmul` also does the RMSNorm or SwiGLU before a product and the residual add
after it, so a Llama-shaped layer is five calls (`backend.CpuBackend.block`).

The library is compiled on first use (a few seconds) into a cache directory
($SPECJAX_CACHE_DIR, else ~/.cache/specjax) under a name that hashes the source, the
jaxlib version and the CPU, and loaded from there afterwards. Without a compiler, or
with SPECJAX_CPU_KERNELS=0, `available()` is False and the CPU backend keeps XLA's own
products (as does `backends.Options(kernels=False)`); results differ only in the order
of float additions. This module is the kernels' glue only: when they are used, and how
a model's weights are laid out for them, is `specjax.backends.cpu.backend`'s.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

PANEL = 16  # columns per panel (fewrow.cc kPanel)
SOURCE = pathlib.Path(__file__).with_name("fewrow.cc")
_TARGETS = {"specjax_panel_matmul": "SpecjaxPanelMatmul",
            "specjax_panel_matmul_bf16": "SpecjaxPanelMatmulBf16",
            "specjax_panel_lookup_bf16": "SpecjaxPanelLookupBf16",
            "specjax_cached_attention": "SpecjaxCachedAttention",
            "specjax_rope_attention": "SpecjaxRopeAttention",
            "specjax_top": "SpecjaxTop",
            "specjax_panel_lookup": "SpecjaxPanelLookup"}


def _cpu_id() -> str:
  """What -march=native compiles for: the model name and the feature flags."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    keep = [l for l in lines if l.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))
  except OSError:
    return platform.processor() or platform.machine()


def _flags():
  return ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
          f"-I{jax.ffi.include_dir()}"]


def library_path() -> pathlib.Path:
  key = hashlib.sha256("\0".join(
      [SOURCE.read_text(), jaxlib.__version__, _cpu_id()] + _flags()[:-1]).encode())
  root = os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "specjax")
  if not os.access(_existing_parent(root), os.W_OK):  # a read-only home: the temp dir
    root = os.path.join(tempfile.gettempdir(), f"specjax-{os.getuid()}")
  return pathlib.Path(root) / f"fewrow-{key.hexdigest()[:16]}.so"


def _existing_parent(path: str) -> str:
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def compiler() -> str:
  """The C++ compiler the library is built with: $CXX, else c++ or g++ on the PATH."""
  found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if found is None:
    raise RuntimeError("no C++ compiler (set CXX, or install g++)")
  return found


def _build(path: pathlib.Path) -> None:
  compiler_path = compiler()
  path.parent.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: concurrent processes (pytest-xdist) never load
  # a half-written library.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
  os.close(fd)
  try:
    done = subprocess.run([compiler_path, *_flags(), str(SOURCE), "-o", tmp],
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
      raise RuntimeError(f"{compiler_path} failed on {SOURCE.name}:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


@functools.cache
def _load():
  """(True, path) once built, loaded and registered; (False, why) otherwise."""
  if os.environ.get("SPECJAX_CPU_KERNELS", "1") == "0":
    return False, "turned off by SPECJAX_CPU_KERNELS=0"
  try:
    path = library_path()
    if not path.exists():
      _build(path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in _TARGETS.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
    return True, str(path)
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    warnings.warn(f"specjax CPU kernels unavailable, using XLA's products: {e}")
    return False, str(e)


def available() -> bool:
  """Whether the kernels can run here: a CPU backend and a built library (built here)."""
  return jax.default_backend() == "cpu" and _load()[0]


def status() -> str:
  """The library's path, or why the kernels are not used."""
  if jax.default_backend() != "cpu":
    return f"not used on {jax.default_backend()}"
  return _load()[1]


def packable(w) -> bool:
  return w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] % PANEL == 0


def pack(w: jax.Array) -> jax.Array:
  """[K, N] -> panels [N / 16, K, 16]: panel p holds columns 16p..16p+15, row by row."""
  k, n = w.shape
  return w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)


def pack_bf16(w: jax.Array) -> jax.Array:
  """[K, N] -> bfloat16 panels [N / 16, K, 16] for weights that hold bfloat16 values.

  Each panel row interleaves its two halves (columns 0, 8, 1, 9, ..., 7, 15): the kernel
  loads a row in one 32-byte read and gets the columns as float32 by a shift (0-7) and
  a mask (8-15), the same float32 weights `pack` would give from half the bytes."""
  panels = pack(w)
  p, k, _ = panels.shape
  panels = panels.reshape(p, k, 2, PANEL // 2).swapaxes(2, 3).reshape(p, k, PANEL)
  # The high half of each float32's bits: what the kernel widens back (bits << 16).
  high = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(panels, jnp.uint32),
                                     jnp.uint32(16)).astype(jnp.uint16)
  return jax.lax.bitcast_convert_type(high, jnp.bfloat16)


def bf16_exact(leaves) -> bool:
  """Whether every float32 array in `leaves` is concrete and holds only bfloat16 values
  (the low 16 bits of each float32 zero, so `pack_bf16` keeps every bit). Checked on
  the host, so it also answers inside a trace for weights a function closes over."""
  for x in leaves:
    if isinstance(x, jax.core.Tracer) or x.dtype != jnp.float32:
      return False
    if (np.asarray(x).view(np.uint32) & 0xFFFF).any():
      return False
  return True


def unpack(panels: jax.Array) -> jax.Array:
  p, k, c = panels.shape
  if panels.dtype == jnp.bfloat16:  # `pack_bf16`'s interleaved halves
    panels = panels.astype(jnp.float32).reshape(p, k, c // 2, 2).swapaxes(2, 3)
  return panels.reshape(p, k, c).transpose(1, 0, 2).reshape(k, p * c)


def _require():
  ok, why = _load()
  if not ok:
    raise RuntimeError(f"specjax CPU kernels unavailable: {why}")


# Products of fewer multiply-adds than this (rows x K x N) run on the calling thread
# alone: waking a pool thread costs more than it saves (the draft's). Read when traced.
PARALLEL_MIN_WORK = 1 << 16
# Products over at least this many bytes of panels prefetch their weights 4 KiB ahead
# (`fewrow.cc` PanelRows): a matrix this large comes from memory, where prefetching made
# a few rows faster; over weights that stay in the L3 (the shipped pair) it made them
# slower (measured in the work recorded in git as docs/CPU_VERIFY.md).
PREFETCH_MIN_BYTES = 2 << 20


def prefetches(panel_bytes: int) -> bool:
  """Whether a product over this many bytes of panels prefetches its weights (read
  when traced; the kernel does it for 3 or more rows)."""
  return panel_bytes >= PREFETCH_MIN_BYTES


def _live(live) -> jax.Array:
  """A traced count of rows in use as the kernels' int32 [1] operand ([0]: all)."""
  if live is None:
    return jnp.zeros((0,), jnp.int32)
  return jnp.reshape(jnp.asarray(live, jnp.int32), (1,))


def panel_matmul(x: jax.Array, panels: jax.Array, norm_scale=None, eps: float = 0.0,
                 gated: bool = False, add=None, live=None, period: int = 0) -> jax.Array:
  """x [R, K] float32 · W for W = unpack(panels) [K, N] -> [R, N], with the small ops
  around a product done on its rows in the same call:

  gated: x is [gate | up] [R, 2K] and the product is of silu(gate) · up (SwiGLU).
  norm_scale [K]: of RMSNorm(x) with that scale and eps (as `nnx.RMSNorm`).
  add [R, N]: add + the product (a residual stream).
  live (a traced int) and period: of each `period` rows only the first `live` are
  computed (each exactly as with every row), the others are zeros.
  """
  _require()
  n, k = panels.shape[0] * panels.shape[2], panels.shape[1]
  parallel = x.shape[0] * k * n >= PARALLEL_MIN_WORK
  scale = jnp.zeros((0,), jnp.float32) if norm_scale is None else norm_scale.astype(jnp.float32)
  add = jnp.zeros((0, 0), jnp.float32) if add is None else add.astype(jnp.float32)
  if live is not None and (period <= 0 or x.shape[0] % period):
    raise ValueError(f"panel_matmul: live rows need a period dividing {x.shape[0]} rows, "
                     f"got {period}")
  target = "specjax_panel_matmul" + ("_bf16" if panels.dtype == jnp.bfloat16 else "")
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
                              x, panels, scale, add, _live(live), parallel=parallel,
                              eps=np.float32(eps), gated=gated,
                              period=np.int64(period if live is not None else 0),
                              ahead=prefetches(panels.size * panels.dtype.itemsize))


def cached_attention(q, k, v, k_buf, v_buf, length) -> jax.Array:
  """`layers.attend` without a mask, float32: T new queries q [B, T, H, D] over the first
  length[b] slots of k_buf, v_buf [B, KVH, S, D] and, causally, the T new k, v
  [B, T, KVH, D] -> [B, T, H, D]. Only the valid slots are read."""
  _require()
  return jax.ffi.ffi_call("specjax_cached_attention",
                          jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                              q, k, v, k_buf, v_buf, length.astype(jnp.int32))


def rope_attention(qkv, cos, sin, k_buf, v_buf, length, n_heads: int, live=None):
  """A layer's attention from its fused qkv projection [B, T, (H + 2 KVH) D] (one group,
  `split_fused`'s G = 1): RoPE of the new q and k by cos, sin [B, T, D / 2]
  (`layers.rope_angles`), attention as `cached_attention`, and the new k, v written at
  slots length[b] + t of k_buf, v_buf [B, KVH, S, D] in place (dropped past S).
  Returns (out [B, T, H D], k_buf, v_buf): the buffers are the inputs' own (aliased), so
  XLA copies a cache only where the old one is still needed elsewhere. live (a traced
  int): only each row's first `live` tokens are attended and written (out: zeros past)."""
  _require()
  b, t, _ = qkv.shape
  out = jax.ShapeDtypeStruct((b, t, n_heads * k_buf.shape[3]), jnp.float32)
  bufs = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (k_buf, v_buf)]
  return jax.ffi.ffi_call("specjax_rope_attention", (out, *bufs),
                          input_output_aliases={3: 1, 4: 2})(
                              qkv, cos, sin, k_buf, v_buf, length.astype(jnp.int32),
                              _live(live))


def panel_lookup(panels: jax.Array, tokens: jax.Array) -> jax.Array:
  """Rows of the table [V, d] laid out as panels [V / 16, d, 16] (`pack` of its
  transpose, a tied LM head): tokens int [...] -> float32 [..., d], indices clipped."""
  _require()
  target = "specjax_panel_lookup" + ("_bf16" if panels.dtype == jnp.bfloat16 else "")
  return jax.ffi.ffi_call(target,
                          jax.ShapeDtypeStruct(tokens.shape + panels.shape[1:2], jnp.float32),
                          vmap_method="sequential")(tokens.astype(jnp.int32), panels)


def top(x: jax.Array):
  """(jnp.argmax(x, axis=-1), the number of entries > 0) over the last axis of float32
  x [..., V], both int32 [...], in one call (`SpecjaxTop`; XLA:CPU runs each reduction
  over a vocabulary as three thunks). Batched under vmap."""
  _require()
  out = [jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)] * 2
  return tuple(jax.ffi.ffi_call("specjax_top", out, vmap_method="broadcast_all")(
      x.astype(jnp.float32)))
