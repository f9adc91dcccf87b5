"""experiments/prompts.py: Spec-Bench questions or the built-in list, chat templates, buckets."""

import json

import numpy as np
import pytest

from conftest import byte_bpe
from experiments import prompts


class CharTokenizer:
  """One token per character: lengths are easy to reason about."""

  def encode(self, text):
    return [ord(c) % 97 for c in text]


def _spec_bench_file(path, n=6):
  categories = ["writing", "math", "translation"]
  lines = [json.dumps({"question_id": i, "category": categories[i % 3],
                       "turns": ["q" * (10 + 20 * (i % 2)) + str(i), "a second turn"]})
           for i in range(n)]
  lines.insert(2, "")  # blank lines are skipped
  path.write_text("\n".join(lines) + "\n")
  return path


def test_questions_from_a_spec_bench_file(tmp_path):
  path = _spec_bench_file(tmp_path / "question.jsonl")
  questions, source = prompts.load_questions(path.as_uri())
  assert source.startswith("Spec-Bench (6 questions")
  assert [q["id"] for q in questions] == list(range(6))
  assert questions[1] == {"id": 1, "category": "math", "text": "q" * 30 + "1"}  # first turn


@pytest.mark.parametrize("url", [None, "", "file:///no/such/question.jsonl"])
def test_no_file_or_no_url_gives_the_builtin_prompts(url):
  questions, source = prompts.load_questions(url)
  assert source.startswith("built-in")
  assert len(questions) == len(prompts.BUILTIN) >= 10
  assert len({q["category"] for q in questions}) >= 8


def test_a_file_without_questions_gives_the_builtin_prompts(tmp_path):
  path = tmp_path / "question.jsonl"
  path.write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
  questions, source = prompts.load_questions(path.as_uri())
  assert source.startswith("built-in (ValueError")


def test_select_takes_one_bucket_with_categories_interleaved(tmp_path):
  questions, _ = prompts.load_questions(_spec_bench_file(tmp_path / "q.jsonl", n=12).as_uri())
  ids, chosen = prompts.select(questions, CharTokenizer(), "plain", 4, max_tokens=200)
  lengths = [len(p) for p in ids]
  # 'Question: ' + text + '\n\nAnswer:' is 19 + 11 or 19 + 31 characters: buckets 32, 64.
  assert len({-(-n // 16) for n in lengths}) == 1
  assert len({q["category"] for q in chosen}) == 3
  assert all(q["prompt"].startswith("Question: q") and "ids" not in q for q in chosen)
  assert ids[0] == CharTokenizer().encode(chosen[0]["prompt"])


def test_select_fills_from_other_buckets_then_repeats(tmp_path):
  questions, _ = prompts.load_questions(_spec_bench_file(tmp_path / "q.jsonl", n=3).as_uri())
  ids, chosen = prompts.select(questions, CharTokenizer(), "plain", 5, max_tokens=200)
  assert [q["id"] for q in chosen] == [0, 2, 1, 0, 2]  # the fuller bucket (0, 2) first
  ids, chosen = prompts.select(questions, CharTokenizer(), "plain", 2, max_tokens=40)
  assert [q["id"] for q in chosen] == [0, 2]  # the longer one does not fit


def test_select_refuses_what_cannot_work():
  questions = prompts.builtin_questions()
  with pytest.raises(ValueError, match="unknown template"):
    prompts.select(questions, CharTokenizer(), "vicuna", 2, max_tokens=100)
  with pytest.raises(ValueError, match="fits in 10 tokens"):
    prompts.select(questions, CharTokenizer(), "plain", 2, max_tokens=10)


def test_every_pair_has_a_template():
  from configs import sweep
  for variant in (*sweep.HUB_PAIRS, "gpt2"):
    assert prompts.PAIR_TEMPLATES[variant] in prompts.TEMPLATES
  assert all("{q}" in t for t in prompts.TEMPLATES.values())


@pytest.mark.parametrize("bos", [False, True])
def test_prompts_start_as_the_tokenizer_starts_a_text(tmp_path, monkeypatch, bos):
  """A Llama tokenizer's BOS (from its post-processor) begins every prompt, held-out
  windows cut from inside a document (counted in their length) and templated questions,
  as its training text and transformers' tokenizer(text) begin; a GPT-2 style one adds
  nothing."""
  from experiments import common
  from specjax.models.tokenizer import Tokenizer
  tok = Tokenizer(byte_bpe(["the cat sat on the mat\n"] * 10, 280, ["<s>", "</s>"],
                           bos="<s>" if bos else None))
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(f"line {i}: the cat sat on the mat\n" for i in range(400)))
  windows = common.heldout_prompts(tok, str(corpus), 3, 12)
  assert [len(w) for w in windows] == [12] * 3
  for w in windows:
    assert (w[0] == 0) == bos and 0 not in w[1:]
  ids, _ = prompts.select([{"id": 1, "category": "x", "text": "the cat"}], tok, "plain", 1,
                          max_tokens=50)
  assert ids[0] == [0] * bos + tok.encode(prompts.TEMPLATES["plain"].format(q="the cat"))
  # A template that writes the BOS itself (Llama 3's) keeps one, as chat templates do.
  monkeypatch.setitem(prompts.TEMPLATES, "own_bos", "<s>Q: {q}")
  ids, _ = prompts.select([{"id": 1, "category": "x", "text": "the cat"}], tok, "own_bos", 1,
                          max_tokens=50)
  assert ids[0] == tok.encode("<s>Q: the cat") and ids[0].count(0) == 1
  # A tokenizer object whose encode gives an array (or a tuple) gets the same windows.
  class ArrayTokenizer:
    encode = staticmethod(lambda text: np.asarray(tok.encode(text)))
    encode_prompt = staticmethod(lambda text: tuple(tok.encode_prompt(text)))
  assert common.heldout_prompts(ArrayTokenizer(), str(corpus), 3, 12) == windows
  with pytest.raises(ValueError, match="no room for text"):
    common.heldout_prompts(tok, str(corpus), 1, 1 if bos else 0)
