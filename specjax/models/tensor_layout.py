"""What a 'model' axis of size tp splits, and the weight layout that makes it possible.

`model.MODEL_AXIS` says which axis of which weight is split; `plan` says which parts of a
config can be (whole heads, whole MLP units, whole tokens; a part that does not divide
stays replicated); `layout_config` / `regroup` lay the fused q|k|v and gate|up kernels
out in tp groups and repeat KV heads (host-side permutations of the columns);
`param_specs` gives each parameter its PartitionSpec. No device placement here:
`specjax.models.sharding` places what this module describes (docs/SCALING.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import checks
from specjax.models import model as model_lib
from specjax.models import quantization
from specjax.models.config import ModelConfig

MODEL = "model"  # the mesh axis the weights are split over


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a config is split over a 'model' axis of size tp (False: replicated)."""
  tp: int
  attention: bool  # q/k/v/out kernels and the KV cache split by heads
  mlp: bool  # up/down kernels split by hidden units
  vocab: bool  # embedding and LM head split by token
  kv_heads: int  # KV heads after repetition (a multiple of tp when attention is split)


def plan(cfg: ModelConfig, tp: int) -> Plan:
  tp = checks.int_at_least("tp (the mesh's 'model' axis)", tp, 1)
  split = tp > 1
  attention = split and cfg.n_heads % tp == 0
  return Plan(tp=tp, attention=attention, mlp=split and cfg.d_ff % tp == 0,
              vocab=split and cfg.vocab_size % tp == 0,
              kv_heads=math.lcm(cfg.n_kv_heads, tp) if attention else cfg.n_kv_heads)


def layout_config(cfg: ModelConfig, tp: int) -> ModelConfig:
  """The config of `cfg`'s weights laid out for a 'model' axis of size tp."""
  p = plan(cfg, tp)
  return dataclasses.replace(
      cfg, n_kv_heads=p.kv_heads, qkv_groups=tp if p.attention else 1,
      mlp_groups=tp if p.mlp and cfg.mlp == "swiglu" else 1)


def _qkv_order(h, kvh, d, groups):
  """For each column of the grouped q|k|v layout, its column in the usual layout."""
  hg, kg = h // groups, kvh // groups
  parts = []
  for g in range(groups):
    parts += [np.arange(g * hg * d, (g + 1) * hg * d),
              h * d + np.arange(g * kg * d, (g + 1) * kg * d),
              (h + kvh) * d + np.arange(g * kg * d, (g + 1) * kg * d)]
  return np.concatenate(parts)


def _mlp_order(f, groups):
  fg = f // groups
  return np.concatenate([np.concatenate([np.arange(g * fg, (g + 1) * fg),
                                         f + np.arange(g * fg, (g + 1) * fg)])
                         for g in range(groups)])


def qkv_columns(old: ModelConfig, new: ModelConfig) -> np.ndarray:
  """new_kernel = old_kernel[..., index]: regroups q|k|v and repeats KV heads."""
  h, d, kvh, kvh2 = old.n_heads, old.head_dim, old.n_kv_heads, new.n_kv_heads
  if kvh2 % kvh:
    raise ValueError(f"cannot go from {kvh} to {kvh2} KV heads by repeating them")
  j = np.arange(kvh2 * d)
  repeat = (j // d // (kvh2 // kvh)) * d + j % d  # KV head j' is a copy of j' // r
  usual = np.concatenate([np.arange(h * d), h * d + repeat, (h + kvh) * d + repeat])
  where_old = np.argsort(_qkv_order(h, kvh, d, old.qkv_groups))  # usual column -> old
  return where_old[usual[_qkv_order(h, kvh2, d, new.qkv_groups)]]


def mlp_columns(old: ModelConfig, new: ModelConfig) -> np.ndarray:
  f = old.d_ff
  return np.argsort(_mlp_order(f, old.mlp_groups))[_mlp_order(f, new.mlp_groups)]


def regroup(params, old: ModelConfig, new: ModelConfig):
  """`params` of `old` rearranged for `new` (same model, other groups / repeated KV heads).

  Only the fused kernels and biases (and their int8 values and scales) change; they
  are permuted on the host. Every other leaf is passed through as it is.
  """
  index = {("attn", "qkv"): qkv_columns(old, new)}
  if old.mlp == "swiglu":
    index[("mlp", "up")] = mlp_columns(old, new)
  index = {k: v for k, v in index.items() if not np.array_equal(v, np.arange(len(v)))}
  if not index:
    return params

  def visit(tree, path):
    if isinstance(tree, dict):
      return {k: visit(v, path + (k,)) for k, v in tree.items()}
    base = _base_path(path)
    cols = index.get(tuple(base[-3:-1]))
    if cols is None or base[-1] not in ("kernel", "bias"):
      return tree
    return np.asarray(host(tree))[..., cols]

  return visit(params, ())


def _base_path(path):
  """The parameter path of a leaf (an int8 weight's 'int8' / 'scale' dropped)."""
  return path[:-1] if path and path[-1] in quantization.KEYS else path


def param_specs(cfg: ModelConfig, params, tp: int):
  """A PartitionSpec per leaf of `params` (laid out for tp), from `model.MODEL_AXIS`."""
  p = plan(cfg, tp)
  parts = {"attn": p.attention, "mlp": p.mlp, "embed": p.vocab, "lm_head": p.vocab}
  if (p.attention and cfg.qkv_groups != tp) or (
      p.mlp and cfg.mlp == "swiglu" and cfg.mlp_groups != tp):
    raise ValueError(f"these weights are laid out for qkv_groups={cfg.qkv_groups}, "
                     f"mlp_groups={cfg.mlp_groups}, not a 'model' axis of {tp}: use shard()")

  def spec(path, leaf):
    base = _base_path(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path))
    for tail, axis in model_lib.MODEL_AXIS.items():
      if base[-len(tail):] == tail:
        part = tail[0] if tail[0] in parts else None
        if part and parts[part] and np.shape(leaf)[axis] > 1:
          return P(*[MODEL if a == axis else None for a in range(np.ndim(leaf))])
    return P()

  return jax.tree_util.tree_map_with_path(spec, params)


def host(x):
  """x as a host array; a global array sharded over processes is gathered first."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))
