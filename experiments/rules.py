"""Block against token-level verification on the shipped pair, paired (issue #51).

  python -m experiments.rules                       # model + EAGLE, γ = 2, 4, 6, T = 0.7, 1
  python -m experiments.rules --drafter=model --gamma=4 --temperature=1.0 --repeats=5

For each drafter, γ and temperature: one batched call per rule over --batch_prompts
held-out prompts (the same prompts and seed) counts tokens per target call, with its
standard error from the committed-per-round histogram (the rules draw their randomness
differently, so the two counts are independent samples); then both rules decode
--num_prompts prompts one a call with the same seeds, the order of the two flipping from
call to call, for the quartiles of the per-call ratio block / exact of the round's time
(call time / rounds; prefill included). Printed, and written as JSON lines with --out.
"""

from __future__ import annotations

import json
import time

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
_OUT = flags.DEFINE_string("out", None, "JSON-lines file for the rows.")

RULES = ("exact", "block")


def compare(target, prompts, kw: dict, repeats: int) -> dict:
  """Paired calls of both rules: tokens per target call and round time, with quartiles."""
  call = lambda rule, i: specjax.generate(target, [prompts[i]], seed=i, verify_rule=rule,
                                          **kw)
  stats = {rule: [call(rule, i).stats for i in range(len(prompts))] for rule in RULES}
  per_call = {rule: [s["committed"] / s["target_calls"] for s in stats[rule]]
              for rule in RULES}
  round_s = {rule: [] for rule in RULES}
  for r in range(repeats):
    for i in range(len(prompts)):
      for rule in (RULES if (r + i) % 2 == 0 else RULES[::-1]):
        start = time.perf_counter()
        call(rule, i)  # generate returns host lists: the call has finished
        round_s[rule].append((time.perf_counter() - start) / stats[rule][i]["rounds"])
  pooled = {rule: sum(s["committed"] for s in stats[rule])
            / sum(s["target_calls"] for s in stats[rule]) for rule in RULES}
  return dict(
      tokens_per_call={rule: round(v, 4) for rule, v in pooled.items()},
      lossless={rule: all(s["lossless"] for s in stats[rule]) for rule in RULES},
      calls_ratio=common.quartiles([b / e for b, e in zip(per_call["block"],
                                                          per_call["exact"])]),
      round_ratio=common.quartiles([b / e for b, e in zip(round_s["block"],
                                                          round_s["exact"])]))


def per_call(stats: dict) -> tuple[float, float]:
  """(tokens per target call, its standard error) from the committed-per-round histogram."""
  hist = stats["committed_hist"]
  n = sum(hist)
  mean = sum(k * c for k, c in enumerate(hist)) / n
  var = sum(c * (k - mean) ** 2 for k, c in enumerate(hist)) / max(n - 1, 1)
  return mean, (var / n) ** 0.5


def counted(target, prompts, kw: dict) -> dict:
  """One batched call per rule (the same prompts and seed): tokens per target call with
  its standard error, and block − exact with the error of the difference."""
  out = {rule: per_call(specjax.generate(target, prompts, seed=0, verify_rule=rule,
                                         **kw).stats) for rule in RULES}
  gain = out["block"][0] - out["exact"][0]
  return dict(batched={rule: {"mean": round(m, 4), "se": round(e, 4)}
                       for rule, (m, e) in out.items()},
              batched_gain=round(gain, 4),
              batched_gain_se=round((out["block"][1] ** 2 + out["exact"][1] ** 2) ** 0.5, 4))


def main(argv):
  del argv
  rows = []
  for drafter in _DRAFTERS.value:
    for gamma in map(int, _GAMMAS.value):
      target, _, kw = common.drafter_pair("stdlib-target", drafter, None, gamma)
      prompts = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value,
                                       _PROMPT_TOKENS.value)
      many = (common.heldout_prompts(target.tokenizer, "stdlib", _BATCH.value,
                                     _PROMPT_TOKENS.value, seed=1) if _BATCH.value else None)
      for temperature in map(float, _TEMPS.value):
        run_kw = dict(kw, temperature=temperature, max_new_tokens=_NEW.value)
        out = compare(target, prompts, run_kw, _REPEATS.value) if _REPEATS.value else {}
        if many:
          out.update(counted(target, many, run_kw))
        row = dict(drafter=drafter, gamma=gamma, temperature=temperature, **out)
        rows.append(row)
        line = f"{drafter:6s} γ={gamma} T={temperature}:"
        if many:
          b = out["batched"]
          line += (f" batched tokens/call exact {b['exact']['mean']:.3f} ± {b['exact']['se']:.3f}"
                   f" block {b['block']['mean']:.3f} ± {b['block']['se']:.3f}, gain "
                   f"{out['batched_gain']:+.3f} ± {out['batched_gain_se']:.3f};")
        if _REPEATS.value:
          q, r = out["calls_ratio"], out["round_ratio"]
          line += (f" paired calls: tokens/call block/exact {q['median']:.3f} [{q['q1']:.3f}, "
                   f"{q['q3']:.3f}], round time block/exact {r['median']:.3f} [{r['q1']:.3f}, "
                   f"{r['q3']:.3f}]")
        print(line, flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  app.run(main)
