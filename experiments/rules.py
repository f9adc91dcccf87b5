"""Block against token-level verification on the shipped pair, paired (issue #51).

  python -m experiments.rules                       # model + EAGLE, γ = 2, 4, 6, T = 0.7, 1
  python -m experiments.rules --drafter=model --gamma=4 --temperature=1.0 --repeats=5

For each drafter, γ and temperature, both rules decode the same held-out prompts with the
same seeds (one prompt a call, the order of the two flipping from call to call). Printed
(and written as JSON lines with --out): tokens per target call of each rule (pooled over
the calls), the quartiles of the per-call ratio block / exact of tokens per target call,
and of the round's time (call time / rounds; includes prefill, so a round ratio is of
whole calls spread over their rounds).
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


def main(argv):
  del argv
  rows = []
  for drafter in _DRAFTERS.value:
    for gamma in map(int, _GAMMAS.value):
      target, _, kw = common.drafter_pair("stdlib-target", drafter, None, gamma)
      prompts = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value,
                                       _PROMPT_TOKENS.value)
      for temperature in map(float, _TEMPS.value):
        out = compare(target, prompts, dict(kw, temperature=temperature,
                                            max_new_tokens=_NEW.value), _REPEATS.value)
        row = dict(drafter=drafter, gamma=gamma, temperature=temperature, **out)
        rows.append(row)
        q, r = out["calls_ratio"], out["round_ratio"]
        print(f"{drafter:6s} γ={gamma} T={temperature}: tokens/call exact "
              f"{out['tokens_per_call']['exact']:.3f} block {out['tokens_per_call']['block']:.3f}"
              f"; per call block/exact {q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}]"
              f"; round time block/exact {r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]",
              flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  app.run(main)
