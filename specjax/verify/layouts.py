"""A round's candidates laid out as a chain or as a tree: one interface, two implementations.

`decode_round` reads straight through either: it asks the layout for the verify pass's
positions and mask, the processors' histories of each candidate prefix, the accepted
path (the verify rule, or the walk down a tree), the prefix before each committed token,
how many slots a round may write, and the rollback of both caches.

  Chain  γ drafts in a row: candidate j follows prefix j; the verify rule is the engine's
         (`verify.exact`, `verify.block`, `verify.rules`), then the γ policy's `settle`
         (a rule with `reads_lengths`, the block rule, takes each row's length itself).
  Tree   a static token tree (`specjax.trees.Tree`): one pass over every node with a tree
         mask, the walk from the root (`verify.tree.walk_batch`, or the rule's own
         `walk_tree`: traversal verification), and the accepted path's KV compacted into
         contiguous slots, so no other branch is read again.
  DynamicTreeLayout  a `trees.DynamicTree`: the tree's, with this round's parents (the
         drafter's state, `bind`) giving each row its own mask and children.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.processors import history as processors
from specjax.trees import DynamicTree, Tree
from specjax.verify import tree as tree_verify


@dataclasses.dataclass(frozen=True)
class Chain:
  gamma: int
  narrowable = True  # the verify pass may compute only the round's longest draft (CPU)

  def bind(self, draft_state):
    """The layout of this round's proposal (the drafter's state after `propose`)."""
    return self

  def pass_layout(self, n) -> dict:
    """forward_cached's extra arguments for the pass at length n - 1: none, causal."""
    return {}

  def prefixes(self, sampling, history, ys):
    """Processor histories of the committed prefix + ys[:, :i] for every i, [B, γ+1, ...];
    None without history-dependent processors."""
    if history is None:
      return None
    return processors.prefix_histories(sampling.pcfg, sampling.procs, history, ys)

  def verify(self, engine, row_keys, ys, qs, ps, lengths, key, greedy=None, top=None):
    """(n_accepted, next_token, overlap, path, by_rank, committed ys): path and by_rank
    None for a chain; ys as drafted. greedy: `sampling.Paths.greedy` (static). top:
    int32[B, γ+1], the argmax of every p where each is a point mass known to the host
    (else None): the exact rule and the bonus read it instead of p."""
    kw = {"top": top} if top is not None and getattr(engine.rule, "reads_top", False) else {}
    if lengths is not None and getattr(engine.rule, "reads_lengths", False):
      # The rule decides from the whole chain (block): it applies each row's length.
      return (*engine.rule(row_keys, ys, qs, ps, greedy, lengths=lengths, **kw), None, None,
              ys)
    n_accepted, next_token, overlap = engine.rule(row_keys, ys, qs, ps, greedy, **kw)
    n_accepted, next_token = engine.policy.settle(n_accepted, next_token, ps, lengths, key,
                                                  greedy, top)
    return n_accepted, next_token, overlap, None, None, ys

  def before_each(self, path):
    """The prefix before each committed candidate; None: candidate j follows prefix j."""
    return None

  def slots(self) -> int:
    """KV slots a round writes past the committed history."""
    return self.gamma + 1

  def rollback(self, drafter, target_kv, draft_state, n, features, start, path, n_accepted):
    return target_kv, drafter.rollback(draft_state, n, features, start)


@dataclasses.dataclass(frozen=True)
class TreeLayout:
  tree: Tree
  deterministic: bool  # the drafter's children are point masses (its top-k)
  narrowable = False

  def bind(self, draft_state):
    return self

  def pass_layout(self, n) -> dict:
    return tree_verify.verify_layout(self.tree, n)

  def prefixes(self, sampling, history, ys):
    """Processor histories of the tree's nodes, [B, N+1, ...] (0: the committed prefix,
    i+1: it + node i's root-to-node path); or None."""
    if history is None:
      return None
    return processors.tree_histories(sampling.pcfg, sampling.procs, history, ys,
                                     self.tree.parents)

  def children(self):
    """The walk's children int32[B, N+1, K] where each row has its own tree; else None."""
    return None

  def verify(self, engine, row_keys, ys, qs, ps, lengths, key, greedy=None, top=None):
    walk = getattr(engine.rule, "walk_tree", tree_verify.walk_batch)
    children = self.children()
    kw = {} if children is None else {"children": children}
    n_accepted, next_token, overlap, path, by_rank = walk(
        row_keys, ys, qs, ps, self.tree, self.deterministic, engine.unroll_walk, **kw)
    return n_accepted, next_token, overlap, path, by_rank, jnp.take_along_axis(
        ys, jnp.maximum(path, 0), axis=1)  # the accepted path's tokens

  def before_each(self, path):
    """int32[B, γ+1]: the round's prefix (the index into its per-node bans and histories)
    before each committed candidate: the accepted path's nodes (node i is at i + 1, the
    root at 0, as is -1 past the path), exact up to the accepted count, which is all the
    commit reads."""
    return jnp.concatenate([jnp.zeros_like(path[:, :1]), path + 1], axis=1)

  def slots(self) -> int:
    return self.tree.num_nodes + 1

  def rollback(self, drafter, target_kv, draft_state, n, features, start, path, n_accepted):
    target_kv = tree_verify.compact_path(target_kv, start, path, n_accepted)
    return target_kv, drafter.rollback(draft_state, n, features, start, path=path)


@dataclasses.dataclass(frozen=True)
class DynamicTreeLayout(TreeLayout):
  """A dynamic tree: `TreeLayout` with this round's parents int32[B, N] (`bind`)."""
  parents: object = None

  def bind(self, draft_state):
    return dataclasses.replace(self, parents=draft_state.parents)

  def pass_layout(self, n) -> dict:
    return tree_verify.dynamic_layout(self.tree, n,
                                      tree_verify.ancestors_of(self.tree, self.parents))

  def prefixes(self, sampling, history, ys):
    if history is None:
      return None
    return processors.dynamic_tree_histories(sampling.pcfg, sampling.procs, history, ys,
                                             self.tree.levels, self.parents)

  def children(self):
    return tree_verify.children_of(self.tree, self.parents)


def for_drafter(drafter):
  """The layout of a drafter's candidates: its tree's, else a chain of its γ."""
  tree = getattr(drafter, "tree", None)
  if tree is None:
    return Chain(drafter.gamma)
  if isinstance(tree, DynamicTree):
    return DynamicTreeLayout(tree, drafter.sample_mode == "greedy")
  return TreeLayout(tree, drafter.sample_mode == "greedy")
