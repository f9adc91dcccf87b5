"""Traversal verification of a token tree (Weng et al. 2025, arXiv 2505.12398): lossless,
leaves towards the root, each node judged by its whole root-to-node path.

Every node v keeps a weight w_v (block verification's path weight) and a target
distribution p_v (its row of `ps`, later a residual). A child c of u carries the draft
distribution q_c it was drawn from: q at u minus the siblings already tried, renormalised
(sampled children, drawn without replacement, as `sample_distinct` draws them), or the
point mass at its token (top-k children, or a sampled child past q's support). Entering c:
  w_c = min(1, w_u p_u(x_c) / q_c(x_c)).
The nodes are tested in post-order (a node after all its children, siblings in order): a
node is accepted with probability w_v, which ends the walk (the path to it is accepted
and the next token is drawn from p_v). Rejecting child c of u removes it and updates u:
  r = [w_u p_u - q_c]_+,  p_u <- r / Σr,  w_u <- Σr / (Σr + 1 - w_u),
and q at u loses x_c. The root keeps w = 1, so the walk always ends.

Why it is exact (docs/ARCHITECTURE.md): by induction over children, a node entered with
weight w emits its next token with law w·p_v (exactly, the rest of the path by the target
law) and is rejected with probability 1 - w. Child c is then emitted with mass
min(q_c, w p_u)(x) and rejected with mass [q_c - w p_u]_+(x), which sums to Σr + 1 - w,
and what is left of u (weight Σr/(Σr + 1 - w), law r/Σr, the remaining children drawn
from the reduced q) emits r: min(q_c, w p_u) + r = w p_u. The update does not depend on
the rejected token, so the argument holds for draws without replacement and for fixed
tokens alike. At w = 1 (the root) the root's update is the node rule's recursive rejection
sampling; the gain comes from deeper nodes, whose weights carry the path's p/q surplus.
For a chain it is block verification (Sun et al. 2024). tests/test_traversal.py checks
the law in float64 over every draft tree, and the engine's (`verify_rule='traversal'`)
by sampling and at temperature 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax
import jax.numpy as jnp

from specjax.processors.sampling import sample
from specjax.trees import Tree


def schedule(tree: Tree):
  """The static Euler tour: int32[2N, 2] of (node, 1 = enter | 0 = test), a child entered
  after its previous sibling's test and tested after its own children; and int32[N+1,
  depth], each row's root-to-node path of node indices (-1 past it)."""
  children = tree.children
  events = []

  def visit(row):
    for c in children[row]:
      if c < 0:
        break
      events.append((int(c), 1))
      visit(int(c) + 1)
      events.append((int(c), 0))

  visit(0)
  paths = np.full((tree.num_nodes + 1, tree.depth), -1, np.int32)
  for i, p in enumerate(tree.parents):
    paths[i + 1] = paths[p + 1] if p >= 0 else -1
    paths[i + 1, tree.depths[i] - 1] = i
  return np.asarray(events, np.int32), paths


def traced_schedule(tree, children):
  """`schedule` of one row whose tree is data (a `trees.DynamicTree`; `children` int32[N+1,
  K] as `verify.tree.children_of` gives them), with each node's parent row and sibling
  rank: (events, paths, parents + 1, ranks). Nodes lie depth by depth (`tree.levels`)."""
  nodes, width = tree.num_nodes, children.shape[1]
  rows = jnp.broadcast_to(jnp.arange(nodes + 1, dtype=jnp.int32)[:, None], children.shape)
  cols = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], children.shape)
  slot = jnp.where(children >= 0, children, nodes)  # padding lands out of range: dropped
  parent_row = jnp.zeros((nodes,), jnp.int32).at[slot].set(rows, mode="drop")
  ranks = jnp.zeros((nodes,), jnp.int32).at[slot].set(cols, mode="drop")
  paths = jnp.full((nodes + 1, tree.depth), -1, jnp.int32)
  for d, (first, count) in enumerate(tree.levels):
    idx = jnp.arange(first, first + count, dtype=jnp.int32)
    paths = paths.at[idx + 1].set(paths[parent_row[idx]].at[:, d].set(idx))

  def step(e, c):
    # After entering a node: its first child, or its test if it is a leaf. After testing
    # it: its next sibling, else its parent's test (the last event has neither).
    events, node, enter = c
    events = events.at[e].set(jnp.stack([node, enter.astype(jnp.int32)]))
    first = children[node + 1, 0]
    r = ranks[node] + 1
    sibling = jnp.where(r < width, children[parent_row[node], jnp.minimum(r, width - 1)], -1)
    down = enter & (first >= 0)
    node = jnp.where(down, first, jnp.where(enter, node, jnp.where(sibling >= 0, sibling,
                                                                   parent_row[node] - 1)))
    return events, node, down | (~enter & (sibling >= 0))

  events, _, _ = jax.lax.fori_loop(
      0, 2 * nodes, step, (jnp.zeros((2 * nodes, 2), jnp.int32), children[0, 0], jnp.bool_(True)))
  return events, paths, parent_row, ranks


def walk(key, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None,
         update_parent=True, children=None):
  """One row, `verify.tree.walk`'s inputs and outputs: (n_accepted, next_token,
  overlap[depth], path int32[depth] (-1 past it), by_rank).

  overlap[j]: Σ min(p, q) at the accepted path's node of depth j (0 past the path or at
  a leaf), as the node walk reports it. by_rank (tried, accepted, chance) per sibling
  rank: how many rank-r nodes were tested, how many lie on the accepted path (so the
  accepted counts add up to n_accepted), and the sum of the tested nodes' weights.
  children: int32[N+1, K], this row's own tree (a `trees.DynamicTree`); None: the static
  tree's. update_parent=False is a deliberately wrong variant (a rejection leaves the
  parent's p and w as they were) for the tests; it is not lossless.
  """
  unroll = jax.default_backend() != "cpu" if unroll is None else bool(unroll)
  if children is None:
    events, paths = schedule(tree)
    order = jnp.asarray(events[events[:, 1] == 0, 0])
    paths = jnp.asarray(paths)
    parents = jnp.asarray(np.asarray(tree.parents, np.int32) + 1)  # the parent's row
    ranks = jnp.asarray(tree.ranks, jnp.int32)
    children = jnp.asarray(tree.children)
  else:
    events, paths, parents, ranks = traced_schedule(tree, children)
    # The tests in walk order: test events take their place among the tests.
    tests = events[:, 1] == 0
    at = jnp.where(tests, jnp.cumsum(tests) - 1, tree.num_nodes)
    order = jnp.zeros((tree.num_nodes,), jnp.int32).at[at].set(events[:, 0], mode="drop")
  depth, nodes = tree.depth, tree.num_nodes
  depths = jnp.asarray(tree.depths, jnp.int32)
  first = jnp.maximum(children[:, 0], 0)
  has_children = children[:, 0] >= 0
  width, vocab = children.shape[1], ps.shape[-1]
  keys = jax.random.split(key, nodes + 1)
  # Drawn before the loop (the same numbers as drawing in it).
  uniforms = jax.vmap(jax.random.uniform)(keys[:-1])
  # Row u's draft q (what its children were drawn from), and its mass.
  left0 = jnp.where(has_children[:, None], node_q[first], 0.0)
  mass0 = jnp.sum(left0, axis=-1)
  kids = jnp.maximum(children, 0)  # [N+1, K]
  is_kid = children >= 0

  def q_at(left_x, mass):
    """q(x) of a child drawn from what is left of its parent's q (a point mass where
    nothing is: a fixed token; top-k children always)."""
    if deterministic:
      return jnp.ones_like(left_x)
    return jnp.where(mass > 0, left_x / jnp.where(mass > 0, mass, 1.0), 1.0)

  # A first child's q(x) and its parent's p(x) when the parent has just been entered
  # (nothing tried below it yet): scalars, per node.
  fresh_p = ps[parents, node_tokens]
  fresh_q = q_at(left0[parents, node_tokens], mass0[parents])

  # chain[v]: v, its first child, that one's first child, ... (-1 past a leaf): the nodes
  # entered, in one go, after v's previous sibling is rejected.
  chain = [jnp.arange(nodes, dtype=jnp.int32)]
  for _ in range(depth - 1):
    chain.append(jnp.where(chain[-1] >= 0, children[jnp.maximum(chain[-1], 0) + 1, 0], -1))
  chain = jnp.stack(chain, axis=1)  # [N, depth]
  # log(p/q) of entering a first child of a just-entered node (its parent's ps row).
  gain = jnp.log(fresh_p) - jnp.log(jnp.maximum(fresh_q, 1e-30))

  def descend(v, d, a, w, fresh, row_at):
    """Enter v at depth d with weight a (-1: none), then the first child of each entered
    node down to a leaf. Their weights w_k = min(1, w_(k-1) p/q) in closed form, with
    S_k the partial sums of log(p/q) below v: w_k = min(1, exp(S_k - max(-log a,
    S_1..S_(k-1)))); their distributions are their ps rows (`fresh`) until a child of
    theirs is rejected."""
    nodes_k = chain[jnp.maximum(v, 0)]
    on = (nodes_k >= 0) & (v >= 0)
    sums = jnp.cumsum(jnp.where(jnp.arange(depth) > 0, gain[jnp.maximum(nodes_k, 0)], 0.0))
    floor = jnp.concatenate([jnp.full((2,), -jnp.log(a)), sums[1:-1]])[:depth]  # M_k
    weights = jnp.minimum(1.0, jnp.exp(sums - jax.lax.cummax(floor, axis=0)))
    at = jnp.where(on, d + jnp.arange(depth), depth + 1)  # past the stack: dropped
    w = w.at[at].set(weights, mode="drop")
    fresh = fresh.at[at].set(True, mode="drop")
    row_at = row_at.at[at].set(nodes_k + 1, mode="drop")
    return w, fresh, row_at

  def read(dist, fresh, row_at, d):
    """The current distribution of the live node at depth d."""
    return jnp.where(fresh[d], ps[row_at[d]], dist[d])

  def step(e, c):
    # One step per test, in post-order. Only the nodes from the root to the one tested
    # are live (entered, not yet tested), one per depth: their weights and distributions
    # are a stack indexed by depth, [depth + 1, V] (a node's row is its ps row until a
    # child of it is rejected: `fresh`), because XLA:CPU copies a carried array it reads
    # and updates every step. What is left of a node's q after its tried children is
    # rebuilt from `gone` (bool[N]) for the same reason. The enters between two tests
    # are scalars: a weight from the parent's weight and its p and q at the child.
    w, dist, fresh, row_at, gone, final, tried, taken, chance = c
    node = order[e]
    row, u, d = node + 1, parents[node], depths[node]
    x = node_tokens[node]
    live = final < 0
    w_u, w_v = w[d - 1], w[d]
    dist_u = read(dist, fresh, row_at, d - 1)
    out_kids = is_kid[u] & gone[kids[u]]
    left_u = left0[u].at[node_tokens[kids[u]]].multiply(jnp.where(out_kids, 0.0, 1.0))
    if deterministic:
      qc = jax.nn.one_hot(x, vocab, dtype=ps.dtype)
    else:
      mass = jnp.sum(left_u)
      qc = jnp.where(mass > 0, left_u / jnp.where(mass > 0, mass, 1.0),
                     jax.nn.one_hot(x, vocab, dtype=ps.dtype))
    # Accepted with probability w_v; else the parent is updated.
    accept = uniforms[node] < w_v
    rejected = live & ~accept
    r = jnp.maximum(w_u * dist_u - qc, 0.0)
    total = jnp.sum(r)
    w_out = jnp.where(u == 0, 1.0, total / jnp.maximum(total + 1.0 - w_u, 1e-30))
    if update_parent:
      new_u = jnp.where(total > 0, r / jnp.maximum(total, 1e-30), dist_u)
      dist = dist.at[d - 1].set(jnp.where(rejected, new_u, dist[d - 1]))
      fresh = fresh.at[d - 1].set(fresh[d - 1] & ~rejected)
      w = w.at[d - 1].set(jnp.where(rejected, w_out, w_u))
      w_u, dist_u = jnp.where(rejected, w_out, w_u), jnp.where(rejected, new_u, dist_u)
    gone = gone.at[node].set(gone[node] | rejected)
    rank = ranks[node]
    tried = tried.at[rank].add(live.astype(jnp.int32))
    chance = chance.at[rank].add(jnp.where(live, w_v, 0.0))
    final = jnp.where(live & accept, row, final)
    # Rejected: enter the next sibling (drawn from what is left of q) and its first
    # descendants, which the next steps test.
    r_next = jnp.minimum(rank + 1, width - 1)
    sib = jnp.where((rank + 1 < width) & rejected, children[u, r_next], -1)
    x_s = node_tokens[jnp.maximum(sib, 0)]
    left_next = left_u.at[x].set(0.0)
    q_s = q_at(left_next[x_s], jnp.sum(left_next))
    w_s = jnp.minimum(1.0, w_u * dist_u[x_s] / jnp.maximum(q_s, 1e-30))
    w, fresh, row_at = descend(sib, d, w_s, w, fresh, row_at)
    return w, dist, fresh, row_at, gone, final, tried, taken, chance

  w0 = jnp.ones((depth + 1,), ps.dtype)
  fresh0 = jnp.zeros((depth + 1,), bool).at[0].set(True)
  row_at0 = jnp.zeros((depth + 1,), jnp.int32)
  # The root's first child and its first descendants are entered before the first test.
  v0 = children[0, 0]
  a0 = jnp.minimum(1.0, fresh_p[v0] / jnp.maximum(fresh_q[v0], 1e-30))
  w0, fresh0, row_at0 = descend(v0, 1, a0, w0, fresh0, row_at0)
  init = (w0, jnp.zeros((depth + 1, vocab), ps.dtype), fresh0, row_at0,
          jnp.zeros((nodes,), bool), jnp.int32(-1),
          jnp.zeros((width,), jnp.int32), jnp.zeros((width,), jnp.int32),
          jnp.zeros((width,), jnp.float32))
  if unroll or jax.default_backend() != "cpu":
    carry = jax.lax.fori_loop(0, nodes, step, init, unroll=unroll)
  else:
    # On a CPU: stop at the first accepted node, as nothing changes after it (a while
    # loop's test is free there; on an accelerator it would wait on the host).
    carry = jax.lax.while_loop(lambda c: (c[0] < nodes) & (c[1][5] < 0),
                               lambda c: (c[0] + 1, step(c[0], c[1])), (0, init))[1]
  w, dist, fresh, row_at, _, final, tried, taken, chance = carry
  # Nothing changes once a node is accepted, so its depth's row is its distribution;
  # every child rejected: the root (w = 1) emits from what is left of its p.
  last = jnp.where(final < 0, 0, depths[jnp.maximum(final - 1, 0)])
  next_token = sample(keys[-1], read(dist, fresh, row_at, last))
  final = jnp.maximum(final, 0)
  path = paths[final]
  on_path = path >= 0
  n_accepted = jnp.sum(on_path).astype(jnp.int32)
  taken = taken.at[ranks[jnp.maximum(path, 0)]].add(on_path.astype(jnp.int32))
  # The path's rows by depth (root first); overlap as the node walk defines it.
  rows = jnp.concatenate([jnp.zeros((1,), jnp.int32), path[:-1] + 1])
  alive = jnp.arange(depth) <= n_accepted
  alive = alive & jnp.concatenate([jnp.ones((1,), bool), on_path[:-1]]) & has_children[rows]
  overlap = jnp.where(alive, jnp.sum(jnp.minimum(ps[rows], left0[rows]), axis=-1), 0.0)
  return n_accepted, next_token, overlap.astype(jnp.float32), path, (tried, taken, chance)


def walk_batch(keys, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None,
               update_parent=True, children=None):
  """`walk` of each row (vmapped over the first four, and `children` [B, N+1, K] when
  given)."""
  if children is None:
    return jax.vmap(lambda *rows: walk(*rows, tree, deterministic, unroll, update_parent))(
        keys, node_tokens, node_q, ps)
  return jax.vmap(lambda k, y, q, p, c: walk(k, y, q, p, tree, deterministic, unroll,
                                             update_parent, c))(
      keys, node_tokens, node_q, ps, children)


@dataclasses.dataclass(frozen=True)
class TraversalRule:
  """`verify_rule='traversal'`: a token tree verified leaves first, lossless.

  A tree rule: `layouts.TreeLayout` calls `walk_tree` in place of the node walk. On a
  chain the walk is block verification, which `verify_rule='block'` runs.
  """
  lossless = True

  @staticmethod
  def walk_tree(keys, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None,
                children=None):
    """`verify.tree.walk_batch`'s outputs (children: each row's own, for a dynamic tree).
    By sibling rank only the accepted path's counts are kept: the walk tests nodes leaves
    first, so its tries and their weights are not the node rule's α by rank, which
    `ledger.tree_expected_tokens` prices (results give nan for them)."""
    kw = {} if children is None else {"children": children}
    n_accepted, next_token, overlap, path, (tried, taken, chance) = walk_batch(
        keys, node_tokens, node_q, ps, tree, deterministic, unroll, **kw)
    return n_accepted, next_token, overlap, path, (jnp.zeros_like(tried), taken,
                                                   jnp.zeros_like(chance))

  def __call__(self, *args, **kwargs):
    raise ValueError("verify_rule='traversal' verifies a token tree: pass tree=...; on a "
                     "chain it is block verification, verify_rule='block'")
