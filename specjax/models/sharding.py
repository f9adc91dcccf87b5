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

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax import checks
from specjax import drafters as drafters_lib
from specjax.models import kv_cache
from specjax.models.config import ModelConfig
from specjax.models.model import Model
from specjax.models.tensor_layout import MODEL, host, layout_config, param_specs, plan, regroup
from specjax.processors.sampling import PROCESSOR_ROWS, SAMPLING_ROWS, map_rows

DATA = "data"
# Per-row fields of `Sampling` and of `processors.ProcessorSettings` (everything else in
# them is shared by all rows: stop tables, automaton tables, banned-token masks).


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


def _sampling(sampling, extra, mesh):
  """Sampling padded by `extra` rows and placed: per-row fields on 'data'."""
  rows, shared = NamedSharding(mesh, P(DATA)), NamedSharding(mesh, P())
  out = map_rows(sampling, lambda x: put(_pad(x, extra), rows))
  placed = set(SAMPLING_ROWS) | {f"procs.{f}" for f in PROCESSOR_ROWS}

  def rest(path, x):
    name = ".".join(str(getattr(k, "name", k)) for k in path)
    return x if name in placed else put(x, shared)

  return jax.tree_util.tree_map_with_path(rest, out)


def distribute(prepared, mesh, shard_draft: bool = False):
  """A `generation.Prepared` laid out on `mesh`; its `run` returns the real rows only.

  The target is sharded (kept as it is when `shard` already placed it for this mesh);
  a model draft is replicated, or sharded with shard_draft=True; the batch is padded
  to a multiple of the 'data' axis with copies of the last row (and every row
  prefilled: `Engine.samples` 1).
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
      engine=dataclasses.replace(engine, target=target.config, drafter=drafter, mesh=mesh,
                                 samples=1),
      weights=decode_lib.Weights(target=target.params, draft=draft_params),
      prompt_width=prepared.prompt_width, cache_size=prepared.cache_size,
      tokens=put(_pad(prepared.tokens, extra), rows),
      prompt_len=put(_pad(prepared.prompt_len, extra), rows),
      sampling=_sampling(prepared.sampling, extra, mesh), stops=prepared.stops, rows=batch)


def collect(state, rows: int):
  """The final state's tokens, lengths, counters and stats on the host, first `rows` rows.

  Gathers across processes when the state spans several; the caches are dropped.
  """
  first = lambda x: host(x)[:rows]
  return state.replace(tokens=first(state.tokens), n=first(state.n),
                       prompt_len=first(state.prompt_len), done=first(state.done),
                       stopped=first(state.stopped),
                       stats=jax.tree_util.tree_map(first, state.stats),
                       target_calls=host(state.target_calls), target_kv=None,
                       draft_state=None, history=None, key=host(state.key),
                       logprobs=jax.tree_util.tree_map(first, state.logprobs))


@functools.lru_cache(maxsize=None)
def _distributed_class():
  # A subclass of generation.Prepared, which imports the engine (and so this module):
  # defined on first use.
  from specjax.generation import Prepared

  @dataclasses.dataclass(frozen=True)
  class Distributed(Prepared):
    """A `Prepared` on a mesh. `rows`: the caller's batch (the rest is padding)."""
    rows: int = 0

    def run(self, key, max_rounds=None):
      """The final state, on the host, without the padding rows (see `collect`)."""
      key = put(key, NamedSharding(self.engine.mesh, P()))
      limit = {} if max_rounds is None else dict(max_rounds=max_rounds)
      return collect(super().run(key, **limit), self.rows)

    def start(self, key):
      return super().start(put(key, NamedSharding(self.engine.mesh, P())))

    def finish(self, state):
      return collect(state, self.rows)

    def progress(self, state):  # gathered across processes, as `collect` does
      return jax.tree_util.tree_map(lambda x: host(x)[:self.rows],
                                    (state.tokens, state.n, state.done, state.stopped,
                                     state.logprobs))

  return Distributed
