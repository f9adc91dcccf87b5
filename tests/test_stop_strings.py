"""Stop strings match the text, however it is split into tokens (`processors/stops.py`)."""

import numpy as np
from absl.testing import absltest, parameterized

import specjax
from conftest import PROMPTS, tiny_model
from specjax.processors import stops

# A 16-token toy vocabulary whose tokens overlap: ")" lies inside ")[", "ab" spans "a"+"b".
PIECES = [b"", b"a", b"b", b"ab", b"ba", b")", b")[", b"[", b"x", b"xy", b"y", b"aba",
          b"\n", b"\n\n", b"c", b"cc"]


class ToyTokenizer:
  """Only `vocab_size`, `encode` and `decode`: stop strings fall back to decoded pieces."""
  vocab_size = len(PIECES)
  eos_id = None

  def decode(self, ids):
    return b"".join(PIECES[int(i)] for i in ids).decode("utf-8")

  def encode(self, text):
    raise NotImplementedError  # never needed: stop strings are not encoded


def first_stop(new_tokens, strings, min_new=0):
  """Brute force: the index of the first new token after which the new text contains a
  stop string (completed by that token, at index >= min_new), or None."""
  text = b""
  for j, t in enumerate(new_tokens):
    before, text = text, text + PIECES[t]
    for s in strings:
      # An occurrence completed by token j ends past `before`.
      if j >= min_new and s in text and text.rfind(s) + len(s) > len(before):
        return j
  return None


def cut(tokens, strings, min_new=0):
  j = first_stop(tokens, strings, min_new)
  return tokens if j is None else tokens[:j + 1]


class TableTest(parameterized.TestCase):

  def test_aho_corasick_table_finds_the_first_completing_token(self):
    rng = np.random.default_rng(0)
    for trial in range(40):
      alphabet = b"ab)"
      strings = [bytes(rng.choice(list(alphabet), rng.integers(1, 4)))
                 for _ in range(rng.integers(1, 4))]
      nxt, hit = stops.token_table(strings, PIECES[:12])
      self.assertEqual(nxt.shape[0] % 16, 0)
      for _ in range(20):
        seq = rng.integers(0, 12, rng.integers(1, 12)).tolist()
        state, got = 0, None
        for j, t in enumerate(seq):
          if hit[state, t]:
            got = j
            break
          state = nxt[state, t]
        self.assertEqual(got, first_stop(seq, strings), (strings, seq))

  def test_token_bytes_of_a_byte_level_vocabulary_rebuild_the_text(self):
    tok = specjax.load_pretrained("stdlib-target").tokenizer
    pieces = tok.token_bytes()
    for text in ["import os\n\ndef f(x):\n    return x[1:]", "café €5 — \t\x00 end"]:
      ids = tok.encode(text)
      self.assertEqual(b"".join(pieces[i] for i in ids), tok.decode(ids).encode("utf-8"))

  def test_decode_fallback_reads_the_pieces(self):
    self.assertEqual(stops.token_bytes(ToyTokenizer()), PIECES)

  def test_ids_past_the_tokenizer_add_no_text(self):
    # A model's embedding padded past its tokenizer (Qwen2): the table covers every id.
    nxt, hit = stops.tokenizer_table(ToyTokenizer(), [b"ab"], vocab=20)
    self.assertEqual(nxt.shape[1], 20)
    a = nxt[0, 1]  # after "a"
    self.assertTrue(hit[a, 2])  # "b" completes it
    self.assertFalse(hit[a, 18])
    self.assertEqual(nxt[a, 18], a)  # an empty token keeps the state


def mid_strings(rows):
  """One two-byte string from the middle of each row's text."""
  out = []
  for row in rows:
    text = b"".join(PIECES[t] for t in row)
    if len(text) >= 4:
      out.append(text[len(text) // 2:len(text) // 2 + 2])
  return out


def toy_target(seed=3):
  model = tiny_model(vocab=16, n_layers=2, seed=seed)
  model.tokenizer = ToyTokenizer()
  return model


class EngineTest(parameterized.TestCase):
  """A stop only truncates: rows draw their own random numbers, so a run with stop
  strings is the same run without them, each row cut at its first completing token."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.target = toy_target()
    cls.draft = tiny_model(vocab=16, n_layers=1, seed=5)

  def run_pair(self, spec, prompts=PROMPTS, min_new=0, pick=None):
    kw = dict(max_new_tokens=14, temperature=1.0, seed=2, min_new_tokens=min_new, **spec)
    plain = specjax.generate(self.target, prompts, **kw).tokens
    strings = pick(plain) if pick else mid_strings(plain)
    res = specjax.generate(self.target, prompts, stop_sequences=strings, **kw)
    self.last = res
    return plain, strings, res.tokens

  @parameterized.named_parameters(
      ("autoregressive", {}),
      ("draft_model", dict(draft="draft", gamma=4)),
      ("self_draft", dict(draft="target", gamma=4)),  # fully accepted: stops inside a round
      ("ngram", dict(drafter="ngram", gamma=3)),
      ("tree", dict(draft="draft", tree=(2, 1, 1))))
  def test_rows_are_cut_at_the_first_token_completing_a_string(self, spec):
    if "draft" in spec:
      spec = dict(spec, draft=self.draft if spec["draft"] == "draft" else self.target)
    plain, strings, res = self.run_pair(spec, prompts=PROMPTS * 2)
    cuts = [cut(row, strings) for row in plain]
    self.assertEqual(res, cuts)
    early = [c for c in cuts if len(c) < 14]
    self.assertGreater(len(early), 1)
    # Some row ends on a token that is not itself a stop string: a token-id match on the
    # strings' own encodings would have run on.
    self.assertTrue(any(PIECES[c[-1]] not in strings for c in early), (strings, early))
    # stop_reasons name the string (as given) the row's text holds: with no
    # min_new_tokens, one ending at its last token (else it would have stopped before).
    text = lambda row: b"".join(PIECES[t] for t in row)
    named = [next((s for s in strings if s in text(c)), None) for c in cuts]
    self.assertEqual(self.last.stop_reasons, named)
    self.assertEqual([r is not None for r in named], [f == "stop" for f in self.last.finish_reasons])

  def test_a_match_across_the_prompt_boundary_does_not_stop_the_row(self):
    prompt = [1, 2, 5]  # its text ends in ")"
    pick = lambda plain: [b")" + next(PIECES[t] for t in plain[0] if PIECES[t])[:1]]
    plain, strings, res = self.run_pair({}, prompts=[prompt], pick=pick)
    self.assertEqual(res, [cut(plain[0], strings)])

  def test_min_new_tokens_defers_a_match(self):
    pick = lambda plain: [b"x", b"a", b")", b"b"]  # early in nearly every row
    plain, strings, res = self.run_pair(dict(draft=self.draft, gamma=4), min_new=3, pick=pick)
    self.assertEqual(res, [cut(row, strings, min_new=3) for row in plain])
    self.assertTrue(any(first_stop(row, strings) < 3 for row in plain))
    # The named string is the first (as given) whose text ends inside the last token,
    # not one that matched, uncounted, within the first three.
    def ending_last(row):
      text, before = b"".join(PIECES[t] for t in row), b"".join(PIECES[t] for t in row[:-1])
      return next((s for s in strings if any(text[:k].endswith(s) for k in
                                             range(len(before) + 1, len(text) + 1))), None)
    named = [ending_last(c) if f == "stop" else None
             for c, f in zip(res, self.last.finish_reasons)]
    self.assertEqual(self.last.stop_reasons, named)
    self.assertTrue(any(r is not None and r != next(s for s in strings if s in
                                                    b"".join(PIECES[t] for t in c))
                        for r, c in zip(named, res)), named)  # an earlier match was skipped

  @parameterized.named_parameters(
      ("empty", [""], "stop sequence 0 is empty"),
      ("empty_bytes", [b"a", b""], "stop sequence 1 is empty"),
      ("too_long", ["x" * 2 ** 24], "stop strings too long"))
  def test_bad_stop_strings(self, stops_arg, message):
    with self.assertRaisesRegex(ValueError, message):
      specjax.generate(self.target, PROMPTS, max_new_tokens=4, stop_sequences=stops_arg)


if __name__ == "__main__":
  absltest.main()
