"""Pieces the sweep and the benchmark share: models by name, prompts, timed decoding."""

from __future__ import annotations

import time

import numpy as np

import specjax
from specjax import costs
from specjax import data as data_lib
from specjax import generation
from specjax.pretrained import load_pretrained


def load_pair(target_name: str, draft_name: str | None):
  target = load_pretrained(target_name)
  draft = load_pretrained(draft_name) if draft_name else None
  if draft is not None and draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft {draft_name!r} (vocab {draft.config.vocab_size}) and target "
                     f"{target_name!r} (vocab {target.config.vocab_size}) differ")
  return target, draft


def heldout_prompts(tokenizer, corpus: str, num_prompts: int, prompt_tokens: int,
                    seed: int = 0) -> list[list[int]]:
  """`num_prompts` windows of `prompt_tokens` tokens from distinct held-out documents."""
  texts = data_lib.load_corpus(corpus).read("heldout")
  rng = np.random.default_rng(seed)
  prompts = []
  for i in rng.permutation(len(texts)):
    ids = tokenizer.encode(texts[i])
    if len(ids) < prompt_tokens + 1:
      continue
    start = int(rng.integers(0, len(ids) - prompt_tokens))
    prompts.append(ids[start:start + prompt_tokens])
    if len(prompts) == num_prompts:
      return prompts
  if not prompts:
    raise ValueError(f"no held-out document of corpus {corpus!r} has {prompt_tokens} tokens")
  return [prompts[i % len(prompts)] for i in range(num_prompts)]


def timed_generate(target, prompts, batch_size: int, repeats: int, **kwargs):
  """Decodes all prompts in batches; returns (best wall seconds, merged stats, tokens).

  The first pass compiles and is not timed (every batch has the same shape, so one
  compile serves all of them).
  """
  batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
  if len(batches[-1]) < batch_size:  # keep one shape: pad with repeats of the first prompt
    batches[-1] = batches[-1] + [prompts[0]] * (batch_size - len(batches[-1]))
  specjax.generate(target, batches[0], **kwargs)
  best, results = float("inf"), None
  for _ in range(max(repeats, 1)):
    start = time.perf_counter()
    run = [specjax.generate(target, b, **kwargs) for b in batches]
    elapsed = time.perf_counter() - start
    if elapsed < best:
      best, results = elapsed, run
  return best, merge_stats([r.stats for r in results]), [t for r in results for t in r.tokens]


def merge_stats(stats: list[dict]) -> dict:
  """Sums the counters of several generate calls and recomputes the rates."""
  counts = {}
  for key in generation.COUNTERS:
    values = [s[key] for s in stats]
    counts[key] = ([int(x) for x in np.sum(values, axis=0)] if isinstance(values[0], list)
                   else sum(values))
  return dict(gamma=stats[0]["gamma"], **generation.with_rates(counts))


def step_costs(target, draft, drafter: str, gamma: int, batch: int, context: int,
               ngram=(1, 4), draft_sample="probabilistic", repeats: int = 3,
               temperature: float = 1.0):
  """Measured c (draft step / target step) and v(γ) ((γ+1)-token pass / 1-token pass)."""
  cache = context + gamma + 130
  t1 = costs.forward_cost(target, batch, 1, context=context, cache_size=cache, repeats=repeats)
  tv = costs.forward_cost(target, batch, gamma + 1, context=context, cache_size=cache,
                          repeats=repeats)
  obj = generation.make_drafter(target, draft, drafter, gamma, draft_sample, *ngram)
  params = draft.params if drafter == "model" else None
  propose = costs.propose_cost(obj, params, batch, target.config.vocab_size, context=context,
                               repeats=repeats, temperature=temperature)
  return {"target_step_s": t1, "verify_s": tv, "propose_s": propose,
          "c": propose / gamma / t1, "v": tv / t1}
