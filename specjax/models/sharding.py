"""Scaling past one device: weights split over 'model', the batch over 'data'.

    mesh = jax.make_mesh((dp, tp), ("data", "model"))
    target = specjax.shard(target, mesh)          # once: weights laid out and placed
    specjax.generate(target, prompts, draft=draft, mesh=mesh)

`shard` applies the rules that live beside the model (`model.MODEL_AXIS`: which axis of
which weight goes on 'model'): attention heads, the MLP's hidden units and the
vocabulary (embedding, LM head) are split; norms, position embeddings and the biases
added after a split contraction are replicated. The fused q|k|v kernel stores all q
heads, then all k heads, then all v heads, so a contiguous 1/tp slice of it would not
hold whole heads: `shard` first permutes its columns into tp groups [q | k | v] of
n_heads/tp and n_kv_heads/tp heads (`ModelConfig.qkv_groups`; SwiGLU's gate|up kernel
likewise, `mlp_groups`), and the forward splits the projection group-wise. With
n_kv_heads not a multiple of tp, each KV head is repeated until there are
lcm(n_kv_heads, tp) (the KV heads are replicated on tp / n_kv_heads devices when
n_kv_heads < tp; query head j still reads a copy of its own KV head, so the output is
unchanged). A part that does not divide falls back to being replicated: attention when
n_heads % tp != 0 (every device computes every head; its KV cache is then replicated
over 'model'), the MLP when d_ff % tp != 0, the embedding / LM head when
vocab_size % tp != 0. `plan` says which; docs/SCALING.md has the table. These rules
and layouts live in `specjax.models.tensor_layout`; this module places arrays on the mesh.

`generate(..., mesh=mesh)` runs the same jitted engine (`decode.decode`):
`specjax.prepare.distribute` places the weights and pads and places the batch, and
`specjax.distribute` pins the decode state's layout on every round. This module knows
weights and caches only, nothing of the engine.

Random bits do not depend on the sharding: jax's partitionable threefry (the default)
draws each element from its own counter, so a seed gives the tokens of one device.
The mesh's axes are used as `Auto` (GSPMD propagation from these placements); a mesh
made with `Explicit` axes is converted.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.models.config import ModelConfig
from specjax.models.model import Model
from specjax.models.tensor_layout import MODEL, host, layout_config, param_specs, plan, regroup

DATA = "data"


def check_mesh(mesh) -> Mesh:
  """`mesh` with axes ('data', 'model') as Auto axes; ValueError for anything else."""
  if not isinstance(mesh, Mesh):
    raise ValueError("mesh must be a jax.sharding.Mesh, e.g. "
                     f"jax.make_mesh((dp, tp), ('data', 'model')), got {type(mesh).__name__}")
  if tuple(mesh.axis_names) != (DATA, MODEL):
    raise ValueError(f"mesh axes must be ('data', 'model'), got {tuple(mesh.axis_names)}")
  if any(t != AxisType.Auto for t in mesh.axis_types):
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * 2)
  return mesh


# ----------------------------------------------------------------------------
# Placing arrays.


def put(x, sharding: NamedSharding):
  """x placed with `sharding`: each device gets only its own slice of the host array.

  Works in multi-process runs (every process passes the same value; each fills its own
  devices). An array that already has this sharding is returned as it is.
  """
  if isinstance(x, jax.Array):
    if x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    if not x.is_fully_addressable:
      return jax.device_put(x, sharding)
  host = np.asarray(jax.device_get(x))
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _place(tree, specs, mesh):
  return jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(mesh, s)), tree, specs,
                                is_leaf=lambda s: isinstance(s, P))


def replicate_tree(tree, mesh):
  """Every leaf of `tree` placed whole on every device of `mesh`."""
  return _place(tree, jax.tree_util.tree_map(lambda _: P(), tree), mesh)


def is_sharded(model: Model, mesh) -> bool:
  """True if `model` is laid out and placed for `mesh` as `shard` would leave it."""
  mesh = check_mesh(mesh)
  tp = mesh.shape[MODEL]
  if layout_config(model.config, tp) != model.config:
    return False
  specs = param_specs(model.config, model.params, tp)
  ok = jax.tree_util.tree_map(
      lambda x, s: isinstance(x, jax.Array) and x.sharding.is_equivalent_to(
          NamedSharding(mesh, s), x.ndim), model.params, specs,
      is_leaf=lambda s: isinstance(s, P))
  return all(jax.tree_util.tree_leaves(ok))


def shard(model: Model, mesh) -> Model:
  """`model` laid out for the mesh's 'model' axis and placed on the mesh.

  Returns a new `Model` (config with `qkv_groups` / `mlp_groups` / `n_kv_heads` set
  for this mesh, same tokenizer) whose parameters are jax Arrays with a NamedSharding:
  split over 'model' as `plan` says, replicated over 'data'. Works on int8 models.
  Fallbacks (a part replicated) are logged at WARNING level.
  """
  if not isinstance(model, Model):
    raise ValueError(f"shard needs a specjax Model, got {type(model).__name__}")
  mesh = check_mesh(mesh)
  tp = mesh.shape[MODEL]
  p = plan(model.config, tp)
  for part, what in (("attention", f"n_heads={model.config.n_heads}"),
                     ("mlp", f"d_ff={model.config.d_ff}"),
                     ("vocab", f"vocab_size={model.config.vocab_size}")):
    if tp > 1 and not getattr(p, part):
      logging.warning("specjax.shard: %s is replicated over 'model' (%s is not divisible "
                      "by %d)", part, what, tp)
  cfg = layout_config(model.config, tp)
  params = regroup(model.params, model.config, cfg)
  params = _place(params, param_specs(cfg, params, tp), mesh)
  return model.with_params(params, cfg)


def replicate(model: Model, mesh) -> Model:
  """`model` as it is, every parameter replicated on every device of the mesh."""
  mesh = check_mesh(mesh)
  specs = jax.tree_util.tree_map(lambda _: P(), model.params)
  return model.with_params(_place(model.params, specs, mesh))


def unshard(model: Model) -> Model:
  """The usual layout again (one group; repeated KV heads are kept), on the host."""
  cfg = dataclasses.replace(model.config, qkv_groups=1, mlp_groups=1)
  params = jax.tree_util.tree_map(host, regroup(model.params, model.config, cfg))
  return model.with_params(params, cfg)


# ----------------------------------------------------------------------------
# The KV cache.


def kv_spec(cfg, tp: int) -> P:
  """KV buffers [B, kv_heads, S, head_dim]: rows on 'data', heads on 'model' if split."""
  split = isinstance(cfg, ModelConfig) and tp > 1 and cfg.qkv_groups == tp
  return P(DATA, MODEL if split else None)
















