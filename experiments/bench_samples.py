r"""n samples of a prompt: `generate(..., n=N)` against the prompt repeated N times.

  python -m experiments.bench_samples --samples=8 --out=docs/results/samples.json

Both sides give the same tokens (checked on every call): n=N prefills the prompt once
and copies its caches to its N rows, where the repeated batch prefills N copies. For
each held-out prompt the two calls are timed alternately, the order flipping from
prompt to prompt and pass to pass; reported: the median call of each, the median and
quartiles of repeated / n (the speedup), and the prefill's share of a repeated call
(its prefill alone, `decode.start`, timed the same way against the call).
"""

from __future__ import annotations

import json

from absl import app
from absl import flags

from experiments import common
from specjax import costs

_DRAFTER = flags.DEFINE_enum("drafter", "ngram", ["model", "ngram"], "Drafter.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per prompt (n).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 192, "Tokens per prompt.")
_PROMPTS = flags.DEFINE_integer("prompts", 4, "Held-out prompts (one per call).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Passes over the prompts.")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "New tokens per sample.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def main(argv):
  del argv
  draft_name = "stdlib-draft" if _DRAFTER.value == "model" else None
  target, draft = common.load_pair("stdlib-target", draft_name)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value,
                                   _PROMPT_TOKENS.value)
  n = _SAMPLES.value
  kw = dict(max_new_tokens=_NEW.value, temperature=_TEMPERATURE.value, gamma=_GAMMA.value,
            eos_id=None, **(dict(draft=draft) if draft else dict(drafter="ngram")))
  row = dict(samples=n, prompt_tokens=_PROMPT_TOKENS.value, max_new_tokens=_NEW.value,
             drafter=_DRAFTER.value, gamma=_GAMMA.value, temperature=_TEMPERATURE.value,
             **common.compare_samples(target, prompts, n, kw, _REPEATS.value),
             machine=costs.machine_info())
  q, s = row["repeated_over_n"], row["prefill_share_of_repeated"]
  print(f"n={n}, {_PROMPT_TOKENS.value}-token prompts, {_NEW.value} new tokens, "
        f"{_DRAFTER.value} γ={_GAMMA.value}, T={_TEMPERATURE.value}: n "
        f"{1e3 * row['call_s']['n']:.1f} ms, repeated {1e3 * row['call_s']['repeated']:.1f} "
        f"ms; repeated / n {q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f}); the repeated "
        f"batch's prefill {s['median']:.2f} of its call ({row['calls']} pairs)")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(row, f, indent=1)


if __name__ == "__main__":
  app.run(main)
