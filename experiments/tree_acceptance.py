r"""Tokens per target call of sampled token trees against the chain: acceptance, no timing.

  python -m experiments.tree_acceptance                       # T = 1 and 0.7, 3 seeds
  python -m experiments.tree_acceptance --trees='2,2,1,1;4,2,1,1' --temperatures=1.0
  python -m experiments.tree_acceptance --draft=stdlib-medusa --temperatures=0,1   # Medusa

For each temperature, the chain (γ = the trees' depth) and each tree decode the same
held-out prompts with `draft_sample='probabilistic'` once per seed; printed: tokens per
target call (mean over seeds, min–max), α̂, α̂ by sibling rank (the mean acceptance
probability of a rank-r child when tried) and the ledger's expected tokens per call
from α̂ by rank and from one α̂ for every rank. Counting only, so two runs (two commits,
two machines) compare directly; wall-clock speed is the sweep's job
(`--config.trees=...` in `experiments.run`).
"""

from __future__ import annotations

import statistics

from absl import app
from absl import flags

import numpy as np

import specjax
from experiments.common import heldout_prompts, load_pair
from specjax import generation
from specjax import ledger

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target name or directory.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model or Medusa head: name or "
                             "directory.")
_TREES = flags.DEFINE_string("trees", "2,2,1,1;4,2,1,1", "Branching factors, ';' between trees.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["1.0", "0.7"], "Sampling temperatures.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Runs per point, seeds 0..seeds-1.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 32, "Held-out prompts per run.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens per prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 48, "New tokens per prompt.")


def main(argv):
  del argv
  trees = [tuple(int(k) for k in t.split(",")) for t in _TREES.value.split(";") if t]
  depth = max(len(t) for t in trees)
  target, draft = load_pair(_TARGET.value, _DRAFT.value)
  prompts = heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value, _PROMPT_TOKENS.value)
  print(f"{_PROMPTS.value} prompts x {_NEW.value} new tokens, {_SEEDS.value} seeds per point")
  print("| T | drafting | tokens / target call (min–max) | α̂ | α̂ by sibling rank "
        "| E, α̂ by rank | E, one α̂ |\n|---|---|---|---|---|---|---|")
  for temperature in (float(t) for t in _TEMPERATURES.value):
    for tree in [None] + trees:
      calls, alphas, by_rank = [], [], []
      for seed in range(_SEEDS.value):
        shape = dict(tree=tree) if tree else dict(gamma=depth)
        stats = specjax.generate(target, prompts, max_new_tokens=_NEW.value, draft=draft,
                                 temperature=temperature, draft_sample="probabilistic",
                                 seed=seed, eos_id=None, **shape).stats  # fixed budget
        calls.append(stats["tokens_per_target_call"])
        alphas.append(stats["alpha_hat"])
        by_rank.append(stats["alpha_by_sibling"])
      name = f"tree {tree}" if tree else f"chain γ = {depth}"
      parents = generation.make_tree(tree or (1,) * depth, None).parents
      rates = np.nanmean(np.asarray(by_rank, np.float64), axis=0)
      alpha = statistics.mean(alphas)
      print(f"| {temperature:g} | {name} | {statistics.mean(calls):.2f} "
            f"({min(calls):.2f}–{max(calls):.2f}) | {alpha:.3f} | "
            f"{', '.join(f'{a:.3f}' for a in rates)} | "
            f"{ledger.tree_expected_tokens(parents, rates):.2f} | "
            f"{ledger.tree_expected_tokens(parents, alpha):.2f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
