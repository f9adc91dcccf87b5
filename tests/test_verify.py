"""The verification rule is exact: accept path + reject path = p.

Oracles: the exact output law computed in float64 from the implementation's own
acceptance probabilities and residual; a Monte Carlo run of the real jitted sampler;
and the deliberately wrong rule (redraw from p after a rejection) failing that check.
"""

from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from specjax.processors.sampling import process_logits, sample
from specjax.verify.exact import acceptance_prob, residual, verify
from specjax.verify import exact

P = np.array([0.6, 0.3, 0.1])
Q = np.array([0.2, 0.5, 0.3])


def output_law(p, q):
  """float64 law of the emitted token, from the implementation's a(y) and residual."""
  vocab = len(p)
  a = np.asarray(acceptance_prob(jnp.broadcast_to(jnp.asarray(p, jnp.float32), (vocab, vocab)),
                                 jnp.broadcast_to(jnp.asarray(q, jnp.float32), (vocab, vocab)),
                                 jnp.arange(vocab)), np.float64)
  r = np.asarray(residual(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)), np.float64)
  q = np.asarray(q, np.float64)
  accept = q * a
  return accept + (1.0 - accept.sum()) * r, accept.sum()


class ExactTest(parameterized.TestCase):

  def test_tutorial_example(self):
    law, acceptance = output_law(P, Q)
    np.testing.assert_allclose(law, P, atol=1e-6)
    np.testing.assert_allclose(acceptance, 0.6, atol=1e-6)  # Σ min(p, q) = 0.2 + 0.3 + 0.1
    np.testing.assert_allclose(residual(P, Q), [1, 0, 0], atol=1e-7)

  def test_one_hot_draft(self):
    q = np.array([0.0, 1.0, 0.0])  # a token-only draft proposing token 1
    law, acceptance = output_law(P, q)
    np.testing.assert_allclose(law, P, atol=1e-6)
    np.testing.assert_allclose(acceptance, 0.3, atol=1e-6)  # = p(y)
    np.testing.assert_allclose(residual(P, q), [0.6 / 0.7, 0, 0.1 / 0.7], atol=1e-6)

  @parameterized.parameters(range(6))
  def test_random_pairs(self, seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 40))
    p = rng.dirichlet(np.full(vocab, 0.3))
    q = rng.dirichlet(np.full(vocab, 0.3))
    if seed % 3 == 1:  # disjoint supports: nothing can be accepted
      p[: vocab // 2] = 0
      q[vocab // 2:] = 0
      p, q = p / p.sum(), q / q.sum()
    if seed % 3 == 2:  # identical: everything is accepted, the residual is never used
      q = p.copy()
    law, acceptance = output_law(p, q)
    np.testing.assert_allclose(law, p, atol=1e-6)
    np.testing.assert_allclose(acceptance, np.minimum(p, q).sum(), atol=1e-6)

  def test_safe_at_zero_probabilities(self):
    p = jnp.array([0.5, 0.5, 0.0])
    q = jnp.array([0.0, 0.5, 0.5])
    a = acceptance_prob(jnp.stack([p] * 3), jnp.stack([q] * 3), jnp.arange(3))
    np.testing.assert_allclose(a, [1.0, 1.0, 0.0])  # q(y)=0<p(y) accepts; p(y)=0 rejects
    self.assertTrue(bool(jnp.all(jnp.isfinite(residual(p, p)))))


def first_token(keys, logits_p, logits_q, temperature, top_k, top_p, wrong=False):
  """One position through the real sampler: process both sides, draw y ~ q, verify."""
  p = process_logits(logits_p, temperature, top_k, top_p)
  q = process_logits(logits_q, temperature, top_k, top_p)

  def one(key):
    k_draft, k_verify = jax.random.split(key)
    y = sample(k_draft, q)
    n_acc, nxt, _ = verify(k_verify, y[None], q[None], jnp.stack([p, p]))
    if wrong:  # the classic bug: after a rejection, redraw from p instead of the residual
      nxt = jnp.where(n_acc == 0, sample(jax.random.fold_in(k_verify, 1), p), nxt)
    return jnp.where(n_acc == 1, y, nxt), n_acc

  return jax.vmap(one)(keys), p


def within_bound(counts, probs, draws, z=6.0):
  """Every frequency within z binomial standard deviations (+1 count) of its law."""
  probs = np.asarray(probs, np.float64)
  sd = np.sqrt(draws * probs * (1 - probs))
  return np.all(np.abs(counts - draws * probs) <= z * sd + 1), counts / draws


class ZeroUniformTest(chex.TestCase):

  def test_a_zero_uniform_never_accepts_a_token_p_excludes(self):
    """u is drawn from [0, 1): a draft token with p(y) = 0 (cut by top-k/top-p or a
    constraint) is rejected even at u = 0."""
    zeros = lambda key, shape=(), *a, **k: jnp.zeros(shape)
    with mock.patch.object(jax.random, "uniform", zeros):
      n, _, _ = verify(jax.random.PRNGKey(0), jnp.array([0]), jnp.array([[1.0, 0.0, 0.0]]),
                       jnp.array([[0.0, .5, .5], [.2, .3, .5]]))
    self.assertEqual(int(n), 0)


class MonteCarloTest(chex.TestCase):
  DRAWS = 1_000_000

  def _run(self, logits_p, logits_q, temperature=1.0, top_k=0, top_p=1.0, wrong=False):
    keys = jax.random.split(jax.random.PRNGKey(0), self.DRAWS)
    fn = jax.jit(first_token, static_argnames="wrong")
    (tokens, n_acc), p = fn(keys, logits_p, logits_q, temperature, top_k, top_p, wrong=wrong)
    counts = np.bincount(np.asarray(tokens), minlength=logits_p.shape[-1])
    return counts, np.asarray(p), float(np.mean(n_acc))

  def test_tutorial_example_and_wrong_rule(self):
    counts, p, rate = self._run(jnp.log(P), jnp.log(Q))
    ok, freq = within_bound(counts, P, self.DRAWS)
    self.assertTrue(ok, f"correct rule off: {freq} vs {P}")
    self.assertAlmostEqual(rate, 0.6, delta=6 * np.sqrt(0.24 / self.DRAWS))
    counts, _, _ = self._run(jnp.log(P), jnp.log(Q), wrong=True)
    ok, freq = within_bound(counts, P, self.DRAWS)
    self.assertFalse(ok, "the wrong rule passed the check, so the check is too weak")
    np.testing.assert_allclose(freq, [0.44, 0.42, 0.14], atol=3e-3)

  def test_filters_on_both_sides(self):
    rng = np.random.default_rng(1)
    logits_p = jnp.asarray(rng.normal(size=12) * 2, jnp.float32)
    logits_q = jnp.asarray(rng.normal(size=12) * 2, jnp.float32)
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.3, 6, 1.0), (1.0, 0, 0.8),
                                      (0.9, 8, 0.9)]:
      counts, p, _ = self._run(logits_p, logits_q, temperature, top_k, top_p)
      ok, freq = within_bound(counts, p, self.DRAWS)
      self.assertTrue(ok, f"T={temperature} k={top_k} p={top_p}: {freq} vs {p}")
      self.assertEqual(counts[p == 0].sum(), 0)  # nothing outside the target's support
    # The same bound is tight enough to catch the wrong rule with filters on both sides.
    counts, p, _ = self._run(logits_p, logits_q, 0.9, 8, 0.9, wrong=True)
    self.assertFalse(within_bound(counts, p, self.DRAWS)[0])

  def test_greedy_needs_no_randomness(self):
    counts, p, rate = self._run(jnp.log(P), jnp.log(Q), temperature=0.0)
    np.testing.assert_array_equal(counts, [self.DRAWS, 0, 0])
    self.assertEqual(rate, 0.0)  # the draft's argmax (token 1) is never the target's


class VerifyShapesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_accepted_prefix_stops_at_first_rejection(self):
    vocab = 4
    p = jax.nn.one_hot(jnp.array([2, 1, 3, 0]), vocab)  # greedy target: argmaxes 2, 1, 3, 0
    q = jax.nn.one_hot(jnp.array([2, 1, 0]), vocab)
    n_acc, nxt, overlap = self.variant(verify)(jax.random.PRNGKey(0), jnp.array([2, 1, 0]),
                                               q, p)
    self.assertEqual(int(n_acc), 2)
    self.assertEqual(int(nxt), 3)  # the correction is the target's argmax
    np.testing.assert_allclose(overlap, [1, 1, 0])
    # All accepted: the bonus comes from the (γ+1)-th distribution.
    q = jax.nn.one_hot(jnp.array([2, 1, 3]), vocab)
    n_acc, nxt, _ = self.variant(verify)(jax.random.PRNGKey(0), jnp.array([2, 1, 3]), q, p)
    self.assertEqual((int(n_acc), int(nxt)), (3, 0))

class PointMassTest(chex.TestCase):

  def test_rule_with_point_masses_is_the_sampled_rule(self):
    # Every p one-hot (temperature 0): ExactRule decides by argmaxes and gathers instead
    # of drawing; for any q (one-hot or soft) and key the tokens must be the same (so a
    # batch the host cannot call greedy runs verify_batch, without a conditional).
    b, gamma, vocab = 6, 3, 64
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    p = jax.nn.one_hot(jax.random.randint(keys[0], (b, gamma + 1), 0, 4), vocab)
    soft = jax.nn.softmax(2 * jax.random.normal(keys[1], (b, gamma, vocab)))
    ys = jax.random.randint(keys[2], (b, gamma), 0, 4)
    # q(y) = 0 too (accepted by the rule's min(1, p/q) convention): q on other tokens.
    for q in (jax.nn.one_hot(ys, vocab), soft, jax.nn.one_hot((ys + 1) % 4, vocab)):
      for seed in range(8):
        row_keys = jax.random.split(jax.random.PRNGKey(seed), b)
        self.assertTrue(bool(exact.point_masses(p)))
        got = jax.jit(lambda *a: exact.ExactRule()(*a, greedy=True))(row_keys, ys, q, p)
        want = exact.verify_batch(row_keys, ys, q, p)
        # With each p's token given (a greedy round), p is not read: the same numbers.
        top = jnp.argmax(p, axis=-1).astype(jnp.int32)
        given = exact.ExactRule()(row_keys, ys, q, jnp.zeros_like(p), True, top=top)
        for g, w, t in zip(got, want, given):
          np.testing.assert_array_equal(g, w)
          np.testing.assert_array_equal(t, w)
    # γ = 0 (target-only decoding): nothing to accept, the next token is p's argmax.
    empty_q = jnp.zeros((b, 0, vocab))
    got = exact.verify_point_masses(row_keys, ys[:, :0], empty_q, p[:, :1])
    np.testing.assert_array_equal(got[0], 0)
    np.testing.assert_array_equal(got[1], jnp.argmax(p[:, 0], axis=-1))
    for g, w in zip(got, exact.verify_batch(row_keys, ys[:, :0], empty_q, p[:, :1])):
      np.testing.assert_array_equal(g, w)
    # One soft row anywhere and the batch is sampled.
    self.assertFalse(bool(exact.point_masses(p.at[2, 1].set(soft[0, 0]))))
