"""Autoregressive `specjax.generate`: greedy oracle, stops, one compile per sweep, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import specjax
from specjax import prepare as prepare_lib
from specjax import results
from conftest import PROMPTS, decode_traces, greedy_oracle, tiny_model


class AutoregressiveTest(parameterized.TestCase):

  @parameterized.named_parameters(("gpt2", {}), ("llama", dict(llama=True, n_heads=4,
                                                               n_kv_heads=2)))
  def test_greedy_equals_repeated_argmax(self, kw):
    model = tiny_model(vocab=16, n_layers=2, seed=3, **kw)
    res = specjax.generate(model, PROMPTS, max_new_tokens=12, temperature=0.0)
    for prompt, out in zip(PROMPTS, res.tokens):
      self.assertEqual(out, greedy_oracle(model, prompt, 12))
    self.assertEqual(res.stats["committed"], 36)
    self.assertEqual(res.stats["target_calls"], 12)

  def test_eos_stops_a_row_and_is_emitted(self):
    model = tiny_model(vocab=16, n_layers=2, seed=3)
    full = specjax.generate(model, PROMPTS, max_new_tokens=12).tokens
    eos = full[1][4]
    res = specjax.generate(model, PROMPTS, max_new_tokens=12, eos_id=eos)
    for want, got in zip(full, res.tokens):
      cut = want.index(eos) + 1 if eos in want else len(want)
      self.assertEqual(got, want[:cut])

  def test_sampling_is_seeded_and_rows_are_independent(self):
    model = tiny_model(vocab=16, n_layers=1, seed=4)
    kw = dict(max_new_tokens=10, temperature=1.0)
    a = specjax.generate(model, [[1, 2]] * 6, seed=7, **kw).tokens
    b = specjax.generate(model, [[1, 2]] * 6, seed=7, **kw).tokens
    c = specjax.generate(model, [[1, 2]] * 6, seed=8, **kw).tokens
    self.assertEqual(a, b)
    self.assertNotEqual(a, c)
    self.assertGreater(len({tuple(x) for x in a}), 1)  # identical prompts, different samples

  def test_sweep_compiles_once_per_path(self):
    # Values are traced; what the host knows of them (`sampling.Paths`: all greedy, any
    # filter) picks the program: T = 0, T > 0, T > 0 with top-k/top-p.
    model = tiny_model(vocab=16, n_layers=1, seed=5)
    with decode_traces(n=3) as traced:
      for temperature in (0.0, 0.5, 1.0, 1.5):
        for top_p in (1.0, 0.9, 0.5):
          specjax.generate(model, [[1, 2, 3]], max_new_tokens=23, temperature=temperature,
                           top_p=top_p, top_k=3 if top_p < 1 else 0, seed=1)
    self.assertEqual(len(traced), 3)

  def test_a_round_limit_stops_the_compiled_loop_early(self):
    # costs.call_costs times calls stopped after 1 and R rounds on the full call's program.
    import jax
    from specjax import generation
    model = tiny_model(vocab=16, n_layers=1, seed=5)
    args = generation.prepare(model, PROMPTS, max_new_tokens=20, temperature=1.0, top_k=0,
                              top_p=1.0, eos_id=None, drafter="ngram", gamma=2)
    key = jax.random.PRNGKey(3)
    with decode_traces() as traced:
      full = args.run(key)
      parts = {r: args.run(key, r) for r in (1, 3)}
    self.assertEqual(len(traced), 1)  # the limit is traced: one program for every limit
    self.assertGreater(int(full.target_calls), 3)
    for r, part in parts.items():
      self.assertEqual(int(part.target_calls), r)
      for row in range(len(PROMPTS)):  # the same rounds as the full call, cut short
        start, stop = int(part.prompt_len[row]), int(part.n[row])
        self.assertLess(stop, int(full.n[row]))
        np.testing.assert_array_equal(part.tokens[row, start:stop], full.tokens[row, start:stop])

  def test_stats_are_per_sequence(self):
    model = tiny_model(vocab=16, n_layers=1, seed=4)
    s = specjax.generate(model, [[1, 2]] * 4, max_new_tokens=5).stats
    self.assertEqual((s["rows"], s["rounds"], s["target_calls"]), (4, 20, 5))
    self.assertEqual(s["tokens_per_target_call"], 1.0)

  def test_lenient_but_exact_inputs(self):
    model = tiny_model(vocab=16, n_layers=1, seed=4)
    want = specjax.generate(model, [[1, 2]], max_new_tokens=4).tokens
    # numpy prompts and ints, a huge top_k (= off) and a tiny temperature all work.
    self.assertEqual(specjax.generate(model, np.array([[1, 2]]), max_new_tokens=np.int64(4),
                                      top_k=2 ** 40).tokens, want)
    self.assertEqual(specjax.generate(model, [[1, 2]], max_new_tokens=4, temperature=1.2e-38,
                                      seed=3).stats["committed"], 4)
    res = specjax.generate(model, [[1, 2]], max_new_tokens=4, temperature=1e-30)
    self.assertEqual(res.tokens, want)  # the limit of T -> 0 is greedy, never NaN
    # jax arrays, as a batch or a prompt.
    self.assertEqual(specjax.generate(model, jnp.array([[1, 2]]), max_new_tokens=4).tokens,
                     want)
    self.assertEqual(specjax.generate(model, [jnp.array([1, 2])], max_new_tokens=4).tokens,
                     want)

  def test_processors_at_their_limit_stay_finite(self):
    """Penalties and biases of 1e30 (the most taken) on every token the row repeats:
    the processed logprobs are finite or -inf, never NaN (1e39 and a repetition penalty
    of 1e-40, finite in float64, made every token NaN)."""
    model = tiny_model(vocab=16, n_layers=1, seed=4)
    for kw in (dict(frequency_penalty=-1e30, presence_penalty=1e30, repetition_penalty=1e-30,
                    logit_bias={5: 1e30, 6: -1e30}),
               dict(frequency_penalty=1e30, presence_penalty=-1e30, repetition_penalty=1e30,
                    logit_bias={5: -1e30, 6: 1e30})):
      res = specjax.generate(model, [[1, 2, 5, 5, 6]], max_new_tokens=8, temperature=1.0,
                             drafter="ngram", gamma=2, logprobs=True,
                             logprobs_mode="processed", **kw)
      lp = np.asarray(res.logprobs[0])
      self.assertEqual(len(lp), 8)
      self.assertFalse(np.any(np.isnan(lp)), (kw, lp))
      self.assertTrue(np.all(np.isfinite(lp)), (kw, lp))  # each token drawn was allowed

  def test_text_that_is_not_unicode_is_refused_by_name(self):
    target = specjax.load_pretrained("stdlib-target")
    with self.assertRaisesRegex(ValueError, "prompt 1 is not valid text"):
      specjax.generate(target, ["def f():", "x = '\ud800'"], max_new_tokens=2)
    with self.assertRaisesRegex(ValueError, "stop sequence 1 is not valid text"):
      specjax.generate(target, ["def f():"], max_new_tokens=2, stop_sequences=["a", "\udfff"])

  def test_a_bare_stop_string_is_one_stop_sequence(self):
    target = specjax.load_pretrained("stdlib-target")
    kw = dict(max_new_tokens=24, drafter="ngram", gamma=2)
    plain = specjax.generate(target, ["import os"], **kw).tokens[0]
    stop = target.tokenizer.decode(plain[2:4])  # text the model does produce
    self.assertEqual(target.tokenizer.encode(stop), plain[2:4])
    as_list = specjax.generate(target, ["import os"], stop_sequences=[stop], **kw)
    as_str = specjax.generate(target, ["import os"], stop_sequences=stop, **kw)
    self.assertEqual(as_str.tokens, as_list.tokens)
    self.assertLess(len(as_list.tokens[0]), 24)

  def test_rows_stop_at_the_tokenizers_eos_by_default(self):
    """eos_id='auto' (the default) is the tokenizer's end-of-text id, as transformers and
    vLLM stop; None runs to max_new_tokens. A bias makes EOS the first token allowed
    after min_new_tokens."""
    target = specjax.load_pretrained("stdlib-target")
    eos = target.tokenizer.eos_id
    kw = dict(max_new_tokens=12, min_new_tokens=3, logit_bias={eos: 50.0}, drafter="ngram",
              gamma=2)
    res = specjax.generate(target, ["import os", "def f():"], **kw)
    for tokens in res.tokens:
      self.assertEqual(tokens[-1], eos)
      self.assertEqual(len(tokens), 4)
    self.assertEqual(res.finish_reasons, ["stop", "stop"])
    self.assertEqual(res.stop_reasons, [eos, eos])
    for tokens, text in zip(res.tokens, res.texts):  # the text leaves <|endoftext|> out
      self.assertEqual(text, target.tokenizer.decode(tokens[:-1]))
      self.assertNotIn("<|endoftext|>", text)
    chunks = list(specjax.stream(target, ["import os"], **kw))
    self.assertEqual(sum((c.tokens[0] for c in chunks), []), res.tokens[0])
    off = specjax.generate(target, ["import os"], eos_id=None, **kw)
    self.assertEqual(len(off.tokens[0]), 12)
    self.assertEqual(off.finish_reasons, ["length"])
    with self.assertRaisesRegex(ValueError, "eos_id must be 'auto'.*got 'eos'"):
      specjax.generate(target, ["import os"], eos_id="eos")
    bare = tiny_model(vocab=16)  # no tokenizer: no EOS
    res = specjax.generate(bare, [[1, 2]], max_new_tokens=5, logit_bias={0: 50.0})
    self.assertEqual(res.tokens[0], [0] * 5)

  def test_texts_need_a_tokenizer(self):
    model = tiny_model(vocab=16)
    with self.assertRaisesRegex(ValueError, "tokenizer"):
      specjax.generate(model, ["hello"])


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("no_prompts", dict(prompts=[]), "non-empty"),
      ("empty_prompt", dict(prompts=[[1], []]), "empty"),
      ("too_long", dict(prompts=[[1] * 60], max_new_tokens=5), "max_len"),
      ("token_high", dict(prompts=[[1, 16]]), "vocabulary"),
      ("token_negative", dict(prompts=[[-1]]), "vocabulary"),
      ("temperature", dict(temperature=-0.1), "temperature"),
      ("top_p_zero", dict(top_p=0.0), "top_p"),
      ("top_p_high", dict(top_p=1.5), "top_p"),
      ("top_k", dict(top_k=-1), "top_k"),
      ("top_k_float", dict(top_k=2.5), "top_k"),
      ("max_new", dict(max_new_tokens=0), "max_new_tokens"),
      ("eos", dict(eos_id=99), "eos_id"),
      ("per_row_shape", dict(temperature=[1.0, 0.5]), "one value per prompt"),
      ("bool_budget", dict(max_new_tokens=True), "max_new_tokens"),
      ("bool_temperature", dict(temperature=True), "temperature"),
      ("float_token", dict(prompts=[[1, 2.5]]), "integer token ids"),
      ("bool_token", dict(prompts=[[1, True]]), "integer token ids"),
      ("flat_stops", dict(stop_sequences=[3, 4]), "stop sequence 0"),
      ("seed_negative", dict(seed=-1), "seed"),
      ("seed_huge", dict(seed=2 ** 40), "seed"),
      ("stops_not_a_list", dict(stop_sequences=5), "stop_sequences must be a list"),
      ("bias_not_a_dict", dict(logit_bias=5), "logit_bias must be a dict"),
      # Finite in float64 but not as the engine computes (float32): NaNs before the limit.
      ("repetition_underflow", dict(repetition_penalty=1e-40),
       r"repetition_penalty must be a number in \[1e-30, 1e30\]"),
      ("repetition_huge", dict(repetition_penalty=1e31), "repetition_penalty"),
      ("frequency_huge", dict(frequency_penalty=1e39),
       "frequency_penalty must be finite, at most 1e30"),
      ("presence_huge", dict(presence_penalty=-2e30), "presence_penalty must be finite"),
      ("bias_huge", dict(logit_bias={5: 1e39}), "logit_bias for token 5 must be a finite"),
      ("bias_bool", dict(logit_bias={5: True}), "logit_bias for token 5"),
      ("top_p_underflow", dict(top_p=1e-50), r"top_p must be in \(0, 1\].*1e-50"),
      ("top_p_just_above", dict(top_p=1.00000001), "top_p"),
      ("ragged_per_row", dict(temperature=[[0.5], [0.1, 0.2]]),
       "temperature must be a scalar or one value per prompt"),
      ("nested_prompt", dict(prompts=np.array([[[1, 2]]])), "prompts"),
      ("prompt_a_matrix", dict(prompts=[np.array([[1, 2]])]), "prompt 0 must be a list"),
      # Past the context (64): refused, where they made huge buffers or ran for minutes.
      ("gamma_past_context", dict(drafter="ngram", gamma=65),
       "gamma \\(draft length\\) 65 is longer than the target's context max_len=64"),
      ("ngram_max_past_context", dict(drafter="ngram", ngram_max=65),
       "ngram_max 65 is longer than the target's context max_len=64"),
      ("tree_past_context", dict(drafter="ngram", tree=(65,)),
       "tree has 65 nodes, more than the target's context max_len=64"),
  )
  def test_raises_before_any_work(self, kwargs, message):
    model = tiny_model(vocab=16, max_len=64)
    args = dict(prompts=[[1, 2]], max_new_tokens=4)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with self.assertRaisesRegex(ValueError, message):
      specjax.generate(model, prompts, **args)

  def test_a_target_that_is_not_a_model(self):
    with self.assertRaisesRegex(ValueError, "target must be a specjax Model.*got str"):
      specjax.generate("stdlib-target", [[1, 2]])
    with self.assertRaisesRegex(ValueError, "target must be a specjax Model.*a draft head"):
      specjax.generate(specjax.load_pretrained("stdlib-eagle"), [[1, 2]])
    with self.assertRaisesRegex(ValueError, "regex needs the target's tokenizer"):
      specjax.constraints.regex("ab", tiny_model(vocab=16).tokenizer)


def test_seed_key_is_prng_key():
  from specjax import generation
  for seed in (0, 1, 7, 2 ** 31, 2 ** 32 - 1):
    np.testing.assert_array_equal(prepare_lib.seed_key(seed), jax.random.PRNGKey(seed))


def test_on_host_matches_device_get():
  """`results.on_host` reads CPU results in place: the same values and dtypes as
  `jax.device_get`, numpy leaves passed through, None kept."""
  from specjax import generation
  out = jax.jit(lambda x: (x + 1, {"f": x * 0.5, "none": None}, x.sum()))(
      np.arange(6, dtype=np.int32).reshape(2, 3))
  tree = (out, np.array([7, 8], np.int16))
  got, want = results.on_host(tree), jax.device_get(tree)
  got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  assert len(got_leaves) == 4
  for g, w in zip(got_leaves, want_leaves):
    assert isinstance(g, np.ndarray) and g.dtype == w.dtype
    np.testing.assert_array_equal(g, w)


def test_programs_are_dropped_near_the_memory_map_limit_by_the_harness_not_generate(
    monkeypatch):
  """XLA:CPU maps every compiled program's code: near vm.max_map_count the harness's guard
  drops the compiled programs (LLVM would abort the process at a later compile); a
  `generate` call never does, however many mappings the process holds."""
  from specjax import compile_guard
  maps = compile_guard.memory_maps()  # this process's own, where /proc has them
  assert maps is None or 0 < maps[0] < maps[1]
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
  used = 100
  monkeypatch.setattr(compile_guard, "memory_maps", lambda: (used, 65530))
  assert not compile_guard.release_near_map_limit() and not cleared  # far from the limit
  used = 50000
  model = tiny_model(vocab=11, d_model=24, n_layers=1, seed=5)
  out = specjax.generate(model, [[1, 2], [3]], max_new_tokens=2)  # compiles
  assert not cleared and [len(t) for t in out.tokens] == [2, 2]
  with pytest.warns(UserWarning, match="vm.max_map_count"):
    assert compile_guard.release_near_map_limit(out.tokens)
  assert cleared


class _ByteTokenizer:
  """Ids as bytes, some of them halves of 'é' (C3 A9) and '€' (E2 82 AC): text cut
  inside a character, as byte-level BPE cuts it."""
  BYTES = [b"a", b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xac", b" ", b"b", b"\xc3\xa9", b"c",
           b"d", b"e"]

  def decode(self, ids):
    return b"".join(self.BYTES[i] for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def stream_pair():
  target = tiny_model(vocab=12, n_layers=2, seed=3)
  target.tokenizer = _ByteTokenizer()
  return target, tiny_model(vocab=12, n_layers=1, seed=9)


def test_a_draft_with_another_tokenizer_is_refused(stream_pair):
  """One vocabulary size is not one vocabulary: the draft would propose other tokens."""
  target, draft = stream_pair

  class Shifted(_ByteTokenizer):
    BYTES = _ByteTokenizer.BYTES[1:] + _ByteTokenizer.BYTES[:1]

  draft.tokenizer = Shifted()
  try:
    with pytest.raises(ValueError, match=re.escape(
        "draft and target tokenizers differ: token 0 is '\ufffd' in the draft's and 'a'")):
      specjax.generate(target, [[1, 2]], draft=draft, gamma=2, max_new_tokens=2)
    draft.tokenizer = _ByteTokenizer()  # another object, the same tokens: fine
    specjax.generate(target, [[1, 2]], draft=draft, gamma=2, max_new_tokens=2)
  finally:
    draft.tokenizer = None


def test_equal_results_compare_equal(stream_pair):
  """Target-only drafts nothing: its acceptance rates are NaN, and still equal."""
  target, _ = stream_pair
  a, b = (specjax.generate(target, [[1, 2]], max_new_tokens=3) for _ in range(2))
  assert np.isnan(a.stats["acceptance_rate"]) and a == b
  c = specjax.generate(target, [[1, 2]], max_new_tokens=3, seed=1, temperature=1.0)
  assert a != c and a != a.tokens


def test_stream_hands_out_what_generate_returns(stream_pair):
  """Chunks add up to generate's tokens and text, and its result is generate's (same
  seed: rounds in chunks draw what one call draws), at T = 0 and T > 0 in one batch."""
  target, draft = stream_pair
  prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 0]] * 3
  kw = dict(draft=draft, gamma=3, max_new_tokens=14, temperature=[0.0, 0.8, 1.0] * 3,
            eos_id=4, seed=11)
  want = specjax.generate(target, prompts, **kw)
  s = specjax.stream(target, prompts, rounds_per_chunk=2, **kw)
  with pytest.raises(RuntimeError, match="chunks left"):
    s.result
  chunks = list(s)
  assert len(chunks) > 2  # several rounds' worth: the loop did stop and resume
  for i in range(len(prompts)):
    assert sum((c.tokens[i] for c in chunks), []) == want.tokens[i]
    assert "".join(c.texts[i] for c in chunks) == want.texts[i]
    done = [c.done[i] for c in chunks]
    assert done == sorted(done) and done[-1]  # once done, a row stays done ...
    assert all(not c.tokens[i] for c in chunks[done.index(True) + 1:])  # ... and silent
    for c in chunks:  # a character cut between tokens waits for its last byte
      assert c.done[i] or not c.texts[i].endswith("\ufffd")
  assert s.result.tokens == want.tokens and s.result.texts == want.texts
  assert s.result.stats == want.stats
  assert s.result == want
  assert any("\ufffd" in t for t in want.texts)  # the rows did end mid-character
  assert any(b"\xc3\xa9".decode() in t or "€" in t for t in want.texts)


def _sentencepiece_like():
  """A Llama-2-style decoder: '▁' for a space and the text's first space dropped, so a
  token decodes otherwise at the start of a text. (No byte tokens: its byte fallback
  turns a whole run of bytes into U+FFFDs when a later byte makes it invalid, rewriting
  text already sent, which no stream can take back.)"""
  import tokenizers
  from tokenizers import decoders, models
  from specjax.models.tokenizer import Tokenizer
  pieces = ["<unk>", "▁Hello", "▁world", "é", "▁€", ".", "▁a", "b", "▁", "▁▁", "c",
            "d"]
  tok = tokenizers.Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)},
                                              unk_token="<unk>"))
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  return Tokenizer(tok)


def _llama_like():
  """A WordLevel tokenizer whose post-processor puts <s> before a text, as Llama's and
  Mistral's files do; 8 ids, <s> and </s> special."""
  import tokenizers
  from tokenizers import models, pre_tokenizers, processors
  from specjax.models.tokenizer import Tokenizer
  pieces = ["<unk>", "<s>", "</s>", "a", "b", "c", "d", "e"]
  tok = tokenizers.Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)},
                                              unk_token="<unk>"))
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
      ("<s>", 1)])
  return Tokenizer(tok)


def test_text_in_and_out_as_transformers_and_vllm_give_it():
  """A string prompt gets the BOS its tokenizer's post-processor adds (transformers'
  tokenizer(text), vLLM); texts leave out special tokens (vLLM's skip_special_tokens)
  and ids past the tokenizer's table (a padded embedding: no crash after the work)."""
  target = tiny_model(vocab=12, n_layers=1, seed=5)  # 4 rows past the tokenizer's 8
  target.tokenizer = _llama_like()
  # Row 0 draws a padded id only; row 1 <s> and "a", about evenly.
  kw = dict(max_new_tokens=8, temperature=1.0, seed=2,
            logit_bias=[{9: 40.0}, {1: 40.0, 3: 42.5}])
  res = specjax.generate(target, ["a b c", "b"], **kw)
  assert res.prompt_tokens == [[1, 3, 4, 5], [1, 4]]
  assert res.tokens[0] == [9] * 8 and res.texts[0] == ""
  assert len(res.tokens[1]) == 8 and set(res.tokens[1]) == {1, 3}, res.tokens[1]
  assert res.texts[1].split() == ["a"] * res.tokens[1].count(3)
  chunks = list(specjax.stream(target, ["a b c", "b"], **kw))
  for i in range(2):
    assert sum((c.tokens[i] for c in chunks), []) == res.tokens[i]
    assert "".join(c.texts[i] for c in chunks) == res.texts[i]
  assert specjax.generate(target, [[3, 4, 5]], max_new_tokens=6).prompt_tokens[0] == [3, 4, 5]


def test_stream_text_decodes_a_window_not_the_row(stream_pair):
  """Each chunk's text is the row's text past what was sent, with a tokenizer whose
  decode of a token depends on what comes before it (a leading '▁' loses its space at
  the start of a text), while the decoded tokens grow with the row, not its square."""
  target, _ = stream_pair
  tokenizer = _sentencepiece_like()
  decoded = []

  class Counting:
    def decode(self, ids):
      decoded.append(len(ids))
      return tokenizer.decode(ids)

  prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 0], [8]]
  kw = dict(max_new_tokens=48, temperature=1.0, seed=5)
  target.tokenizer = Counting()
  try:
    chunks = list(specjax.stream(target, prompts, rounds_per_chunk=1, **kw))
  finally:
    target.tokenizer = _ByteTokenizer()
  rows = [sum((c.tokens[i] for c in chunks), []) for i in range(len(prompts))]
  for i, row in enumerate(rows):
    assert "".join(c.texts[i] for c in chunks) == tokenizer.decode(row)
  # Some chunk after the first opens with a '▁' token: decoded alone it would lose a space.
  assert any(c.tokens[i][:1] and c.tokens[i][0] in (1, 2, 4, 6, 8, 9)
             for c in chunks[1:] for i in range(len(prompts)))
  n = sum(map(len, rows))
  assert sum(decoded) < 6 * n  # the whole row each chunk: ~n * 48 / 2


def test_stream_text_passes_tokens_that_render_nothing_and_stays_linear():
  """A window does not open on tokens that decode to nothing (a special token a
  transformers tokenizer skips): the token after it would decode as a text's first
  (WordPiece's '##' kept, a space dropped). And a row whose every chunk ends in a byte
  that is not UTF-8 moves its window to a boundary among its last 3 tokens that ends on
  a whole character."""
  import tokenizers
  from tokenizers import decoders, models
  from specjax.results import TextStream as _TextStream
  pieces = ["[UNK]", "play", "##ing", "now"]
  tok = tokenizers.Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)},
                                              unk_token="[UNK]"))
  tok.add_special_tokens([tokenizers.AddedToken("[SEP]", special=True)])  # id 4
  tok.decoder = decoders.WordPiece(prefix="##")

  class Skipping:  # decode as transformers does with skip_special_tokens=True
    def decode(self, ids):
      return tok.decode(list(ids), skip_special_tokens=True)

  for chunks in ([[1], [4], [2, 3]], [[1, 2], [4], [3]], [[1], [4], [4], [], [2], [3]]):
    text = _TextStream(Skipping())
    out = "".join(text.add(c, i == len(chunks) - 1) for i, c in enumerate(chunks))
    assert out == Skipping().decode(sum(chunks, [])) == "playing now"

  decoded = []

  class Bytes:
    def decode(self, ids):
      decoded.append(len(ids))
      return b"".join([b"a", b"\xff"][i] for i in ids).decode("utf-8", errors="replace")

  text = _TextStream(Bytes())
  out = "".join(text.add([0, 1], False) for _ in range(200))
  assert out == "a\ufffd" * 199 + "a"  # the last U+FFFD waits: it could be a cut character
  assert sum(decoded) < 8 * 400  # the whole row each chunk: ~200 * 400 / 2


def test_finish_reasons(stream_pair):
  """'stop' for a row that ended at EOS (also on its budget's last token), a stop
  sequence, or a prefix where every token is banned; 'length' for one that used its
  budget; a stream's chunks say None until the row is done."""
  target, draft = stream_pair
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]
  free = specjax.generate(target, prompts, max_new_tokens=8, draft=draft, gamma=3)
  assert free.finish_reasons == ["length"] * 4 and free.stop_reasons == [None] * 4
  eos, at = free.tokens[0][5], free.tokens[0].index(free.tokens[0][5])  # row 0's budget
  out = specjax.generate(target, prompts, max_new_tokens=at + 1, eos_id=eos, draft=draft,
                         gamma=3)
  assert out.tokens[0][-1] == eos and len(out.tokens[0]) == at + 1
  for tokens, reason in zip(out.tokens, out.finish_reasons):
    assert reason == ("stop" if tokens[-1] == eos else "length"), (tokens, reason)
    assert reason == "stop" or len(tokens) == at + 1
  assert out.stop_reasons == [eos if r == "stop" else None for r in out.finish_reasons]
  seq = free.tokens[1][2:4]
  stop = specjax.generate(target, prompts, max_new_tokens=8, draft=draft, gamma=3,
                          stop_sequences=[[11, 10, 11, 10, 11], seq])
  assert stop.finish_reasons[1] == "stop" and len(stop.tokens[1]) <= 4
  # stop_reasons: the stop as given where one ended the row, found in its last tokens.
  for tokens, reason, why in zip(stop.tokens, stop.stop_reasons, stop.finish_reasons):
    assert reason == (seq if why == "stop" else None) and (why == "length" or tokens[-2:] == seq)
  # min_new_tokens bans EOS and one-token stops only (vLLM's min_tokens): a longer stop
  # sequence completed before it does not count, and its first token stays allowed.
  late = specjax.generate(target, prompts, max_new_tokens=8, draft=draft, gamma=3,
                          stop_sequences=[seq], min_new_tokens=4)
  for row, got, reason in zip(free.tokens, late.tokens, late.stop_reasons):
    ends = [j + 1 for j in range(4, 8) if row[j - 1:j + 1] == seq]
    assert got == row[:ends[0] if ends else 8] and reason == (seq if ends else None)
  assert late.tokens[1][:4] == free.tokens[1][:4]  # seq, at new tokens 2-3, not banned
  banned = specjax.generate(target, [[1, 2, 3]], max_new_tokens=20, drafter="ngram",
                            no_repeat_ngram_size=1, temperature=1.0)
  assert len(banned.tokens[0]) == 9 and banned.finish_reasons == ["stop"]  # 12 tokens seen
  assert banned.stop_reasons == [None]  # not at a stop: every token was banned
  # A constraint whose text is complete, with nothing to follow: stop, on the budget too.
  from specjax.processors import constraints
  nxt = np.full((3, 12), constraints.DEAD)
  nxt[0, [0, 1, 2, 3]], nxt[1, [5, 6]] = 1, 2
  auto = constraints.TokenAutomaton(next=nxt, accept=np.array([False, False, True]))
  for budget in (10, 2):
    done = specjax.generate(target, prompts, max_new_tokens=budget, constraint=auto,
                            temperature=1.0, draft=draft, gamma=3)
    assert [len(t) for t in done.tokens] == [2] * 4 and done.finish_reasons == ["stop"] * 4
    assert done.stop_reasons == [None] * 4
  s = specjax.stream(target, prompts, max_new_tokens=at + 1, eos_id=eos, draft=draft,
                     gamma=3, rounds_per_chunk=1)
  chunks = list(s)
  assert s.result.finish_reasons == out.finish_reasons
  for c in chunks:
    assert [r is not None for r in c.finish_reasons] == c.done
    assert all(r is None or d for r, d in zip(c.stop_reasons, c.done))
  assert chunks[-1].finish_reasons == out.finish_reasons
  assert chunks[-1].stop_reasons == s.result.stop_reasons == out.stop_reasons
  assert eos in out.stop_reasons


def _log_softmax(target, ids):
  """float64 [len(ids), V]: log p(. | ids[:i + 1]) from one full forward (zero-padded to
  32 tokens: causal, and one compiled forward for every length)."""
  width = max(32, len(ids))
  logits = np.asarray(target.logits(np.asarray([ids + [0] * (width - len(ids))])),
                      np.float64)[0, :len(ids)]
  return logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                keepdims=True)) - logits.max(-1, keepdims=True)


def _teacher_forced(target, prompt, new):
  """log p(new[j] | prompt + new[:j]) from one full forward, in float64."""
  logp = _log_softmax(target, prompt + new)
  return [logp[len(prompt) - 1 + j, t] for j, t in enumerate(new)]


def _check_top(top, logp, n, atol=2e-5):
  """top: (token, logprob) pairs at each position of logp [positions, V]: the n most
  likely tokens, most likely first (ids checked through their values: near ties may
  order either way)."""
  assert len(top) == len(logp)
  for pairs, row in zip(top, logp):
    ids, values = zip(*pairs)
    assert len(set(ids)) == n and list(values) == sorted(values, reverse=True)
    np.testing.assert_allclose(values, np.sort(row)[::-1][:n], atol=atol)
    np.testing.assert_allclose(values, row[list(ids)], atol=atol)


@pytest.mark.parametrize("kw", [
    dict(),  # target only
    dict(draft=True, gamma=3, temperature=[0.7, 0.0, 1.3, 1.0], top_k=[5, 0, 0, 3],
         repetition_penalty=1.3),
    dict(draft=True, tree=(2, 2), temperature=1.0, no_repeat_ngram_size=2),
    dict(drafter="ngram", tree=(2, 1), temperature=[0.0, 1.0, 0.5, 2.0]),
], ids=["target", "chain", "model-tree", "ngram-tree"])
def test_logprobs_are_the_targets_teacher_forced_ones(stream_pair, kw):
  """Each new token's logprob is the target's raw log-probability after everything
  before it, as a full forward of prompt + output gives (not the processed, tempered
  distribution it was drawn from), for rows that accept different counts and stop at
  different rounds; so are the top 3 at each position, and the prompt's."""
  target, draft = stream_pair
  kw = dict(kw, draft=draft) if kw.get("draft") else kw
  prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 0], [2, 2]]
  out = specjax.generate(target, prompts, max_new_tokens=12, eos_id=4, seed=3,
                         logprobs=True, top_logprobs=3, prompt_logprobs=True, **kw)
  assert len({len(t) for t in out.tokens}) > 1  # some rows stopped at EOS
  for i, (prompt, new) in enumerate(zip(prompts, out.tokens)):
    logp = _log_softmax(target, prompt + new)
    assert len(out.logprobs[i]) == len(new)
    np.testing.assert_allclose(out.logprobs[i], _teacher_forced(target, prompt, new),
                               atol=2e-5)
    _check_top(out.top_logprobs[i], logp[len(prompt) - 1:-1], 3)
    first, *rest = out.prompt_logprobs[i]
    assert first is None and len(rest) == len(prompt) - 1 and out.prompt_tokens[i] == prompt
    np.testing.assert_allclose(rest, [logp[t - 1, prompt[t]] for t in range(1, len(prompt))],
                               atol=2e-5)
    first, *rest = out.prompt_top_logprobs[i]
    assert first is None
    _check_top(rest, logp[:len(prompt) - 1], 3)
  plain = specjax.generate(target, prompts, max_new_tokens=12, eos_id=4, seed=3, **kw)
  assert plain.tokens == out.tokens and plain.logprobs is None
  assert plain.top_logprobs is plain.prompt_logprobs is plain.prompt_top_logprobs is None
  assert specjax.generate(target, [[1]], top_logprobs=None).top_logprobs is None


def _processed(logits, history, temperature, top_k, top_p, penalty):
  """float64 log p [V] of the distribution sampled from, after the repetition penalty
  (Hugging Face's rule over `history`), temperature, top-k and top-p: written apart
  from the engine's code, as the oracle."""
  x = np.array(logits, np.float64)
  seen = sorted(set(history))
  x[seen] = np.where(x[seen] > 0, x[seen] / penalty, x[seen] * penalty)
  if temperature == 0:
    return np.where(np.arange(len(x)) == np.argmax(x), 0.0, -np.inf)
  x = x / temperature
  if top_k:
    x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
  probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
  order = np.argsort(-probs, kind="stable")
  before = np.cumsum(probs[order]) - probs[order]  # the mass of the tokens above each
  x[x < x[order[np.sum(before < top_p) - 1]]] = -np.inf
  return x - x.max() - np.log(np.sum(np.exp(x - x.max())))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(draft=True, gamma=3),
    dict(draft=True, tree=(2, 2)),
], ids=["target", "chain", "model-tree"])
def test_processed_logprobs_are_the_sampled_distributions(stream_pair, kw):
  """logprobs_mode='processed': each new token's logprob and the top 4 under the
  distribution it was drawn from (penalty, per-row temperature, top-k, top-p), as an
  oracle written apart computes it from a full forward; tokens outside it get -inf, and
  no drawn token is one (the output lies in its support)."""
  target, draft = stream_pair
  kw = dict(kw, draft=draft) if kw.get("draft") else kw
  rows = dict(temperature=[0.7, 0.0, 1.3, 1.0], top_k=[5, 0, 0, 3], top_p=[1.0, 1.0, 0.8, 0.9])
  prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 0], [2, 2]]
  out = specjax.generate(target, prompts, max_new_tokens=12, seed=3, logprobs=True,
                         logprobs_mode="processed", top_logprobs=4, repetition_penalty=1.3,
                         **rows, **kw)
  for i, (prompt, new) in enumerate(zip(prompts, out.tokens)):
    ids = prompt + new  # zero-padded: one compiled forward for every length (causal)
    logits = np.asarray(target.logits(np.asarray([ids + [0] * (32 - len(ids))])), np.float64)[0]
    settings = [rows[k][i] for k in ("temperature", "top_k", "top_p")]
    want = np.array([_processed(logits[len(prompt) - 1 + j], prompt + new[:j], *settings,
                                1.3) for j in range(len(new))])
    got = np.array(out.logprobs[i])
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want[np.arange(len(new)), new], atol=1e-4)
    _check_top(out.top_logprobs[i], want, 4, atol=1e-4)
    if settings[0] == 0:
      assert got.tolist() == [0.0] * len(new)
  assert np.isinf([v for row in out.top_logprobs for pos in row for _, v in pos]).any()


@pytest.mark.parametrize("kw", [
    dict(draft=True, gamma=3, repetition_penalty=[1.0, 1.3]),
    dict(drafter="ngram", tree=(2, 1)),
], ids=["chain", "ngram-tree"])
def test_n_samples_per_prompt_are_the_prompt_repeated(stream_pair, kw):
  """n=3: rows i*3..i*3+2 are prompt i's, the tokens (and logprobs) of the prompts
  repeated three times with the same seed and per-row settings; the samples differ."""
  target, draft = stream_pair
  kw = dict(kw, draft=draft) if kw.get("draft") else kw
  prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 0]]
  rows = dict(temperature=[0.8, 1.3], top_k=[0, 5])
  out = specjax.generate(target, prompts, n=3, max_new_tokens=10, seed=4, logprobs=True,
                         prompt_logprobs=True, **rows, **kw)
  three = lambda x: np.repeat(x, 3).tolist() if isinstance(x, list) else x
  want = specjax.generate(target, [p for p in prompts for _ in range(3)], max_new_tokens=10,
                          seed=4, logprobs=True, prompt_logprobs=True,
                          **{k: three(v) for k, v in {**rows, **kw}.items()})
  assert out.tokens == want.tokens and out.texts == want.texts
  # The repeated batch's larger prefill may take another kernel: equal up to rounding.
  for got, ref in [*zip(out.logprobs, want.logprobs),
                   *((g[1:], r[1:]) for g, r in zip(out.prompt_logprobs, want.prompt_logprobs))]:
    np.testing.assert_allclose(got, ref, atol=1e-5)
  assert out.stats["rows"] == 6 and out.stats["committed"] == want.stats["committed"]
  assert len({tuple(t) for t in out.tokens[:3]}) == 3  # three different samples


def test_n_samples_share_one_prefill(stream_pair, monkeypatch):
  """The target and the draft prefill each prompt once; its caches go to its n rows."""
  from specjax import decode as decode_lib
  from specjax import generation
  target, draft = stream_pair
  seen = []
  forward = decode_lib.model_lib.forward_cached

  def counting(graphdef, params, tokens, kv, **kw):
    seen.append(tokens.shape)
    return forward(graphdef, params, tokens, kv, **kw)

  monkeypatch.setattr(decode_lib.model_lib, "forward_cached", counting)  # draft's too
  prepared = generation.prepare(
      target, [[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0,
      eos_id=None, draft=draft, gamma=2, n=4)
  state = prepared.prefill(prepare_lib.seed_key(0))  # op by op: one forward each
  assert [shape[0] for shape in seen] == [2, 2]  # the target's, then the draft's
  assert state.target_kv.k[0].shape[0] == state.draft_state.k[0].shape[0] == 8
  np.testing.assert_array_equal(state.target_kv.k[0][4], state.target_kv.k[0][7])
  np.testing.assert_array_equal(state.target_kv.length, [2] * 4 + [1] * 4)


def test_logprobs_on_a_narrowed_pass():
  """A Llama-shaped target narrows its CPU verify pass to the longest draft (the
  logits past it repeat its last position); the logprobs read no padded position."""
  from specjax import backends
  target = tiny_model(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      llama=True, seed=5)
  prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 9, 8, 7, 9, 8], [60, 61, 62]]
  out = specjax.generate(target, prompts, max_new_tokens=12, drafter="ngram", gamma=3,
                         temperature=1.0, seed=1, logprobs=True)
  if backends.select().narrow_pass:
    assert out.stats["pass_hist"][-1] < out.stats["rounds"]  # some pass narrowed
  for p, new, lp in zip(prompts, out.tokens, out.logprobs):
    np.testing.assert_allclose(lp, _teacher_forced(target, p, new), atol=2e-5)


@pytest.mark.parametrize("make", [_ByteTokenizer, _sentencepiece_like])
def test_stream_text_matches_decoding_the_whole_row(make):
  """Every chunk's text is what decoding the whole row hands out, for random chunkings
  (empty chunks, rows done early or never, characters cut across chunks)."""
  import random
  from specjax.results import TextStream as _TextStream
  tok, rng = make(), random.Random(0)
  for _ in range(300):
    ids = [rng.randrange(12) for _ in range(rng.randint(0, 40))]
    cuts = sorted(rng.sample(range(len(ids) + 1), rng.randint(0, len(ids) + 1)))
    chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])] + [[]]
    done_at = rng.choice([len(chunks) - 1, None])
    text, row, sent = _TextStream(tok), [], ""
    for j, c in enumerate(chunks):
      done = done_at is not None and j >= done_at
      row += c
      whole = tok.decode(row) if done else tok.decode(row).rstrip("\ufffd")
      want = whole[len(sent):]
      sent += want
      assert text.add(c, done) == want


def test_stream_hands_out_the_logprobs_and_logprobs_is_checked(stream_pair):
  target, draft = stream_pair
  kw = dict(draft=draft, gamma=2, max_new_tokens=10, temperature=1.0, seed=1,
            logprobs=True)
  s = specjax.stream(target, [[1, 2], [3]], rounds_per_chunk=1, **kw)
  chunks = list(s)
  for i in range(2):
    assert sum((c.logprobs[i] for c in chunks), []) == s.result.logprobs[i]
    assert all(len(c.logprobs[i]) == len(c.tokens[i]) for c in chunks)
    assert all(c.top_logprobs is None for c in chunks)
  assert all(c.prompt_logprobs is c.prompt_top_logprobs is None for c in chunks)
  s = specjax.stream(target, [[1, 2], [3]], rounds_per_chunk=2, top_logprobs=2, n=2,
                     prompt_logprobs=True, **kw)
  chunks = list(s)
  assert len(s.result.tokens) == 4 and all(len(c.tokens) == 4 for c in chunks)  # n=2 rows
  for i in range(4):
    assert sum((c.tokens[i] for c in chunks), []) == s.result.tokens[i]
    assert sum((c.top_logprobs[i] for c in chunks), []) == s.result.top_logprobs[i]
    assert all(len(c.top_logprobs[i]) == len(c.tokens[i]) for c in chunks)
  # The prompt's, as vLLM hands them out: whole, in the first chunk only.
  assert len(chunks) > 1 and chunks[0].prompt_logprobs[0][1] is not None
  assert chunks[0].prompt_logprobs == s.result.prompt_logprobs
  assert chunks[0].prompt_top_logprobs == s.result.prompt_top_logprobs
  assert all(c.prompt_logprobs is c.prompt_top_logprobs is None for c in chunks[1:])
  for bad, match in [
      (dict(logprobs="yes"), "logprobs must be True or False, got 'yes'"),
      (dict(logprobs=True, prompt_logprobs=1), "prompt_logprobs must be True or False"),
      (dict(top_logprobs=2), "^top_logprobs needs logprobs=True"),
      (dict(prompt_logprobs=True, top_logprobs=1),
       "^top_logprobs and prompt_logprobs need logprobs=True"),
      (dict(logprobs_mode="processed"), "^logprobs_mode needs logprobs=True"),
      (dict(logprobs=True, logprobs_mode="sampled"),
       "logprobs_mode must be 'raw' or 'processed', got 'sampled'"),
      (dict(logprobs=True, top_logprobs=-1), "top_logprobs must be an int >= 0"),
      (dict(logprobs=True, top_logprobs=2.0), "top_logprobs"),
      (dict(logprobs=True, top_logprobs=target.config.vocab_size + 1),
       "top_logprobs must be <= the vocabulary size"),
      (dict(n=0), "n must be an int >= 1, got 0"),
      (dict(n=True), "n must be an int >= 1, got True"),
      (dict(n=2 ** 20 + 1), r"n=1048577 samples of 1 prompt\(s\) make 1048577 rows"),
  ]:
    with pytest.raises(ValueError, match=match):
      specjax.generate(target, [[1, 2]], **bad)


@pytest.mark.parametrize("kw, message", [
    (dict(rounds_per_chunk=0), "rounds_per_chunk"),
    (dict(temperature=-1.0), "temperature"),
    (dict(mesh=object()), "mesh"),
    (dict(seed=2 ** 32), "seed"),
    (dict(rounds_per_chunk=2 ** 40), r"rounds_per_chunk must be <= 2\*\*30")])
def test_stream_refuses_bad_input_before_anything_runs(stream_pair, kw, message):
  with pytest.raises(ValueError, match=message):
    specjax.stream(stream_pair[0], [[1, 2]], **kw)


def test_a_bad_mesh_is_refused_before_the_ledger_times_the_pair(stream_pair, monkeypatch):
  """gamma_policy='ledger' times the pair in `prepare` (seconds): the mesh is checked
  before it, for generate and stream alike."""
  from specjax import timing
  def timed(*args, **kwargs):
    raise AssertionError("the pair was timed before the mesh was checked")
  monkeypatch.setattr(timing, "step_costs", timed)
  target, draft = stream_pair
  for call in (specjax.generate, specjax.stream):
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
      call(target, [[1, 2]], draft=draft, gamma=2, gamma_policy="ledger", mesh="foo")
  with pytest.raises(AssertionError, match="timed before"):  # the patch is on the path
    specjax.generate(target, [[1, 2]], draft=draft, gamma=2, gamma_policy="ledger")


def test_stream_takes_generates_arguments_and_defaults(stream_pair):
  with pytest.raises(TypeError, match=r"\['max_new_token'\]"):
    specjax.stream(stream_pair[0], [[1, 2]], max_new_token=3)
  s = specjax.stream(stream_pair[0], [[1, 2]], rounds_per_chunk=5)
  assert sum(len(c.tokens[0]) for c in s) == 32  # generate's default budget
