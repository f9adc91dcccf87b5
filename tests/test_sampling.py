"""Logits processing: the distribution that is actually sampled from."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from specjax.processors.sampling import Sampling, argmax, process_logits, sample

LOGITS = jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15]))


class ProcessLogitsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_plain_softmax_and_temperature(self):
    fn = self.variant(process_logits)
    np.testing.assert_allclose(fn(LOGITS, 1.0, 0, 1.0), jax.nn.softmax(LOGITS), atol=1e-6)
    np.testing.assert_allclose(fn(LOGITS, 0.5, 0, 1.0), jax.nn.softmax(LOGITS / 0.5), atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_is_exact_argmax(self):
    probs = self.variant(process_logits)(LOGITS, 0.0, 0, 1.0)
    np.testing.assert_array_equal(probs, [0, 1, 0, 0, 0])
    # Ties go to the first maximum, as argmax does.
    tied = self.variant(process_logits)(jnp.array([1.0, 3.0, 3.0]), 0.0, 0, 1.0)
    np.testing.assert_array_equal(tied, [0, 1, 0])

  @chex.variants(with_jit=True, without_jit=True)
  def test_argmax_is_jnp_argmax(self):
    # The CPU's max-then-min form: ties to the first maximum, a NaN wins (its first),
    # all -inf gives 0, any leading shape.
    rows = jnp.array([[1.0, 3.0, 3.0, 2.0], [jnp.nan, 1.0, jnp.nan, 5.0],
                      [-jnp.inf] * 4, [2.0, jnp.inf, 0.0, jnp.inf]])
    np.testing.assert_array_equal(self.variant(argmax)(rows), jnp.argmax(rows, -1))
    many = jnp.round(jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2048)) * 4)  # ties
    np.testing.assert_array_equal(self.variant(argmax)(many), jnp.argmax(many, -1))

  def test_sample_is_jax_categorical(self):
    # The same construction (Gumbel-max, one noise value per token) with the fast argmax:
    # the same draws, bit for bit, as jax.random.categorical on log p.
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (4, 3, 2048)) * 3)
    probs = probs.at[0, 0].set(jax.nn.one_hot(7, 2048))  # a point mass: log 0 = -inf
    for seed in range(5):
      key = jax.random.PRNGKey(seed)
      want = jax.random.categorical(key, jnp.log(probs), axis=-1)
      np.testing.assert_array_equal(jax.jit(sample)(key, probs), want)

  @chex.variants(with_jit=True, without_jit=True)
  def test_top_k_support(self):
    probs = self.variant(process_logits)(LOGITS, 1.0, 2, 1.0)
    np.testing.assert_allclose(probs, np.array([0, 0.4, 0, 0.3, 0]) / 0.7, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_top_p_support(self):
    fn = self.variant(process_logits)
    # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. p = 0.7 is reached by {0.4, 0.3}; 0.71 needs 0.15.
    np.testing.assert_allclose(fn(LOGITS, 1.0, 0, 0.7), np.array([0, 0.4, 0, 0.3, 0]) / 0.7,
                               atol=1e-6)
    np.testing.assert_allclose(fn(LOGITS, 1.0, 0, 0.71),
                               np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85, atol=1e-6)
    # The top token always survives.
    np.testing.assert_allclose(fn(LOGITS, 1.0, 0, 0.01), [0, 1, 0, 0, 0], atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_top_k_then_top_p(self):
    # top-k 3 leaves {0.4, 0.3, 0.15} / 0.85 = {.471, .353, .176}: top-p 0.8 of that is
    # reached by the first two, 0.83 needs all three.
    fn = self.variant(process_logits)
    np.testing.assert_allclose(fn(LOGITS, 1.0, 3, 0.8), np.array([0, 0.4, 0, 0.3, 0]) / 0.7,
                               atol=1e-6)
    np.testing.assert_allclose(fn(LOGITS, 1.0, 3, 0.83),
                               np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_per_row_parameters_and_normalisation(self):
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 50)) * 3
    temperature = jnp.array([0.0, 0.7, 1.0, 2.0])
    top_k = jnp.array([0, 5, 0, 10])
    top_p = jnp.array([1.0, 1.0, 0.9, 0.5])
    probs = self.variant(process_logits)(logits, temperature, top_k, top_p)
    chex.assert_shape(probs, (4, 3, 50))
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    support = np.asarray(probs > 0).sum(-1)
    np.testing.assert_array_equal(support[0], [1, 1, 1])
    self.assertTrue(np.all(support[1] == 5))
    self.assertTrue(np.all(support[3] <= 10))
    # Each row equals the same row processed alone.
    for b in range(4):
      alone = process_logits(logits[b], temperature[b], top_k[b], top_p[b])
      np.testing.assert_allclose(probs[b], alone, atol=1e-6)

  def test_sample_never_draws_zero_probability(self):
    probs = jnp.array([0.0, 0.5, 0.0, 0.5])
    draws = sample(jax.random.PRNGKey(0), jnp.broadcast_to(probs, (10000, 4)))
    self.assertEqual(set(np.unique(draws).tolist()), {1, 3})


def test_create_shares_device_arrays_only_for_equal_settings():
  a = Sampling.create(2, temperature=[0.5, 1.0], top_k=3, max_new=8)
  assert Sampling.create(2, temperature=[0.5, 1.0], top_k=3, max_new=8) is a
  for kwargs, field, want in ((dict(temperature=[0.7, 1.0], top_k=3, max_new=8), "temperature",
                               [0.7, 1.0]),
                              (dict(temperature=[0.5, 1.0], top_k=4, max_new=8), "top_k", [4, 4]),
                              (dict(temperature=[0.5, 1.0], top_k=3, max_new=9), "max_new", [9, 9])):
    b = Sampling.create(2, **kwargs)
    np.testing.assert_allclose(getattr(b, field), want)
    assert isinstance(b.temperature, jax.Array)
  # A batch of 3 with the same values is another shape, not the cached batch of 2.
  assert Sampling.create(3, temperature=0.5).temperature.shape == (3,)
  assert Sampling.create(2, temperature=0.5).temperature.shape == (2,)
  # repeat=n (n samples a prompt): each row n times, adjacent, and cached the same way.
  r = Sampling.create(2, temperature=[0.5, 1.0], top_k=3, max_new=8, repeat=3)
  np.testing.assert_allclose(r.temperature, [0.5] * 3 + [1.0] * 3)
  assert r.top_k.shape == r.max_new.shape == (6,) and isinstance(r.top_k, jax.Array)
  assert Sampling.create(2, temperature=[0.5, 1.0], top_k=3, max_new=8, repeat=3) is r


class DeepCutTest(chex.TestCase):
  """Cuts beyond the 64 largest logits take the bisection path; both paths must agree
  with a plain sort-based reference."""

  @staticmethod
  def reference(logits, temperature, top_k, top_p):
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones_like(scaled, bool)
    if top_k > 0:
      keep &= scaled >= scaled[order[top_k - 1]]
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
      sorted_probs = probs[order]
      before = np.cumsum(sorted_probs) - sorted_probs
      n_keep = max(int(np.sum(before < top_p)), 1)
      keep &= scaled >= scaled[order[n_keep - 1]]
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    return probs / probs.sum()

  @chex.variants(with_jit=True, without_jit=True)
  def test_against_sort_reference(self):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 500)) * 0.5, jnp.float32)  # flat: deep cuts
    cases = [(1.0, 0, 0.9), (1.0, 200, 1.0), (0.8, 300, 0.95), (1.0, 10, 0.9), (1.3, 0, 0.3),
             (1.0, 499, 0.999)]
    temperature, top_k, top_p = (jnp.array(x) for x in zip(*cases))
    probs = self.variant(process_logits)(logits, temperature, top_k, top_p)
    for row, (t, k, p) in enumerate(cases):
      want = self.reference(logits[row], t, k, p)
      np.testing.assert_array_equal(np.asarray(probs[row]) > 0, want > 0)
      np.testing.assert_allclose(probs[row], want, atol=1e-5)
