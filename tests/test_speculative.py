"""Speculative decoding end to end: lossless at every temperature, exact when greedy."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax import backends
from specjax import decode as decode_lib
from specjax import drafters
from specjax.generation import prepare
from specjax.verify import exact as exact_rule
from conftest import (LAW_ROWS, PROMPTS, decode_traces, exact_continuations, greedy_oracle,
                      target_and_draft, tempered, tiny_model, within_law)


def three_token_law(spec, temperature):
  """(result, *`within_law`) of LAW_ROWS 3-token continuations of [3, 1, 3]."""
  target, draft = target_and_draft()
  prompt, length, rows = [3, 1, 3], 3, LAW_ROWS
  law_of = target if temperature == 1.0 else tempered(target, temperature)
  _, probs = exact_continuations(law_of, prompt, length)
  res = specjax.generate(target, [prompt] * rows, max_new_tokens=length,
                         temperature=temperature, seed=11,
                         draft=None if spec.get("drafter") == "ngram" else draft, **spec)
  return (res, *within_law(res.tokens, probs))


class DistributionTest(parameterized.TestCase):
  """The empirical law of 3-token continuations equals the target's exact law."""

  @parameterized.named_parameters(
      ("model_probabilistic_g3", dict(gamma=3, draft_sample="probabilistic"), 1.0),
      ("model_greedy_draft_g2_hot", dict(gamma=2, draft_sample="greedy"), 1.5),
      ("ngram_g3", dict(gamma=3, drafter="ngram"), 1.0))
  def test_three_token_law(self, spec, temperature):
    res, ok, worst = three_token_law(spec, temperature)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertLess(res.stats["acceptance_rate"], 0.95)  # the draft really disagreed
    self.assertGreater(res.stats["rounds"], LAW_ROWS)  # and rounds were rolled back


class GreedyTest(parameterized.TestCase):

  @parameterized.parameters(("model", 1), ("model", 3), ("model", 5), ("ngram", 1),
                            ("ngram", 3), ("ngram", 5), ("model_greedy", 3))
  def test_equals_target_greedy(self, drafter, gamma):
    target = tiny_model(vocab=16, n_layers=2, seed=3)
    draft = tiny_model(vocab=16, d_model=16, n_layers=1, seed=4)
    kw = dict(drafter="ngram") if drafter == "ngram" else dict(
        draft=draft, draft_sample="greedy" if drafter == "model_greedy" else "probabilistic")
    res = specjax.generate(target, PROMPTS, max_new_tokens=12, gamma=gamma, **kw)
    for prompt, out in zip(PROMPTS, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 12))
    s = res.stats
    self.assertLessEqual(s["accepted"], s["drafted"])
    if drafter == "ngram":  # a row without a match drafts nothing that round
      self.assertLessEqual(s["drafted"], gamma * s["rounds"])
      self.assertEqual(s["drafted"] % gamma, 0)
    else:
      self.assertEqual(s["drafted"], gamma * s["rounds"])
    self.assertEqual(sum(s["committed_hist"]), s["rounds"])

  def test_identical_draft_accepts_everything(self):
    target = tiny_model(vocab=16, n_layers=2, seed=3)
    gamma = 3
    res = specjax.generate(target, PROMPTS, max_new_tokens=16, draft=target, gamma=gamma,
                           temperature=1.0, seed=2)
    s = res.stats
    self.assertEqual(s["accepted"], s["drafted"])
    self.assertAlmostEqual(s["alpha_hat"], 1.0, places=5)
    # 16 = 4 + 4 + 4 + 4: every round commits γ+1 tokens.
    self.assertEqual(s["committed_hist"], [0, 0, 0, 0, 4 * len(PROMPTS)])
    self.assertEqual(s["target_calls"], 4)


def _one_round_setup(target, draft, prompts, gamma, temperature, seed=0, max_new=20):
  args = prepare(target, prompts, max_new_tokens=max_new, temperature=temperature, top_k=0,
                 top_p=1.0, eos_id=None, draft=draft, gamma=gamma)
  state = args.prefill(jax.random.PRNGKey(seed))
  step = jax.jit(lambda s: decode_lib.decode_round(args.engine, args.weights, s, args.sampling))
  return state, step, args


class RollbackTest(parameterized.TestCase):

  def test_lengths_follow_the_committed_history(self):
    target, draft = target_and_draft()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 0, 1, 2], [3]] * 4
    gamma = 3
    state, step, _ = _one_round_setup(target, draft, prompts, gamma, 1.0)
    n0 = np.array(state.n)
    np.testing.assert_array_equal(state.target_kv.length, n0 - 1)
    np.testing.assert_array_equal(state.draft_state.length, n0 - 1)
    saw_reject = saw_full = False
    for _ in range(4):
      before = np.array(state.n)
      state = step(state)
      n = np.array(state.n)
      committed = n - before
      np.testing.assert_array_equal(state.target_kv.length, n - 1)
      full = committed == gamma + 1
      # After a rejection the draft is rolled back to the committed history too; after a
      # fully accepted round it never saw y_γ and is one behind.
      np.testing.assert_array_equal(state.draft_state.length, np.where(full, n - 2, n - 1))
      saw_reject |= bool(np.any(~full))
      saw_full |= bool(np.any(full))
    self.assertTrue(saw_reject and saw_full)

  def test_poisoned_stale_slots_change_nothing(self):
    target, draft = target_and_draft()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 0, 1, 2]]
    state, step, args = _one_round_setup(target, draft, prompts, 3, 1.0, seed=5)
    state = step(step(state))

    def poison(kv):
      slot = jnp.arange(kv.size)[None, None, :, None]
      stale = slot >= kv.length[:, None, None, None]
      bad = lambda buf: jnp.where(stale, jnp.nan, buf)
      return kv.replace(k=tuple(map(bad, kv.k)), v=tuple(map(bad, kv.v)))

    poisoned = state.replace(target_kv=poison(state.target_kv),
                             draft_state=poison(state.draft_state))
    clean_out, dirty_out = state, poisoned
    for _ in range(5):
      clean_out, dirty_out = step(clean_out), step(dirty_out)
    np.testing.assert_array_equal(clean_out.n, dirty_out.n)
    np.testing.assert_array_equal(clean_out.tokens, dirty_out.tokens)


class StopTest(parameterized.TestCase):

  def test_eos_inside_an_accepted_run(self):
    target = tiny_model(vocab=16, n_layers=2, seed=3)
    plain = specjax.generate(target, PROMPTS, max_new_tokens=12).tokens
    eos = plain[0][5]
    # The draft is the target: rounds are fully accepted runs of 5, so EOS lands inside one.
    res = specjax.generate(target, PROMPTS, max_new_tokens=12, draft=target, gamma=4,
                           eos_id=eos)
    for want, got in zip(plain, res.tokens):
      cut = want.index(eos) + 1 if eos in want else len(want)
      self.assertEqual(got, want[:cut])
      if eos in got:
        self.assertEqual(got.index(eos), len(got) - 1)  # nothing after EOS

  @parameterized.named_parameters(("autoregressive", {}), ("speculative", dict(gamma=4)))
  def test_stop_sequence(self, spec):
    target = tiny_model(vocab=16, n_layers=2, seed=3)
    plain = specjax.generate(target, PROMPTS, max_new_tokens=12).tokens
    stop = plain[1][3:5]  # two tokens generated for prompt 1
    if spec:
      spec = dict(spec, draft=target)  # fully accepted runs: the stop lands inside one
    res = specjax.generate(target, PROMPTS, max_new_tokens=12, stop_sequences=[stop], **spec)
    for want, got in zip(plain, res.tokens):
      ends = [i + 2 for i in range(len(want) - 1) if want[i:i + 2] == stop]
      self.assertEqual(got, want[:ends[0]] if ends else want)
    self.assertEqual(res.tokens[1][-2:], stop)

  def test_stop_sequence_needs_generated_tokens(self):
    target = tiny_model(vocab=16, n_layers=2, seed=3)
    prompt = [1, 2, 3]
    first = specjax.generate(target, [prompt], max_new_tokens=6).tokens[0]
    stop = [3, first[0]]  # matches across the prompt boundary: that must not stop the row
    res = specjax.generate(target, [prompt], max_new_tokens=6, stop_sequences=[stop]).tokens[0]
    ends = [i + 2 for i in range(len(first) - 1) if first[i:i + 2] == stop]
    self.assertEqual(res, first[:ends[0]] if ends else first)
    self.assertGreater(len(res), 1)

  @parameterized.parameters(1, 2, 7, 13)
  def test_max_new_tokens_is_exact(self, max_new):
    target, draft = target_and_draft()
    res = specjax.generate(target, [[1], [2, 3, 4]], max_new_tokens=max_new, draft=draft,
                           gamma=5, temperature=1.0)
    self.assertEqual([len(t) for t in res.tokens], [max_new, max_new])
    self.assertEqual(res.stats["committed"], 2 * max_new)

  def test_stats_add_up(self):
    target, draft = target_and_draft()
    res = specjax.generate(target, [[1, 2], [3]] * 8, max_new_tokens=30, draft=draft, gamma=4,
                           temperature=1.0)
    s = res.stats
    # Untruncated rounds commit accepted + 1; truncation only ever removes tokens.
    self.assertLessEqual(s["committed"], s["accepted"] + s["rounds"])
    self.assertGreaterEqual(s["committed"], s["accepted"] + s["rounds"] - 16 * 4)
    self.assertLessEqual(s["accepted"], s["drafted"])
    self.assertEqual(s["accepted_at"][0], round(s["acceptance_by_position"][0] * s["rounds"]))
    self.assertTrue(all(a >= b for a, b in zip(s["accepted_at"], s["accepted_at"][1:])))
    self.assertTrue(0.0 < s["alpha_hat"] < 1.0)
    # A chain is a tree with one child per node: one sibling rank, tried at every
    # verified position, with the chain's own α̂.
    self.assertEqual(s["sibling_tried"], [sum(s["verified_at"])])
    self.assertEqual(s["sibling_accepted"], [s["accepted"]])
    self.assertAlmostEqual(s["alpha_by_sibling"][0], s["alpha_hat"], places=5)


class DeterminismTest(parameterized.TestCase):

  def test_same_seed_same_tokens(self):
    target, draft = target_and_draft()
    kw = dict(max_new_tokens=12, draft=draft, gamma=3, temperature=1.0)
    a = specjax.generate(target, [[1, 2]] * 8, seed=3, **kw).tokens
    b = specjax.generate(target, [[1, 2]] * 8, seed=3, **kw).tokens
    c = specjax.generate(target, [[1, 2]] * 8, seed=4, **kw).tokens
    self.assertEqual(a, b)
    self.assertNotEqual(a, c)
    self.assertGreater(len({tuple(x) for x in a}), 4)  # rows sample independently

  def test_temperature_sweep_compiles_once_per_path(self):
    target, draft = target_and_draft()  # T = 0 is a program of its own (`sampling.Paths`)
    with decode_traces(n=2) as traced:
      for temperature in (0.0, 0.3, 0.7, 1.0, 2.0):
        specjax.generate(target, [[1, 2, 3]] * 2, max_new_tokens=21, draft=draft, gamma=3,
                         temperature=temperature, top_p=0.9)
    self.assertEqual(len(traced), 2)


class NgramSizedTest(parameterized.TestCase):

  def test_rows_without_a_match_draft_nothing(self):
    # Distinct prompt tokens: the first round finds no earlier match, so the row drafts
    # nothing, and on a CPU the verify pass computes the pending token alone
    # (`decode._verify_pass`). The output is still greedy decoding's, and at temperature 1
    # the same tokens and stats as with every pass computed whole (the same bits).
    target = tiny_model(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        llama=True, seed=5)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 9, 8, 7, 9, 8], [60, 61, 62]]
    res = specjax.generate(target, prompts, max_new_tokens=12, drafter="ngram", gamma=3)
    for prompt, out in zip(prompts, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 12))
    kw = dict(max_new_tokens=12, drafter="ngram", gamma=3, temperature=1.0)
    narrow = [specjax.generate(target, [p], seed=i, **kw) for i, p in enumerate(prompts)]
    self.assertLess(sum(r.stats["drafted"] for r in narrow),
                    3 * sum(r.stats["rounds"] for r in narrow))
    # Narrowing off is another engine (`backends.Options.narrow_pass`), so another
    # compiled program: no cache to clear between the two.
    real = decode_lib.Engine
    wide = lambda *a, **k: real(*a, backend_options=backends.Options(narrow_pass=False), **k)
    with mock.patch.object(decode_lib, "Engine", wide):
      whole = [specjax.generate(target, [p], seed=i, **kw) for i, p in enumerate(prompts)]
    for a, b in zip(narrow, whole):
      self.assertEqual(a.tokens, b.tokens)
      # One row: each pass computed that row's draft, or all γ tokens with narrowing off.
      self.assertEqual(a.stats.pop("pass_hist"), a.stats["length_hist"])
      self.assertEqual(b.stats.pop("pass_hist"), [0, 0, 0, b.stats["rounds"]])
      np.testing.assert_equal(a.stats, b.stats)

  def test_draft_lengths(self):
    tokens = jnp.asarray([[1, 2, 3, 4, 0, 0], [4, 5, 4, 0, 0, 0]], jnp.int32)
    n = jnp.array([4, 3])
    for sized, want in ((True, [0, 3]), (False, [3, 3])):
      d = drafters.NgramDrafter(vocab_size=8, gamma=3, sized=sized)
      y, q, _, lengths = d.propose_sized(None, (), tokens, n, None, None)
      np.testing.assert_array_equal(lengths, want)
      np.testing.assert_array_equal(y, d.propose(None, (), tokens, n, None, None)[0])


class NgramDrafterTest(parameterized.TestCase):

  def _propose(self, seq, gamma=3, min_n=1, max_n=3, size=16):
    tokens = np.zeros((1, size), np.int32)
    tokens[0, :len(seq)] = seq
    d = drafters.NgramDrafter(vocab_size=10, gamma=gamma, min_n=min_n, max_n=max_n)
    y, q, _ = d.propose(None, (), jnp.asarray(tokens), jnp.array([len(seq)]), None, None)
    np.testing.assert_array_equal(q, jax.nn.one_hot(y, 10))
    return np.asarray(y[0]).tolist()

  def test_longest_then_latest_match(self):
    # Suffix [1, 2]: "1 2" is followed by 3 at index 2 and by 7 at index 6 (latest wins).
    self.assertEqual(self._propose([1, 2, 3, 4, 1, 2, 7, 8, 9, 5, 1, 2]), [7, 8, 9])
    # A longer match beats a later shorter one: suffix [5, 1, 2] matches at the start.
    self.assertEqual(self._propose([5, 1, 2, 3, 4, 1, 2, 7, 8, 5, 1, 2]), [3, 4, 1])

  def test_periodic_continuation_wraps(self):
    self.assertEqual(self._propose([4, 5, 6, 4, 5, 6, 4], gamma=5), [5, 6, 4, 5, 6])

  def test_no_match_repeats_last_token(self):
    self.assertEqual(self._propose([1, 2, 3, 4]), [4, 4, 4])
    self.assertEqual(self._propose([1, 2, 3, 1], min_n=2), [1, 1, 1])


class SpeculativeBadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("gamma_zero", dict(gamma=0), "gamma"),
      ("gamma_float", dict(gamma=2.0), "gamma"),
      ("no_draft", dict(drafter="model"), "draft model"),
      ("unknown_drafter", dict(drafter="tree"), "drafter"),
      ("vocab", dict(draft="other_vocab"), "vocabularies differ"),
      ("draft_sample", dict(draft="draft", draft_sample="top1"), "draft_sample"),
      ("ngram_sizes", dict(drafter="ngram", ngram_min=3, ngram_max=2), "ngram"),
      ("draft_context", dict(draft="short", prompts=[[1] * 20]), "draft's context"),
      ("empty_stop", dict(stop_sequences=[[]]), "stop sequence 0 is empty"),
      ("stop_vocab", dict(stop_sequences=[[1, 99]]), "stop sequence 0"),
      # A bad γ is refused even where nothing uses it; a draft nothing would use too.
      ("gamma_without_drafter", dict(gamma=-3, draft=None), "gamma"),
      ("draft_with_ngram", dict(drafter="ngram", draft="draft"), "uses no draft model"))
  def test_raises(self, kwargs, message):
    target, draft = target_and_draft()
    models = {"draft": draft, "other_vocab": tiny_model(vocab=9, seed=2),
              "short": tiny_model(vocab=8, max_len=16, seed=2), None: None}
    kwargs = dict(kwargs)
    if "draft" in kwargs:
      kwargs["draft"] = models[kwargs["draft"]]
    elif kwargs.get("drafter") != "model" and "gamma" in kwargs:
      kwargs["draft"] = draft
    prompts = kwargs.pop("prompts", [[1, 2]])
    with self.assertRaisesRegex(ValueError, message):
      specjax.generate(target, prompts, max_new_tokens=4, **kwargs)


class OverAcceptanceTest(parameterized.TestCase):
  """Last in the file: it clears the compiled engines the tests above share."""

  def test_over_acceptance_is_caught(self):
    """LAW_ROWS is enough: accepting with min(1, 1.3 p/q) fails the check that the right
    rule passes on the same inputs (model_probabilistic_g3)."""
    right = exact_rule.acceptance_prob
    over = lambda p, q, y: jnp.minimum(1.3 * right(p, q, y), 1.0)
    # A new verify_batch: lax.cond keeps the trace of the one it has seen.
    with mock.patch.object(exact_rule, "acceptance_prob", over), mock.patch.object(
        exact_rule, "verify_batch", jax.vmap(exact_rule.verify)):
      decode_lib.decode.clear_cache()
      try:
        _, ok, worst = three_token_law(dict(gamma=3, draft_sample="probabilistic"), 1.0)
      finally:
        decode_lib.decode.clear_cache()
    self.assertFalse(ok, f"the over-accepting rule passed (worst z={worst})")
