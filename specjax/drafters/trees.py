"""Tree drafters: a token tree of candidates per round instead of a chain.

`TreeModelDrafter` (a draft model, depth by depth with a tree mask),
`DynamicTreeModelDrafter` (the same, the tree's parents chosen each round from the draft's
confidence: `trees.DynamicTree`), `TreeEagleDrafter` (the EAGLE head, static or
dynamic trees, each node conditioned on its parent's predicted feature), `NgramTreeDrafter`
(prompt lookup: distinct continuations of several earlier matches, as a trie cut to the
tree's shape; `DynamicNgramTreeDrafter` keeps its most shared paths) and
`TreeMedusaDrafter` (Medusa heads: head d drafts every node at depth d, in one head
pass). Sampled children are drawn without replacement
(`sample_distinct`), so siblings never repeat a token and the walk
(`specjax.verify.tree`) stays exact.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.heads import EagleDrafter, MedusaDrafter, MedusaState
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models import heads as heads_lib
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.processors import history as processors
from specjax.processors.sampling import argmax, pick_by_paths
from specjax.trees import DynamicTree, Tree
from specjax.verify import tree as tree_verify


def top_ids(x, k):
  """int32[..., k]: the indices of x's k largest values along the last axis, ties to the
  lower index (`lax.top_k`'s). XLA:CPU runs a top_k as a full sort of the vocabulary
  where its rewrite to a TopK call does not apply (bfloat16 values; a k = 1 use in the
  static depth-6 tree's proposal): ~1 ms a call on the shipped pair's 2,048 tokens. So
  k = 1 is an argmax, and the rest float32."""
  if k == 1:
    return argmax(x)[..., None].astype(jnp.int32)
  return jax.lax.top_k(x.astype(jnp.float32), k)[1].astype(jnp.int32)


def sample_distinct(key, q, logits, k):
  """k distinct children per row of q [..., V]: draws without replacement, in draw order.

  Gumbel-top-k (Kool et al. 2019): the top k of log q + Gumbel noise are a sequential
  sample without replacement from q. Once q's support is used up, the rest are the
  best remaining `logits`, fixed tokens that the walk judges with the point-mass rule.
  """
  inside = q > 0
  noise = jax.random.gumbel(key, q.shape, jnp.float32)
  drawn = top_ids(jnp.where(inside, jnp.log(jnp.where(inside, q, 1.0)) + noise, -jnp.inf), k)
  rest = top_ids(jnp.where(inside, -jnp.inf, logits), k)
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
  top = lambda: top_ids(logits, k)
  if sample_mode == "greedy":
    return top(), q

  def draws():  # distinct draws from q (without replacement); T = 0 rows: the top-k
    return sample_distinct(key, q, logits, k)

  # At T = 0 q is a point mass: its one draw is the argmax and the rest fall back to the
  # draft's next-best logits, which is the top-k. The walk judges those with the
  # point-mass rule once q's support is used up, so they stay exact.
  return pick_by_paths(sampling, top, draws), q


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
    anc = jnp.broadcast_to(jnp.asarray(tree.ancestors), (b,) + tree.ancestors.shape)
    for level in range(len(tree.levels)):
      key, sub = jax.random.split(key)
      ys, nodes, node_tokens, node_q, history = _level(
          tree, level, frontier_nodes, self.sample_mode, sub, frontier, sampling, history,
          node_tokens, node_q)
      if level + 1 == len(tree.levels):
        break
      # Feed this level: node i at slot n + i, position n - 1 + depth.
      first, count = tree.levels[level]
      sees = level_sees(anc, first, count, rel)
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
      kv = kv_cache.compact(kv, src, start + 1, jnp.sum(path[:, :fed] >= 0, axis=1))
      kv = kv.rollback(start + 1 + jnp.sum(path[:, :fed] >= 0, axis=1))
    return kv.rollback(jnp.minimum(kv.length, n - 1))


@flax.struct.dataclass
class DynamicDraftState:
  """A dynamic tree drafter's state: its KV cache, and the parents of the round's nodes
  (int32[B, N], -1 = the root), which the verify layout reads."""
  kv: kv_cache.KVState
  parents: jax.Array


def best_candidates(score, count):
  """int32[B, count]: the `count` best of score [B, C], in candidate order. Ties go to
  the lower index, so a node's kept children are always its first ranks (a prefix of
  its draws in draw order), whatever the scores' ties (-inf included)."""
  c = score.shape[1]
  i = jnp.arange(c)
  better = (score[:, None, :] > score[:, :, None]) | (
      (score[:, None, :] == score[:, :, None]) & (i[None, None, :] < i[None, :, None]))
  keep = jnp.sum(better, axis=2) < count  # [B, C]: fewer than `count` ahead of it
  return jax.lax.top_k(jnp.where(keep, c - i[None, :], -1), count)[1].astype(jnp.int32)


def rank_scores(logits, cands, q, sampled=None, alpha=None):
  """[B, F, k]: what child rank r of each frontier node adds to its path's score: the
  log of an estimate of P(child r is the one accepted) made from the draft's raw
  probabilities at the node alone (logits [B, F, V]).

  Top-k children (T = 0 rows, greedy drafts): the r-th largest raw probability, what the
  point-mass rule accepts with if the draft is calibrated. Sampled children of the rows
  in `sampled` (bool[B]) when `alpha`, the measured acceptance by sibling rank, is given:
  the first draw is accepted with a(v) = α₀ + (1 − α₀)·m², m the node's largest raw
  probability, and rank r ≥ 1 with (1 − a(v)) Π_{1≤s<r} (1 − α_s) α_r. (On the shipped
  pair Σ min(p, q) of a sampled draw is ~0.57 wherever m < 0.3 and follows c + (1 − c)·m²
  above; raw m would price a flat node's first draw ~9x too low.) Either reads neither a
  child's token (cands) nor its q: were it log q(child), a child's own draw would decide
  whether its later siblings are tried, and the walk's law would move
  (tests/test_dynamic_trees.py shows it in float64 and through the engine).

  sampled=None: the host knows no row samples. Top-k children are the r-th largest
  themselves, so their values are read at cands (the same numbers): a `lax.top_k` over
  the vocabulary per frontier node doubled the round on XLA:CPU."""
  del q
  k = cands.shape[-1]
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  fixed = jnp.take_along_axis(logits, cands, axis=-1) - lse
  if sampled is None:
    return fixed
  if alpha is None:
    ranked = jax.lax.top_k(logits, k)[0] - lse
  else:
    a = np.array([alpha[min(r, len(alpha) - 1)] for r in range(k)])
    later = np.cumprod(np.concatenate([[1.0], 1 - a[1:-1]])) * a[1:]  # rank r >= 1, reached
    first = a[0] + (1 - a[0]) * jnp.exp(2 * (jnp.max(logits, -1, keepdims=True) - lse))
    est = jnp.concatenate([first, (1 - first) * jnp.asarray(later, jnp.float32)], axis=-1)
    ranked = jnp.log(jnp.maximum(est, 1e-30))
  return jnp.where(sampled[:, None, None], ranked, fixed)


def _sampled_rows(sample_mode, sampling):
  """bool[B]: the rows whose children are draws; None where the host knows there are none."""
  if sample_mode == "greedy" or sampling.paths.greedy is True:
    return None
  return sampling.temperature > 0


@flax.struct.dataclass
class Growth:
  """A dynamic tree as it grows: the node tokens [B, N], the q each was drawn from
  [B, N, V], the parents [B, N] (-1 = the root) and ancestors [B, N+1, N+1]
  (`verify.tree`), and the frontier's path scores and node ids [B, F] (-1: the root)."""
  tokens: jax.Array
  q: jax.Array
  parents: jax.Array
  anc: jax.Array
  score: jax.Array
  ids: jax.Array

  @classmethod
  def start(cls, batch: int, nodes: int, vocab: int) -> "Growth":
    return cls(tokens=jnp.zeros((batch, nodes), jnp.int32),
               q=jnp.zeros((batch, nodes, vocab), jnp.float32),
               parents=jnp.full((batch, nodes), -1, jnp.int32),
               anc=tree_verify.root_ancestors(batch, nodes),
               score=jnp.zeros((batch, 1), jnp.float32), ids=jnp.full((batch, 1), -1, jnp.int32))


def grow_level(tree, level, growth: Growth, sample_mode, key, frontier, sampling, sampled,
               history=None):
  """One depth of a dynamic tree from its frontier's logits [B, F, V]: draws the
  frontier's children, keeps the level's best (frontier node, rank) pairs and records
  them. Returns (growth, the level's tokens [B, c], each one's parent column in the
  frontier [B, c], their processor histories (history: the frontier's, or None))."""
  first, count = tree.levels[level]
  b, f = frontier.shape[:2]
  k = min(tree.topk, count)
  cands, q = draw_children(sample_mode, key, frontier, sampling, k, history)
  score = (growth.score[:, :, None] + rank_scores(frontier, cands, q, sampled, tree.alpha)
           ).reshape(b, f * k)
  idx = best_candidates(score, count)  # [B, count]
  col = idx // k
  ys = jnp.take_along_axis(cands.reshape(b, f * k), idx, axis=1)
  par = jnp.take_along_axis(growth.ids, col, axis=1)
  if history is not None and level + 1 < len(tree.levels):
    history = processors.advance_each(sampling.pcfg, sampling.procs,
                                      processors.at(history, col), ys)
  level_nodes = slice(first, first + count)
  growth = Growth(
      tokens=growth.tokens.at[:, level_nodes].set(ys),
      q=growth.q.at[:, level_nodes].set(jnp.take_along_axis(q, col[:, :, None], axis=1)),
      parents=growth.parents.at[:, level_nodes].set(par),
      anc=tree_verify.add_level(growth.anc, first, par),
      score=jnp.take_along_axis(score, idx, axis=1),
      ids=jnp.broadcast_to(first + jnp.arange(count, dtype=jnp.int32), (b, count)))
  return growth, ys, col, history


def level_sees(anc, first, count, rel):
  """bool[B, c, S]: the cache slots the level's nodes attend when fed at slots base +
  first.. (rel = slot - base): the committed history and each node's own strict ancestors
  in its row's tree (anc bool[B, N+1, N+1], `verify.tree`), never a sibling branch; the
  chunk's own mask is the identity."""
  b, nodes = anc.shape[0], anc.shape[1] - 1
  own = jnp.arange(nodes)[None, :] == (first + jnp.arange(count))[:, None]  # [c, N]
  strict = anc[:, first + 1:first + 1 + count, 1:] & ~own[None]  # [B, c, N]
  seen = jnp.take_along_axis(
      strict, jnp.broadcast_to(jnp.clip(rel, 0, nodes - 1)[:, None, :],
                               (b, count, rel.shape[1])), axis=2)
  return (rel < 0)[:, None, :] | ((rel < nodes)[:, None, :] & seen)


@dataclasses.dataclass(frozen=True)
class DynamicTreeModelDrafter(TreeModelDrafter):
  """The draft model growing a `DynamicTree`: depth d keeps the tree's d-th level size of
  the best (frontier node, child rank) pairs by cumulative draft log-probability, where
  rank r of a node scores the log of the r-th largest raw draft probability at that node
  (EAGLE-2's expansion and rerank, per depth). The children themselves are drawn as a
  static tree's are (without replacement, or the top-k), so the walk is unchanged; the
  kept set reads q's sorted values at the parents, never a child's own token or p."""

  tree: DynamicTree | None = None

  def init(self, batch, size):
    return DynamicDraftState(kv=super().init(batch, size),
                             parents=jnp.full((batch, self.tree.num_nodes), -1, jnp.int32))

  def prefill(self, params, state, tokens, n, features=None):
    return state.replace(kv=super().prefill(params, state.kv, tokens, n, features))

  def propose(self, params, state, tokens, n, key, sampling):
    tree = self.tree
    logits, kv = self._catch_up(params, state.kv, tokens, n)
    b = tokens.shape[0]
    growth = Growth.start(b, tree.num_nodes, logits.shape[-1])
    frontier = logits[:, None]
    rel = jnp.arange(kv.size)[None, :] - n[:, None]  # [B, S]: slot - n = node index
    sampled = _sampled_rows(self.sample_mode, sampling)
    history = _frontier_history(sampling)
    for level, (first, count) in enumerate(tree.levels):
      key, sub = jax.random.split(key)
      growth, ys, _, history = grow_level(tree, level, growth, self.sample_mode, sub,
                                          frontier, sampling, sampled, history)
      if level + 1 == len(tree.levels):
        break
      # Feed this level at slots n + first.., positions n + level.
      sees = level_sees(growth.anc, first, count, rel)
      positions = jnp.broadcast_to(n[:, None] + level, (b, count))
      frontier, step_kv = model_lib.forward_cached(
          self.graphdef, params, ys, kv.rollback(n + first), positions=positions,
          mask=(jnp.eye(count, dtype=bool), sees))
      kv = step_kv.rollback(n)
    return growth.tokens, growth.q, DynamicDraftState(kv=kv, parents=growth.parents)

  def rollback(self, state, n, features=None, start=None, path=None):
    return state.replace(kv=super().rollback(state.kv, n, features, start, path))


@flax.struct.dataclass
class EagleTreeState:
  """The EAGLE head's state (`EagleState`: its cache and the pending true features) and
  the parents of the round's nodes (int32[B, N]; a static tree's, or this round's)."""
  kv: kv_cache.KVState
  feats: jax.Array
  parents: jax.Array


@dataclasses.dataclass(frozen=True)
class TreeEagleDrafter(EagleDrafter):
  """The EAGLE head drafting a token tree, static (`Tree`) or grown each round
  (`DynamicTree`, as `DynamicTreeModelDrafter` grows one): a node's children come from
  the head's step on (its parent's predicted feature, its own token), the chain's step,
  fed one depth a pass at slots L + node (L: the head's true slots), positions L + depth
  - 1, with a tree mask, so each node sees the true history and its own ancestors only.
  Every fed slot is dropped again; `rollback` keeps the target's true features along the
  accepted path for the next round's first chunk, as the chain keeps them. `gamma` is
  the tree's depth."""

  tree: Tree | DynamicTree | None = None

  def init(self, batch, size):
    state = super().init(batch, size)
    return self._with(state, jnp.full((batch, self.tree.num_nodes), -1, jnp.int32))

  def _with(self, state, parents):
    return EagleTreeState(kv=state.kv, feats=state.feats, parents=parents)

  def prefill(self, params, state, tokens, n, features):
    return self._with(super().prefill(params, state, tokens, n, features), state.parents)

  def propose(self, params, state, tokens, n, key, sampling):
    tree = self.tree
    dynamic = isinstance(tree, DynamicTree)
    nodes = tree.num_nodes
    x, logits, kv = self._first(params, state, tokens, n)  # kv.length = L: true slots
    base = kv.length
    b, vocab = logits.shape
    growth = Growth.start(b, nodes, vocab)  # a static tree fills tokens and q only
    if not dynamic:
      growth = growth.replace(
          parents=jnp.broadcast_to(jnp.asarray(tree.parents, jnp.int32), (b, nodes)),
          anc=jnp.broadcast_to(jnp.asarray(tree.ancestors), (b, nodes + 1, nodes + 1)))
    frontier, front_x = logits[:, None], x  # the frontier's logits [B, F, V], features
    frontier_nodes, history = [-1], _frontier_history(sampling)
    sampled = _sampled_rows(self.sample_mode, sampling)
    rel = jnp.arange(kv.size)[None, :] - base[:, None]  # [B, S]: slot - L = node index
    for level, (first, count) in enumerate(tree.levels):
      key, sub = jax.random.split(key)
      if dynamic:
        growth, ys, col, history = grow_level(tree, level, growth, self.sample_mode, sub,
                                              frontier, sampling, sampled, history)
        parent_x = jnp.take_along_axis(front_x, col[:, :, None], axis=1)
      else:
        where = [frontier_nodes.index(tree.parents[i]) for i in range(first, first + count)]
        ys, frontier_nodes, node_tokens, node_q, history = _level(
            tree, level, frontier_nodes, self.sample_mode, sub, frontier, sampling, history,
            growth.tokens, growth.q)
        growth = growth.replace(tokens=node_tokens, q=node_q)
        parent_x = front_x[:, np.asarray(where)]
      if level + 1 == len(tree.levels):
        break
      positions = jnp.broadcast_to(base[:, None] + level, (b, count))
      front_x, frontier, step_kv = heads_lib.eagle_apply(
          self.config, params, parent_x, ys, kv.rollback(base + first), positions=positions,
          mask=(jnp.eye(count, dtype=bool), level_sees(growth.anc, first, count, rel)))
      kv = step_kv.rollback(base)
    return growth.tokens, growth.q, EagleTreeState(kv=kv, feats=state.feats,
                                                   parents=growth.parents)

  def rollback(self, state, n, features, start, path=None):
    """The target's features [B, N+1, d] along the accepted path, in chain order: the
    root's (the pending token's), then the path's nodes'."""
    depth = self.tree.depth
    if path is None:  # nothing accepted (cost measurements)
      chain = features[:, :depth + 1]
    else:
      idx = jnp.concatenate([jnp.zeros_like(path[:, :1]), 1 + jnp.maximum(path[:, :depth], 0)],
                            axis=1)
      chain = jnp.take_along_axis(features, idx[:, :, None], axis=1)
    return self._with(super().rollback(state, n, chain, start), state.parents)


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

  def _candidates(self, tokens, n):
    """The best matches' continuations int32[m, depth] (best first), which of them are
    real matches bool[m], and the root's token (the last committed one)."""
    score = self._scores(tokens, n)  # [S]
    m = min(self.candidates, tokens.shape[0])
    score, start = jax.lax.top_k(score, m)  # the m best matches, best first
    period = jnp.maximum(n - start, 1)
    cont = jnp.take(tokens, start[:, None] + jnp.arange(self.tree.depth)[None, :]
                    % period[:, None], mode="clip")  # [m, depth]
    return cont, score >= 0, jnp.take(tokens, n - 1, mode="clip")

  def _propose_row(self, tokens, n):
    tree = self.tree
    cont, valid, root = self._candidates(tokens, n)
    m = cont.shape[0]
    member = valid[None, :]  # [F, m]: candidates agreeing with each frontier path
    front_tokens = root[None]  # [F]: the root's token
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


@flax.struct.dataclass
class NgramTreeState:
  """A dynamic n-gram tree's state: the parents of the round's nodes (int32[B, N])."""
  parents: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicNgramTreeDrafter(NgramTreeDrafter):
  """Prompt lookup growing a `DynamicTree`: the same trie of the best matches'
  continuations, a node's children ordered by how many matches continue with them (ties:
  the better match), and depth d keeps the level size's best (frontier node, child rank)
  pairs by the log share of the matches that agree with the whole path (a child that s of
  its parent's m agreeing matches continue with adds log(s / m)). So the tree spends its
  nodes where the context repeats itself most. Children are fixed tokens, as in the static
  n-gram tree, so the point-mass walk is exact whatever is kept."""

  tree: DynamicTree | None = None

  def init(self, batch, size):
    return NgramTreeState(parents=jnp.full((batch, self.tree.num_nodes), -1, jnp.int32))

  def _grow_row(self, tokens, n):
    """(node tokens [N], parents [N]) of one row."""
    tree = self.tree
    cont, valid, root = self._candidates(tokens, n)
    m = cont.shape[0]
    member = valid[None, :]  # [F, m]
    front_tokens = root[None]
    path_score = jnp.zeros((1,), jnp.float32)
    ids = jnp.full((1,), -1, jnp.int32)
    earlier = np.tril(np.ones((m, m), bool), -1).T  # [c', c]: c' ranks before c
    out, parents = [], []
    for d, (first, count) in enumerate(tree.levels):
      k = min(tree.topk, count)
      nxt = cont[:, d]
      same = nxt[:, None] == nxt[None, :]  # [c', c]
      dup = (member.astype(jnp.int32) @ (same & earlier).astype(jnp.int32)) > 0
      opens = member & ~dup  # [F, m]: a candidate opening a child of its frontier node
      support = member.astype(jnp.int32) @ same.astype(jnp.int32)  # [F, m]
      # Children by support, most first (ties: the better match), so a node's best
      # children are its first ranks, as the rerank expects.
      ahead = (support[:, :, None] > support[:, None, :]) | (
          (support[:, :, None] == support[:, None, :]) & earlier[None])  # [F, c', c]
      rank = jnp.sum(opens[:, :, None] & ahead, axis=1)
      rank = jnp.where(opens, rank, m)
      pick = opens[:, None, :] & (rank[:, None, :] == jnp.arange(k)[None, :, None])  # [F, k, m]
      found = jnp.any(pick, axis=2)  # [F, k]
      which = jnp.argmax(pick, axis=2)
      ys = jnp.where(found, nxt[which], front_tokens[:, None])  # [F, k]
      share = jnp.take_along_axis(support, which, axis=1) / jnp.maximum(
          jnp.sum(member, axis=1, keepdims=True), 1)
      cand_score = path_score[:, None] + jnp.where(found, jnp.log(share), -jnp.inf)
      f = cand_score.shape[0]
      idx = best_candidates(cand_score.reshape(1, f * k), count)[0]  # [count]
      col, r = idx // k, idx % k
      kept = ys[col, r]
      out.append(kept)
      parents.append(ids[col])
      member = member[col] & found[col, r][:, None] & (nxt[None, :] == kept[:, None])
      path_score = cand_score[col, r]
      front_tokens = kept
      ids = first + jnp.arange(count, dtype=jnp.int32)
    return jnp.concatenate(out), jnp.concatenate(parents)

  def propose(self, params, state, tokens, n, key, sampling):
    y, parents = jax.vmap(self._grow_row)(tokens, n)
    y = y.astype(jnp.int32)
    return y, jax.nn.one_hot(y, self.vocab_size, dtype=jnp.float32), NgramTreeState(parents)


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
