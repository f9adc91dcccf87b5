"""Token trees: static shapes, tree drafting, one target pass over the tree, and the
lossless walk down from the root.

A `Tree` lists its N nodes breadth-first by parent index (-1: the root, which is the
last committed token). `Tree.from_branching((k_1, ..., k_d))` gives every node at depth
j-1 k_j children; `Tree.from_paths([(0,), (1,), (0, 0)])` takes Medusa-style choices
(each a path of child ranks from the root). A chain of γ is `from_branching((1,) * γ)`.

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

Drafters of trees: `TreeModelDrafter` (a draft model, depth by depth with a tree mask),
`NgramTreeDrafter` (prompt lookup: distinct continuations of several earlier matches, as
a trie cut to the tree's shape) and `TreeMedusaDrafter` (Medusa heads: head d drafts
every node at depth d, in one head pass).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.heads import MedusaDrafter, MedusaState
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models import heads as heads_lib
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.processors import history as processors
from specjax.processors.sampling import sample
from specjax.verify.exact import residual


@dataclasses.dataclass(frozen=True)
class Tree:
  parents: tuple[int, ...]  # breadth-first; -1 = the root

  def __post_init__(self):
    for i, p in enumerate(self.parents):
      if not -1 <= p < i:
        raise ValueError(f"tree node {i} has parent {p}: parents must come first")
    if not self.parents:
      raise ValueError("a tree needs at least one node")
    if any(d1 > d2 for d1, d2 in zip(self.depths, self.depths[1:])):
      raise ValueError("tree nodes must be listed depth by depth")

  @classmethod
  def from_branching(cls, branching) -> "Tree":
    branching = tuple(branching)
    if not branching or any(not isinstance(k, (int, np.integer)) or k < 1 for k in branching):
      raise ValueError(f"tree branching factors must be ints >= 1, got {branching}")
    parents, frontier = [], [-1]
    for k in branching:
      nxt = []
      for p in frontier:
        for _ in range(k):
          parents.append(p)
          nxt.append(len(parents) - 1)
      frontier = nxt
    return cls(tuple(parents))

  @classmethod
  def from_paths(cls, paths) -> "Tree":
    """Medusa-style choices: each path lists child ranks from the root."""
    try:
      ok = all(isinstance(r, (int, np.integer)) and not isinstance(r, bool)
               for p in paths for r in p)
    except TypeError:
      ok = False
    if not ok:
      raise ValueError(f"tree paths must be tuples of int child ranks, got {paths!r}")
    paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if not paths or any(not p or min(p) < 0 for p in paths):
      raise ValueError("tree paths must be non-empty tuples of child ranks >= 0")
    index = {}
    parents = []
    for p in paths:
      if len(p) > 1 and p[:-1] not in index:
        raise ValueError(f"tree path {p} needs its parent path {p[:-1]} too")
      # A node's rank is its place among its siblings: rank r needs ranks 0..r-1 beside
      # it (a lone (1,) would otherwise draft the first candidate, not the second).
      if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
        raise ValueError(f"tree path {p} needs its sibling {p[:-1] + (p[-1] - 1,)} too "
                         "(child ranks count from 0)")
      index[p] = len(parents)
      parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return cls(tuple(parents))

  @functools.cached_property
  def depths(self) -> tuple[int, ...]:
    out = []
    for p in self.parents:
      out.append(1 if p < 0 else out[p] + 1)
    return tuple(out)

  @property
  def num_nodes(self) -> int:
    return len(self.parents)

  @property
  def depth(self) -> int:
    return max(self.depths)

  @functools.cached_property
  def ranks(self) -> tuple[int, ...]:
    """Each node's rank among its siblings (0 = first child)."""
    seen, out = {}, []
    for p in self.parents:
      out.append(seen.get(p, 0))
      seen[p] = out[-1] + 1
    return tuple(out)

  @functools.cached_property
  def children(self) -> np.ndarray:
    """int32[N+1, K]: children of the root (row 0) and of node i (row i+1); -1 pads."""
    rows = [[] for _ in range(self.num_nodes + 1)]
    for i, p in enumerate(self.parents):
      rows[p + 1].append(i)
    width = max(len(r) for r in rows)
    return np.array([r + [-1] * (width - len(r)) for r in rows], np.int32)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """bool[N+1, N+1] over [root, nodes]: column j is an ancestor of (or is) row i."""
    n = self.num_nodes + 1
    out = np.eye(n, dtype=bool)
    out[:, 0] = True
    for i, p in enumerate(self.parents):
      out[i + 1] |= out[p + 1]
    return out

  @functools.cached_property
  def levels(self) -> tuple[tuple[int, int], ...]:
    """(first node, count) of each depth, breadth-first."""
    out = []
    for d in range(1, self.depth + 1):
      idx = [i for i, x in enumerate(self.depths) if x == d]
      out.append((idx[0], len(idx)))
    return tuple(out)


# ----------------------------------------------------------------------------
# Drafting.


def sample_distinct(key, q, logits, k):
  """k distinct children per row of q [..., V]: draws without replacement, in draw order.

  Gumbel-top-k (Kool et al. 2019): the top k of log q + Gumbel noise are a sequential
  sample without replacement from q. Once q's support is used up, the rest are the
  best remaining `logits`, fixed tokens that the walk judges with the point-mass rule.
  """
  inside = q > 0
  noise = jax.random.gumbel(key, q.shape, jnp.float32)
  drawn = jax.lax.top_k(jnp.where(inside, jnp.log(jnp.where(inside, q, 1.0)) + noise,
                                  -jnp.inf), k)[1]
  rest = jax.lax.top_k(jnp.where(inside, -jnp.inf, logits.astype(jnp.float32)), k)[1]
  j = jnp.arange(k)
  support = jnp.sum(inside, axis=-1, keepdims=True)  # the first `support` picks are draws
  fill = jnp.take_along_axis(rest, jnp.clip(j - support, 0, k - 1), axis=-1)
  return jnp.where(j < support, drawn, fill).astype(jnp.int32)


def draw_children(sample_mode, key, logits, sampling, k, history):
  """k candidate children per frontier node: logits [B, F, V] -> [B, F, k], q [B, F, V].

  `history` ([B, F, ...] or None): the processors' history of each frontier node's
  prefix (committed + its root-to-node path), so q is processed like the target's p."""
  if history is not None:
    logits = jax.vmap(sampling.adjust, in_axes=(1, 1), out_axes=1)(logits, history)
  q = sampling.process(logits)
  top = lambda: jax.lax.top_k(logits, k)[1].astype(jnp.int32)
  if sample_mode == "greedy":
    return top(), q

  def draws():  # distinct draws from q (without replacement); T = 0 rows: the top-k
    return sample_distinct(key, q, logits, k)

  # At T = 0 q is a point mass: its one draw is the argmax and the rest fall back to the
  # draft's next-best logits, which is the top-k. The walk judges those with the
  # point-mass rule once q's support is used up, so they stay exact.
  return jax.lax.cond(jnp.all(sampling.temperature <= 0), top, draws), q


def _frontier_history(sampling):
  """The committed prefix's processor history as a one-node frontier [B, 1, ...]; or None."""
  if sampling.history is None or not sampling.has_processors:
    return None
  return jax.tree_util.tree_map(lambda x: x[:, None], sampling.history)


def _level(tree, level, frontier_nodes, sample_mode, key, frontier, sampling, history,
           node_tokens, node_q):
  """Draws one level's nodes from their parents' frontier logits; returns the level's
  tokens [B, count], the nodes, and node_tokens / node_q / history updated."""
  first, count = tree.levels[level]
  nodes = list(range(first, first + count))
  where = [frontier_nodes.index(tree.parents[i]) for i in nodes]  # parent's column
  width = max(tree.ranks[i] for i in nodes) + 1
  cands, q = draw_children(sample_mode, key, frontier, sampling, width, history)  # [B, F, k]
  ys = cands[:, where, [tree.ranks[i] for i in nodes]]  # [B, count]
  node_tokens = node_tokens.at[:, first:first + count].set(ys)
  node_q = node_q.at[:, first:first + count].set(q[:, where])
  if history is not None and level + 1 < len(tree.levels):
    # each new node: its parent's history + its own token
    history = processors.advance_each(
        sampling.pcfg, sampling.procs,
        jax.tree_util.tree_map(lambda x: x[:, np.asarray(where)], history), ys)
  return ys, nodes, node_tokens, node_q, history


@dataclasses.dataclass(frozen=True)
class TreeModelDrafter(ModelDrafter):
  """The model drafter, growing a tree depth by depth: one cached pass per depth scores
  the whole frontier with a tree mask. `gamma` is the tree's depth (positions that can be
  accepted); the proposal is N node tokens with, per node, the q it was drawn from."""

  tree: Tree | None = None

  def propose(self, params, kv, tokens, n, key, sampling):
    tree = self.tree
    logits, kv = self._catch_up(params, kv, tokens, n)  # kv.length = n: pending has KV
    b, vocab = tokens.shape[0], logits.shape[-1]
    node_tokens = jnp.zeros((b, tree.num_nodes), jnp.int32)
    node_q = jnp.zeros((b, tree.num_nodes, vocab), jnp.float32)
    frontier, frontier_nodes = logits[:, None], [-1]  # draft logits at the frontier
    history = _frontier_history(sampling)  # the frontier's processor histories, [B, F, ...]
    rel = jnp.arange(kv.size)[None, :] - n[:, None]  # [B, S]: slot - n = node index
    strict = tree.ancestors[1:, 1:] & ~np.eye(tree.num_nodes, dtype=bool)
    for level in range(len(tree.levels)):
      key, sub = jax.random.split(key)
      ys, nodes, node_tokens, node_q, history = _level(
          tree, level, frontier_nodes, self.sample_mode, sub, frontier, sampling, history,
          node_tokens, node_q)
      if level + 1 == len(tree.levels):
        break
      # Feed this level: node i at slot n + i, position n - 1 + depth; it sees the
      # committed history and its own ancestors, never a sibling branch.
      first, count = tree.levels[level]
      anc = jnp.asarray(strict[nodes])[:, jnp.clip(rel, 0, tree.num_nodes - 1)]  # [c, B, S]
      sees = (rel < 0)[:, None, :] | ((rel < tree.num_nodes)[:, None, :]
                                      & jnp.moveaxis(anc, 0, 1))
      positions = jnp.broadcast_to(n[:, None] + level, (b, count))
      frontier, step_kv = model_lib.forward_cached(
          self.graphdef, params, ys, kv.rollback(n + first), positions=positions,
          mask=(jnp.eye(count, dtype=bool), sees))
      kv = step_kv.rollback(n)
      frontier_nodes = nodes
    return node_tokens, node_q, kv

  def rollback(self, kv, n, features=None, start=None, path=None):
    """Moves the accepted path's KV (nodes fed at slots start+1+i) to contiguous slots."""
    if path is None:  # nothing accepted (cost measurements): the committed history only
      return super().rollback(kv, n)
    fed = min(self.tree.depth - 1, path.shape[1])
    if fed:
      src = start[:, None] + 1 + jnp.maximum(path[:, :fed], 0)
      kv = compact(kv, src, start + 1, jnp.sum(path[:, :fed] >= 0, axis=1))
      kv = kv.rollback(start + 1 + jnp.sum(path[:, :fed] >= 0, axis=1))
    return kv.rollback(jnp.minimum(kv.length, n - 1))


@dataclasses.dataclass(frozen=True)
class NgramTreeDrafter(NgramDrafter):
  """Prompt lookup as a tree: several earlier matches, several continuations.

  The best `candidates` earlier matches of the suffix (max_n..min_n tokens) are candidate
  continuations, wrapping periodically past the end as in the chain; they form a trie, cut to
  the static tree: a node's children are the distinct next tokens of the candidates that
  agree with its root-to-node path, best match first (longest, then most recent). The
  leftmost path is the chain's proposal. A child with no candidate left repeats its
  parent's token (the chain's no-match proposal; harmless). Children are fixed tokens, so
  the walk uses the point-mass rule (`sample_mode = 'greedy'`), q is one-hot.
  """

  tree: Tree | None = None
  candidates: int = 32  # the best matches considered (a trie over their continuations)
  sample_mode = "greedy"  # deterministic children: the point-mass node rule

  @property
  def sizes_drafts(self) -> bool:  # a tree has a fixed shape
    return False

  def _propose_row(self, tokens, n):
    tree = self.tree
    score = self._scores(tokens, n)  # [S]
    m = min(self.candidates, tokens.shape[0])
    score, start = jax.lax.top_k(score, m)  # the m best matches, best first
    period = jnp.maximum(n - start, 1)
    cont = jnp.take(tokens, start[:, None] + jnp.arange(tree.depth)[None, :]
                    % period[:, None], mode="clip")  # [m, depth]
    member = (score >= 0)[None, :]  # [F, m]: candidates agreeing with each frontier path
    front_tokens = jnp.take(tokens, n - 1, mode="clip")[None]  # [F]: the root's token
    earlier = np.tril(np.ones((m, m), bool), -1).T  # [c', c]: c' ranks before c
    frontier_nodes = [-1]
    out = []
    for d, (first, count) in enumerate(tree.levels):
      nodes = list(range(first, first + count))
      where = np.asarray([frontier_nodes.index(tree.parents[i]) for i in nodes])
      ranks = np.asarray([tree.ranks[i] for i in nodes])
      nxt = cont[:, d]
      # A candidate opens a child if no better member of the same node has its next token.
      shadow = (nxt[:, None] == nxt[None, :]) & earlier  # [c', c]
      dup = (member.astype(jnp.int32) @ shadow.astype(jnp.int32)) > 0
      opens = member & ~dup  # [F, m]
      rank = jnp.cumsum(opens, axis=1) - 1
      pick = opens[where] & (rank[where] == ranks[:, None])  # [count, m]
      found = jnp.any(pick, axis=1)
      ys = jnp.where(found, nxt[jnp.argmax(pick, axis=1)], front_tokens[where])
      out.append(ys)
      member = member[where] & found[:, None] & (nxt[None, :] == ys[:, None])
      front_tokens, frontier_nodes = ys, nodes
    return jnp.concatenate(out)

  def propose(self, params, state, tokens, n, key, sampling):
    y = jax.vmap(self._propose_row)(tokens, n).astype(jnp.int32)  # [B, N]
    return y, jax.nn.one_hot(y, self.vocab_size, dtype=jnp.float32), state

  def rollback(self, state, n, features=None, start=None, path=None):
    return state


@dataclasses.dataclass(frozen=True)
class TreeMedusaDrafter(MedusaDrafter):
  """Medusa heads as a tree: the children of a node at depth d come from head d+1's
  distribution (head 1 for the root's), processed with that node's path history; drawn
  without replacement, or the top-k, as for the model's tree. All heads read the same
  committed feature, so one head pass drafts the whole tree. `gamma` is the depth."""

  tree: Tree | None = None

  def propose(self, params, state, tokens, n, key, sampling):
    tree = self.tree
    logits = heads_lib.medusa_apply(self.config, params, state.feature)  # [B, K, V]
    b, vocab = logits.shape[0], logits.shape[-1]
    node_tokens = jnp.zeros((b, tree.num_nodes), jnp.int32)
    node_q = jnp.zeros((b, tree.num_nodes, vocab), jnp.float32)
    frontier_nodes, history = [-1], _frontier_history(sampling)
    for level in range(len(tree.levels)):
      key, sub = jax.random.split(key)
      frontier = jnp.broadcast_to(logits[:, level, None], (b, len(frontier_nodes), vocab))
      _, frontier_nodes, node_tokens, node_q, history = _level(
          tree, level, frontier_nodes, self.sample_mode, sub, frontier, sampling, history,
          node_tokens, node_q)
    return node_tokens, node_q, state

  def rollback(self, state, n, features=None, start=None, path=None):
    """Keeps the feature of the last accepted node (the root's when none was), which
    predicts the next pending token, as the chain keeps f_{n-2}."""
    if path is None:  # nothing accepted (cost measurements)
      return super().rollback(state, n, features, start)
    accepted = n - 2 - start  # < 0: the row committed nothing this round
    last = jnp.take_along_axis(path, jnp.clip(accepted - 1, 0, path.shape[1] - 1)[:, None],
                               axis=1)[:, 0]
    new = self._take(features, jnp.where(accepted > 0, 1 + last, 0))  # [pending, nodes]
    return MedusaState(feature=jnp.where((accepted >= 0)[:, None], new, state.feature))


def _span(level):
  first, count = level
  return first, first + count


def compact(kv: kv_cache.KVState, src, dst_start, count) -> kv_cache.KVState:
  """KV of slots src[b, j] (j < count[b]) moved to dst_start[b] + j, every layer."""
  def move(buf):
    rows = jnp.arange(buf.shape[0])[:, None]
    picked = buf[rows, :, jnp.clip(src, 0, buf.shape[2] - 1)]  # [B, J, H, D]
    return kv_cache.write(buf, picked, dst_start, count)
  return kv.replace(k=tuple(move(k) for k in kv.k), v=tuple(move(v) for v in kv.v))


# ----------------------------------------------------------------------------
# Verification.


def walk(key, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None):
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
  """
  # On a CPU, rolled loops: unrolled, the program grew with depth x width (the shipped
  # pair's (4, 2, 2, 1) program took 1.5x as long to trace and compile) and ran no
  # faster. Unrolled elsewhere, as it was: a loop's iterations there are not measured.
  unroll = jax.default_backend() != "cpu" if unroll is None else bool(unroll)
  children = jnp.asarray(tree.children)
  depth, width = tree.depth, tree.children.shape[1]
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


def walk_batch(keys, node_tokens, node_q, ps, tree: Tree, deterministic: bool, unroll=None):
  """`walk` of each row (vmapped over the first four); tree, deterministic, unroll shared."""
  return jax.vmap(lambda *rows: walk(*rows, tree, deterministic, unroll))(
      keys, node_tokens, node_q, ps)



def siblings(drafter) -> int:
  """K of the drafter's tree (its widest node's number of children); 1 for a chain."""
  tree = getattr(drafter, "tree", None)
  return 1 if tree is None else int(tree.children.shape[1])


def verify_layout(tree: Tree, n):
  """forward_cached's positions and mask for [pending, nodes] at length n - 1: each node
  at position n - 1 + depth, seeing the committed history and its ancestors."""
  depths = jnp.asarray((0,) + tree.depths, jnp.int32)
  return dict(positions=(n - 1)[:, None] + depths[None, :],
              mask=(jnp.asarray(tree.ancestors), None))


def compact_path(kv: kv_cache.KVState, start, path, n_accepted) -> kv_cache.KVState:
  """Target KV after a tree pass written at start (root) and start + 1 + i (node i):
  the accepted nodes' KV moves to start + 1 + j, so the committed history is contiguous."""
  return compact(kv, start[:, None] + 1 + jnp.maximum(path, 0), start + 1, n_accepted)
