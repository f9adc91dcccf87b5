"""specjax against transformers on identical weights: tokens/s side by side, outputs compared.

  python -m experiments.bench --part=peer --target=stdlib-target --draft=stdlib-draft   # the app

Both models are exported with `specjax.hf.export_hf` and loaded back by transformers, and
the two stacks' logits are checked to agree before anything is timed. Then, at
temperature 0, batch 1, every prompt in turn:

  specjax      greedy | speculative (draft model) | prompt lookup (n-gram drafter)
  transformers greedy | assisted generation (its defaults, and with a fixed gamma) |
               prompt lookup

and specjax at batch B (transformers refuses batch > 1 for assisted generation). EOS is
ignored on both sides, so every run makes exactly `max_new_tokens` tokens per prompt, and
every method's tokens are compared with transformers' greedy output. Each method runs
once untimed (jit compilation, caches, allocator), then all of them take turns for
`repeats` timed passes (so a change in machine load hits every method alike); the median
pass is reported.
"""

from __future__ import annotations

import copy
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the network

import jax
import numpy as np

import specjax
from specjax import arguments
from specjax import hf
from specjax.models.model import Model

HF_ASSISTED = "transformers assisted"  # the peer the goal is stated against


def _check_prompts(prompts, target: Model, draft: Model, max_new_tokens: int) -> list[list[int]]:
  prompts = arguments.check_prompts(prompts, target)
  limit = min(target.config.max_len, draft.config.max_len)
  for i, prompt in enumerate(prompts):
    if len(prompt) + max_new_tokens > limit:
      raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_new_tokens={max_new_tokens} "
                       f"exceed the models' context of {limit}")
  return prompts


def _machine() -> dict[str, Any]:
  import torch
  import transformers
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {
      "date": datetime.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
      "jax_backend": jax.default_backend(), "jax": jax.__version__,
      "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
      "transformers": transformers.__version__,
  }


def _to_transformers(model: Model, directory: Path):
  import torch
  import transformers
  hf.export_hf(model, directory)
  ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  # Same stopping rule as specjax with eos_id=None: exactly max_new_tokens, no EOS.
  ref.generation_config.eos_token_id = None
  ref.generation_config.pad_token_id = 0
  return ref


def _check_same_logits(model: Model, ref, prompt: list[int], atol: float = 1e-3):
  import torch
  with torch.no_grad():
    theirs = ref(torch.tensor([prompt])).logits.numpy()
  ours = np.asarray(model.logits(np.asarray([prompt], np.int32)))
  err = float(np.max(np.abs(ours - theirs)))
  if err > atol:
    raise RuntimeError(f"exported weights disagree with transformers: max |logit diff| {err}")
  return err


def _time_interleaved(runs: list[Callable[[], Any]], repeats: int,
                      log: Callable[[str], None]) -> tuple[list[Any], list[float]]:
  """Runs each once untimed, then `repeats` rounds of all of them in turn.

  Interleaving spreads any change in machine load over every method alike; each method
  reports its median time. Returns the outputs of the last round and the medians.
  """
  outs = [run() for run in runs]
  times: list[list[float]] = [[] for _ in runs]
  for round_ in range(repeats):
    log(f"timed round {round_ + 1}/{repeats}")
    for i, run in enumerate(runs):
      start = time.perf_counter()
      outs[i] = run()
      times[i].append(time.perf_counter() - start)
  return outs, [statistics.median(t) for t in times]


def _first_difference(a: list[int], b: list[int]) -> int | None:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def run_peer_benchmark(target: Model, draft: Model, prompts, *, max_new_tokens: int = 64,
                       gamma: int = 4, batch: int = 8, ngram_max: int = 3, repeats: int = 3,
                       torch_threads: int = 1, export_dir: str | os.PathLike | None = None,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
  """Times specjax and transformers decoding on the same weights; returns the results.

  Args:
    target, draft: specjax models with the same vocabulary, GPT-2- or Llama-style (the
      configs `specjax.hf.export_hf` can write).
    prompts: token-id lists (or strings, with the target's tokenizer), run one at a time
      for the batch-1 rows and `batch` at a time (cycled to fill) for the batched rows.
    max_new_tokens: tokens generated per prompt (EOS ignored on both sides).
    gamma: draft tokens per round for specjax, transformers' fixed-gamma assisted run and
      both prompt-lookup runs.
    batch: batch size of the batched specjax rows.
    ngram_max: longest suffix the prompt-lookup drafters match (both stacks).
    repeats: timed passes per method (the median is reported), after one untimed pass.
    torch_threads: torch's intra-op threads for the transformers runs (0: torch's
      default). 1 by default: on a small, shared CPU, torch's OpenMP threads spin against
      other work and run the same generation up to 10x slower than one thread does, so
      one thread is the peer's best setting there.
    export_dir: where the transformers copies are written (default: a temporary folder).
    log: progress lines go here.

  Returns:
    {'machine', 'settings', 'max_abs_logit_diff', 'rows': [{'method', 'batch',
    'tokens_per_s', 'seconds', 'tokens', 'identical_to_transformers_greedy', ...}],
    'speedup_vs_transformers_assisted': {method: ratio}}.
  """
  import torch

  if not isinstance(target, Model) or not isinstance(draft, Model):
    raise ValueError("target and draft must be specjax Models")
  if target.config.vocab_size != draft.config.vocab_size:
    raise ValueError(f"target and draft vocabularies differ: {target.config.vocab_size} vs "
                     f"{draft.config.vocab_size}")
  for name, value in (("max_new_tokens", max_new_tokens), ("gamma", gamma), ("batch", batch),
                      ("ngram_max", ngram_max), ("repeats", repeats)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if not isinstance(torch_threads, int) or torch_threads < 0:
    raise ValueError(f"torch_threads must be an int >= 0, got {torch_threads!r}")
  for model in (target, draft):
    hf.config_to_hf(model.config)  # refuses unexportable configs before any work
  prompts = _check_prompts(prompts, target, draft, max_new_tokens)

  with tempfile.TemporaryDirectory() as tmp:
    root = Path(export_dir) if export_dir is not None else Path(tmp)
    log(f"exporting the pair to {root} and loading it in transformers")
    ref_target = _to_transformers(target, root / "target")
    ref_draft = _to_transformers(draft, root / "draft")
  logit_diff = max(_check_same_logits(target, ref_target, prompts[0]),
                   _check_same_logits(draft, ref_draft, prompts[0]))
  assistant_defaults = copy.deepcopy(ref_draft.generation_config)

  def specjax_rows(rows, **kwargs):
    return lambda: [specjax.generate(target, rows_i, max_new_tokens=max_new_tokens,
                                     temperature=0.0, eos_id=None, **kwargs) for rows_i in rows]

  def transformers_run(assistant: dict | None = None, **kwargs):
    def run():
      outs = []
      for prompt in prompts:
        if assistant is not None:
          # The assistant's settings drift between calls (heuristics); start each equal.
          ref_draft.generation_config = copy.deepcopy(assistant_defaults)
          for key, value in assistant.items():
            setattr(ref_draft.generation_config, key, value)
          kwargs["assistant_model"] = ref_draft
        ids = torch.tensor([prompt])
        with torch.inference_mode():
          out = ref_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, **kwargs)
        outs.append(out[0, len(prompt):].tolist())
      return outs
    return run

  one_by_one = [[p] for p in prompts]
  cycled = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // batch) * batch)]
  batched = [cycled[i:i + batch] for i in range(0, len(cycled), batch)]
  methods = [
      ("transformers greedy", 1, transformers_run()),
      (HF_ASSISTED, 1, transformers_run(assistant={})),
      (f"{HF_ASSISTED}, fixed gamma={gamma}", 1, transformers_run(assistant=dict(
          num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
          assistant_confidence_threshold=0.0))),
      ("transformers prompt lookup", 1, transformers_run(
          prompt_lookup_num_tokens=gamma, max_matching_ngram_size=ngram_max)),
      ("specjax greedy", 1, specjax_rows(one_by_one)),
      ("specjax speculative", 1, specjax_rows(one_by_one, draft=draft, gamma=gamma)),
      ("specjax prompt lookup", 1, specjax_rows(one_by_one, drafter="ngram", gamma=gamma,
                                                ngram_max=ngram_max)),
      ("specjax greedy", batch, specjax_rows(batched)),
      ("specjax speculative", batch, specjax_rows(batched, draft=draft, gamma=gamma)),
  ]

  log(f"warming up {len(methods)} methods, then {repeats} interleaved timed rounds")
  default_threads = torch.get_num_threads()
  torch.set_num_threads(torch_threads or default_threads)
  try:
    machine = _machine()
    outs, medians = _time_interleaved([run for _, _, run in methods], repeats, log)
  finally:
    torch.set_num_threads(default_threads)
  reference = outs[0]  # transformers greedy comes first
  rows = []
  for (name, rows_per_call, _), out, seconds in zip(methods, outs, medians):
    row: dict[str, Any] = {"method": name, "batch": rows_per_call, "seconds": seconds}
    if name.startswith("specjax"):
      stats = [r.stats for r in out]
      tokens = [t for r in out for t in r.tokens]
      committed = sum(s["committed"] for s in stats)
      row_calls = sum(s["target_calls"] * s["rows"] for s in stats)
      # Per row: a batched call advances every row in it.
      row["tokens_per_target_call"] = committed / row_calls if row_calls else float("nan")
      if "greedy" not in name:
        alphas = [s["alpha_hat"] for s in stats if s["alpha_hat"] == s["alpha_hat"]]
        row["alpha_hat"] = float(np.mean(alphas)) if alphas else float("nan")
        row["acceptance_rate"] = float(np.mean([s["acceptance_rate"] for s in stats]))
    else:
      tokens = out
    n_tokens = sum(len(t) for t in tokens)
    row["tokens"] = n_tokens
    row["tokens_per_s"] = n_tokens / seconds
    # Batched rows cycle the prompts; compare each row with its prompt's greedy output.
    diffs = [_first_difference(t, reference[i % len(prompts)]) for i, t in enumerate(tokens)]
    row["identical_to_transformers_greedy"] = all(d is None for d in diffs)
    if not row["identical_to_transformers_greedy"]:
      row["first_difference"] = next(d for d in diffs if d is not None)
      row["rows_differing"] = sum(d is not None for d in diffs)
    rows.append(row)

  assisted = max(r["tokens_per_s"] for r in rows if r["method"].startswith(HF_ASSISTED))
  return {
      "machine": machine,
      "settings": dict(max_new_tokens=max_new_tokens, gamma=gamma, batch=batch,
                       ngram_max=ngram_max, repeats=repeats, n_prompts=len(prompts),
                       prompt_lengths=sorted({len(p) for p in prompts}),
                       target_params=target.num_params, draft_params=draft.num_params),
      "max_abs_logit_diff": logit_diff,
      "rows": rows,
      # Against the faster of transformers' two assisted runs: the strongest peer.
      "speedup_vs_transformers_assisted": {
          f"{r['method']} (batch {r['batch']})": r["tokens_per_s"] / assisted for r in rows},
  }


def format_table(result: dict[str, Any]) -> str:
  """The rows as a Markdown table, with the machine and settings above it."""
  m, s = result["machine"], result["settings"]
  lines = [
      f"{m['date']}, {m['cpu']} ({m['cores']} cores), jax {m['jax']} ({m['jax_backend']}), "
      f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}",
      f"target {s['target_params']:,} params, draft {s['draft_params']:,}; {s['n_prompts']} "
      f"prompts of {s['prompt_lengths']} tokens, {s['max_new_tokens']} new tokens each, "
      f"gamma={s['gamma']}, temperature 0, median of {s['repeats']}; "
      f"max |logit diff| between stacks {result['max_abs_logit_diff']:.1e}",
      "",
      "| method | batch | tokens/s | × transformers assisted | tokens/target call | α̂ "
      "| = transformers greedy |",
      "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  speedups = result["speedup_vs_transformers_assisted"]
  for r in result["rows"]:
    tpc = r.get("tokens_per_target_call")
    alpha = r.get("alpha_hat")
    same = "yes" if r["identical_to_transformers_greedy"] else (
        f"no ({r['rows_differing']} rows, first at token {r['first_difference']})")
    speedup = speedups[f"{r['method']} (batch {r['batch']})"]
    lines.append(
        f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {speedup:.2f} | "
        f"{'' if tpc is None else f'{tpc:.2f}'} | {'' if alpha is None else f'{alpha:.3f}'} "
        f"| {same} |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# The prompts of python -m experiments.bench --part=peer


def default_prompts(model: Model, n: int, length: int, seed: int = 0) -> list[list[int]]:
  """`n` prompts of `length` tokens: held-out standard-library windows with a tokenizer
  (the same prompts the other parts of `experiments.bench` use), random ids without one."""
  if model.tokenizer is None:
    return np.random.RandomState(seed).randint(0, model.config.vocab_size, (n, length)).tolist()
  from experiments import common
  return common.heldout_prompts(model.tokenizer, "stdlib", n, length, seed=seed)
