"""Pieces the apps share: models by name, held-out prompts and windows, timed decoding."""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import costs
from specjax import decode as decode_lib
from specjax.training import data as data_lib
from specjax import arguments
from specjax import prepare as prepare_lib
from specjax import results
from specjax.models import heads as heads_lib
from specjax.models import tokenizer as tokenizer_lib
from specjax.models.pretrained import load_pretrained, read_config


# The shipped draft of each drafter that needs one.
DEFAULT_DRAFTS = {"model": "stdlib-draft", "eagle": "stdlib-eagle", "eagle3": "stdlib-eagle3",
                  "medusa": "stdlib-medusa"}

# Every history-dependent processor but the automaton, for their share of a round.
PROCESSORS = dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1,
                  no_repeat_ngram_size=3, min_new_tokens=4, logit_bias={0: -1.0})


def check_pair(target_name: str, draft_name: str | None) -> None:
  """Raises, naming both, where the draft cannot go with the target, from their configs
  alone: nothing is loaded (a hub id's config is not fetched; `load_pair` checks it)."""
  target = read_config(target_name)
  draft = read_config(draft_name) if draft_name else None
  if target is None or draft is None:
    return
  if isinstance(target, heads_lib.HeadConfig):
    raise ValueError(f"target {target_name!r} is a draft head, not a model")
  if isinstance(draft, heads_lib.HeadConfig):
    draft.check_target_config(target)
  elif draft.vocab_size > target.vocab_size:  # a smaller draft vocabulary is padded
    raise ValueError(f"draft {draft_name!r} (vocab {draft.vocab_size}) and target "
                     f"{target_name!r} (vocab {target.vocab_size}) differ")


def load_pair(target_name: str, draft_name: str | None, dtype=jnp.float32):
  check_pair(target_name, draft_name)  # before gigabytes of weights are read
  target = load_pretrained(target_name, dtype=dtype)
  draft = load_pretrained(draft_name, dtype=dtype) if draft_name else None
  if isinstance(draft, heads_lib.Head):  # a draft head (stdlib-eagle, stdlib-medusa)
    draft.check_target(target)
    return target, draft
  if draft is not None and draft.config.vocab_size < target.config.vocab_size:
    # Same tokenizer, fewer embedding rows (Qwen2.5-0.5B vs 7B): zero rows never win.
    from specjax import hf
    draft = hf.pad_vocab(draft, target.config.vocab_size)
  if draft is not None and draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft {draft_name!r} (vocab {draft.config.vocab_size}) and target "
                     f"{target_name!r} (vocab {target.config.vocab_size}) differ")
  return target, draft


def drafter_pair(target_name: str, drafter: str, draft_name: str | None, gamma: int):
  """The target, the drafter's model or head (None for prompt lookup; by default the
  shipped one), and the generate keywords that name the drafter, its draft and γ."""
  if drafter == "ngram" and draft_name:
    raise ValueError(f"--drafter=ngram drafts from the context: drop --draft={draft_name}")
  if drafter != "ngram":
    draft_name = draft_name or DEFAULT_DRAFTS[drafter]
  target, draft = load_pair(target_name, draft_name if drafter != "ngram" else None)
  kw = dict(drafter=drafter, gamma=gamma, **({} if draft is None else {"draft": draft}))
  return target, draft, kw


def refuse_flags(names, why: str) -> None:
  """An app's flags that the chosen part does not read: set, they are a mistake to name."""
  for name in names:
    if flags.FLAGS[name].present:
      raise app.UsageError(f"--{name} {why}")


def heldout_prompts(tokenizer, corpus: str | data_lib.Corpus, num_prompts: int,
                    prompt_tokens: int, seed: int = 0) -> list[list[int]]:
  """`num_prompts` windows of `prompt_tokens` tokens from distinct held-out documents of
  `corpus` (a source `load_corpus` takes, or a corpus it returned). Each starts with what
  the tokenizer's post-processor puts before a prompt (a Llama tokenizer's BOS, counted
  in `prompt_tokens`), as the model's training text did."""
  if isinstance(corpus, data_lib.Corpus):
    texts, corpus = corpus.read("heldout"), str(corpus.root)
  else:
    texts = data_lib.load_corpus(corpus).read("heldout")
  prefix = tokenizer_lib.prompt_prefix(tokenizer)
  window = prompt_tokens - len(prefix)
  if window < 1:
    raise ValueError(f"prompt_tokens={prompt_tokens} leaves no room for text after the "
                     f"tokenizer's {len(prefix)} prompt prefix ids")
  rng = np.random.default_rng(seed)
  prompts = []
  for i in rng.permutation(len(texts)):
    ids = [int(t) for t in tokenizer.encode(texts[i])]
    if len(ids) < window + 1:
      continue
    start = int(rng.integers(0, len(ids) - window))
    prompts.append(prefix + ids[start:start + window])
    if len(prompts) == num_prompts:
      return prompts
  if not prompts:
    raise ValueError(f"no held-out document of corpus {corpus!r} has {prompt_tokens} tokens")
  return [prompts[i % len(prompts)] for i in range(num_prompts)]


def heldout_windows(tokenizer, seq_len: int, num_windows: int) -> np.ndarray:
  """Fixed windows of `seq_len` tokens spread over the held-out split of this
  interpreter's stdlib: the text the shipped models' cards measure (and the tests
  re-measure a slice of)."""
  corpus = data_lib.load_corpus(data_lib.STDLIB, heldout_fraction=0.05)
  stream = data_lib.token_stream(tokenizer, corpus.read("heldout"))
  return data_lib.eval_windows(stream, seq_len, num_windows)


def _batches(prompts, batch_size: int):
  """Prompts in batches of one shape: the last is padded with repeats of the first prompt."""
  batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
  if len(batches[-1]) < batch_size:
    batches[-1] = batches[-1] + [prompts[0]] * (batch_size - len(batches[-1]))
  return batches


def paired_generate(target, prompts, batch_size: int, pairs: int, method: dict,
                    baseline: dict) -> dict:
  """Times `generate(**method)` against `generate(**baseline)`, alternately, on all prompts.

  One warm-up pass of each compiles (every batch has one shape); batch i uses seed + i.
  Returns both sides'
  merged stats, tokens and median tokens/s, and the paired speedup (median ratio of
  baseline time to method time, with its min and max).
  """
  batches = _batches(prompts, batch_size)
  outputs = {}

  def runner(name, kwargs):
    # Batch i draws with seed + i (both sides alike): one seed for every batch would give
    # each batch the same random stream, and a rule that ignores the tokens (synthetic)
    # the same acceptances, so the batches would not be independent samples.
    seed = kwargs.get("seed", 0)

    def run():
      outputs[name] = [specjax.generate(target, b, **dict(kwargs, seed=seed + i))
                       for i, b in enumerate(batches)]
    return run

  timing = costs.paired(runner("method", method), runner("baseline", baseline), pairs=pairs)
  out = {"speedup": timing["ratio"], "speedup_min": timing["ratio_min"],
         "speedup_max": timing["ratio_max"], "pairs": len(timing["method_s"])}
  for name, times in (("method", timing["method_s"]), ("baseline", timing["baseline_s"])):
    results = outputs[name]
    stats = merge_stats([r.stats for r in results])
    out[name] = {"stats": stats, "tokens": [t for r in results for t in r.tokens],
                 "seconds": statistics.median(times),
                 "tokens_per_s": stats["committed"] / statistics.median(times)}
  return out


def merge_stats(stats: list[dict]) -> dict:
  """Sums the counters of several generate calls and recomputes the rates."""
  counts = {}
  for key in results.COUNTERS:
    values = [s[key] for s in stats]
    counts[key] = (np.sum(values, axis=0).tolist() if isinstance(values[0], list)
                   else sum(values))
  return dict(gamma=stats[0]["gamma"], lossless=all(s.get("lossless", True) for s in stats),
              **results.with_rates(counts))


def step_costs(target, draft, drafter: str, gamma: int, batch: int, context: int,
               ngram=(1, 4), draft_sample="probabilistic", repeats: int = 5,
               temperature: float = 1.0, tree=None):
  """`costs.step_costs` for a drafter named as in `specjax.generate`.

  draft: the draft model for 'model', the head for 'eagle' / 'medusa' (unused for 'ngram').
  """
  draft = None if drafter == "ngram" else draft
  obj = arguments.make_drafter(target, draft, drafter, None if tree else gamma, draft_sample,
                                *ngram, tree=tree)
  if drafter in arguments.HEAD_DRAFTERS:
    params = draft.draft_params(target)
  else:
    params = draft.params if drafter == "model" else None
  return costs.step_costs(target, obj, params, batch, context, temperature=temperature,
                          repeats=repeats)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
  """rows as a Markdown table; columns are (header, key, format spec or 'x' for a ratio).

  A '{key}' with min/max siblings ('{key}_min', '{key}_max') prints as 'v (min–max)'.
  """
  head = "| " + " | ".join(h for h, _, _ in columns) + " |"
  lines = [head, "|" + "---|" * len(columns)]
  for row in rows:
    cells = []
    for _, key, fmt in columns:
      value = row.get(key)
      if value is None:
        cells.append("")
        continue
      ratio = fmt == "x"
      text = f"{value:.2f}x" if ratio else format(value, fmt)
      if f"{key}_min" in row and f"{key}_max" in row:
        lo, hi = row[f"{key}_min"], row[f"{key}_max"]
        text += f" ({lo:.2f}–{hi:.2f})" if ratio else f" ({lo:{fmt}}–{hi:{fmt}})"
      cells.append(text)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def quartiles(values) -> dict:
  """Median and quartiles (linear interpolation) of a list of ratios."""
  return {"median": statistics.median(values), "q1": float(np.percentile(values, 25)),
          "q3": float(np.percentile(values, 75))}


def spread(q: dict) -> str:
  """'median [q1, q3]' of `quartiles`."""
  return f"{q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}]"


def write_rows(path, rows: list[dict]) -> None:
  """rows as a JSON-lines file."""
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def paired_rounds(target, prompts, sides: dict[str, dict], repeats: int):
  """Each side's `generate` keywords, one prompt a call, the sides alternating (their
  order flipped from call to call). Returns (each side's stats per prompt, from an
  untimed call that also compiles it; its seconds per round of each timed call)."""
  call = lambda kw, i: specjax.generate(target, [prompts[i]], seed=i, **kw)
  stats = {name: [call(kw, i).stats for i in range(len(prompts))]
           for name, kw in sides.items()}
  names = list(sides)
  secs = {name: [] for name in names}
  for r in range(repeats):
    for i in range(len(prompts)):
      for name in (names if (r + i) % 2 == 0 else names[::-1]):
        start = time.perf_counter()
        call(sides[name], i)  # generate returns host lists: the call has finished
        secs[name].append((time.perf_counter() - start) / stats[name][i]["rounds"])
  return stats, secs


def compare_calls(target, prompts, base: dict, variants: dict[str, dict],
                  rounds: int) -> dict:
  """Whole `generate` calls of target-only (`base`) and each variant (`base` + its
  arguments), one prompt a call, each round over the prompts in an order that flips
  from prompt to prompt (`experiments.bench --part=calls`).

  Returns {side: {call_s, speedup (quartiles of target-only / side), tokens_per_round,
  drafted_per_round, tokens (the new tokens of each prompt)}} and, for each variant
  after the first, its quartiles of first / it under 'against_first'.
  """
  sides = {"target-only": dict(base), **{k: dict(base, **v) for k, v in variants.items()}}
  call = lambda kw, i: specjax.generate(target, [prompts[i]], seed=i, **kw)
  out = {}
  for name, kw in sides.items():  # compiles, and the counts (a call is deterministic)
    results = [call(kw, i) for i in range(len(prompts))]
    rounds_run = sum(r.stats["rounds"] for r in results)
    out[name] = {"tokens": [r.tokens[0] for r in results],
                 "tokens_per_round": sum(r.stats["committed"] for r in results) / rounds_run,
                 "drafted_per_round": sum(r.stats["drafted"] for r in results) / rounds_run}
  times = {name: [] for name in sides}
  names = list(sides)
  for r in range(max(rounds, 1)):
    for i in range(len(prompts)):
      for name in (names if (r + i) % 2 == 0 else names[::-1]):
        start = time.perf_counter()
        call(sides[name], i)  # generate returns host lists: the call has finished
        times[name].append(time.perf_counter() - start)
  for name in sides:
    out[name]["call_s"] = statistics.median(times[name])
    out[name]["speedup"] = quartiles([b / t for b, t in zip(times["target-only"],
                                                               times[name])])
  first = names[1] if len(names) > 1 else None
  for name in names[2:]:
    out[name]["against_first"] = quartiles([a / t for a, t in zip(times[first],
                                                                     times[name])])
  return out


def compare_samples(target, prompts, n: int, kw: dict, repeats: int) -> dict:
  """n=`n` against [prompt] * n, one prompt a call, interleaved; the tokens checked
  equal on every call. Returns the medians, quartiles of repeated / n and of the
  repeated batch's prefill over its call, and the pairs timed."""
  sides = {"n": lambda p, seed: specjax.generate(target, [p], n=n, seed=seed, **kw),
           "repeated": lambda p, seed: specjax.generate(target, [p] * n, seed=seed, **kw)}

  def prefill(p):  # the repeated batch's prefill alone, as the call compiles it
    args = prepare_lib.prepare(target, [p] * n, **{"top_k": 0, "top_p": 1.0, "eos_id": None,
                                                  **kw})
    return lambda: jax.block_until_ready(decode_lib.start(
        args.engine, args.prompt_width, args.cache_size,
        decode_lib.laid_out(args.engine, args.weights), args.tokens, args.prompt_len,
        args.sampling, prepare_lib.seed_key(0)))

  prefills = [prefill(p) for p in prompts]
  for i, p in enumerate(prompts):  # compile and warm
    for side in sides.values():
      side(p, i)
    prefills[i]()
  times = {name: [] for name in sides}
  ratios, shares = [], []
  for r in range(repeats):
    for i, p in enumerate(prompts):
      order = list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]
      got = {}
      for name in order:
        start = time.perf_counter()
        out = sides[name](p, i)
        t = time.perf_counter() - start
        times[name].append(t)
        got[name] = out.tokens
      if got["n"] != got["repeated"]:
        raise AssertionError(f"n={n} and the repeated prompt gave different tokens")
      ratios.append(times["repeated"][-1] / times["n"][-1])
      start = time.perf_counter()
      prefills[i]()
      t_prefill = time.perf_counter() - start
      shares.append(t_prefill / times["repeated"][-1])
  return dict(call_s={k: statistics.median(v) for k, v in times.items()},
              repeated_over_n=quartiles(ratios),
              prefill_share_of_repeated=quartiles(shares), calls=len(ratios))


def per_call(stats: dict) -> tuple[float, float]:
  """(tokens per target call, its standard error) from the committed-per-round histogram."""
  hist = stats["committed_hist"]
  n = sum(hist)
  mean = sum(k * c for k, c in enumerate(hist)) / n
  var = sum(c * (k - mean) ** 2 for k, c in enumerate(hist)) / max(n - 1, 1)
  return mean, (var / n) ** 0.5
