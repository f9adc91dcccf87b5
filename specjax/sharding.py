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
vocab_size % tp != 0. `plan` says which; docs/SCALING.md has the table.

`generate(..., mesh=mesh)` runs the same jitted engine (`decode.decode`): `distribute`
places the weights, pads the batch to a multiple of the 'data' axis with copies of the
last prompt (dropped from the result and the stats), puts the token buffer, lengths and
per-row sampling settings on 'data', and `Engine.mesh` makes the engine constrain its
state on every round (`constrain`): KV buffers [batch -> 'data', kv_heads -> 'model'],
every other per-row array on 'data'. The draft is replicated over 'model' by default
(docs/BENCHMARKS.md: on the shipped pair splitting it was not faster on any mesh).

Random bits do not depend on the sharding: jax's partitionable threefry (the default)
draws each element from its own counter, so a seed gives the tokens of one device.
The mesh's axes are used as `Auto` (GSPMD propagation from these placements); a mesh
made with `Explicit` axes is converted.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax import checks
from specjax import drafters as drafters_lib
from specjax import kv_cache
from specjax import model as model_lib
from specjax import quantization
from specjax.config import ModelConfig
from specjax.model import Model

DATA, MODEL = "data", "model"
# Per-row fields of `Sampling` and of `processors.ProcessorSettings` (everything else in
# them is shared by all rows: stop tables, automaton tables, banned-token masks).
SAMPLING_ROWS = ("temperature", "top_k", "top_p", "max_new")
PROCESSOR_ROWS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                  "no_repeat_ngram", "min_new", "logit_bias")


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
# What is split, and the layout that makes it possible.


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
    return np.asarray(_host(tree))[..., cols]

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


# ----------------------------------------------------------------------------
# Placing arrays.


def _host(x):
  """x as a host array; a global array sharded over processes is gathered first."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


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
  return Model(cfg, params, model.tokenizer)


def replicate(model: Model, mesh) -> Model:
  """`model` as it is, every parameter replicated on every device of the mesh."""
  mesh = check_mesh(mesh)
  specs = jax.tree_util.tree_map(lambda _: P(), model.params)
  return model.with_params(_place(model.params, specs, mesh))


def unshard(model: Model) -> Model:
  """The usual layout again (one group; repeated KV heads are kept), on the host."""
  cfg = dataclasses.replace(model.config, qkv_groups=1, mlp_groups=1)
  params = jax.tree_util.tree_map(_host, regroup(model.params, model.config, cfg))
  return Model(cfg, params, model.tokenizer)


# ----------------------------------------------------------------------------
# The decode state.


def kv_spec(cfg, tp: int) -> P:
  """KV buffers [B, kv_heads, S, head_dim]: rows on 'data', heads on 'model' if split."""
  split = isinstance(cfg, ModelConfig) and tp > 1 and cfg.qkv_groups == tp
  return P(DATA, MODEL if split else None)


def state_shardings(engine, state):
  """A NamedSharding for every leaf of a `decode.DecodeState` on `engine.mesh`.

  KV states (target and model draft) by `kv_spec`; the PRNG key and the call counter
  replicated; every other array whose leading axis is the batch on 'data'.
  """
  mesh = engine.mesh
  tp = mesh.shape[MODEL]
  batch = state.n.shape[0]
  rows, shared = NamedSharding(mesh, P(DATA)), NamedSharding(mesh, P())

  def kv(state_kv, cfg):
    buf = NamedSharding(mesh, kv_spec(cfg, tp))
    return state_kv.replace(k=tuple(buf for _ in state_kv.k), v=tuple(buf for _ in state_kv.v),
                            length=rows)

  def tree(x, cfg=None):
    return jax.tree_util.tree_map(
        lambda a: kv(a, cfg) if isinstance(a, kv_cache.KVState)
        else rows if np.ndim(a) and np.shape(a)[0] == batch else shared,
        x, is_leaf=lambda a: isinstance(a, kv_cache.KVState))

  specs = tree(state)
  return specs.replace(target_kv=kv(state.target_kv, engine.target),
                       draft_state=tree(state.draft_state,
                                        getattr(engine.drafter, "config", None)),
                       key=shared, target_calls=shared)


def constrain(engine, state):
  """The state pinned to its shardings when the engine has a mesh; as it is otherwise."""
  if getattr(engine, "mesh", None) is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_shardings(engine, state))


# ----------------------------------------------------------------------------
# One batch on a mesh: `generate(..., mesh=...)`.


def _pad(x, extra):
  x = np.asarray(jax.device_get(x))
  return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)]) if extra else x


def _rows(obj, fields, fn):
  return obj.replace(**{f: fn(getattr(obj, f)) for f in fields})


def _sampling(sampling, extra, mesh):
  """Sampling padded by `extra` rows and placed: per-row fields on 'data'."""
  rows, shared = NamedSharding(mesh, P(DATA)), NamedSharding(mesh, P())
  out = _rows(sampling, SAMPLING_ROWS, lambda x: put(_pad(x, extra), rows))
  if sampling.procs is not None:
    out = out.replace(procs=_rows(sampling.procs, PROCESSOR_ROWS,
                                  lambda x: put(_pad(x, extra), rows)))
  placed = set(SAMPLING_ROWS) | {f"procs.{f}" for f in PROCESSOR_ROWS}

  def rest(path, x):
    name = ".".join(str(getattr(k, "name", k)) for k in path)
    return x if name in placed else put(x, shared)

  return jax.tree_util.tree_map_with_path(rest, out)


def distribute(prepared, mesh, shard_draft: bool = False):
  """A `generation.Prepared` laid out on `mesh`; its `run` returns the real rows only.

  The target is sharded (kept as it is when `shard` already placed it for this mesh);
  a model draft is replicated, or sharded with shard_draft=True; the batch is padded
  to a multiple of the 'data' axis with copies of the last row.
  """
  from specjax import decode as decode_lib
  mesh = check_mesh(mesh)
  dp = mesh.shape[DATA]
  engine, weights = prepared.engine, prepared.weights
  batch = prepared.tokens.shape[0]
  extra = checks.round_up(batch, dp) - batch
  target = Model(engine.target, weights.target)
  target = target if is_sharded(target, mesh) else shard(target, mesh)
  drafter, draft_params = engine.drafter, weights.draft
  if isinstance(drafter, drafters_lib.ModelDrafter):
    draft = Model(drafter.config, draft_params)
    draft = shard(draft, mesh) if shard_draft else replicate(draft, mesh)
    drafter, draft_params = dataclasses.replace(drafter, config=draft.config), draft.params
  elif draft_params is not None:
    draft_params = _place(draft_params, jax.tree_util.tree_map(lambda _: P(), draft_params),
                          mesh)
  rows = NamedSharding(mesh, P(DATA))
  return _distributed_class()(
      engine=dataclasses.replace(engine, target=target.config, drafter=drafter, mesh=mesh),
      weights=decode_lib.Weights(target=target.params, draft=draft_params),
      prompt_width=prepared.prompt_width, cache_size=prepared.cache_size,
      tokens=put(_pad(prepared.tokens, extra), rows),
      prompt_len=put(_pad(prepared.prompt_len, extra), rows),
      sampling=_sampling(prepared.sampling, extra, mesh), rows=batch)


def collect(state, rows: int):
  """The final state's tokens, lengths, counters and stats on the host, first `rows` rows.

  Gathers across processes when the state spans several; the caches are dropped.
  """
  first = lambda x: _host(x)[:rows]
  return state.replace(tokens=first(state.tokens), n=first(state.n),
                       prompt_len=first(state.prompt_len), done=first(state.done),
                       stats=jax.tree_util.tree_map(first, state.stats),
                       target_calls=_host(state.target_calls), target_kv=None,
                       draft_state=None, history=None, key=_host(state.key))


@functools.lru_cache(maxsize=None)
def _distributed_class():
  # A subclass of generation.Prepared, which imports the engine (and so this module):
  # defined on first use.
  from specjax.generation import Prepared

  @dataclasses.dataclass(frozen=True)
  class Distributed(Prepared):
    """A `Prepared` on a mesh. `rows`: the caller's batch (the rest is padding)."""
    rows: int = 0

    def run(self, key):
      """The final state, on the host, without the padding rows (see `collect`)."""
      key = put(key, NamedSharding(self.engine.mesh, P()))
      return collect(super().run(key), self.rows)

  return Distributed
