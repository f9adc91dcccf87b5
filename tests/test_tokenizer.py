"""Byte-level BPE: exact round trips on real source text, the end-of-text token, files."""

import json

import numpy as np
import pytest

from conftest import byte_bpe
from specjax.models.tokenizer import EOS_TOKEN, Tokenizer
from specjax.training import data

TRICKY = ("naïve café — λx: x² → 日本語 🐍\n\tmixed\tindent  \r\n"
          "trailing spaces   \n\x00\x7f control\u200b zero-width \ufeff bom\n")


@pytest.fixture(scope="module")
def source_texts():
  """A few real standard-library files, some with non-ASCII characters."""
  root = data.stdlib_root()
  paths = [root / p for p in ("textwrap.py", "string.py", "heapq.py", "colorsys.py")]
  texts = [p.read_text(encoding="utf-8") for p in paths if p.is_file()]
  non_ascii = []
  for rel in data.list_files(root, (".py",)):
    text = (root / rel).read_text(encoding="utf-8")
    if any(ord(c) > 127 for c in text) and len(text) < 50_000:
      non_ascii.append(text)
    if len(non_ascii) == 3:
      break
  assert len(texts) >= 3 and len(non_ascii) == 3
  return texts, non_ascii


@pytest.fixture(scope="module")
def tokenizer(source_texts):
  texts, _ = source_texts
  return Tokenizer.train(texts, vocab_size=400)


def test_train_sizes_and_eos(tokenizer):
  assert tokenizer.vocab_size == 400
  assert tokenizer.eos_id == 0 and tokenizer.eos_token == EOS_TOKEN
  assert tokenizer.encode(EOS_TOKEN) == [0]


def test_round_trip_real_source_including_non_ascii(tokenizer, source_texts):
  texts, non_ascii = source_texts
  for text in texts + non_ascii + [TRICKY, "", " ", "\n\n"]:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_merges_compress_source(tokenizer, source_texts):
  text = source_texts[0][0]
  assert len(tokenizer.encode(text)) < 0.6 * len(text.encode("utf-8"))


def test_token_byte_lengths_sum_to_text_bytes(tokenizer, source_texts):
  lengths = tokenizer.token_byte_lengths()
  assert lengths.shape == (tokenizer.vocab_size,) and lengths[tokenizer.eos_id] == 0
  for text in source_texts[1] + [TRICKY]:
    assert lengths[np.asarray(tokenizer.encode(text))].sum() == len(text.encode("utf-8"))


def test_save_and_load_file(tokenizer, tmp_path, source_texts):
  path = tokenizer.save(tmp_path / "tokenizer.json")
  loaded = Tokenizer.from_file(path)
  same_dir = Tokenizer.from_file(tmp_path)
  text = source_texts[1][0]
  assert loaded.encode(text) == tokenizer.encode(text) == same_dir.encode(text)
  assert loaded.eos_id == tokenizer.eos_id and loaded.vocab_size == tokenizer.vocab_size


def test_hugging_face_style_file_finds_its_eos(tmp_path):
  # A tokenizer.json whose end token goes by another common name, as in Llama-style files.
  hf = byte_bpe(["def f(x):\n    return x\n"] * 10, 300, ["<s>", "</s>"])
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert tok.eos_token == "</s>" and tok.eos_id == 1 and tok.eos_ids == (1,)
  assert tok.decode(tok.encode(TRICKY)) == TRICKY
  # Llama's files put <s> before a text in their post-processor: a prompt gets it (as
  # transformers' tokenizer(text) does), a piece of text (a stop string) does not.
  tok = Tokenizer(byte_bpe(["def f(x):\n    return x\n"] * 10, 300, ["<s>", "</s>"], bos="<s>"))
  ids = tok.encode("def f(x):")
  assert tok.encode_prompt("def f(x):") == [0] + ids and 0 not in ids
  # Output text leaves special tokens out (vLLM's), and ids past the table (a padded
  # embedding); decode keeps the former and refuses the latter.
  assert tok.decode_text([0] + ids + [1, 300, 10**6]) == "def f(x):"
  assert tok.decode([0] + ids + [1]) == "<s>def f(x):</s>"
  assert tok.token_bytes()[0] == tok.token_bytes()[1] == b""
  more = Tokenizer(hf, more_eos_ids=[0, 1, 0])  # a chat model's end-of-turn, say
  assert more.eos_id == 1 and more.eos_ids == (1, 0)
  with pytest.raises(ValueError, match=r"end-of-text ids \[300\] are not in the vocabulary"):
    Tokenizer(hf, more_eos_ids=[300])


def test_bad_input(tokenizer, tmp_path):
  with pytest.raises(ValueError, match="str"):
    tokenizer.encode(b"bytes")
  with pytest.raises(ValueError, match="out of range"):
    tokenizer.decode([tokenizer.vocab_size])
  with pytest.raises(ValueError, match="at least"):
    Tokenizer.train(["x"], vocab_size=100)
  with pytest.raises(FileNotFoundError, match="nope"):
    Tokenizer.from_file(tmp_path / "nope.json")
  (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
  with pytest.raises(ValueError, match="bad.json"):
    Tokenizer.from_file(tmp_path / "bad.json")


def test_corpus_split_is_deterministic_and_disjoint(tmp_path):
  for i in range(40):
    (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
  (tmp_path / "latin1.py").write_bytes("é = 1\n".encode("latin-1"))  # not UTF-8: skipped
  a = data.load_corpus(str(tmp_path), heldout_fraction=0.25)
  b = data.load_corpus(str(tmp_path), heldout_fraction=0.25)
  assert a == b and not set(a.train) & set(a.heldout)
  assert len(a.train) + len(a.heldout) == 40 and "latin1.py" not in a.train + a.heldout
  # A file's side depends on its own path only.
  (tmp_path / "new.py").write_text("y = 1\n")
  c = data.load_corpus(str(tmp_path), heldout_fraction=0.25)
  assert set(a.heldout) <= set(c.heldout) and set(a.train) <= set(c.train)
  with pytest.raises(ValueError, match="does not exist"):
    data.load_corpus(str(tmp_path / "missing"))
  for empty in ("", " "):
    with pytest.raises(ValueError, match="corpus source must be 'stdlib', a directory or"):
      data.load_corpus(empty)


def test_stream_and_batches(tokenizer, tmp_path):
  stream = data.token_stream(tokenizer, ["ab", "cd"])
  assert (stream == tokenizer.eos_id).sum() == 2 and stream[-1] == tokenizer.eos_id
  long = np.arange(1000, dtype=np.int32)
  b1 = data.batch_at(long, step=3, batch_size=4, seq_len=16, seed=1)
  assert b1.shape == (4, 17)
  np.testing.assert_array_equal(b1, data.batch_at(long, 3, 4, 16, seed=1))
  assert not np.array_equal(b1, data.batch_at(long, 4, 4, 16, seed=1))
  np.testing.assert_array_equal(np.diff(b1, axis=1), 1)  # contiguous windows
  w = data.eval_windows(long, 16, 5)
  assert w.shape == (5, 17) and w[0, 0] == 0 and w[-1, -1] == 999
  with pytest.raises(ValueError, match="shorter"):
    data.batch_at(long[:10], 0, 1, 16)
