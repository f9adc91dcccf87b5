r"""The history-dependent processors' share of a speculative round, paired.

  python -m experiments.bench_processors --out=docs/results/processors.json

A round with every processor but the automaton on (common.PROCESSORS) against the same
round with them off, 16 rounds per fused loop, timed alternately (costs.paired):
share = 1 - (round without) / (round with). Issue #10's goal: <= 10%. The set
`stop_strings` times the same way a round tracking three stop strings matched on the
text (ones that do not occur, so both loops run every round) against none.
"""

from __future__ import annotations

import json
import statistics

from absl import app
from absl import flags

from experiments import common
from specjax import costs
from specjax.generation import prepare

ROUNDS = 16
SETS = {"processors": common.PROCESSORS,
        # Text stop strings that the held-out continuations do not hold: tracked, never hit.
        "stop_strings": dict(stop_sequences=["\n\n\n\n\n\n", "#" * 12, "\x07"])}

_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes.")
_TEMPERATURE = flags.DEFINE_list("temperature", ["0", "1"], "Temperatures.")
_PAIRS = flags.DEFINE_integer("pairs", 7, "Timing pairs (median ratio kept).")
_SETS = flags.DEFINE_list("sets", list(SETS), f"What to time against none: {list(SETS)}.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def main(argv):
  del argv
  target, draft = common.load_pair("stdlib-target", "stdlib-draft")
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", 8, 64)
  rows = []
  for name in _SETS.value:
    if name not in SETS:
      raise app.UsageError(f"--sets takes {list(SETS)}, got {name!r}")
  for name in _SETS.value:
    for batch in map(int, _BATCH.value):
      for temperature in map(float, _TEMPERATURE.value):
        kw = dict(max_new_tokens=ROUNDS * (_GAMMA.value + 1), temperature=temperature,
                  top_k=0, top_p=1.0, eos_id=None, draft=draft, gamma=_GAMMA.value)
        on = costs.round_timer(prepare(target, prompts[:batch], **kw, **SETS[name]), ROUNDS)
        off = costs.round_timer(prepare(target, prompts[:batch], **kw), ROUNDS)
        t = costs.paired(on, off, pairs=_PAIRS.value, timers=True)  # ratio = off / on
        row = dict(set=name, batch=batch, temperature=temperature, gamma=_GAMMA.value,
                   round_ms=statistics.median(t["baseline_s"]) * 1e3,
                   round_with_processors_ms=statistics.median(t["method_s"]) * 1e3,
                   share=1 - t["ratio"], share_min=1 - t["ratio_max"],
                   share_max=1 - t["ratio_min"], machine=costs.machine_info())
        rows.append(row)
        print(f"{name}: batch {batch}, T={temperature:g}: round {row['round_ms']:.2f} ms, "
              f"with {row['round_with_processors_ms']:.2f} ms: {100 * row['share']:.0f}% "
              f"({100 * row['share_min']:.0f}–{100 * row['share_max']:.0f}%) of the round",
              flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
