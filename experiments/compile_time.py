r"""Compile time of a token tree's program: the verify walk's loops rolled against unrolled.

  python -m experiments.compile_time --out=docs/results/compile_time.json

For each tree (the shipped pair, draft model or prompt lookup, batch --batch, T = 1) the
whole `generate` program (`decode.decode`) is traced, lowered and compiled with the walk's
loops rolled (what a CPU runs, `Engine.unroll_walk = False`) and unrolled (what an
accelerator runs, and what every backend ran before), alternately, --rounds times, with
jax's caches cleared before each so nothing is reused; then both compiled programs run the
same call alternately (--calls pairs) and must give the same tokens. Printed per tree:
the median and min–max of the seconds to compile each way, the compiled HLO's lines, and
the per-pair ratio of the calls' times (rolled / unrolled).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from absl import app
from absl import flags

import jax
import numpy as np

from experiments.common import heldout_prompts, load_pair
from specjax import costs
from specjax import decode as decode_lib
from specjax import generation

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target name or directory.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model: name or directory.")
_TREES = flags.DEFINE_string("trees", "model:2,2,1;model:4,2,2,1;ngram:3,2,1",
                             "drafter:branching factors, ';' between trees.")
_BATCH = flags.DEFINE_integer("batch", 2, "Rows per call.")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "New tokens per row.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Compiles of each form per tree.")
_CALLS = flags.DEFINE_integer("calls", 21, "Timed call pairs per tree.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def compiled(prepared: generation.Prepared, key, unroll: bool):
  """(seconds to trace, lower and compile, the compiled program, its HLO lines)."""
  jax.clear_caches()  # a cold trace each time: the loops' traces are kept by identity
  engine = dataclasses.replace(prepared.engine, unroll_walk=unroll)
  start = time.perf_counter()
  program = decode_lib.decode.lower(
      engine, prepared.prompt_width, prepared.cache_size,
      decode_lib.laid_out(prepared.engine, prepared.weights), prepared.tokens,
      prepared.prompt_len, prepared.sampling, key).compile()
  seconds = time.perf_counter() - start
  return seconds, program, program.as_text().count("\n")


def main(argv):
  del argv
  target, draft = load_pair(_TARGET.value, _DRAFT.value)
  prompts = heldout_prompts(target.tokenizer, "stdlib", _BATCH.value, 32)
  key = generation.seed_key(0)
  rows = []
  print(costs.machine_info())
  for spec in _TREES.value.split(";"):
    drafter, branching = spec.split(":")
    tree = tuple(int(k) for k in branching.split(","))
    kw = dict(drafter="ngram") if drafter == "ngram" else dict(draft=draft)
    prepared = generation.prepare(target, prompts, max_new_tokens=_NEW.value, temperature=1.0,
                                  top_k=0, top_p=1.0, eos_id=None, tree=tree, **kw)
    seconds = {False: [], True: []}
    programs, lines = {}, {}
    for i in range(_ROUNDS.value):
      for unroll in ((False, True) if i % 2 == 0 else (True, False)):
        s, programs[unroll], lines[unroll] = compiled(prepared, key, unroll)
        seconds[unroll].append(s)
    args = (decode_lib.laid_out(prepared.engine, prepared.weights), prepared.tokens,
            prepared.prompt_len, prepared.sampling, key)
    outs = {u: np.asarray(p(*args).tokens) for u, p in programs.items()}
    if not np.array_equal(outs[False], outs[True]):
      raise AssertionError(f"{spec}: the rolled and unrolled walks gave different tokens")
    call = lambda u: lambda: jax.block_until_ready(programs[u](*args).tokens)
    timed = costs.paired(call(False), call(True), pairs=_CALLS.value)
    row = {"tree": spec, "compile_rolled_s": seconds[False], "compile_unrolled_s": seconds[True],
           "hlo_lines_rolled": lines[False], "hlo_lines_unrolled": lines[True],
           "call_unrolled_over_rolled": timed["ratio"],
           "call_ratio_min": timed["ratio_min"], "call_ratio_max": timed["ratio_max"],
           "call_rolled_ms": 1e3 * statistics.median(timed["method_s"]),
           **costs.machine_info()}
    rows.append(row)
    speed = [u / r for r, u in zip(seconds[False], seconds[True])]
    print(f"{spec:16s} compile rolled {statistics.median(seconds[False]):5.2f} s, unrolled "
          f"{statistics.median(seconds[True]):5.2f} s: {statistics.median(speed):.2f}x faster "
          f"rolled ({min(speed):.2f}-{max(speed):.2f}); HLO {lines[False]:,} vs "
          f"{lines[True]:,} lines; a call {row['call_rolled_ms']:.1f} ms rolled, unrolled / "
          f"rolled time {timed['ratio']:.3f} ({timed['ratio_min']:.3f}-"
          f"{timed['ratio_max']:.3f})", flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
