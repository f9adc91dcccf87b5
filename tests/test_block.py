"""Block verification (`verify_rule="block"`) is lossless, never accepts less than the
token-level rule, and is the greedy comparison at temperature 0.

Oracles: the law of the committed window summed in float64 over every draft chain (weight
Π q) and over the rule's uniforms (P(τ = t) = h_t Π_{j>t} (1 − h_j), from the
implementation's own h and residual), completed with target draws to γ + 1 tokens and
compared with the target's law; the engine's 3-token law test; target greedy at T = 0;
and the planted wrong variants (the residual without the w_τ weight, τ = the first
failure) failing the same checks.
"""

import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax import decode as decode_lib
from specjax.verify import block
from specjax.verify.exact import acceptance_prob
from conftest import (LAW_ROWS, PROMPTS, exact_continuations, greedy_oracle, target_and_draft,
                      tiny_model, within_law)


def _dists(rng, vocab, kind):
  """A conditional law {prefix tuple: [V]} over every prefix of up to 4 tokens."""
  out = {}
  for n in range(5):
    for prefix in itertools.product(range(vocab), repeat=n):
      if kind == "one_hot":
        d = np.eye(vocab)[rng.integers(vocab)]
      else:
        d = rng.dirichlet(np.full(vocab, 0.5))
        if kind == "zeros":  # some tokens impossible (on either side, independently)
          d[rng.random(vocab) < 0.35] = 0
          if d.sum() == 0:
            d[rng.integers(vocab)] = 1
          d = d / d.sum()
      out[prefix] = d
  return out


def _target_law(P, vocab, length, prefix=()):
  """{string of `length` tokens after prefix: its probability under P}."""
  law = {}
  for s in itertools.product(range(vocab), repeat=length):
    prob = 1.0
    for i, x in enumerate(s):
      prob *= P[prefix + s[:i]][x]
    law[s] = prob
  return law


def block_law(P, Q, vocab, gamma, length=None, wrong=None):
  """(law of the committed γ+1 window {string: prob}, E[τ]) of the block rule, float64
  over the implementation's w, h and residual; `wrong` plants a variant."""
  L = gamma if length is None else length
  law = dict.fromkeys(itertools.product(range(vocab), repeat=gamma + 1), 0.0)
  expected = 0.0
  for ys in itertools.product(range(vocab), repeat=gamma):
    # Past a row's length the tokens are junk the rule must ignore: each tail equally.
    weight = np.prod([Q[ys[:i]][ys[i]] for i in range(L)]) / vocab ** (gamma - L)
    if weight == 0:
      continue
    p = np.stack([P[ys[:i]] for i in range(gamma + 1)])
    q = np.array([Q[ys[:i]] for i in range(gamma)]).reshape(gamma, vocab)
    w, h, q_pad = block.weights(jnp.asarray(ys, jnp.int32), jnp.asarray(q, jnp.float32),
                                jnp.asarray(p, jnp.float32),
                                None if length is None else jnp.int32(length))
    w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
    h_all = np.concatenate([[1.0], h])  # t = 0 needs only the later ones to fail
    for t in range(gamma + 1):
      if wrong == "first_failure":  # positions 1..t pass, t+1 fails
        p_t = np.prod(h[:t]) * (1.0 - h[t] if t < gamma else 1.0)
      else:
        p_t = h_all[t] * np.prod(1.0 - h[t:])
      if p_t == 0:
        continue
      expected += weight * p_t * t
      if wrong == "unweighted":
        res = block.weighted_residual(1.0, jnp.asarray(p[t], jnp.float32), q_pad[t])
      else:
        res = block.weighted_residual(w[t], jnp.asarray(p[t], jnp.float32), q_pad[t])
      res = np.asarray(res, np.float64)
      for x in range(vocab):
        head = ys[:t] + (x,)
        for tail, prob in _target_law(P, vocab, gamma - t, head).items():
          law[head + tail] += weight * p_t * res[x] * prob
  return law, expected


def token_rule_expected(P, Q, vocab, gamma):
  """E[accepted] of the token-level rule: Σ_k P(the first k drafts all pass)."""
  total = 0.0
  for ys in itertools.product(range(vocab), repeat=gamma):
    weight = np.prod([Q[ys[:i]][ys[i]] for i in range(gamma)])
    if weight == 0:
      continue
    a = [float(acceptance_prob(jnp.asarray(P[ys[:i]], jnp.float32),
                               jnp.asarray(Q[ys[:i]], jnp.float32), jnp.int32(ys[i])))
         for i in range(gamma)]
    total += weight * np.sum(np.cumprod(a))
  return total


def _gap(law, P, vocab, gamma):
  target = _target_law(P, vocab, gamma + 1)
  return max(abs(law[s] - target[s]) for s in target)


CASES = [  # (vocab, γ, the target's kind, the draft's kind, seed)
    (3, 1, "dense", "dense", 0), (3, 2, "dense", "dense", 1), (3, 3, "dense", "dense", 2),
    (4, 2, "dense", "dense", 3), (3, 3, "dense", "one_hot", 4), (4, 2, "dense", "one_hot", 5),
    (3, 3, "zeros", "zeros", 6), (4, 2, "zeros", "dense", 7), (3, 2, "dense", "zeros", 8),
    (3, 3, "one_hot", "dense", 9)]



class VerifyTest(parameterized.TestCase):
  """`block.verify` composes its parts as the law test's oracle does (which uses
  `weights` and `weighted_residual`, not `verify`)."""

  def test_outcome_frequencies_are_the_oracles(self):
    """(τ, next token) over 50,000 keys against P(τ = t) = h_t Π_{j>t} (1 − h_j) and the
    residual weighted by w_τ, within 5 sd + 1 count, on drafts where w_1 = 0.5 (so an
    unweighted residual gives [.714, .286, 0] at τ = 1 where [.8, .2, 0] is right)."""
    p = jnp.array([[.25, .25, .5], [.6, .3, .1], [1 / 3, 1 / 3, 1 / 3]])
    q = jnp.array([[.5, .25, .25], [.1, .1, .8]])
    ys = jnp.array([0, 2])
    w, h, q_pad = (np.asarray(a, np.float64) for a in block.weights(ys, q, p))
    want = {}
    for t in range(3):
      stop = (h[t - 1] if t else 1.0) * np.prod(1 - h[t:])
      nxt = np.maximum(w[t] * np.asarray(p[t], np.float64) - q_pad[t], 0.0)
      nxt = nxt / nxt.sum() if nxt.sum() > 0 else np.asarray(p[t], np.float64)
      for y in range(3):
        want[t, y] = stop * nxt[y]
    n = 50000
    tau, nxt, _ = jax.jit(jax.vmap(lambda k: block.verify(k, ys, q, p)))(
        jax.random.split(jax.random.PRNGKey(1), n))
    counts = {}
    for t, y in zip(np.asarray(tau).tolist(), np.asarray(nxt).tolist()):
      counts[t, y] = counts.get((t, y), 0) + 1
    self.assertGreater(want[1, 0], 0.05)  # the weighted case is well represented
    for key, prob in want.items():
      got = counts.get(key, 0)
      self.assertLessEqual(abs(got - n * prob), 5 * np.sqrt(n * prob * (1 - prob)) + 1,
                           (key, got, n * prob))

  def test_a_zero_uniform_never_passes_a_zero_weight(self):
    """η is drawn from [0, 1): where h = 0 (p(y) = 0, or a position past the row's
    length) even η = 0 must not pass."""
    p = jnp.array([[0.0, .5, .5], [.2, .3, .5]])
    q = jnp.array([[1.0, 0.0, 0.0]])
    zeros = lambda key, shape=(), *a, **k: jnp.zeros(shape)
    with mock.patch.object(jax.random, "uniform", zeros):
      self.assertEqual(int(block.verify(jax.random.PRNGKey(0), jnp.array([0]), q, p)[0]), 0)
      self.assertEqual(int(block.verify(jax.random.PRNGKey(0), jnp.array([1]), q,
                                        jnp.array([[.2, .3, .5]] * 2), length=0)[0]), 0)

class ExactLawTest(parameterized.TestCase):

  @parameterized.parameters(*CASES)
  def test_window_law_is_the_target(self, vocab, gamma, p_kind, q_kind, seed):
    rng = np.random.default_rng(seed)
    P, Q = _dists(rng, vocab, p_kind), _dists(rng, vocab, q_kind)
    law, _ = block_law(P, Q, vocab, gamma)
    self.assertLess(_gap(law, P, vocab, gamma), 2e-6)

  def test_identical_draft_accepts_everything(self):
    rng = np.random.default_rng(0)
    P = _dists(rng, 3, "dense")
    law, expected = block_law(P, P, 3, 3)  # every r_i = 0 and w_i = 1: h_i is 0/0
    self.assertLess(_gap(law, P, 3, 3), 2e-6)
    self.assertAlmostEqual(expected, 3.0, places=5)

  @parameterized.parameters((2, 0), (3, 1), (3, 2))
  def test_a_shorter_row_length(self, gamma, length):
    """A row that drafted `length` < γ tokens: the positions after it are not drafted."""
    rng = np.random.default_rng(10 + gamma + length)
    P, Q = _dists(rng, 3, "dense"), _dists(rng, 3, "dense")
    law, expected = block_law(P, Q, 3, gamma, length=length)
    self.assertLess(_gap(law, P, 3, gamma), 2e-6)
    short, short_expected = block_law(P, Q, 3, length)  # a chain of `length` tokens
    self.assertAlmostEqual(expected, short_expected, places=6)

  @parameterized.parameters(*CASES)
  def test_accepts_at_least_the_token_rule(self, vocab, gamma, p_kind, q_kind, seed):
    rng = np.random.default_rng(seed)
    P, Q = _dists(rng, vocab, p_kind), _dists(rng, vocab, q_kind)
    _, expected = block_law(P, Q, vocab, gamma)
    token = token_rule_expected(P, Q, vocab, gamma)
    self.assertGreaterEqual(expected, token - 1e-6)
    if gamma >= 2 and p_kind == q_kind == "dense":  # strictly more: the check has teeth
      self.assertGreater(expected, token + 1e-3)

  @parameterized.parameters(("unweighted", 2), ("first_failure", 6))
  def test_planted_wrong_variants_fail(self, wrong, cases_failed):
    """Each variant fails the law check above (the same 2e-6) on this many of CASES, by
    far more than rounding. The unweighted residual differs only where a stop at
    0 < τ < γ has w_τ < 1 (dense drafts at γ ≥ 2)."""
    gaps = []
    for vocab, gamma, p_kind, q_kind, seed in CASES:
      rng = np.random.default_rng(seed)
      P, Q = _dists(rng, vocab, p_kind), _dists(rng, vocab, q_kind)
      law, _ = block_law(P, Q, vocab, gamma, wrong=wrong)
      gaps.append(_gap(law, P, vocab, gamma))
    self.assertEqual(sum(g > 2e-6 for g in gaps), cases_failed, gaps)
    self.assertGreater(max(gaps), 5e-3)


def filtered_law(model, prompt, length, temperature, top_k, top_p):
  """P(x_1..x_L | prompt) under the target after `process_logits` (its tested filters),
  by teacher forcing, in float64 from its float32 distributions."""
  from specjax.processors.sampling import process_logits
  conts, _ = exact_continuations(model, prompt, length)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  p = np.asarray(process_logits(model.logits(jnp.asarray(seqs)), temperature, top_k, top_p),
                 np.float64)
  start = len(prompt) - 1
  steps = [p[np.arange(len(conts)), start + i, conts[:, i]] for i in range(length)]
  return np.prod(steps, axis=0)


def _head(target, kind="eagle"):
  from test_heads import random_head
  return random_head(target, kind)


ENGINE = {  # name: (generate's arguments, T, top-k, top-p)
    "model_probabilistic_g3": (dict(gamma=3), 1.0, 0, 1.0),
    "model_greedy_draft_g2_hot": (dict(gamma=2, draft_sample="greedy"), 1.5, 0, 1.0),
    "ngram_g3": (dict(gamma=3, drafter="ngram"), 1.0, 0, 1.0),
    "model_top_k_top_p_g3": (dict(gamma=3), 0.8, 5, 0.9),
    "eagle_g3": (dict(gamma=3, draft="eagle"), 1.0, 0, 1.0),
    "medusa_g2": (dict(gamma=2, draft="medusa"), 1.0, 0, 1.0),
    "heuristic_g3": (dict(gamma=3, gamma_policy="heuristic"), 1.0, 0, 1.0),
}


class EngineLawTest(parameterized.TestCase):
  """The empirical law of LAW_ROWS 3-token continuations under verify_rule='block'."""

  @parameterized.named_parameters(*[(name, name) for name in ENGINE])
  def test_three_token_law(self, name):
    spec, temperature, top_k, top_p = ENGINE[name]
    target, draft = target_and_draft()
    spec = dict(spec)
    if spec.get("draft") in ("eagle", "medusa"):
      spec["draft"] = _head(target, spec["draft"])
    elif spec.get("drafter") != "ngram":
      spec["draft"] = draft
    prompt, length = [3, 1, 3], 3
    probs = filtered_law(target, prompt, length, temperature, top_k, top_p)
    res = specjax.generate(target, [prompt] * LAW_ROWS, max_new_tokens=length,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=11,
                           verify_rule="block", **spec)
    ok, worst = within_law(res.tokens, probs)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertTrue(res.stats["lossless"])
    self.assertLess(res.stats["acceptance_rate"], 0.95)  # the draft really disagreed
    self.assertGreater(res.stats["rounds"], LAW_ROWS)  # and rounds were rolled back
    if spec.get("gamma_policy"):
      self.assertLess(res.stats["drafted"], 3 * res.stats["rounds"])  # short rows ran

  def test_penalties(self):
    from test_processors import EOS, PENALTIES, PROMPT, TEMPERATURE, exact_law, law_check
    target, draft = target_and_draft()
    law = exact_law(target, PROMPT, 3, TEMPERATURE, PENALTIES)
    res = specjax.generate(target, [PROMPT] * LAW_ROWS, max_new_tokens=3,
                           temperature=TEMPERATURE, seed=5, gamma=3, eos_id=EOS, draft=draft,
                           verify_rule="block", **PENALTIES)
    ok, worst = law_check(law, res.tokens, 3)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertGreater(res.stats["rounds"], LAW_ROWS)


  def test_constraint(self):
    from test_processors import EOS, PROMPT, exact_law, law_check
    from specjax.processors import constraints
    # test_processors' automaton: tokens 0-3 then anything; 4 only after a 0; 6, 7 never.
    nxt = np.full((3, 8), constraints.DEAD)
    nxt[0, [0, 1, 2, 3]] = [1, 2, 2, 2]
    nxt[1, [4, 1]] = [2, 2]
    nxt[2, [0, 1, 2, 3]] = 2
    automaton = constraints.TokenAutomaton(next=nxt, accept=np.array([False, False, True]))
    target, draft = target_and_draft()
    law = exact_law(target, PROMPT, 3, 1.0, {}, automaton)
    res = specjax.generate(target, [PROMPT] * LAW_ROWS, max_new_tokens=3, temperature=1.0,
                           seed=3, gamma=2, draft=draft, constraint=automaton, eos_id=EOS,
                           verify_rule="block")
    ok, worst = law_check(law, res.tokens, 3)
    self.assertTrue(ok, f"worst z={worst}")


class GreedyTest(parameterized.TestCase):

  @parameterized.parameters(("model", 3), ("model_greedy", 3), ("ngram", 3), ("eagle", 2),
                            ("heuristic", 3))
  def test_equals_target_greedy(self, drafter, gamma):
    target = tiny_model(vocab=16, n_layers=2, seed=3)
    draft = tiny_model(vocab=16, d_model=16, n_layers=1, seed=4)
    kw = {"ngram": dict(drafter="ngram"), "model": dict(draft=draft),
          "model_greedy": dict(draft=draft, draft_sample="greedy"),
          "eagle": dict(draft=_head(target)),
          "heuristic": dict(draft=draft, gamma_policy="heuristic")}[drafter]
    res = specjax.generate(target, PROMPTS, max_new_tokens=12, gamma=gamma,
                           verify_rule="block", **kw)
    for prompt, out in zip(PROMPTS, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 12))
    # At T = 0 the rule is the greedy comparison: the token rule's very rounds.
    exact = specjax.generate(target, PROMPTS, max_new_tokens=12, gamma=gamma, **kw)
    for key in ("accepted", "drafted", "committed_hist", "rounds"):
      self.assertEqual(res.stats[key], exact.stats[key], key)

  def test_mixed_rows_match_the_exact_rule(self):
    """A batch with a greedy row runs the sampled path: that row's tokens are still the
    target's greedy ones."""
    target, draft = target_and_draft()
    res = specjax.generate(target, PROMPTS, max_new_tokens=10, gamma=3, draft=draft,
                           temperature=[0.0, 1.0, 0.0], verify_rule="block", seed=3)
    for b in (0, 2):
      self.assertEqual(res.tokens[b], greedy_oracle(target, PROMPTS[b], 10))


class RuleTest(parameterized.TestCase):

  def test_made_by_name_and_refused_on_trees(self):
    from specjax.verify import rules
    self.assertIsInstance(rules.make_rule("block", None, 3), block.BlockRule)
    self.assertTrue(block.BlockRule.lossless)
    with self.assertRaisesRegex(ValueError, "takes rule_params"):
      rules.make_rule("block", {"ratio": 1.0}, 3)
    target, draft = target_and_draft()
    with self.assertRaisesRegex(ValueError, "tree="):
      specjax.generate(target, [[1, 2]], max_new_tokens=2, draft=draft, tree=(2, 1),
                       verify_rule="block")


class PlantedEngineTest(parameterized.TestCase):
  """Last in the file: it clears the compiled engines the tests above share."""

  def test_first_failure_is_caught(self):
    """τ = the first failure (with the block weights) fails the engine law check that
    the rule passes (model_probabilistic_g3: worst z ≈ 40 at LAW_ROWS). The unweighted
    residual is subtler: only the float64 law test above catches it."""
    from specjax.processors.sampling import sample
    from specjax.verify.exact import accepted_prefix

    def first_failure(key, ys, q, p, length=None):
      key_accept, key_next = jax.random.split(key)
      w, h, q_pad = block.weights(ys, q, p, length)
      tau = accepted_prefix(jax.random.uniform(key_accept, h.shape) < h)
      nxt = sample(key_next, block.weighted_residual(w[tau], p[tau], q_pad[tau]))
      return tau, nxt, jnp.sum(jnp.minimum(p[:q.shape[0]], q), axis=-1)

    with mock.patch.object(block, "verify_batch", jax.vmap(first_failure)):
      decode_lib.decode.clear_cache()
      try:
        spec, temperature, _, _ = ENGINE["model_probabilistic_g3"]
        target, draft = target_and_draft()
        _, probs = exact_continuations(target, [3, 1, 3], 3)
        res = specjax.generate(target, [[3, 1, 3]] * LAW_ROWS, max_new_tokens=3,
                               temperature=temperature, seed=11, verify_rule="block",
                               draft=draft, **spec)
      finally:
        decode_lib.decode.clear_cache()
    ok, worst = within_law(res.tokens, probs)
    self.assertFalse(ok, f"the first-failure variant passed (worst z={worst})")
