"""`trees.best_static` (Sequoia's programme) against every tree, by brute force."""

import itertools

import numpy as np
from absl.testing import absltest, parameterized

from specjax import ledger, trees


def every_tree(nodes, depth, topk):
  """Every set of <= nodes paths closed under parents and earlier siblings."""
  out = set()

  def grow(paths):
    out.add(paths)
    if len(paths) == nodes:
      return
    for p in itertools.chain([()], paths):
      if len(p) == depth:
        continue
      r = sum(1 for q in paths if len(q) == len(p) + 1 and q[:-1] == p)
      if r < topk:
        grow(tuple(sorted(paths + (p + (r,),))))

  grow(())
  out.discard(())
  return out


class BestStaticTest(parameterized.TestCase):

  @parameterized.parameters(
      (6, (0.8,), None, None), (6, (0.6, 0.3), None, None), (7, (0.5, 0.4, 0.1), 3, None),
      (7, (0.3, 0.6), None, 2), (6, (0.9, 0.05, 0.5), 2, 3), (5, (0.0,), None, None))
  def test_no_tree_commits_more(self, nodes, alpha, depth, topk):
    best = trees.best_static(nodes, alpha, depth=depth, topk=topk)
    got = ledger.tree_expected_tokens(best.parents, alpha)
    self.assertLessEqual(best.num_nodes, nodes)
    self.assertLessEqual(best.depth, depth or nodes)
    self.assertLessEqual(best.children.shape[1], topk or nodes)
    top = max(ledger.tree_expected_tokens(trees.Tree.from_paths(p).parents, alpha)
              for p in every_tree(nodes, depth or nodes, topk or nodes))
    np.testing.assert_allclose(got, top, rtol=1e-12)

  def test_one_rate_at_one_budget_is_a_chain(self):
    # π_r = α (1 − α)^r: with α = 0.9 a second child is worth less than a deeper node.
    self.assertEqual(trees.best_static(6, 0.9).parents, trees.Tree.from_branching((1,) * 6).parents)

  def test_beats_the_hand_picked_tree_at_its_budget(self):
    alpha = (0.55, 0.3, 0.15)  # acceptance falling with sibling rank, as measured trees have
    hand = trees.Tree.from_branching((2, 2, 1, 1))
    best = trees.best_static(hand.num_nodes, alpha)
    self.assertGreater(ledger.tree_expected_tokens(best.parents, alpha),
                       ledger.tree_expected_tokens(hand.parents, alpha) + 0.05)

  @parameterized.parameters(({"nodes": 0}, "node budget"), ({"nodes": 4, "depth": 0}, "depth"),
                            ({"nodes": 4, "topk": 1.5}, "topk"),
                            ({"nodes": 4, "alpha": (0.5, 1.2)}, "alpha"),
                            ({"nodes": 4, "alpha": float("nan")}, "alpha"))
  def test_raises(self, kw, message):
    kw = {"alpha": 0.5, **kw}
    with self.assertRaisesRegex(ValueError, message):
      trees.best_static(kw.pop("nodes"), **kw)


if __name__ == "__main__":
  absltest.main()
