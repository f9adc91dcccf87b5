"""History-dependent processors stay lossless under speculation.

Oracle: a plain float64 reference processor applied to each prefix of a teacher-forced
target gives the exact law of 3-token continuations; the real sampler (speculative,
model and n-gram drafters) must match it, and a deliberately wrong engine (penalty state
from the committed history for every draft position) must not.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import specjax
from specjax.processors import constraints
from specjax.processors import history as hist
from specjax.processors import stops
from specjax import decode as decode_lib
from conftest import LAW_ROWS, decode_traces, target_and_draft, tiny_model, within_law

EOS = 5
VOCAB = 8


def reference_logits(raw, history, prompt_len, kw, automaton=None):
  """The processors in float64, straight from their definitions."""
  out = np.asarray(raw, np.float64).copy()
  rp = kw.get("repetition_penalty", 1.0)
  for t in set(history):
    out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
  gen = history[prompt_len:]
  counts = np.bincount(gen, minlength=len(out)) if gen else np.zeros(len(out))
  out -= kw.get("presence_penalty", 0.0) * (counts > 0) + kw.get("frequency_penalty", 0.0) * counts
  for t, b in (kw.get("logit_bias") or {}).items():
    out[t] += b
  banned = np.zeros(len(out), bool)
  n = kw.get("no_repeat_ngram_size", 0)
  if n and len(history) >= n - 1:
    suffix = history[len(history) - n + 1:] if n > 1 else []
    for j in range(n - 1, len(history)):
      if history[j - n + 1:j] == suffix:
        banned[history[j]] = True
  if len(gen) < kw.get("min_new_tokens", 0):
    banned[EOS] = True
  if automaton is not None:
    state = automaton.start
    for t in gen:
      state = automaton.next[state, t]
    banned |= automaton.next[state] == constraints.DEAD
    if automaton.accept[state]:
      banned[EOS] = False
  if banned.all():
    return out
  out[banned] = -np.inf
  return out


def exact_law(model, prompt, length, temperature, kw, automaton=None):
  """P(x_1..x_L | prompt) under the processed, tempered target, by teacher forcing."""
  conts = np.array(list(itertools.product(range(VOCAB), repeat=length)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  raw = np.asarray(model.logits(seqs), np.float64)
  probs = np.ones(len(conts))
  for c, cont in enumerate(conts):
    for i in range(length):
      history = list(prompt) + cont[:i].tolist()
      logits = reference_logits(raw[c, len(history) - 1], history, len(prompt), kw, automaton)
      p = np.exp((logits - logits.max()) / temperature)
      probs[c] *= p[cont[i]] / p.sum()
  return conts, probs


def law_check(law, outs, length):
  """`within_law` for rows that end at EOS: tokens after it are zeros on both sides
  (their mass is merged)."""
  conts, probs = law
  ended = np.cumsum(np.cumsum(conts == EOS, axis=1), axis=1) > 1  # strictly after EOS
  conts = np.where(ended, 0, conts)
  index = np.ravel_multi_index(conts.T, (VOCAB,) * length)
  probs = np.bincount(index, weights=probs, minlength=VOCAB ** length)
  return within_law([t + [0] * (length - len(t)) for t in outs], probs, vocab=VOCAB)


PENALTIES = dict(repetition_penalty=2.5, presence_penalty=0.7, frequency_penalty=0.4)
PROMPT = [3, 1, 3]
TEMPERATURE = 0.8


class LawTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("repetition_model", dict(repetition_penalty=2.5), "model"),
      ("presence_frequency_model", dict(presence_penalty=0.7, frequency_penalty=0.4), "model"),
      ("no_repeat_ngram_model", dict(no_repeat_ngram_size=2), "model"),
      ("min_new_bias_model", dict(min_new_tokens=2, logit_bias={2: 1.5, 3: -1.0}), "model"),
      ("combined_model", dict(PENALTIES, no_repeat_ngram_size=2, min_new_tokens=1), "model"),
      ("combined_ngram", dict(PENALTIES, no_repeat_ngram_size=2, min_new_tokens=1), "ngram"))
  def test_three_token_law(self, kw, drafter):
    target, draft = target_and_draft()
    rows, length = LAW_ROWS, 3
    law = exact_law(target, PROMPT, length, TEMPERATURE, kw)
    res = specjax.generate(target, [PROMPT] * rows, max_new_tokens=length,
                           temperature=TEMPERATURE, seed=5, gamma=3, eos_id=EOS,
                           draft=draft if drafter == "model" else None, drafter=drafter, **kw)
    ok, worst = law_check(law, res.tokens, length)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertGreater(res.stats["rounds"], rows)  # drafts were rejected and rolled back

  def test_wrong_state_is_caught(self):
    """Penalty state from the committed history at every draft position fails the check
    that the right engine passes on the same inputs."""
    target, draft = target_and_draft()
    rows, length = LAW_ROWS, 3
    law = exact_law(target, PROMPT, length, TEMPERATURE, PENALTIES)
    from specjax.verify import layouts
    right = layouts.Chain.prefixes
    kw = dict(max_new_tokens=length, temperature=TEMPERATURE, seed=5, gamma=3, draft=draft,
              eos_id=EOS, **PENALTIES)  # without eos_id the rows run on past EOS and fail
    ok, worst = law_check(law, specjax.generate(target, [PROMPT] * rows, **kw).tokens, length)
    self.assertTrue(ok, f"the right engine failed (worst z={worst})")

    def committed_only(self, sampling, history, tokens):
      out = right(self, sampling, history, tokens)
      if out is None or tokens.shape[1] != 3:  # only the γ draft positions are wronged
        return out
      return out.replace(counts=out.counts[:, :1].repeat(4, axis=1),
                         gen_counts=out.gen_counts[:, :1].repeat(4, axis=1))

    layouts.Chain.prefixes = committed_only
    decode_lib.decode.clear_cache()
    try:
      res = specjax.generate(target, [PROMPT] * rows, **kw)
    finally:
      layouts.Chain.prefixes = right
      decode_lib.decode.clear_cache()
    ok, worst = law_check(law, res.tokens, length)
    self.assertFalse(ok, f"the wrong engine passed (worst z={worst})")

  def test_constraint_law(self):
    # Tokens 0-3 then anything; token 4 only after a 0; 6 and 7 never; EOS when accepting.
    nxt = np.full((3, VOCAB), constraints.DEAD)
    nxt[0, [0, 1, 2, 3]] = [1, 2, 2, 2]
    nxt[1, [4, 1]] = [2, 2]
    nxt[2, [0, 1, 2, 3]] = 2
    automaton = constraints.TokenAutomaton(next=nxt, accept=np.array([False, False, True]))
    target, draft = target_and_draft()
    rows, length = LAW_ROWS, 3
    law = exact_law(target, PROMPT, length, 1.0, {}, automaton)
    res = specjax.generate(target, [PROMPT] * rows, max_new_tokens=length, temperature=1.0,
                           seed=3, gamma=2, draft=draft, constraint=automaton, eos_id=EOS)
    ok, worst = law_check(law, res.tokens, length)
    self.assertTrue(ok, f"worst z={worst}")


class GreedyTest(parameterized.TestCase):

  @parameterized.parameters(("model", 2), ("model", 4), ("ngram", 3))
  def test_speculative_equals_autoregressive_equals_reference(self, drafter, gamma):
    target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
    draft = tiny_model(vocab=16, d_model=16, seed=4, sharpness=1.5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 0, 1, 2, 3, 4], [7]]
    kw = dict(repetition_penalty=[1.3, 2.0, 1.1], presence_penalty=0.2, frequency_penalty=0.1,
              no_repeat_ngram_size=[2, 3, 0], logit_bias={5: 0.5})
    ar = specjax.generate(target, prompts, max_new_tokens=10, **kw)
    spec = specjax.generate(target, prompts, max_new_tokens=10, gamma=gamma,
                            draft=draft if drafter == "model" else None, drafter=drafter, **kw)
    self.assertEqual(spec.tokens, ar.tokens)
    for b, prompt in enumerate(prompts):
      row_kw = {k: (v[b] if isinstance(v, list) else v) for k, v in kw.items()}
      seq = list(prompt)
      for _ in range(10):  # zero-padded to one width: one compiled forward (causal)
        raw = np.asarray(target.logits(np.array([seq + [0] * (20 - len(seq))])))[0, len(seq) - 1]
        seq.append(int(np.argmax(reference_logits(raw, seq, len(prompt), row_kw))))
      self.assertEqual(ar.tokens[b], seq[len(prompt):])

  def test_penalty_sweep_compiles_once(self):
    target, draft = target_and_draft()
    with decode_traces() as traced:
      for rp in (1.1, 1.4, 2.0):
        specjax.generate(target, [[1, 2]], max_new_tokens=4, draft=draft, gamma=2,
                         repetition_penalty=rp, presence_penalty=0.1)
    self.assertLen(traced, 1)


class NothingAllowedTest(parameterized.TestCase):
  """Where the bans rule out every token the row ends; before, it fell back to the
  unprocessed logits and broke its own bans."""

  @parameterized.named_parameters(
      ("autoregressive", {}), ("model", dict(draft=True, gamma=3)),
      ("ngram", dict(drafter="ngram", gamma=2)), ("tree", dict(draft=True, tree=(2, 1))))
  def test_no_repeat_unigrams_use_up_the_vocabulary_then_stop(self, spec):
    target, draft = target_and_draft()  # 8 tokens
    if spec.pop("draft", False):
      spec["draft"] = draft
    prompts = [[1, 2, 3], [4], list(range(VOCAB))] * 2
    res = specjax.generate(target, prompts, max_new_tokens=10, no_repeat_ngram_size=1,
                           temperature=[0.0] * 3 + [1.0] * 3, seed=1, **spec)
    for prompt, row in zip(prompts, res.tokens):
      self.assertLen(set(row), len(row))  # no token twice
      self.assertFalse(set(row) & set(prompt))
      self.assertEqual(set(row) | set(prompt), set(range(VOCAB)))  # ran until none was left
    self.assertEqual(res.tokens[2], [])  # the prompt used every token: nothing to generate


@pytest.fixture(scope="module")
def shipped():
  return specjax.load_pretrained("stdlib-target"), specjax.load_pretrained("stdlib-draft")


PATTERN = r"def [a-z_]{1,12}\(self\):"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [False, True])
def test_regex_outputs_match_in_full(shipped, temperature, speculative):
  target, draft = shipped
  automaton = constraints.regex(PATTERN, target.tokenizer)
  prompts = ["class Config:\n    ", "class Parser(object):\n    ", "    "]
  res = specjax.generate(target, prompts, max_new_tokens=24, temperature=temperature, seed=1,
                         constraint=automaton, draft=draft if speculative else None, gamma=3)
  for text in res.texts:
    assert re.fullmatch(PATTERN, text), text


def test_regex_build_is_fast_and_exact(shipped):
  target, _ = shipped
  automaton = constraints.regex(PATTERN, target.tokenizer)
  assert automaton.vocab_size == target.config.vocab_size
  ids = target.tokenizer.encode("def parse(self):")
  assert automaton.matches(ids)
  assert not automaton.matches(target.tokenizer.encode("def Parse(self):"))


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("rep_zero", dict(repetition_penalty=0.0), "repetition_penalty"),
      ("rep_inf", dict(repetition_penalty=float("inf")), "repetition_penalty"),
      ("presence_nan", dict(presence_penalty=float("nan")), "presence_penalty"),
      ("ngram_negative", dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
      ("min_new_negative", dict(min_new_tokens=-2), "min_new_tokens"),
      ("min_new_too_big", dict(min_new_tokens=9), "min_new_tokens"),
      ("bias_id", dict(logit_bias={99: 1.0}), "outside the vocabulary"),
      ("bias_str_key", dict(logit_bias={"5": 1.0}),
       r"logit_bias keys must be integer token ids, got '5' \(str\)"),
      ("bias_value", dict(logit_bias={1: float("inf")}), "finite"),
      ("constraint_type", dict(constraint="def .*"), "TokenAutomaton"),
      ("constraint_vocab", dict(constraint=constraints.TokenAutomaton(
          next=np.zeros((1, 4), np.int32), accept=np.array([True]))), "vocabulary"))
  def test_raises(self, kw, message):
    target = tiny_model()
    with self.assertRaisesRegex(ValueError, message):
      specjax.generate(target, [[1, 2]], max_new_tokens=8, **kw)

  def test_empty_language(self):
    with self.assertRaisesRegex(ValueError, "no token sequence can match"):
      constraints.TokenAutomaton(next=np.full((2, 4), constraints.DEAD),
                                 accept=np.array([False, True]))


class HistoryTest(parameterized.TestCase):
  """The round's per-prefix histories (unrolled) and the commit's one-`advance` update
  equal advancing the history one token at a time."""

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(0)
    batch, self.size = 3, 16
    pieces = [b"a", b"b", b"ab", b"ba", b"c", b"", b"bb", b"ca"]
    fsm = constraints.TokenAutomaton(
        next=np.where(rng.random((4, VOCAB)) < 0.3, constraints.DEAD,
                      rng.integers(0, 4, (4, VOCAB))).astype(np.int32),
        accept=np.array([True, False, True, False]))
    self.cfg, settings = hist.settings_from_args(
        batch, VOCAB, 20, np.zeros((1, 1), np.int32), np.zeros(1, np.int32), [EOS],
        repetition_penalty=1.2, presence_penalty=0.5, no_repeat_ngram_size=2,
        min_new_tokens=2, constraint=fsm,
        stop_table=stops.token_table([b"abc", b"bb"], pieces))
    self.settings = jax.device_put(settings)
    self.assertTrue(self.cfg.repetition and self.cfg.presence and self.cfg.ngram
                    and self.cfg.constraint and self.cfg.stop_text)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (batch, self.size)), jnp.int32)
    prompt_len = jnp.array([3, 5, 2], jnp.int32)
    h = hist.init_history(self.cfg, self.settings, tokens, prompt_len, prompt_len, VOCAB)
    for y in rng.integers(0, VOCAB, (2, batch)):  # some generated tokens already
      h = hist.advance(self.cfg, self.settings, h, y.astype(np.int32))
    self.h0, self.ys = h, rng.integers(0, VOCAB, (batch, 4)).astype(np.int32)

  def assert_same(self, got, want):
    """Field by field; `seq` only below the history's length (the rest is unused)."""
    for name in ("length", "prompt_len", "counts", "gen_counts", "fsm", "stop"):
      np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    keep = np.arange(self.size)[None, :] < np.asarray(want.length)[:, None]
    np.testing.assert_array_equal(np.where(keep, got.seq, 0), np.where(keep, want.seq, 0))

  def sequential(self, tokens):
    """The histories after 0..W of tokens [B, W], one `advance` at a time, [B, W+1, ...]."""
    out = [self.h0]
    for j in range(tokens.shape[1]):
      out.append(hist.advance(self.cfg, self.settings, out[-1], tokens[:, j]))
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x, axis=1), *out)

  def test_prefix_histories_equal_one_token_at_a_time(self):
    stacked = hist.prefix_histories(self.cfg, self.settings, self.h0, self.ys)
    chain = hist.tree_histories(self.cfg, self.settings, self.h0, self.ys, (-1, 0, 1, 2))
    want = self.sequential(self.ys)
    for i in range(self.ys.shape[1] + 1):
      at_i = lambda h: hist.at(h, np.full(3, i, np.int32))
      self.assert_same(at_i(stacked), at_i(want))
      self.assert_same(at_i(chain), at_i(want))

  def test_committed_equals_advancing_over_the_committed_tokens(self):
    # Row b accepted a[b] drafts; new holds them, a correction at a[b], then junk.
    a = np.array([0, 2, 4])
    padded = np.pad(self.ys, ((0, 0), (0, 1)))
    new = np.where(np.arange(5)[None, :] < a[:, None], padded,
                   (padded + 3) % VOCAB).astype(np.int32)
    prefixes = hist.prefix_histories(self.cfg, self.settings, self.h0, self.ys)
    after = self.sequential(new)
    # None: a chain's candidate j follows prefix j; a tree passes those indices itself.
    for before, count in itertools.product(
        (None, np.broadcast_to(np.arange(5), (3, 5)).astype(np.int32)),
        itertools.product(*[range(k + 2) for k in a])):
      count = np.array(count, np.int32)
      got = hist.committed(self.cfg, self.settings, prefixes, before, new, count)
      self.assert_same(got, hist.at(after, count))  # row b: after count[b] tokens
