"""Block (chains) or traversal (trees) against token-level verification, paired (issue #51).

  python -m experiments.rules                       # model + EAGLE, γ = 2, 4, 6, T = 0.7, 1
  python -m experiments.rules --drafter=model --gamma=4 --temperature=1.0 --repeats=5
  python -m experiments.rules --drafter=model,medusa --tree=2,2,1,1   # traversal vs exact
  python -m experiments.rules --drafter=model,eagle --tree=dynamic,14,4,4  # a DynamicTree

With --tree the draft is that token tree (branching factors, or dynamic,nodes,depth,topk;
γ is its depth) and the method is traversal verification; without it, a chain of γ and
block verification.

For each drafter, γ and temperature: one batched call per rule over --batch_prompts
held-out prompts (the same prompts and seed) counts tokens per target call, with its
standard error from the committed-per-round histogram (the rules draw their randomness
differently, so the two counts are independent samples); then both rules decode
--num_prompts prompts one a call with the same seeds, the order of the two flipping from
call to call, for the quartiles of the per-call ratio block / exact of the round's time
(call time / rounds; prefill included). Printed, and written as JSON lines with --out.
"""

from __future__ import annotations


import numpy as np
from absl import app
from absl import flags

import specjax
from experiments import common

_DRAFTERS = flags.DEFINE_list("drafter", ["model", "eagle"], "Drafters: model, eagle.")
_GAMMAS = flags.DEFINE_list("gamma", ["2", "4", "6"], "Draft lengths γ.")
_TEMPS = flags.DEFINE_list("temperature", ["0.7", "1.0"], "Temperatures.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 4, "Held-out prompts (one a call).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 32, "Tokens per prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 48, "New tokens per call.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes over the prompts.")
_BATCH = flags.DEFINE_integer("batch_prompts", 64, "Prompts of the one batched call per "
                              "rule that counts tokens per target call (0: none).")
_SEEDS = flags.DEFINE_integer("count_seeds", 1, "Seeds of the batched count (more: the "
                              "errors from their spread).")
_TREE = flags.DEFINE_list("tree", None, "Branching factors of a token tree (2,2,1,1), or "
                          "dynamic,nodes,depth,topk: traversal against exact on it instead "
                          "of block on a chain.")
_OUT = flags.DEFINE_string("out", None, "JSON-lines file for the rows.")


def compare(target, prompts, kw: dict, repeats: int, rules: tuple[str, str]) -> dict:
  """Paired calls of (baseline, method): tokens per target call and round time, with
  quartiles of the per-call ratio method / baseline."""
  base, method = rules
  stats, round_s = common.paired_rounds(
      target, prompts, {rule: dict(kw, verify_rule=rule) for rule in rules}, repeats)
  per_call = {rule: [s["committed"] / s["target_calls"] for s in stats[rule]]
              for rule in rules}
  pooled = {rule: sum(s["committed"] for s in stats[rule])
            / sum(s["target_calls"] for s in stats[rule]) for rule in rules}
  return dict(
      tokens_per_call={rule: round(v, 4) for rule, v in pooled.items()},
      lossless={rule: all(s["lossless"] for s in stats[rule]) for rule in rules},
      calls_ratio=common.quartiles([m / b for m, b in zip(per_call[method],
                                                          per_call[base])]),
      round_ratio=common.quartiles([m / b for m, b in zip(round_s[method],
                                                          round_s[base])]))


def counted(target, prompts, kw: dict, rules: tuple[str, str], seeds: int = 1) -> dict:
  """One batched call per rule and seed (the same prompts): tokens per target call with
  its standard error, and method − baseline with the error of the difference. One seed:
  the errors from the committed-per-round histogram, which treats rounds as independent
  (they are not: a row's rounds share its text); more: the mean over seeds, and the
  errors from the seeds' spread (the gain's from its per-seed differences), which are
  conditional on this prompt set (its prompt-to-prompt variance is not in them) and
  rough with few seeds."""
  base, method = rules
  runs = {rule: [common.per_call(specjax.generate(target, prompts, seed=seed,
                                                  verify_rule=rule, **kw).stats)
                 for seed in range(seeds)] for rule in rules}
  if seeds == 1:
    out = {rule: r[0] for rule, r in runs.items()}
    gain_se = (out[method][1] ** 2 + out[base][1] ** 2) ** 0.5
  else:
    means = {rule: np.array([m for m, _ in r]) for rule, r in runs.items()}
    sem = lambda x: float(np.std(x, ddof=1) / np.sqrt(len(x)))
    out = {rule: (float(x.mean()), sem(x)) for rule, x in means.items()}
    gain_se = sem(means[method] - means[base])
  gain = out[method][0] - out[base][0]
  return dict(batched={rule: {"mean": round(m, 4), "se": round(e, 4)}
                       for rule, (m, e) in out.items()},
              batched_gain=round(gain, 4), batched_gain_se=round(gain_se, 4),
              batched_seeds=seeds)


def main(argv):
  del argv
  rows = []
  if _SEEDS.value < 1:
    raise app.UsageError(f"--count_seeds must be >= 1, got {_SEEDS.value}")
  tree = None
  if _TREE.value:
    dynamic = _TREE.value[0] == "dynamic"
    tree = tuple(int(k) for k in _TREE.value[dynamic:])
    tree = ("dynamic", *tree) if dynamic else tree  # generate's spelling of a DynamicTree
  if tree is not None:
    common.refuse_flags(["gamma"], "is the tree's depth with --tree: drop it")
  rules = ("exact", "traversal") if tree else ("exact", "block")
  base, method = rules
  for drafter in _DRAFTERS.value:
    for gamma in ([None] if tree else map(int, _GAMMAS.value)):
      target, _, kw = common.drafter_pair("stdlib-target", drafter, None, gamma)
      if tree:
        kw = dict(kw, tree=tree)
        kw.pop("gamma")
      prompts = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value,
                                       _PROMPT_TOKENS.value)
      many = (common.heldout_prompts(target.tokenizer, "stdlib", _BATCH.value,
                                     _PROMPT_TOKENS.value, seed=1) if _BATCH.value else None)
      for temperature in map(float, _TEMPS.value):
        run_kw = dict(kw, temperature=temperature, max_new_tokens=_NEW.value)
        out = (compare(target, prompts, run_kw, _REPEATS.value, rules) if _REPEATS.value
               else {})
        if many:
          out.update(counted(target, many, run_kw, rules, _SEEDS.value))
        shape = dict(tree=list(tree)) if tree else dict(gamma=gamma)
        row = dict(drafter=drafter, **shape, temperature=temperature, **out)
        rows.append(row)
        line = (f"{drafter:6s} tree={tree}" if tree else f"{drafter:6s} γ={gamma}")
        line += f" T={temperature}:"
        if many:
          b = out["batched"]
          line += (f" batched tokens/call {base} {b[base]['mean']:.3f} ± {b[base]['se']:.3f}"
                   f" {method} {b[method]['mean']:.3f} ± {b[method]['se']:.3f}, gain "
                   f"{out['batched_gain']:+.3f} ± {out['batched_gain_se']:.3f};")
        if _REPEATS.value:
          line += (f" paired calls: tokens/call {method}/{base} "
                   f"{common.spread(out['calls_ratio'])}, round time {method}/{base} "
                   f"{common.spread(out['round_ratio'])}")
        print(line, flush=True)
  if _OUT.value:
    common.write_rows(_OUT.value, rows)


if __name__ == "__main__":
  app.run(main)
