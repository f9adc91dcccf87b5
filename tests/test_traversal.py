"""Traversal verification (verify.traversal): the exact float64 law over every draft tree,
its accepted length against the node rule's, and a chain's against block verification;
then the engine's `verify_rule='traversal'`: the law of 3-token continuations, greedy
equality, bad input, and a planted error."""

import functools
import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax import decode as decode_lib
from specjax import trees
from specjax.verify import traversal
from conftest import LAW_ROWS, greedy_oracle, target_and_draft, tiny_model, within_law
from test_block import filtered_law
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


def traversal_outcomes(tree, tokens, p, q, mode, update_parent=True, keep_tried=False):
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
    if not keep_tried:  # keep_tried: a wrong variant, later siblings' q keeps x
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
  drafts = [(tree, tokens, wt) for tokens, wt in _draft_trees(tree, q, mode, fallback)]
  return law_over(drafts, p, q, mode, outcomes, tree.depth)


def law_over(drafts, p, q, mode, outcomes, depth):
  """`output_law` over given (tree, node tokens, probability) drafts."""
  vocab = len(p[()])
  law, mean = np.zeros((vocab,) * (depth + 1)), 0.0
  for tree, tokens, wt in drafts:
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


class WalkTest(parameterized.TestCase):
  """The compiled walk (`traversal.walk`) against the float64 reference it follows."""

  @parameterized.parameters(*[(b, m, s) for b in ((2, 2), (3, 1), (2, 1, 1))
                               for m, s in (("sampled", 3), ("sampled", 2), ("topk", 3))])
  def test_outcome_frequencies_are_the_references(self, branching, mode, support):
    """On draft trees of q with full support or of 2 tokens (then a third sibling is a
    fixed token past it), the frequencies of (accepted path, next token) over 20,000 keys
    are `traversal_outcomes`' probabilities (within 5 sd + 1 count), rolled (a while loop
    on the CPU) and unrolled alike, with the same outcomes key by key."""
    tree = trees.Tree.from_branching(branching)
    rng = np.random.default_rng(sum(branching) + (mode == "topk") + 10 * support)
    vocab = 3
    p, q = _models(rng, vocab, tree.depth, support)
    drafts = _draft_trees(tree, q, mode, [2, 0, 1])
    for i in sorted({len(drafts) // 2, len(drafts) - 1}):  # two drafts where there are two
      self._check_one(tree, mode, p, q, drafts[i][0])

  def test_later_siblings_draw_from_what_is_left(self):
    """Inputs where a later sibling's weight is below 1 only if its q leaves out the
    tokens tried before it: the walk follows the reference, and the reference with the
    tried tokens kept in q (a wrong variant) is far from it."""
    tree = trees.Tree.from_branching((3, 1))
    p, q = _models(np.random.default_rng(7), 4, tree.depth, 4)
    p[()], q[()] = np.array([0.05, 0.3, 0.3, 0.35]), np.array([0.7, 0.1, 0.1, 0.1])
    tokens = [0, 1, 2] + [int(np.argmax(q[(x,)])) for x in (0, 1, 2)]
    for mode in ("sampled", "topk"):  # top-k: q is a point mass, so only `sampled` moves
      right, wrong = (self._law(tree, tokens, p, q, mode, keep) for keep in (False, True))
      gap = max(abs(right.get(k, 0) - wrong.get(k, 0)) for k in right.keys() | wrong.keys())
      if mode == "sampled":
        self.assertGreater(gap, 0.05)  # > 10 sd of a frequency over 20,000 keys
      else:
        self.assertLess(gap, 1e-12)
      self._check_one(tree, mode, p, q, tokens)

  @staticmethod
  def _law(tree, tokens, p, q, mode, keep_tried=False):
    """{(accepted path, next token): probability} of the float64 reference."""
    want = {}
    for prob, path, nxt in traversal_outcomes(tree, tokens, p, q, mode, keep_tried=keep_tried):
      for y in range(len(nxt)):
        key = (tuple(path), y)
        want[key] = want.get(key, 0.0) + prob * nxt[y]
    return want

  def _check_one(self, tree, mode, p, q, tokens):
    pre = [()] * (tree.num_nodes + 1)
    for i, par in enumerate(tree.parents):
      pre[i + 1] = pre[par + 1] + (tokens[i],)
    ps = np.stack([p[s] for s in pre]).astype(np.float32)
    node_q = np.stack([q[pre[par + 1]] for par in tree.parents]).astype(np.float32)
    want = self._law(tree, tokens, p, q, mode)
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    args = (keys, jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (n, tree.num_nodes)),
            jnp.broadcast_to(node_q, (n,) + node_q.shape), jnp.broadcast_to(ps, (n,) + ps.shape))
    outs = [traversal.walk_batch(*args, tree, mode == "topk", unroll) for unroll in (False, True)]
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
    n_acc, nxt, _, path, _ = outs[0]
    counts = {}
    for k, y, pa in zip(np.asarray(n_acc), np.asarray(nxt), np.asarray(path)):
      key = (tuple(int(v) for v in pa[:k]), int(y))
      counts[key] = counts.get(key, 0) + 1
    self.assertLessEqual(set(counts), {k for k, v in want.items() if v > 0})
    for key, prob in want.items():
      got, prob = counts.get(key, 0), min(max(prob, 0.0), 1.0)  # float64 rounding
      self.assertLessEqual(abs(got - n * prob), 5 * np.sqrt(n * prob * (1 - prob)) + 1,
                           (key, got, n * prob))


# The engine's walk: `verify_rule='traversal'` with a tree drafter.

ENGINE = {  # name: (generate's arguments, T, top-p)
    "model_sampled_22_T1": (dict(tree=(2, 2)), 1.0, 1.0),
    "model_topk_211_T08_topp": (dict(tree=(2, 1, 1), draft_sample="greedy"), 0.8, 0.9),
    "model_sampled_paths_T08": (dict(tree=[(0,), (1,), (0, 0), (1, 0), (1, 1)]), 0.8, 1.0),
    "medusa_22_T1": (dict(tree=(2, 2), draft="medusa"), 1.0, 1.0),
    "ngram_221_T1": (dict(tree=(2, 2, 1), drafter="ngram"), 1.0, 1.0),
}


def _spec(name, target, draft):
  spec = dict(ENGINE[name][0])
  if spec.get("draft") == "medusa":
    from test_heads import random_head
    spec["draft"] = random_head(target, "medusa")
  elif spec.get("drafter") != "ngram":
    spec["draft"] = draft
  return spec


def _law_run(name, seed=4):
  target, draft = target_and_draft()
  _, temperature, top_p = ENGINE[name]
  prompt = [3, 1, 3, 1, 2, 3, 1] if "ngram" in name else [3, 1, 3]
  res = specjax.generate(target, [prompt] * LAW_ROWS, max_new_tokens=3,
                         temperature=temperature, top_p=top_p, seed=seed,
                         verify_rule="traversal", **_spec(name, target, draft))
  return res, filtered_law(target, prompt, 3, temperature, 0, top_p)


class EngineLawTest(parameterized.TestCase):
  """The empirical law of LAW_ROWS 3-token continuations under verify_rule='traversal'."""

  @parameterized.named_parameters(*[(name, name) for name in ENGINE])
  def test_three_token_law(self, name):
    res, probs = _law_run(name)
    ok, worst = within_law(res.tokens, probs)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertTrue(res.stats["lossless"])
    self.assertLess(res.stats["acceptance_rate"], 0.95)  # the draft really disagreed
    self.assertGreater(res.stats["rounds"], LAW_ROWS)  # and rounds were rolled back
    self.assertEqual(sum(res.stats["sibling_accepted"]), res.stats["accepted"])
    self.assertTrue(all(np.isnan(res.stats["alpha_by_sibling"])))  # not the node rule's

  def test_penalties(self):
    from test_processors import EOS, PENALTIES, PROMPT, TEMPERATURE, exact_law, law_check
    target, draft = target_and_draft()
    law = exact_law(target, PROMPT, 3, TEMPERATURE, dict(PENALTIES, no_repeat_ngram_size=2))
    res = specjax.generate(target, [PROMPT] * LAW_ROWS, max_new_tokens=3,
                           temperature=TEMPERATURE, seed=5, eos_id=EOS, draft=draft,
                           tree=(2, 2), verify_rule="traversal", no_repeat_ngram_size=2,
                           **PENALTIES)
    ok, worst = law_check(law, res.tokens, 3)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertGreater(res.stats["rounds"], LAW_ROWS)

  def test_accepts_no_fewer_than_the_node_walk(self):
    """Same drafts' law, more accepted: the mean accepted per round is not below the
    node walk's (5 standard errors), on the tree and temperature of the first law test."""
    target, draft = target_and_draft()
    means = {}
    for rule in ("exact", "traversal"):
      res = specjax.generate(target, [[3, 1, 3]] * 2000, max_new_tokens=3, temperature=1.0,
                             seed=2, draft=draft, tree=(2, 2), verify_rule=rule)
      hist = np.asarray(res.stats["committed_hist"], np.float64)
      k = np.arange(len(hist))
      m = (hist * k).sum() / hist.sum()
      means[rule] = m, np.sqrt((hist * (k - m) ** 2).sum() / hist.sum() / hist.sum())
    (a, sa), (b, sb) = means["exact"], means["traversal"]
    self.assertGreater(b, a - 5 * np.hypot(sa, sb), means)


class GreedyTest(parameterized.TestCase):

  @parameterized.parameters(("model", (2, 2, 1), "greedy"), ("model", (4, 2, 1, 1), "probabilistic"),
                            ("model", [(0,), (1,), (0, 0), (0, 1), (1, 0)], "greedy"),
                            ("ngram", (2, 2, 1), None), ("medusa", (2, 2), "greedy"))
  def test_equals_target_greedy_and_the_node_walk(self, drafter, tree, mode):
    target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
    if drafter == "ngram":
      kw = dict(drafter="ngram")
    elif drafter == "medusa":
      from test_heads import random_head
      kw = dict(draft=random_head(target, "medusa"), draft_sample=mode)
    else:
      kw = dict(draft=tiny_model(vocab=16, d_model=16, seed=8, sharpness=1.5),
                draft_sample=mode)
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2], [4, 5, 6, 7, 0, 1, 2, 3, 4], [7]]
    res = specjax.generate(target, prompts, max_new_tokens=12, tree=tree,
                           verify_rule="traversal", **kw)
    for prompt, out in zip(prompts, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 12))
    # At T = 0 both walks accept the one path that matches the target's argmax.
    node = specjax.generate(target, prompts, max_new_tokens=12, tree=tree, **kw)
    for key in ("accepted", "rounds"):
      self.assertEqual(res.stats[key], node.stats[key], key)


class RuleTest(parameterized.TestCase):

  def test_made_by_name_and_refused_on_chains(self):
    from specjax.verify import rules
    self.assertIsInstance(rules.make_rule("traversal", None, 3), traversal.TraversalRule)
    self.assertTrue(traversal.TraversalRule.lossless)
    with self.assertRaisesRegex(ValueError, "takes rule_params"):
      rules.make_rule("traversal", {"ratio": 1.0}, 3)
    target, draft = target_and_draft()
    with self.assertRaisesRegex(ValueError, "verifies a token tree"):
      specjax.generate(target, [[1, 2]], max_new_tokens=2, draft=draft, gamma=2,
                       verify_rule="traversal")
    with self.assertRaisesRegex(ValueError, "speculative decoding"):
      specjax.generate(target, [[1, 2]], max_new_tokens=2, verify_rule="traversal")


class PlantedEngineTest(parameterized.TestCase):
  """Last in the file: it clears the compiled engines the tests above share."""

  def test_parent_left_alone_is_caught(self):
    """The variant that leaves the parent's p and weight alone after a rejection fails
    the engine law check the rule passes."""
    right = traversal.walk_batch
    wrong = functools.partial(right, update_parent=False)
    with mock.patch.object(traversal, "walk_batch", wrong):
      decode_lib.decode.clear_cache()
      try:
        res, probs = _law_run("model_sampled_22_T1")
      finally:
        decode_lib.decode.clear_cache()
    ok, worst = within_law(res.tokens, probs)
    self.assertFalse(ok, f"the parent-left-alone variant passed (worst z={worst})")
