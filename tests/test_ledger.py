import numpy as np
from absl.testing import parameterized

from specjax import ledger


class LedgerTest(parameterized.TestCase):

  @parameterized.parameters((0.8, 5, 3.69), (0.9, 10, 6.86), (0.6, 2, 1.96))
  def test_leviathan_table_1(self, alpha, gamma, want):
    # c = 0, v = 1: the speedup is E(α, γ), as in Leviathan et al. 2023, Table 1.
    self.assertAlmostEqual(float(ledger.predicted_speedup(alpha, gamma, c=0.0)), want, places=2)

  def test_expected_tokens_limits(self):
    self.assertEqual(float(ledger.expected_tokens(0.0, 4)), 1.0)
    self.assertEqual(float(ledger.expected_tokens(1.0, 4)), 5.0)
    self.assertAlmostEqual(float(ledger.expected_tokens(0.5, 1)), 1.5)

  @parameterized.parameters((0.8, 0.05, 1.0), (0.6, 0.2, 1.0), (0.9, 0.01, 1.0), (0.3, 0.5, 1.0))
  def test_optimal_gamma_is_the_brute_force_argmax(self, alpha, c, v):
    best, speedup = ledger.optimal_gamma(alpha, c, v, max_gamma=20)
    brute = max(range(1, 21), key=lambda g: (1 - alpha ** (g + 1)) / (1 - alpha)
                / (g * c + v))
    self.assertEqual(best, brute)
    self.assertAlmostEqual(speedup, (1 - alpha ** (best + 1)) / (1 - alpha) / (best * c + v))

  def test_optimal_gamma_with_a_cpu_verify_cost(self):
    v = ledger.fit_verify_cost([0, 4], [1.0, 2.5])  # v(γ) = 1 + 0.375 γ
    best, _ = ledger.optimal_gamma(0.8, 0.05, v, max_gamma=20)
    brute = max(range(1, 21), key=lambda g: (1 - 0.8 ** (g + 1)) / 0.2 / (g * 0.05 + v(g)))
    self.assertEqual(best, brute)
    self.assertAlmostEqual(float(v(2)), 1.75)
    self.assertAlmostEqual(float(v(8)), 4.0)
    # Points at one γ are averaged (one γ: a constant), and v never falls below 1.
    one = ledger.fit_verify_cost([4, 4, 4], [2.0, 3.0, 4.0])
    self.assertAlmostEqual(float(one(3)), 3.0)
    self.assertAlmostEqual(float(one(6)), 3.0)
    steep = ledger.fit_verify_cost([4, 6], [1.5, 3.5])
    self.assertAlmostEqual(float(steep(1)), 1.0)

  def test_alpha_from_positions_recovers_a_geometric_run(self):
    rng = np.random.default_rng(0)
    alpha, gamma, rounds = 0.7, 4, 200_000
    runs = np.minimum(rng.geometric(1 - alpha, rounds) - 1, gamma)
    accepted_at = [(runs > i).sum() for i in range(gamma)]
    self.assertAlmostEqual(ledger.alpha_from_positions(accepted_at, rounds), alpha, delta=0.005)


def test_tree_expected_tokens():
  from specjax import ledger
  from specjax import trees
  chain = trees.Tree.from_branching((1, 1, 1, 1))
  for alpha in (0.3, 0.7):
    np.testing.assert_allclose(ledger.tree_expected_tokens(chain.parents, alpha),
                               ledger.expected_tokens(alpha, 4))
  wide = trees.Tree.from_branching((2, 2, 1, 1))
  assert ledger.tree_expected_tokens(wide.parents, 0.6) > ledger.expected_tokens(0.6, 4)
  # depth 1, two children: 1 + α + (1-α)α
  np.testing.assert_allclose(ledger.tree_expected_tokens((-1, -1), 0.5), 1.75)
  # α by sibling rank: 1 + α_0 + (1-α_0)α_1; past the end the last rate; NaN (never tried) 0
  np.testing.assert_allclose(ledger.tree_expected_tokens((-1, -1), [0.5, 0.2]), 1.6)
  np.testing.assert_allclose(ledger.tree_expected_tokens((-1, -1, -1), [0.5, 0.2]),
                             1 + 0.5 + 0.5 * 0.2 + 0.5 * 0.8 * 0.2)
  np.testing.assert_allclose(ledger.tree_expected_tokens((-1, -1), [0.5, float("nan")]), 1.5)
  np.testing.assert_allclose(ledger.tree_expected_tokens(wide.parents, [0.6]),
                             ledger.tree_expected_tokens(wide.parents, 0.6))


def test_predicted_call_speedup():
  e, rho = ledger.expected_tokens(0.8, 4), 2.0
  # No fixed part: E / ρ, the ledger's form with ρ for γc + v(γ).
  np.testing.assert_allclose(ledger.predicted_call_speedup(e, 64, rho, 0.0, 0.0), e / rho)
  # Fixed parts of 10 and 8 rounds: (8 + 64) / (10 + 64 / E · ρ), nearer 1 than E / ρ.
  s = ledger.predicted_call_speedup(e, 64, rho, 10.0, 8.0)
  np.testing.assert_allclose(s, 72 / (10 + 64 / e * rho))
  assert 1 < s < e / rho


def test_ceiling_call_speedup():
  # Every round commits γ + 1 = 5: ceil(64 / 5) = 13 rounds of ρ = 2, fixed parts 10 and 8.
  np.testing.assert_allclose(ledger.ceiling_call_speedup(5, 64, 2.0, 10.0, 8.0),
                             72 / (10 + 13 * 2.0))
  np.testing.assert_allclose(ledger.ceiling_call_speedup(5, 64, 2.0, 10.0, 8.0, cut_last=False),
                             72 / (10 + 64 / 5 * 2.0))
  # No acceptance rate predicts more than the ceiling at the same costs.
  for alpha in (0.0, 0.5, 0.9, 0.99):
    rounds = ledger.rounds_to_commit(ledger.commits_by_position([alpha], 4), 64)
    s = ledger.predicted_call_speedup(ledger.expected_tokens(alpha, 4), 64, 2.0, 10.0, 8.0,
                                      rounds)
    assert s < ledger.ceiling_call_speedup(5, 64, 2.0, 10.0, 8.0)


def test_rounds_to_commit_a_budget():
  # One rate for every position is the i.i.d. law: mean E(α, γ).
  law = ledger.commits_by_position([0.7], 3)
  np.testing.assert_allclose(law.sum(), 1.0)
  np.testing.assert_allclose(law @ np.arange(1, 5), ledger.expected_tokens(0.7, 3))
  # Rates by position; a position never reached (NaN) accepts nothing.
  np.testing.assert_allclose(ledger.commits_by_position([0.5, float("nan")], 3),
                             [0.5, 0.5, 0.0, 0.0])
  # Every round commits γ + 1 = 3: ceil(N / 3) rounds, not N / 3.
  assert ledger.rounds_to_commit(ledger.commits_by_position([1.0], 2), 7) == 3.0
  # 1 or 2 tokens a round, evenly: R(1) = 1, R(2) = 1 + R(1) / 2 = 1.5, R(3) = 1 + (R(2) +
  # R(1)) / 2 = 2.25; N / E = 3 / 1.5 = 2 undercounts the cut last round.
  np.testing.assert_allclose(ledger.rounds_to_commit([0.5, 0.5], 3), 2.25)
  # Long budgets: N / E plus a bounded overshoot.
  mean, r = law @ np.arange(1, 5), ledger.rounds_to_commit(law, 400)
  assert 400 / mean < r < 400 / mean + 1


def test_rounds_of_different_draft_lengths():
  # Every round at γ: the ledger's E(α, γ) and v(γ).
  np.testing.assert_allclose(ledger.by_length(0.7, [0, 0, 0, 5], 1.6),
                             (ledger.expected_tokens(0.7, 3), 1.6))
  # Half the rounds draft nothing (an n-gram miss): they commit 1 token for one step.
  e, v = ledger.by_length(0.7, [4, 0, 0, 4], 1.6)
  np.testing.assert_allclose((e, v), ((1 + ledger.expected_tokens(0.7, 3)) / 2, 1.3))
  # A length between: v on the line from v(0) = 1 to v(γ).
  np.testing.assert_allclose(ledger.by_length(0.7, [0, 1, 0, 0], 1.6)[1], 1.2)
  # The law of commits is the mixture of each length's, with that mean.
  law = ledger.commits_by_length([0.7], [4, 0, 0, 4])
  np.testing.assert_allclose(law.sum(), 1.0)
  np.testing.assert_allclose(law @ np.arange(1, 5), e)
  np.testing.assert_allclose(ledger.commits_by_length([0.7], [0, 0, 0, 2]),
                             ledger.commits_by_position([0.7], 3))
  # Rows of a batch share a pass as wide as its longest draft: the passes' widths price it.
  np.testing.assert_allclose(ledger.by_length(0.7, [4, 0, 0, 4], 1.6, [1, 0, 0, 7]),
                             (e, (1 + 7 * 1.6) / 8))
