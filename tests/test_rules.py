"""Research verify rules (specjax.verify.rules): what each accepts, and that its drift shows.

The drift oracle: the target's exact law of the first 3 generated tokens by teacher
forcing (conftest.exact_continuations), the empirical law of one batched generate call
per rule, and the total-variation distance between them set against the noise floor
(the TV of an equally large sample of the exact law itself, simulated). The exact rule
must sit on the floor and every lossy rule far above it, on a pair whose draft disagrees
with the target.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from experiments import drift
from specjax.verify import rules
from conftest import PROMPTS, exact_continuations, greedy_oracle, target_and_draft


def _row_call(rule, ys, q, p, draws, seed=0):
  """The rule on `draws` copies of one row: (n_accepted[draws], next_token[draws])."""
  keys = jax.random.split(jax.random.PRNGKey(seed), draws)
  tile = lambda x: jnp.broadcast_to(jnp.asarray(x), (draws,) + np.shape(x))
  n, nxt, _ = jax.jit(rule)(keys, tile(jnp.asarray(ys, jnp.int32)),
                            tile(jnp.asarray(q, jnp.float32)), tile(jnp.asarray(p, jnp.float32)))
  return np.asarray(n), np.asarray(nxt)


def within_binomial(counts, probs, draws, z=5.0):
  probs = np.asarray(probs, np.float64)
  return np.all(np.abs(np.asarray(counts) - draws * probs)
                <= z * np.sqrt(draws * probs * (1 - probs)) + 1)


class RuleTest(chex.TestCase):

  def test_typical_accepts_and_redraws_from_p(self):
    p = np.array([[0.6, 0.3, 0.1, 0.0],  # H = 0.90: bound min(0.09, 0.3·e^-H = 0.12) = 0.09
                  [0.95, 0.04, 0.01, 0.0],  # H = 0.22: bound 0.09; 0.04 fails
                  [0.25, 0.25, 0.25, 0.25]])
    ys = [1, 1]
    q = jax.nn.one_hot(jnp.array(ys), 4)  # a token-only draft
    draws = 20000
    n, nxt = _row_call(rules.TypicalRule(), ys, q, p, draws)
    np.testing.assert_array_equal(n, 1)
    # The first failure is redrawn from p_2 itself: token 1 comes back with p_2(1) = 0.04,
    # where the exact rule's residual (p without the drafted token) would never give it.
    counts = np.bincount(nxt, minlength=4)
    self.assertTrue(within_binomial(counts, p[1], draws), counts / draws)
    self.assertGreater(counts[1], 0)

  def test_typical_entropy_term_and_bonus(self):
    vocab = 16
    unsure = np.full(vocab, 0.95 / 15)
    unsure[[3, 9]] = [0.05, 0.95 / 15 - 0.05 / 15]  # p(3) = 0.05 < ε; H ≈ 2.77, e^-H ≈ 0.063
    unsure = unsure / unsure.sum()
    p = np.stack([unsure, unsure, np.eye(vocab)[5]])
    ys = [3, 3]
    q = jax.nn.one_hot(jnp.array(ys), vocab)
    # Bound min(0.09, 0.3·0.063): a token below ε passes where the target is unsure.
    n, nxt = _row_call(rules.TypicalRule(), ys, q, p, 64)
    np.testing.assert_array_equal(n, 2)
    np.testing.assert_array_equal(nxt, 5)  # all passed: the bonus comes from p_{γ+1}
    n, _ = _row_call(rules.TypicalRule(epsilon=0.04, delta=1.0), ys, q, p, 4)
    np.testing.assert_array_equal(n, 2)  # bound min(0.04, 0.063) = 0.04 < 0.05
    n, _ = _row_call(rules.TypicalRule(epsilon=0.09, delta=1.0), ys, q, p, 4)
    np.testing.assert_array_equal(n, 0)  # bound min(0.09, 0.063) = 0.063 > 0.05

  @parameterized.parameters(
      # p(y), q(y), ratio, floor, accepted
      (0.3, 0.5, 0.5, 1.0, True),  # p/q = 0.6 >= 0.5
      (0.3, 0.5, 1.0, 1.0, False),  # p/q = 0.6 < 1, p < floor
      (0.3, 0.5, 1.0, 0.3, True),  # p >= floor
      (0.2, 0.0, 4.0, 1.0, True),  # q(y) = 0 < p(y): p/q is infinite
      (0.0, 0.5, 0.1, 0.0, False))  # p(y) = 0 is never accepted, whatever the floor
  def test_threshold_decisions(self, py, qy, ratio, floor, accepted):
    p = np.array([[py, 1 - py], [0.5, 0.5]])
    q = np.array([[qy, 1 - qy]])
    n, _ = _row_call(rules.ThresholdRule(ratio=ratio, floor=floor), [0], q, p, 4)
    np.testing.assert_array_equal(n, int(accepted))

  @parameterized.parameters(rules.TypicalRule(), rules.ThresholdRule(ratio=2.0, floor=0.0))
  def test_greedy_one_hot_is_exact(self, rule):
    p = jax.nn.one_hot(jnp.array([2, 1, 3, 0]), 4)  # a greedy target's argmaxes
    ys = [2, 1, 0]
    n, nxt = _row_call(rule, ys, jax.nn.one_hot(jnp.array(ys), 4), p, 4)
    np.testing.assert_array_equal(n, 2)
    np.testing.assert_array_equal(nxt, 3)  # the correction is the target's argmax

  def test_synthetic_ignores_tokens(self):
    rates = (0.9, 0.5, 0.5, 0.1)
    p = np.tile([0.0, 1.0], (5, 1))  # the drafted token 0 is impossible under the target
    ys = [0, 0, 0, 0]
    draws = 20000
    n, nxt = _row_call(rules.SyntheticRule(rates=rates), ys, jax.nn.one_hot(jnp.array(ys), 2),
                       p, draws)
    reached = [(n > i).sum() for i in range(4)]  # unconditional: P(n_accepted > i) = rates[i]
    self.assertTrue(within_binomial(reached, rates, draws), np.array(reached) / draws)
    np.testing.assert_array_equal(nxt, 1)  # the correction / bonus is drawn from p

  def test_only_exact_is_lossless(self):
    self.assertTrue(rules.make_rule("exact", None, 3).lossless)
    for name, params in (("typical", None), ("threshold", None),
                         ("synthetic", {"rates": (1.0, 0.5, 0.0)})):
      self.assertFalse(rules.make_rule(name, params, 3).lossless)


class DriftTest(parameterized.TestCase):
  """One generate call per rule: 4000 rows at T = 1 for the law, plus greedy rows."""
  ROWS = 4000
  PROMPT = [3, 1, 3]
  LENGTH = 3
  GAMMA = 3

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.target, cls.draft = target_and_draft()
    _, cls.probs = exact_continuations(cls.target, cls.PROMPT, cls.LENGTH)
    rng = np.random.default_rng(0)
    # The noise floor: TV of an empirical law of ROWS draws from the exact law itself.
    floors = [0.5 * np.abs(rng.multinomial(cls.ROWS, cls.probs / cls.probs.sum()) / cls.ROWS
                           - cls.probs).sum() for _ in range(400)]
    cls.floor_mean, cls.floor_sd = np.mean(floors), np.std(floors)

  @parameterized.named_parameters(
      ("exact", "exact", None),
      ("typical", "typical", None),
      ("threshold", "threshold", None),
      ("synthetic", "synthetic", {"rates": (0.9, 0.6, 0.3)}))
  def test_drift_against_noise_floor(self, rule, params):
    rows, n_law = [self.PROMPT] * self.ROWS + PROMPTS, self.ROWS
    temperature = [1.0] * n_law + [0.0] * len(PROMPTS)  # per-row: the greedy rows ride along
    res = specjax.generate(self.target, rows, max_new_tokens=self.LENGTH, draft=self.draft,
                           gamma=self.GAMMA, temperature=temperature, seed=7,
                           verify_rule=rule, rule_params=params)
    self.assertIs(res.stats["lossless"], rule == "exact")
    outs = np.array(res.tokens[:n_law])
    freq = np.bincount(np.ravel_multi_index(outs.T, (8,) * self.LENGTH),
                       minlength=8 ** self.LENGTH) / n_law
    tv = 0.5 * np.abs(freq - self.probs).sum()
    z = (tv - self.floor_mean) / self.floor_sd
    msg = f"TV {tv:.4f}, floor {self.floor_mean:.4f} ± {self.floor_sd:.4f} (z = {z:.1f})"
    if rule == "exact":
      self.assertLess(z, 5.0, msg)
    else:  # floor ≈ 0.08, sd ≈ 0.005; the lossy rules measure 0.2–0.4 on this pair
      self.assertGreater(z, 15.0, msg)
    if rule != "synthetic":  # at T = 0 typical and threshold accept only the argmax
      for prompt, out in zip(PROMPTS, res.tokens[n_law:]):
        self.assertEqual(out, greedy_oracle(self.target, prompt, self.LENGTH))
    if rule == "synthetic":
      s = res.stats
      self.assertTrue(within_binomial(s["accepted_at"], params["rates"], s["rounds"]),
                      np.array(s["accepted_at"]) / s["rounds"])

  def test_audit_estimators_agree(self):
    """The audit's teacher forcing equals the oracle; its two TV estimators agree."""
    conts, probs = drift.exact_law(self.target, self.PROMPT, self.LENGTH, 1.0)
    np.testing.assert_allclose(probs, self.probs, rtol=2e-4, atol=1e-7)
    rng = np.random.default_rng(1)
    samples = conts[rng.choice(len(conts), size=3000, p=probs / probs.sum())]
    by_index = {tuple(c): p for c, p in zip(conts, probs)}
    self.assertAlmostEqual(drift.tv_enumerated(samples, probs, 8),
                           drift.tv_observed(samples, lambda u: np.array(
                               [by_index[tuple(c)] for c in u])), places=5)


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("unknown_rule", dict(verify_rule="lenient"), "verify_rule must be one of"),
      ("params_not_dict", dict(verify_rule="typical", rule_params=[0.1]), "must be a dict"),
      ("unknown_param", dict(verify_rule="typical", rule_params={"eps": 0.1}), "unknown"),
      ("epsilon_zero", dict(verify_rule="typical", rule_params={"epsilon": 0.0}), "epsilon"),
      ("epsilon_big", dict(verify_rule="typical", rule_params={"epsilon": 1.5}), "epsilon"),
      ("delta_negative", dict(verify_rule="typical", rule_params={"delta": -0.1}), "delta"),
      ("delta_nan", dict(verify_rule="typical", rule_params={"delta": float("nan")}), "delta"),
      ("ratio_zero", dict(verify_rule="threshold", rule_params={"ratio": 0}), "ratio"),
      ("floor_big", dict(verify_rule="threshold", rule_params={"floor": 1.01}), "floor"),
      ("floor_bool", dict(verify_rule="threshold", rule_params={"floor": True}), "floor"),
      ("no_rates", dict(verify_rule="synthetic"), "rates"),
      ("rates_range", dict(verify_rule="synthetic", rule_params={"rates": (1.2, 0.5)}),
       r"\[0, 1\]"),
      ("rates_increase", dict(verify_rule="synthetic", rule_params={"rates": (0.5, 0.8)}),
       "increase"),
      ("rates_length", dict(verify_rule="synthetic", rule_params={"rates": (0.9, 0.8, 0.7)}),
       "one value per draft position"),
      ("no_draft", dict(verify_rule="typical", draft=None), "needs speculative decoding"))
  def test_raises(self, kwargs, message):
    target, draft = target_and_draft()
    kwargs = dict(dict(draft=draft, gamma=2), **kwargs)
    with self.assertRaisesRegex(ValueError, message):
      specjax.generate(target, [[1, 2]], max_new_tokens=4, **kwargs)

  def test_rule_objects_check_themselves(self):
    with self.assertRaisesRegex(ValueError, "epsilon"):
      rules.TypicalRule(epsilon=2.0)
    with self.assertRaisesRegex(ValueError, "increase"):
      rules.SyntheticRule(rates=(0.1, 0.2))


class SyntheticBenchTest(parameterized.TestCase):

  def test_configs_build(self):
    from configs import bench as bench_config
    for variant in ("", "gpu"):
      cfg = bench_config.get_config(variant)
      target = specjax.ModelConfig.llama(**cfg.target)
      draft = specjax.ModelConfig.llama(**cfg.draft)
      self.assertEqual(target.vocab_size, draft.vocab_size)
      self.assertTrue(all(0 < a <= 1 for a in cfg.alpha))
    with self.assertRaisesRegex(ValueError, "unknown configs/bench.py variant"):
      bench_config.get_config("tpu")

  def test_smoke_run(self):
    from configs import bench as bench_config
    from experiments import synthetic
    import tempfile
    from pathlib import Path
    cfg = bench_config.get_config()
    cfg.target = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_len=128)
    cfg.draft = dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_len=128)
    cfg.alpha, cfg.gamma, cfg.pairs, cfg.predict = (0.9,), (2,), 1, False
    cfg.num_prompts, cfg.prompt_tokens, cfg.max_new_tokens = 2, 8, 16
    with tempfile.TemporaryDirectory() as workdir:
      rows = synthetic.run(cfg, Path(workdir))
      self.assertIn("| batch |", (Path(workdir) / "summary.md").read_text())
    self.assertLen(rows, 1)
    self.assertFalse(rows[0]["lossless"])
    self.assertBetween(rows[0]["tokens_per_target_call"], 1.0, 3.0)
    self.assertGreater(rows[0]["speedup"], 0)
