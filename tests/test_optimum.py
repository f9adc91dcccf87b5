"""The multi-draft optimum (specjax.verify.optimum): checked against the coupling LP it
solves, against every subset H, and the node rule's exact acceptance against the jitted walk."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from conftest import target_and_draft

from specjax import trees
from specjax.drafters import trees as tree_drafters
from specjax.verify import optimum
from specjax.verify import tree as tree_verify


def _pair(rng, vocab, conc=1.0):
  p = rng.dirichlet(np.ones(vocab) * conc)
  q = rng.dirichlet(np.ones(vocab) * conc)
  return p, q


def coupling_lp(p, q, k, replacement):
  """max P(y ∈ x̄) over joint laws of (x̄ ~ k draws from q, y ~ p): the LP, solved by scipy."""
  draws = list(optimum._draws(q, k, replacement))
  vocab = len(p)
  n = len(draws) * vocab  # variable (t, y): mass on draft tuple t and output y
  gain = np.array([-(y in xs) for xs, _ in draws for y in range(vocab)], np.float64)
  rows, rhs = [], []
  for t, (_, prob) in enumerate(draws):  # Σ_y π(t, y) = Q(t)
    row = np.zeros(n)
    row[t * vocab:(t + 1) * vocab] = 1.0
    rows.append(row)
    rhs.append(prob)
  for y in range(vocab - 1):  # Σ_t π(t, y) = p(y) (the last one follows)
    row = np.zeros(n)
    row[y::vocab] = 1.0
    rows.append(row)
    rhs.append(p[y])
  res = optimize.linprog(gain, A_eq=np.array(rows), b_eq=np.array(rhs), bounds=(0, None),
                         method="highs")
  assert res.status == 0, res.message
  return -res.fun


@pytest.mark.parametrize("seed", range(6))
def test_the_min_cut_is_the_coupling_optimum(seed):
  rng = np.random.default_rng(seed)
  p, q = _pair(rng, 4, conc=[0.3, 1.0, 3.0][seed % 3])
  for k, replacement in ((1, True), (2, True), (2, False), (3, False)):
    lp = coupling_lp(p, q, k, replacement)
    np.testing.assert_allclose(optimum.optimal_acceptance_bruteforce(p, q, k, replacement), lp,
                               atol=1e-9)
    if replacement or k <= 2:
      np.testing.assert_allclose(optimum.optimal_acceptance(p, q, k, replacement), lp,
                                 atol=1e-9)


def test_the_ratio_ordered_sets_hold_the_minimum():
  """The vectorised form searches only the V+1 top-p/q sets: it equals the min over every
  subset, on vocabularies and shapes where a wrong order would show."""
  rng = np.random.default_rng(11)
  for trial in range(60):
    vocab = int(rng.integers(3, 7))
    p, q = _pair(rng, vocab, conc=[0.2, 1.0, 4.0][trial % 3])
    if trial % 5 == 0:
      q[rng.integers(vocab)] = 0.0  # p > 0 where q = 0: those tokens lead
      q /= q.sum()
    for k, replacement in ((2, True), (3, True), (2, False)):
      np.testing.assert_allclose(optimum.optimal_acceptance(p, q, k, replacement),
                                 optimum.optimal_acceptance_bruteforce(p, q, k, replacement),
                                 atol=1e-12, err_msg=f"{trial} {k} {replacement}")


def test_one_draft_gains_nothing_and_the_batch_is_elementwise():
  rng = np.random.default_rng(2)
  p = rng.dirichlet(np.ones(50), 8)
  q = rng.dirichlet(np.ones(50), 8)
  np.testing.assert_allclose(optimum.optimal_acceptance(p, q, 1), np.minimum(p, q).sum(-1),
                             atol=1e-12)
  both = optimum.optimal_acceptance(p, q, 2)
  np.testing.assert_allclose(both, [optimum.optimal_acceptance(a, b, 2) for a, b in zip(p, q)])
  with pytest.raises(ValueError, match="k <= 2"):
    optimum.optimal_acceptance(p, q, 3)


@pytest.mark.parametrize("seed", range(4))
def test_node_rule_acceptance_is_exact_and_below_the_optimum(seed):
  rng = np.random.default_rng(20 + seed)
  p, q = _pair(rng, 5, conc=0.5)
  for k in (1, 2):
    exact = optimum.node_rule_acceptance(p, q, k)
    np.testing.assert_allclose(exact, optimum.node_rule_acceptance_bruteforce(p, q, k),
                               atol=1e-12)
    assert exact <= optimum.optimal_acceptance(p, q, k) + 1e-12
  assert (optimum.node_rule_acceptance_bruteforce(p, q, 3)
          <= optimum.optimal_acceptance_bruteforce(p, q, 3) + 1e-12)


def test_the_node_rule_leaves_a_gap_somewhere():
  """The optimum is a real line above the rule: some node's gap is well above rounding."""
  rng = np.random.default_rng(5)
  gaps = []
  for _ in range(40):
    p, q = _pair(rng, 6, conc=0.5)
    gaps.append(optimum.optimal_acceptance(p, q, 2) - optimum.node_rule_acceptance(p, q, 2))
  assert min(gaps) > -1e-12
  assert max(gaps) > 1e-3


def test_the_exact_acceptance_is_what_the_jitted_walk_accepts():
  """`node_rule_acceptance` models the engine's rule: the walk at one node of 2 children
  drawn by `sample_distinct` accepts a child at that rate (5 sd over 20,000 rows)."""
  tree = trees.Tree.from_branching((2,))
  rng = np.random.default_rng(9)
  vocab, rows = 5, 20000
  p, q = rng.dirichlet(np.ones(vocab) * 0.7), rng.dirichlet(np.ones(vocab) * 0.7)
  qf = jnp.asarray(q, jnp.float32)
  kids = jax.vmap(lambda k: tree_drafters.sample_distinct(
      k, qf, -jnp.arange(vocab, dtype=jnp.float32), 2))(
          jax.random.split(jax.random.PRNGKey(2), rows))
  ps = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (rows, 3, vocab))
  qs = jnp.broadcast_to(qf, (rows, 2, vocab))
  a = jax.jit(tree_verify.walk_batch, static_argnums=(4, 5))(
      jax.random.split(jax.random.PRNGKey(1), rows), kids, qs, ps, tree, False)[0]
  rate = float(np.mean(np.asarray(a) > 0))
  exact = optimum.node_rule_acceptance(p, q, 2)
  assert abs(rate - exact) <= 5 * np.sqrt(exact * (1 - exact) / rows), (rate, exact)
  # The formula tells the rule from one draft (k = 1), which it must not match.
  assert abs(rate - optimum.node_rule_acceptance(p, q, 1)) > 5 * np.sqrt(0.25 / rows)


def test_the_app_reports_each_line_in_order():
  """experiments.optimum on tiny models: one draft ≤ node rule ≤ optimum, the gap its mean,
  and a temperature of 0 (every node a point mass) refused."""
  from absl import app
  from experiments import optimum as app_optimum
  target, draft = target_and_draft()
  windows = np.random.default_rng(0).integers(0, target.config.vocab_size, (2, 12))
  res = app_optimum.measure(target, draft, windows, [1.0])["1.0"]
  assert res["nodes"] == 24
  assert res["one draft"] < res["node rule"] <= res["optimum"] + 1e-12
  np.testing.assert_allclose(res["gap"], res["optimum"] - res["node rule"], atol=1e-12)
  assert "| 1.0 |" in app_optimum.summary({"1.0": res})
  with pytest.raises(app.UsageError, match="temperatures must be > 0"):
    app_optimum.measure(target, draft, windows, [0.0])
