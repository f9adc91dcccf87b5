"""Weight-only int8: `specjax.quantize(model, 'int8')`.

Every Linear kernel [in, out] (q|k|v, out, up, down, an untied LM head) is stored as
int8 with one float scale per output channel, and the embedding [V, d] with one scale
per row (its output channel when it doubles as the tied LM head). A quantised weight
is a plain dict in the parameter tree in place of the array:

    {"int8": int8[in, out], "scale": float[1, out]}      (the embedding: scale [V, 1])

so the tree stays a pytree of arrays (tree_map, device_put, jit and `specjax.shard`
work on it as on any other). The scale keeps the weight's rank, so dequantising is one
broadcast multiply with no axis bookkeeping; it happens inside the forward
(`model.merge`), on the fly, every call. Norms, biases and position embeddings stay in
the model's float dtype, which is also the dtype the forward runs in.

Symmetric rounding to the nearest of 255 levels: scale = max |w| / 127 per channel
(1 for an all-zero channel), int8 = round(w / scale). The error per weight is at most
scale / 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("int8",)
KEYS = frozenset(("int8", "scale"))


def is_quantized(node) -> bool:
  return isinstance(node, dict) and set(node) == KEYS


def quantize_array(w, channel_axis: int) -> dict:
  """{'int8', 'scale'} of w with one scale per index of `channel_axis` (symmetric)."""
  w = jnp.asarray(w)
  reduce = tuple(a for a in range(w.ndim) if a != channel_axis % w.ndim)
  wf = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(wf), axis=reduce, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
  return {"int8": q, "scale": scale.astype(w.dtype)}


def dequantize(tree):
  """The tree with every quantised weight replaced by int8 * scale, in the scale's dtype.

  A tree without quantised weights comes back as is (same leaves).
  """
  if is_quantized(tree):
    return tree["int8"].astype(tree["scale"].dtype) * tree["scale"]
  if isinstance(tree, dict):
    return {k: dequantize(v) for k, v in tree.items()}
  return tree


def _quantize_tree(tree, path=()):
  if is_quantized(tree):  # kept as it is, the embedding's too
    return tree
  if isinstance(tree, dict):
    return {k: _quantize_tree(v, path + (k,)) for k, v in tree.items()}
  if path[-2:] == ("embed", "embedding"):
    return quantize_array(tree, 0)  # one scale per token row
  if path[-1:] == ("kernel",) and np.ndim(tree) == 2:
    return quantize_array(tree, 1)  # one scale per output channel
  return tree


def quantize(model, mode: str = "int8"):
  """`model` with weight-only int8 Linear kernels and embedding, dequantised on the fly.

  Returns a new `Model` (same config and tokenizer); the input is left as it was. An
  already-quantised weight is kept. Unknown modes raise ValueError.
  """
  if mode not in MODES:
    raise ValueError(f"quantize mode must be one of {MODES}, got {mode!r}")
  if not callable(getattr(model, "with_params", None)):  # a Model (model.py imports this one)
    raise ValueError(f"quantize needs a specjax Model, got {type(model).__name__}")
  return model.with_params(_quantize_tree(model.params))


def weight_bytes(params) -> int:
  """Bytes of every array in the tree (int8 weights count one byte per entry)."""
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(params))
