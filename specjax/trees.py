"""Token trees: the static shape of a round's candidates.

A `Tree` lists its N nodes breadth-first by parent index (-1: the root, which is the
last committed token). `Tree.from_branching((k_1, ..., k_d))` gives every node at depth
j-1 k_j children; `Tree.from_paths([(0,), (1,), (0, 0)])` takes Medusa-style choices
(each a path of child ranks from the root). A chain of γ is `from_branching((1,) * γ)`.

A `DynamicTree(nodes, depth, topk)` fixes only how many nodes each depth holds; which
parent each node hangs from is chosen every round from the draft's own confidence
(EAGLE-2's expansion and rerank, in static shapes: `drafters.trees.DynamicTreeModelDrafter`).

The drafters of trees live in `specjax.drafters.trees`; the lossless walk down a tree
and the compaction of its accepted path in `specjax.verify.tree`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


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


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """A token tree grown each round in a fixed shape: `nodes` nodes over `depth` depths.

  Depth d holds a fixed number of nodes (`level_sizes`; by default depth 1 the root's
  `topk` best children, the rest spread evenly over the deeper depths), so every shape
  is static; which parents they hang from is data. Each depth scores every frontier
  node's `topk` child ranks by the path's cumulative draft log-probability (rank r of a
  node adds the log of the r-th largest of the draft's raw probabilities there) and keeps
  the best; those are the next frontier. The score never reads a child's own token or the
  target, so the walk stays exact (docs/ARCHITECTURE.md, "Dynamic trees").

  `alpha`: the measured acceptance by sibling rank at the run's temperature (a tree run's
  `stats["alpha_by_sibling"]`, as `best_static` takes it). Given, it prices the sampled
  children of T > 0 rows: rank 0 by the node's confidence, later ranks by alpha
  (`drafters.trees.rank_scores`). Without it, and for top-k children, rank r scores the
  r-th largest draft probability, which prices a sampled first draw at a flat node far
  below what it is accepted with. `DynamicTree.like(tree, alpha)` takes a static tree's
  node count, depth, width and per-depth sizes (for example `best_static`'s).
  """

  nodes: int
  depth: int
  topk: int = 4
  level_sizes: tuple[int, ...] | None = None
  alpha: tuple[float, ...] | None = None

  def __post_init__(self):
    for name in ("nodes", "depth", "topk"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"DynamicTree {name} must be an int >= 1, got {v!r}")
    if self.nodes < self.depth:
      raise ValueError(f"DynamicTree needs nodes >= depth (one node per depth at least), "
                       f"got nodes={self.nodes}, depth={self.depth}")
    if self.level_sizes is None:
      first = min(self.topk, self.nodes - self.depth + 1)
      rest, deeper = self.nodes - first, self.depth - 1
      sizes = [first] + [rest // deeper + (i < rest % deeper) for i in range(deeper)]
      object.__setattr__(self, "level_sizes", tuple(sizes))
    sizes = tuple(int(k) for k in self.level_sizes)
    object.__setattr__(self, "level_sizes", sizes)
    if len(sizes) != self.depth or sum(sizes) != self.nodes or min(sizes) < 1:
      raise ValueError(f"DynamicTree level_sizes {sizes} must be {self.depth} counts >= 1 "
                       f"summing to nodes={self.nodes}")
    if sizes[0] > self.topk or any(b > a * self.topk for a, b in zip(sizes, sizes[1:])):
      raise ValueError(f"DynamicTree level_sizes {sizes}: depth 1 holds at most topk="
                       f"{self.topk} nodes, and depth d+1 at most topk x depth d's")
    if self.alpha is not None:
      rates = np.atleast_1d(np.asarray(self.alpha, np.float64))
      if (rates.ndim != 1 or not len(rates) or not np.all(np.isfinite(rates))
          or np.any((rates < 0) | (rates > 1))):
        raise ValueError(f"DynamicTree alpha must be acceptance rates in [0, 1] by sibling "
                         f"rank (a rank never tried is nan in the stats: pass 0), got "
                         f"{self.alpha!r}")
      object.__setattr__(self, "alpha", tuple(float(a) for a in rates))

  @classmethod
  def like(cls, tree: "Tree", alpha=None) -> "DynamicTree":
    """A dynamic tree with a static tree's nodes, depth, width and nodes per depth."""
    sizes = np.bincount(np.asarray(tree.depths), minlength=tree.depth + 1)[1:]
    return cls(tree.num_nodes, tree.depth, int(tree.children.shape[1]),
               level_sizes=tuple(int(k) for k in sizes), alpha=alpha)

  @property
  def num_nodes(self) -> int:
    return self.nodes

  @property
  def width(self) -> int:
    """The most children a node can have (the walk's sibling ranks)."""
    return min(self.topk, max(self.level_sizes))

  @functools.cached_property
  def levels(self) -> tuple[tuple[int, int], ...]:
    """(first node, count) of each depth, breadth-first (static)."""
    starts = np.concatenate([[0], np.cumsum(self.level_sizes)[:-1]])
    return tuple((int(a), int(k)) for a, k in zip(starts, self.level_sizes))

  @functools.cached_property
  def depths(self) -> tuple[int, ...]:
    return tuple(d + 1 for d, k in enumerate(self.level_sizes) for _ in range(k))


def siblings(drafter) -> int:
  """K of the drafter's tree (its widest node's number of children); 1 for a chain."""
  tree = getattr(drafter, "tree", None)
  if tree is None:
    return 1
  return tree.width if isinstance(tree, DynamicTree) else int(tree.children.shape[1])


def best_static(nodes: int, alpha, depth: int | None = None, topk: int | None = None) -> Tree:
  """The static tree of at most `nodes` nodes with the most tokens per target call.

  Sequoia's dynamic programme (Chen et al. 2024) on the ledger's model of a tree
  (`ledger.tree_expected_tokens`): alpha is the measured acceptance by sibling rank (a
  try of child r accepted given that ranks < r were rejected; ranks past its end take its
  last value), so child r of any node is the one accepted with probability
  π_r = α_r Π_{s<r} (1 − α_s), and a tree commits 1 + Σ_nodes Π_{path} π tokens. The
  programme picks, for every node budget m and depth left d, how many nodes each child
  rank's subtree gets: O(topk · nodes² · depth) work, instant at a few hundred nodes.
  `depth` bounds the tree's depth and `topk` a node's number of children (both
  unbounded by default, that is by `nodes`).
  """
  if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 1:
    raise ValueError(f"best_static needs a node budget >= 1, got {nodes!r}")
  for name, value in (("depth", depth), ("topk", topk)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                              or value < 1):
      raise ValueError(f"best_static {name} must be an int >= 1 (or None), got {value!r}")
  rates = np.atleast_1d(np.asarray(alpha, np.float64))
  if rates.ndim != 1 or not np.all(np.isfinite(rates)) or np.any((rates < 0) | (rates > 1)):
    raise ValueError(f"best_static alpha must be acceptance rates in [0, 1] by sibling rank, "
                     f"got {alpha!r}")
  nodes, depth = int(nodes), int(depth or nodes)
  topk = min(int(topk or nodes), nodes)
  alpha_r = np.array([rates[min(r, len(rates) - 1)] for r in range(topk)])
  pi = alpha_r * np.concatenate([[1.0], np.cumprod(1 - alpha_r)[:-1]])

  # value[d][m]: the best Σ over a node's subtrees with m nodes below it and depth <= d
  # below; forest[d][r][m]: the same using child ranks r, r+1, ... only.
  neg = -np.inf
  value = [np.array([0.0] + [neg] * nodes)]
  choice = [None]
  for d in range(1, depth + 1):
    forest = np.full((topk + 1, nodes + 1), neg)
    forest[:, 0] = 0.0
    best_k = np.zeros((topk, nodes + 1), np.int64)
    for r in range(topk - 1, -1, -1):
      for m in range(1, nodes + 1):
        k = np.arange(1, m + 1)  # nodes in rank r's subtree, itself included
        below, rest = value[d - 1][k - 1], forest[r + 1][m - k]
        ok = np.isfinite(below) & np.isfinite(rest)  # -inf: no such subtree
        total = np.where(ok, pi[r] * (1 + np.where(ok, below, 0)) + np.where(ok, rest, 0), neg)
        i = int(np.argmax(total))
        forest[r, m], best_k[r, m] = total[i], k[i]
      forest[r, 0] = 0.0
    value.append(forest[0])
    choice.append(best_k)

  # At most `nodes` (a node with π = 0 adds nothing); at least one, ties to the fewest.
  m = int(np.argmax(value[depth][1:])) + 1
  paths = []

  def build(prefix, m, d, r=0):
    while m > 0:
      k = int(choice[d][r, m])
      path = prefix + (r,)
      paths.append(path)
      build(path, k - 1, d - 1)
      m, r = m - k, r + 1

  build((), m, depth)
  return Tree.from_paths(paths)
