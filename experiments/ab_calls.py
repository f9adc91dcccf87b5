r"""Whole `generate` calls of several settings against target-only, interleaved.

  python -m experiments.ab_calls --drafter=ngram --gamma=4 --temperature=1 \
      --variants='fixed={}' --variants='ledger={"gamma_policy": "ledger"}'

Each round times every side once on every held-out prompt (one prompt per call, batch
1), in an order that flips from prompt to prompt, so a machine that changes speed moves
all sides alike. Reported per side: the median call, the median and quartiles of the
per-call ratio target-only / side (the speedup), tokens per round and tokens drafted
per round; and each variant against the first. A 'ledger' variant with no draft_cost
gets the pair (c, v(γ)) measured once here (`costs.step_costs`), not in every call.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags

from experiments import common
from specjax import costs

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model (name or directory).")
_DRAFT = flags.DEFINE_string("draft", None, "Draft model or head; default by --drafter.")
_DRAFTER = flags.DEFINE_enum("drafter", "ngram", ["ngram", "model", "eagle", "medusa"],
                             "Drafter every variant starts from.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
_VARIANTS = flags.DEFINE_multi_string(
    "variants", ["fixed={}"], "name=JSON of generate keyword arguments over the drafter's.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds over the prompts.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Held-out prompts.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens per prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per call.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def main(argv):
  del argv
  drafter = _DRAFTER.value
  draft_name = _DRAFT.value or common.DEFAULT_DRAFTS.get(drafter)
  target, draft = common.load_pair(_TARGET.value, draft_name)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value,
                                   _PROMPT_TOKENS.value)
  base = dict(max_new_tokens=_NEW.value, temperature=_TEMPERATURE.value, eos_id=None)
  spec = dict(drafter=drafter, gamma=_GAMMA.value, **(dict(draft=draft) if draft else {}))
  variants = {}
  for item in _VARIANTS.value:
    name, _, args = item.partition("=")
    variants[name] = dict(spec, **json.loads(args or "{}"))
  measured = None
  for name, kw in variants.items():
    if kw.get("gamma_policy") == "ledger" and "draft_cost" not in kw:
      if measured is None:
        prepared = costs._prepare(target, prompts[:1], dict(base, **spec))
        sc = costs.step_costs(target, prepared.engine.drafter, prepared.weights.draft, 1,
                              _PROMPT_TOKENS.value, temperature=_TEMPERATURE.value)
        measured = (sc["c"], sc["v"])
        print(f"measured c {measured[0]:.3f}, v({_GAMMA.value}) {measured[1]:.2f}")
      kw["draft_cost"] = measured
  out = common.compare_calls(target, prompts, base, variants, _ROUNDS.value)
  fmt = lambda q: f"{q['median']:.3f}x ({q['q1']:.3f}–{q['q3']:.3f})"
  print("| side | call (ms) | speedup (quartiles) | tokens/round | drafted/round | against "
        "the first variant |\n|---|---|---|---|---|---|")
  for name, row in out.items():
    print(f"| {name} | {row['call_s'] * 1e3:.2f} | {fmt(row['speedup'])} | "
          f"{row['tokens_per_round']:.2f} | {row['drafted_per_round']:.2f} | "
          f"{fmt(row['against_first']) if 'against_first' in row else ''} |")
  if _OUT.value:
    record = dict(machine=costs.machine_info(), drafter=drafter, gamma=_GAMMA.value,
                  temperature=_TEMPERATURE.value, rounds=_ROUNDS.value,
                  variants={k: {a: b for a, b in v.items() if a != "draft"}
                            for k, v in variants.items()},
                  results={k: {a: b for a, b in v.items() if a != "tokens"}
                           for k, v in out.items()})
    with open(_OUT.value, "w") as f:
      json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
  app.run(main)
