"""Traversal verification (verify.traversal): the exact float64 law over every draft tree,
its accepted length against the node rule's, and a chain's against block verification.
(The engine does not run the walk yet: `verify_rule='traversal'` is not wired.)"""

import itertools

import numpy as np
from absl.testing import parameterized

from specjax import trees
from specjax.verify import traversal
from test_trees import distinct_draws


def _models(rng, vocab, depth, support):
  """p(.|s) and q(.|s) for every prefix s up to `depth` tokens; q has `support` tokens."""
  p, q = {}, {}
  for n in range(depth + 1):
    for s in itertools.product(range(vocab), repeat=n):
      p[s] = rng.dirichlet(np.ones(vocab) * 0.6)
      qs = np.zeros(vocab)
      qs[rng.permutation(vocab)[:support]] = rng.dirichlet(np.ones(support) * 0.6)
      q[s] = qs
  return p, q


def _draft_trees(tree, q, mode, fallback):
  """Every draft tree (node tokens, probability): children drawn from q without
  replacement ('sampled'; past q's support `fallback`'s next tokens) or q's top-k."""
  rows = [r for r in range(tree.num_nodes + 1) if tree.children[r, 0] >= 0]  # BFS order
  out = []

  def prefix(tokens, row):
    s = []
    while row > 0:
      s.append(tokens[row - 1])
      row = tree.parents[row - 1] + 1
    return tuple(reversed(s))

  def grow(i, tokens, prob):
    if i == len(rows):
      out.append((list(tokens), prob))
      return
    row = rows[i]
    kids = [c for c in tree.children[row] if c >= 0]
    qs = q[prefix(tokens, row)]
    if mode == "topk":
      draws = [(list(np.argsort(-qs, kind="stable")[:len(kids)]), 1.0)]
    else:
      draws = distinct_draws(qs, len(kids), fallback)
    for seq, w in draws:
      new = list(tokens)
      for c, x in zip(kids, seq):
        new[c] = int(x)
      grow(i + 1, new, prob * w)

  grow(0, [0] * tree.num_nodes, 1.0)
  return out


def _child_q(left, x, mode):
  onehot = np.eye(len(left))[x]
  if mode == "topk" or left.sum() <= 0:
    return onehot
  return left / left.sum()


def traversal_outcomes(tree, tokens, p, q, mode, update_parent=True):
  """float64: every (probability, accepted path of nodes, next-token law) of the
  traversal rule on one draft tree, following verify.traversal's events."""
  events, paths = traversal.schedule(tree)
  n = tree.num_nodes + 1
  pre = [()] * n
  for i, par in enumerate(tree.parents):
    pre[i + 1] = pre[par + 1] + (tokens[i],)
  w = np.ones(n)
  dist = [p[s].copy() for s in pre]
  left = [q[s].copy() for s in pre]
  reach, out = 1.0, []
  for node, enter in events:
    row, u, x = node + 1, tree.parents[node] + 1, tokens[node]
    qc = _child_q(left[u], x, mode)
    if enter:
      w[row] = min(1.0, w[u] * dist[u][x] / qc[x])
      continue
    out.append((reach * w[row], [int(v) for v in paths[row] if v >= 0], dist[row].copy()))
    reach *= 1 - w[row]
    if update_parent:
      r = np.maximum(w[u] * dist[u] - qc, 0.0)
      w[u] = 1.0 if u == 0 else r.sum() / (r.sum() + 1 - w[u])
      dist[u] = r / r.sum() if r.sum() > 0 else dist[u]
    left[u] = left[u] * (1 - np.eye(len(left[u]))[x])
  out.append((reach, [], dist[0].copy()))
  return out


def node_rule_outcomes(tree, tokens, p, q, mode):
  """float64: the same for today's node rule (verify.tree.walk), root to leaf."""
  out = []

  def at(row, path, prob, s):
    kids = [c for c in tree.children[row] if c >= 0]
    dist, left = p[s].copy(), q[s].copy()
    for c in kids:
      x = tokens[c]
      qc = _child_q(left, x, mode)
      a = min(1.0, dist[x] / qc[x]) if qc[x] > 0 else 1.0
      at(c + 1, path + [c], prob * a, s + (x,))
      prob *= 1 - a
      r = np.maximum(dist - qc, 0.0)
      dist = r / r.sum() if r.sum() > 0 else dist
      left = left * (1 - np.eye(len(left))[x])
    out.append((prob, path, dist))

  at(0, [], 1.0, ())
  return out


def output_law(tree, p, q, mode, outcomes, fallback):
  """(law of the first depth+1 emitted tokens, completed by the target; expected
  accepted tokens), over every draft tree and the rule's randomness."""
  vocab, depth = len(p[()]), tree.depth
  law, mean = np.zeros((vocab,) * (depth + 1)), 0.0
  for tokens, wt in _draft_trees(tree, q, mode, fallback):
    for prob, path, nxt in outcomes(tree, tokens, p, q, mode):
      if prob == 0:
        continue
      s = tuple(tokens[c] for c in path)
      mean += wt * prob * len(s)
      for y in range(vocab):
        head, mass = s + (y,), wt * prob * nxt[y]
        for tail in itertools.product(range(vocab), repeat=depth - len(s)):
          m, cur = mass, head
          for t in tail:
            m, cur = m * p[cur][t], cur + (t,)
          law[cur] += m
  return law, mean


def target_law(p, vocab, depth):
  law = np.zeros((vocab,) * (depth + 1))
  for seq in itertools.product(range(vocab), repeat=depth + 1):
    law[seq] = np.prod([p[seq[:i]][seq[i]] for i in range(depth + 1)])
  return law


SHAPES = [(2,), (2, 1), (2, 2), (3, 1), (1, 1, 1)]


class ExactLawTest(parameterized.TestCase):

  @parameterized.parameters(itertools.product(SHAPES, ("sampled", "topk"), (3, 2)))
  def test_law_is_p_and_accepts_no_less(self, branching, mode, support):
    """The law of the emitted tokens is the target's, summed over every draft tree
    (siblings without replacement, q of full support or of 2 tokens, or top-k point
    masses) and every test; the expected accepted length is ≥ the node rule's; the
    rule that leaves the parent alone after a rejection is not lossless."""
    if mode == "topk" and support == 2:
      return  # top-k children do not depend on q's support beyond the order
    tree = trees.Tree.from_branching(branching)
    rng = np.random.default_rng(sum(branching) * 7 + support)
    vocab = 3
    p, q = _models(rng, vocab, tree.depth, support)
    fallback = [2, 0, 1]
    want = target_law(p, vocab, tree.depth)
    law, mean = output_law(tree, p, q, mode, traversal_outcomes, fallback)
    np.testing.assert_allclose(law, want, atol=1e-12)
    node_law, node_mean = output_law(tree, p, q, mode, node_rule_outcomes, fallback)
    np.testing.assert_allclose(node_law, want, atol=1e-12)
    self.assertGreaterEqual(mean, node_mean - 1e-12)
    wrong = lambda *a: traversal_outcomes(*a, update_parent=False)
    bad, _ = output_law(tree, p, q, mode, wrong, fallback)
    self.assertGreater(np.abs(bad - want).sum(), 1e-3)

  def test_a_chain_is_block_verification(self):
    """On a chain the rule's accepted-length law is block verification's (Sun et al.
    2024, Algorithm 2: backward from the deepest draft, stop at i w.p. h_i)."""
    rng = np.random.default_rng(3)
    vocab, gamma = 3, 3
    tree = trees.Tree.from_branching((1,) * gamma)
    p, q = _models(rng, vocab, gamma, vocab)
    for tokens, _ in _draft_trees(tree, q, "sampled", [0, 1, 2]):
      ours = np.zeros(gamma + 1)
      for prob, path, _ in traversal_outcomes(tree, tokens, p, q, "sampled"):
        ours[len(path)] += prob
      s = [tuple(tokens[:i]) for i in range(gamma + 1)]
      w = [1.0]
      for i in range(gamma):
        w.append(min(1.0, w[-1] * p[s[i]][tokens[i]] / q[s[i]][tokens[i]]))
      h = [1.0] * (gamma + 1)
      for i in range(1, gamma):
        r = np.maximum(w[i] * p[s[i]] - q[s[i]], 0.0).sum()
        h[i] = r / (r + 1 - w[i])
      h[gamma] = w[gamma]
      block, reach = np.zeros(gamma + 1), 1.0
      for i in range(gamma, -1, -1):
        block[i], reach = reach * h[i], reach * (1 - h[i])
      np.testing.assert_allclose(ours, block, atol=1e-12)
