"""Chat-style prompts for sweeps on public instruct pairs (notebooks/tpu_real_pair.ipynb).

Questions come from Spec-Bench's question.jsonl (480 questions: the 80 of MT-Bench, then
translation, summarization, QA, math reasoning and RAG), downloaded at run time, or from
`BUILTIN`, ten short instructions written for this project, when there is no network.
`select` formats them with a chat template, tokenizes them and picks prompts of one
length bucket, so every `specjax.generate` call of a sweep reuses one compiled engine.
"""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections import defaultdict

from specjax import checks
from specjax.models import tokenizer as tokenizer_lib

SPEC_BENCH_URL = ("https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/"
                  "spec_bench/question.jsonl")

# (category, instruction); the categories follow Spec-Bench's.
BUILTIN = (
    ("writing", "Write a short, friendly email inviting a colleague to a Friday lunch."),
    ("roleplay", "You are a ship's cook in 1850. Describe today's dinner in three sentences."),
    ("reasoning", "If all bloops are razzies and some razzies are lazzies, are some bloops "
                  "necessarily lazzies? Explain briefly."),
    ("math", "A train travels 180 km in 2.5 hours. What is its average speed in km/h? "
             "Show the steps."),
    ("coding", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("extraction", "List the cities in this sentence as a JSON array: We flew from Lisbon to "
                   "Oslo and then took a train to Bergen."),
    ("stem", "Explain in simple terms why the sky is blue."),
    ("translation", "Translate into English: Le chat dort sur le canape depuis ce matin."),
    ("summarization", "Summarize in one sentence: The city council met on Tuesday and voted "
                      "to extend the library's opening hours on weekends, starting in May."),
    ("qa", "What are three common uses of a hash table?"),
)

# Chat templates by name; '{q}' is the instruction. Text only: the tokenizer turns the
# special-token strings into their ids (they are added tokens in these vocabularies).
TEMPLATES = {
    # Qwen3 post-trained models, thinking off (what the chat template writes for
    # enable_thinking=False).
    "qwen3": "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    # Qwen2 / Qwen2.5 (instruct models; base models know the format too).
    "chatml": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
    # Llama 3.x Instruct.
    "llama3_chat": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{q}<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    # Llama 3.x base models: no chat tokens, a beginning-of-text token.
    "llama3_base": "<|begin_of_text|>Question: {q}\n\nAnswer:",
    # Base models without special tokens (GPT-2).
    "plain": "Question: {q}\n\nAnswer:",
}

# configs/sweep.py variant -> template for its models.
PAIR_TEMPLATES = {"qwen3": "qwen3", "qwen25": "chatml", "llama3": "llama3_base", "gpt2": "plain"}


def builtin_questions() -> list[dict]:
  return [{"id": f"builtin-{i}", "category": c, "text": t} for i, (c, t) in enumerate(BUILTIN)]


def parse_spec_bench(text: str) -> list[dict]:
  """question.jsonl lines -> [{'id', 'category', 'text'}], the first turn of each."""
  questions = []
  for line in text.splitlines():
    if not line.strip():
      continue
    row = json.loads(line)
    turns = row.get("turns") or []
    if turns and isinstance(turns[0], str) and turns[0].strip():
      questions.append({"id": row.get("question_id"), "category": row.get("category", ""),
                        "text": turns[0]})
  if not questions:
    raise ValueError("no questions with a first turn")
  return questions


def load_questions(url: str | None = SPEC_BENCH_URL, timeout: float = 20.0):
  """(questions, source): Spec-Bench's from `url`, else `BUILTIN` (no url, no network).

  `url` may be any urllib URL, file:// included. Any failure falls back to the built-in
  list; `source` says which list it is and why.
  """
  if not url:
    return builtin_questions(), "built-in (no URL given)"
  try:
    with urllib.request.urlopen(url, timeout=timeout) as response:
      questions = parse_spec_bench(response.read().decode("utf-8"))
    return questions, f"Spec-Bench ({len(questions)} questions from {url})"
  except Exception as e:  # no network, HTTP errors, a bad file: the built-in list
    return builtin_questions(), f"built-in ({type(e).__name__} fetching {url}: {e})"


def _interleave(items: list[dict]) -> list[dict]:
  """Round-robin over categories, so a few prompts already span several tasks."""
  by_category = defaultdict(list)
  for item in items:
    by_category[item["category"]].append(item)
  rounds = itertools.zip_longest(*by_category.values())
  return [item for group in rounds for item in group if item is not None]


def select(questions: list[dict], tokenizer, template: str, n: int, max_tokens: int,
           width: int = 16) -> tuple[list[list[int]], list[dict]]:
  """`n` templated, tokenized prompts of at most `max_tokens` tokens, from few length buckets.

  `specjax.generate` compiles one engine per prompt width rounded up to a multiple of 16
  (and per cache size); prompts are taken from the fullest bucket first, categories
  interleaved, then from the next fullest. With fewer than `n` fitting questions the list
  repeats. Returns (token-id lists, the chosen questions with their 'prompt' text).
  """
  if template not in TEMPLATES:
    raise ValueError(f"unknown template {template!r}; known: {sorted(TEMPLATES)}")
  buckets = defaultdict(list)
  prefix = tokenizer_lib.prompt_prefix(tokenizer)  # a Llama tokenizer's BOS
  for q in questions:
    text = TEMPLATES[template].format(q=q["text"])
    ids = list(tokenizer.encode(text))
    if ids[:len(prefix)] != prefix:  # one BOS: Llama 3's templates write their own
      ids = prefix + ids
    if 0 < len(ids) <= max_tokens:
      buckets[checks.round_up(len(ids), width)].append(dict(q, prompt=text, ids=ids))
  if not buckets:
    raise ValueError(f"no question fits in {max_tokens} tokens with template {template!r}")
  chosen = []
  for width_ in sorted(buckets, key=lambda w: (-len(buckets[w]), w)):
    chosen += _interleave(buckets[width_])[:n - len(chosen)]
    if len(chosen) == n:
      break
  chosen = [chosen[i % len(chosen)] for i in range(n)]
  return ([q["ids"] for q in chosen],
          [{k: v for k, v in q.items() if k != "ids"} for q in chosen])
