"""The most a node with k drafted children can accept: the multi-draft optimum, in float64.

The reference line for the tree rules (Hu et al., "Towards Optimal Multi-draft
Speculative Decoding", ICLR 2025, arXiv 2502.18779). k children x̄ = (x_1..x_k) are drawn
from the draft's q (i.i.d., or without replacement as `drafters.trees.sample_distinct`
draws them); a lossless rule outputs y ~ p. The best acceptance P(y ∈ x̄) over every
coupling of x̄ and y is a max flow from the draft tuples to the tokens, so by max-flow
min-cut

  α*(p, q, k) = min over H ⊆ V of  1 − p(H) + P(x̄ meets H),

and the minimising H can be taken among the V + 1 sets of the tokens of largest p/q
(checked against every subset and against the coupling LP in tests/test_optimum.py).
k = 1 gives Σ min(p, q), the one-draft rule's acceptance: one draft has nothing to gain.

`node_rule_acceptance` is what specjax's recursive node rule (`verify.tree.walk`, sampled
children) accepts at the same node, exactly, so a gap to the optimum is a number, not a
guess. Both take one node's p, q [V] or a batch [..., V]; numpy, nothing traced.
"""

from __future__ import annotations

import itertools

import numpy as np


def _by_ratio(p, q):
  """p, q [..., V] float64, each row sorted by p/q, largest first (q = 0 < p first)."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  ratio = np.where(q > 0, p / np.where(q > 0, q, 1.0), np.where(p > 0, np.inf, 0.0))
  order = np.argsort(-ratio, axis=-1, kind="stable")
  return np.take_along_axis(p, order, -1), np.take_along_axis(q, order, -1)


def _suffix_sums(x):
  """[..., V+1]: entry i is the sum of x[..., i:] (the tokens outside the top-i set)."""
  tail = np.cumsum(x[..., ::-1], axis=-1)[..., ::-1]
  return np.concatenate([tail, np.zeros(x.shape[:-1] + (1,))], axis=-1)


def _miss(q_sorted, k: int, replacement: bool):
  """[..., V+1]: P(no child lands in the top-i set), i = 0..V."""
  outside = _suffix_sums(q_sorted)  # q of the complement C of the top-i set
  if replacement or k == 1:
    return np.clip(outside, 0.0, 1.0) ** k
  if k != 2:
    raise ValueError(f"the optimum without replacement is computed for k <= 2 children on a "
                     f"large vocabulary, got k = {k} (use optimal_acceptance_bruteforce)")
  # P(x_1 ∈ C, x_2 ∈ C) = Σ_{a ∈ C} q(a) (q(C) − q(a)) / (1 − q(a)).
  keep = q_sorted < 1.0
  w = np.where(keep, q_sorted / np.where(keep, 1.0 - q_sorted, 1.0), 0.0)
  w2 = np.where(keep, q_sorted ** 2 / np.where(keep, 1.0 - q_sorted, 1.0), 0.0)
  return np.clip(outside * _suffix_sums(w) - _suffix_sums(w2), 0.0, 1.0)


def optimal_acceptance(p, q, k: int, replacement: bool = False):
  """α*: the largest P(y ∈ children) any lossless rule reaches with k children from q.

  p, q: [..., V] distributions. replacement: i.i.d. children (True) or drawn without
  replacement (False, as specjax draws them; k ≤ 2 here, and q's support must hold k
  tokens). Returns [...] float64.
  """
  if k < 1:
    raise ValueError(f"a node has k >= 1 children, got {k}")
  p_sorted, q_sorted = _by_ratio(p, q)
  head_p = np.concatenate([np.zeros(p_sorted.shape[:-1] + (1,)),
                           np.cumsum(p_sorted, axis=-1)], axis=-1)  # p of the top-i set
  cost = 1.0 - head_p + 1.0 - _miss(q_sorted, k, replacement)
  return np.clip(np.min(cost, axis=-1), 0.0, 1.0)


def _draws(q, k: int, replacement: bool):
  """(tuple, probability) of every ordered k-tuple of children drawn from q [V]."""
  support = [x for x in range(len(q)) if q[x] > 0]
  tuples = (itertools.product(support, repeat=k) if replacement
            else itertools.permutations(support, k))
  for xs in tuples:
    prob, left = 1.0, 1.0
    for x in xs:
      prob *= q[x] / left
      left -= 0.0 if replacement else q[x]
    yield xs, prob


def optimal_acceptance_bruteforce(p, q, k: int, replacement: bool = False) -> float:
  """`optimal_acceptance` by the min over every H ⊆ V: any k, a small vocabulary [V]."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  draws = list(_draws(q, k, replacement))
  best = np.inf
  for size in range(len(p) + 1):
    for h in itertools.combinations(range(len(p)), size):
      meets = sum(prob for xs, prob in draws if set(xs) & set(h))
      best = min(best, 1.0 - p[list(h)].sum() + meets)
  return float(best)


def node_rule_acceptance(p, q, k: int):
  """P(some child accepted) under specjax's node rule for k children drawn from q without
  replacement: child x is accepted with min(1, p(x)/q(x)); after a rejection p becomes
  normalise([p − q]₊) and q loses x (renormalised). p, q [..., V]; k ≤ 2 on any
  vocabulary (the first child's residual does not depend on which child it was).
  """
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  first = np.sum(np.minimum(p, q), axis=-1)  # P(child 1 accepted)
  if k == 1:
    return first
  if k != 2:
    raise ValueError(f"node_rule_acceptance takes k <= 2 on a batch, got {k} "
                     f"(node_rule_acceptance_bruteforce takes any k on one node)")
  r = np.maximum(p - q, 0.0)
  mass = np.sum(r, axis=-1, keepdims=True)  # P(child 1 rejected)
  r = np.where(mass > 0, r / np.where(mass > 0, mass, 1.0), p)
  # Given child 1 = a was rejected, child 2 ~ q without a, q'(x) = q(x)/(1 − q(a)), and is
  # accepted with Σ_{x ≠ a} min(q'(x), r(x)). P(child 1 = a | rejected) = q(a)(1 − acc(a))
  # / mass, acc(a) = min(1, p(a)/q(a)).
  acc = np.minimum(1.0, p / np.where(q > 0, q, 1.0))
  reject_at = q * (1.0 - acc)  # [..., V]: P(child 1 = a and rejected)
  scale = 1.0 / np.where(q < 1.0, 1.0 - q, 1.0)  # [..., a]
  # Σ_{x ≠ a} min(q(x) s_a, r(x)), for every a: [..., a, x], the diagonal removed.
  pair = np.minimum(q[..., None, :] * scale[..., :, None], r[..., None, :])
  second = np.sum(pair, axis=-1) - np.minimum(q * scale, r)
  return first + np.sum(reject_at * second, axis=-1)


def node_rule_acceptance_bruteforce(p, q, k: int) -> float:
  """`node_rule_acceptance` of one node [V] by enumerating every ordered draw: any k."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  total = 0.0
  for xs, prob in _draws(q, k, replacement=False):
    dist, left, stay = p.copy(), q.copy(), 1.0  # stay: P(every child so far rejected)
    for x in xs:
      qn = left / left.sum()
      a = 1.0 if dist[x] >= qn[x] else dist[x] / qn[x]
      total += prob * stay * a
      stay *= 1.0 - a
      res = np.maximum(dist - qn, 0.0)
      dist = res / res.sum() if res.sum() > 0 else dist
      left = left.copy()
      left[x] = 0.0
  return float(total)
