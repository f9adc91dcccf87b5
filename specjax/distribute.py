"""A decode state on a mesh: which leaf lies on which axis, and the caller's rows back.

`Engine.mesh` makes the engine pin its state to these shardings on every round
(`constrain`): KV buffers [batch -> 'data', kv_heads -> 'model'], every other per-row
array on 'data', the PRNG key and the call counter replicated. The weights' rules live
beside the model (`specjax.models.sharding`, `specjax.models.tensor_layout`); the
batch is padded and placed by `specjax.prepare.distribute`.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax.models import kv_cache
from specjax.models.sharding import DATA, kv_spec, put
from specjax.models.tensor_layout import MODEL, host
from specjax.processors.sampling import PROCESSOR_ROWS, SAMPLING_ROWS, map_rows


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


def pad_rows(x, extra):
  x = np.asarray(jax.device_get(x))
  return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)]) if extra else x


def place_sampling(sampling, extra, mesh):
  """Sampling padded by `extra` rows and placed: per-row fields on 'data'."""
  rows, shared = NamedSharding(mesh, P(DATA)), NamedSharding(mesh, P())
  out = map_rows(sampling, lambda x: put(pad_rows(x, extra), rows))
  placed = set(SAMPLING_ROWS) | {f"procs.{f}" for f in PROCESSOR_ROWS}

  def rest(path, x):
    name = ".".join(str(getattr(k, "name", k)) for k in path)
    return x if name in placed else put(x, shared)

  return jax.tree_util.tree_map_with_path(rest, out)


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
