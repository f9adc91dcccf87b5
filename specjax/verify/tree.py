"""The lossless walk down a token tree, and the compaction of its accepted path.

The walk (one row, `vmap`ped): at the current node the target's distribution p is tried
against the children in order.
  sampled children (draws from the draft's q at that node without replacement):
  recursive rejection sampling. A child x is accepted with min(1, p(x)/q(x)); on a
  rejection p <- normalise([p - q]_+), q loses x (renormalised) and the next child is
  tried against both. Past q's support a child is a fixed token: point-mass rule.
  deterministic children (the draft's top-k, distinct point masses): a child x is
  accepted with probability p(x); on a rejection p(x) <- 0 and p is renormalised.
If every child is rejected the token is drawn from what is left of p; accepting a child
moves to it with that child's own p; at a leaf the bonus token is drawn from its p.
Both node rules emit exactly p (docs/ARCHITECTURE.md says why; tests/test_trees.py
checks it in float64 and by sampling). Treating top-k children as samples from the
draft's soft q (accept with min(1, p/q), residual [p - q]_+) is not exact: they were not
drawn from q, and the float64 test shows the law moving. (With a one-hot q the sampled
rule is the point-mass rule: [p - onehot(x)]_+ is p with x zeroed.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import kv_cache
from specjax.processors.sampling import sample
from specjax.trees import Tree
from specjax.verify.exact import residual


def walk(key, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None,
         children=None):
  """One row: (n_accepted, next_token, overlap[depth], path int32[depth] (-1 past a),
  by_rank).

  by_rank: (tried int32[K], accepted int32[K], chance float32[K]) per sibling rank r (K
  the widest node's number of children): how often a child of rank r was tried, how often
  accepted, and the sum over those tries of its acceptance probability given the walk so
  far (Σ_x min(p, q_r) for a child drawn from q_r; p(x) for a fixed token x): the tree's
  α̂ by rank, which `ledger.tree_expected_tokens` takes.

  ps [N+1, V]: the target's distribution at the root (row 0) and at node i (row i+1).
  node_q [N, V]: its parent's draft distribution q; sampled siblings were drawn from it
  without replacement in sibling order (`sample_distinct`); the walk takes each tried
  sibling out of q before judging the next.
  unroll: the loops unrolled (None: but on a CPU; `decode.Engine.unroll_walk`); the same
  numbers either way.
  children: int32[N+1, K], this row's own `Tree.children` (a `trees.DynamicTree`, whose
  parents are data); None: the static tree's.
  """
  # On a CPU, rolled loops: unrolled, the program grew with depth x width (the shipped
  # pair's (4, 2, 2, 1) program took 1.5x as long to trace and compile) and ran no
  # faster. Unrolled elsewhere, as it was: a loop's iterations there are not measured.
  unroll = jax.default_backend() != "cpu" if unroll is None else bool(unroll)
  children = jnp.asarray(tree.children if children is None else children)
  depth, width = tree.depth, children.shape[1]
  keys = jax.random.split(key, depth * width + 1)

  def level(j, c):
    cur, alive, dist, path, overlap, n_accepted, tried, taken, chance = c
    first = children[cur, 0]
    left = node_q[jnp.maximum(first, 0)]  # the siblings' q, minus the siblings tried
    overlap = overlap.at[j].set(jnp.where(alive & (first >= 0),
                                          jnp.sum(jnp.minimum(dist, left)), 0.0))

    def sibling(r, c):
      dist, left, found, tried, taken, chance = c
      child = children[cur, r]
      trying = alive & (child >= 0) & (found < 0)
      x = node_tokens[jnp.maximum(child, 0)]
      u = jax.random.uniform(keys[j * width + r])
      dropped = dist.at[x].set(0.0)
      point_rejected = dropped / jnp.maximum(jnp.sum(dropped), 1e-30)
      if deterministic:
        accept, rejected, odds = u < dist[x], point_rejected, dist[x]
      else:
        mass = jnp.sum(left)
        drawn = mass > 0  # else q's support is used up: x is a fixed token
        q = left / jnp.where(drawn, mass, 1.0)  # x was drawn from q (without replacement)
        accept = jnp.where(drawn, u * q[x] < dist[x], u < dist[x])
        rejected = jnp.where(drawn, residual(dist, q), point_rejected)
        odds = jnp.where(drawn, jnp.sum(jnp.minimum(dist, q)), dist[x])
        left = jnp.where(trying, left.at[x].set(0.0), left)
      tried = tried.at[r].add(trying.astype(jnp.int32))
      taken = taken.at[r].add((trying & accept).astype(jnp.int32))
      chance = chance.at[r].add(jnp.where(trying, odds, 0.0))
      found = jnp.where(trying & accept, child, found)
      dist = jnp.where(trying & ~accept, rejected, dist)
      return dist, left, found, tried, taken, chance

    dist, _, found, tried, taken, chance = jax.lax.fori_loop(
        0, width, sibling, (dist, left, jnp.int32(-1), tried, taken, chance), unroll=unroll)
    moved = alive & (found >= 0)
    path = path.at[j].set(jnp.where(moved, found, -1))
    n_accepted = n_accepted + moved.astype(jnp.int32)
    cur = jnp.where(moved, found + 1, cur)
    dist = jnp.where(moved, ps[jnp.where(moved, found + 1, 0)], dist)
    alive = moved & (children[cur, 0] >= 0)  # a leaf ends the walk with a bonus
    return cur, alive, dist, path, overlap, n_accepted, tried, taken, chance

  # cur: the row of `ps` / `children` the walk is at (0 = root, i + 1 = node i).
  init = (jnp.int32(0), jnp.bool_(True), ps[0], jnp.full((depth,), -1, jnp.int32),
          jnp.zeros((depth,), jnp.float32), jnp.int32(0), jnp.zeros((width,), jnp.int32),
          jnp.zeros((width,), jnp.int32), jnp.zeros((width,), jnp.float32))
  _, _, dist, path, overlap, n_accepted, tried, taken, chance = jax.lax.fori_loop(
      0, depth, level, init, unroll=unroll)
  next_token = sample(keys[-1], dist)
  return n_accepted, next_token, overlap, path, (tried, taken, chance)


def walk_batch(keys, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None,
               children=None):
  """`walk` of each row (vmapped over the first four, and `children` [B, N+1, K] when
  given); tree, deterministic, unroll shared."""
  if children is None:
    return jax.vmap(lambda *rows: walk(*rows, tree, deterministic, unroll))(
        keys, node_tokens, node_q, ps)
  return jax.vmap(lambda k, y, q, p, c: walk(k, y, q, p, tree, deterministic, unroll, c))(
      keys, node_tokens, node_q, ps, children)


def verify_layout(tree: Tree, n):
  """forward_cached's positions and mask for [pending, nodes] at length n - 1: each node
  at position n - 1 + depth, seeing the committed history and its ancestors."""
  depths = jnp.asarray((0,) + tree.depths, jnp.int32)
  return dict(positions=(n - 1)[:, None] + depths[None, :],
              mask=(jnp.asarray(tree.ancestors), None))


def compact_path(kv: kv_cache.KVState, start, path, n_accepted) -> kv_cache.KVState:
  """Target KV after a tree pass written at start (root) and start + 1 + i (node i):
  the accepted nodes' KV moves to start + 1 + j, so the committed history is contiguous."""
  return kv_cache.compact(kv, start[:, None] + 1 + jnp.maximum(path, 0), start + 1, n_accepted)


# Dynamic trees (`trees.DynamicTree`): depths are static, parents int32[B, N] are data.

def root_ancestors(batch: int, nodes: int):
  """bool[B, N+1, N+1] over [root, nodes] before any node hangs anywhere: the root and
  each row itself; `add_level` fills in each depth's ancestors."""
  eye = jnp.eye(nodes + 1, dtype=bool).at[:, 0].set(True)
  return jnp.broadcast_to(eye, (batch, nodes + 1, nodes + 1))


def add_level(anc, first: int, parents):
  """`anc` with nodes first..first+c-1 (parents int32[B, c], -1 = the root) below their
  parents: each node's row gains its parent's ancestors."""
  count = parents.shape[1]
  above = jnp.take_along_axis(anc, (parents + 1)[:, :, None], axis=1)  # [B, c, N+1]
  rows = slice(first + 1, first + 1 + count)
  return anc.at[:, rows].set(anc[:, rows] | above)


def ancestors_of(tree, parents):
  """bool[B, N+1, N+1]: `Tree.ancestors` of each row's dynamic tree."""
  anc = root_ancestors(parents.shape[0], tree.num_nodes)
  for first, count in tree.levels:
    anc = add_level(anc, first, parents[:, first:first + count])
  return anc


def children_of(tree, parents):
  """int32[B, N+1, K]: `Tree.children` of each row's dynamic tree (K = tree.width). A
  node's children are consecutive and in draw order (`best_candidates`), so a child's
  rank is the number of earlier nodes with its parent."""
  b, nodes = parents.shape
  i = jnp.arange(nodes)
  same = (parents[:, :, None] == parents[:, None, :]) & (i[None, None, :] < i[None, :, None])
  rank = jnp.sum(same, axis=2)  # [B, N]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, nodes))
  out = jnp.full((b, nodes + 1, tree.width), -1, jnp.int32)
  return out.at[rows, parents + 1, rank].set(jnp.broadcast_to(i, (b, nodes)), mode="drop")


def dynamic_layout(tree, n, ancestors):
  """`verify_layout` for one tree per row: ancestors bool[B, N+1, N+1]."""
  depths = jnp.asarray((0,) + tree.depths, jnp.int32)
  return dict(positions=(n - 1)[:, None] + depths[None, :], mask=(ancestors, None))
