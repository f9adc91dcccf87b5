"""Token trees: the static shape of a round's candidates.

A `Tree` lists its N nodes breadth-first by parent index (-1: the root, which is the
last committed token). `Tree.from_branching((k_1, ..., k_d))` gives every node at depth
j-1 k_j children; `Tree.from_paths([(0,), (1,), (0, 0)])` takes Medusa-style choices
(each a path of child ranks from the root). A chain of γ is `from_branching((1,) * γ)`.

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


def siblings(drafter) -> int:
  """K of the drafter's tree (its widest node's number of children); 1 for a chain."""
  tree = getattr(drafter, "tree", None)
  return 1 if tree is None else int(tree.children.shape[1])
