"""XLA:CPU's own options against specjax's CPU kernels (issue 49): a cached forward of
the shipped target, 1 and 5 new tokens, on XLA's products (`backends.Options(
kernels=False)`, row by row as the CPU backend falls back, and with the rows together)
under each XLA flag setting, against the kernels.

  python -m experiments.bench_xla_flags --pairs=4

XLA flags are process-wide, so each setting runs in processes of its own, alternated
with processes of the default flags (default, setting 1, default, setting 2, ..., then
again): a setting's XLA time is compared with the kernels' in the same process (the
flags reach the ops around the kernels too) and in the default-flag processes next to
it. Every process times its paths interleaved (A B A B) with `costs.forward_timer`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app
from absl import flags

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target name or directory.")
_PAIRS = flags.DEFINE_integer("pairs", 3, "Alternations of every setting with the default.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timings per path in a process.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "5"], "New tokens per cached forward.")
_SETTINGS = flags.DEFINE_list("settings", [
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY_SLINKY",
    "--xla_cpu_use_xnnpack=false",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_enable_fast_math=true",
], "XLA_FLAGS values to try (one per process; ';' joins several flags).")
_CHILD = flags.DEFINE_bool("child", False, "Time in this process and print one JSON line.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

PATHS = ("kernels", "xla_rowwise", "xla")


def child():
  import jax
  from specjax import backends
  from specjax import costs
  from specjax.models.pretrained import load_pretrained
  model = load_pretrained(_TARGET.value)
  options = {"kernels": backends.Options(),
             "xla_rowwise": backends.Options(kernels=False),
             "xla": backends.Options(kernels=False, rowwise_max_rows=0)}
  timers = {}
  for t in (int(t) for t in _TOKENS.value):
    for path in PATHS:
      with backends.use(backends.select(options[path])):  # traced and compiled here
        timers[path, t] = costs.forward_timer(model, 1, t, context=128, iters=64)
  times = {key: [] for key in timers}
  for i in range(_REPEATS.value):
    for key in (list(timers) if i % 2 == 0 else list(timers)[::-1]):
      times[key].append(timers[key]())
  print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
                    "ms": {f"{p}/{t}": [1e3 * s for s in v] for (p, t), v in times.items()}}))


def run_child(setting: str) -> dict:
  env = {**os.environ, "XLA_FLAGS": " ".join(setting.split(";")) if setting else ""}
  argv = [sys.executable, "-m", "experiments.bench_xla_flags", "--child",
          f"--target={_TARGET.value}", f"--repeats={_REPEATS.value}",
          f"--tokens={','.join(_TOKENS.value)}"]
  done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    return {"xla_flags": setting, "error": done.stderr[-1500:]}
  return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values):
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "n": len(values)}


def main(argv):
  del argv
  if _CHILD.value:
    return child()
  from specjax import costs
  print(costs.machine_info(), flush=True)
  runs = {s: [] for s in [""] + _SETTINGS.value}
  neighbours = {s: [] for s in _SETTINGS.value}  # the default process before each run
  for _ in range(_PAIRS.value):
    for setting in _SETTINGS.value:
      before = run_child("")
      runs[""].append(before)
      out = run_child(setting)
      runs[setting].append(out)
      neighbours[setting].append(before)
      print(json.dumps(out)[:400], flush=True)
  report = {}
  for setting in [""] + _SETTINGS.value:
    good = [r for r in runs[setting] if "ms" in r]
    row = {"errors": [r["error"] for r in runs[setting] if "error" in r][:1]}
    for t in _TOKENS.value:
      for path in PATHS[1:]:
        # Per process: the median XLA time over the median kernel time in that process.
        same = [statistics.median(r["ms"][f"{path}/{t}"]) /
                statistics.median(r["ms"][f"kernels/{t}"]) for r in good]
        row[f"{path}/{t} over kernels, same process"] = _spread(same) if same else None
        if setting:
          pairs = [(r, n) for r, n in zip(runs[setting], neighbours[setting])
                   if "ms" in r and "ms" in n]
          cross = [statistics.median(r["ms"][f"{path}/{t}"]) /
                   statistics.median(n["ms"][f"kernels/{t}"]) for r, n in pairs]
          row[f"{path}/{t} over default-flag kernels"] = _spread(cross) if cross else None
      row[f"kernels/{t} ms"] = _spread([statistics.median(r["ms"][f"kernels/{t}"])
                                        for r in good]) if good else None
    report[setting or "(default flags)"] = row
  for name, row in report.items():
    print(f"\n{name}")
    for key, value in row.items():
      if isinstance(value, dict):
        print(f"  {key}: {value['median']:.3f} [{value['min']:.3f}, {value['max']:.3f}] "
              f"n={value['n']}")
      elif value:
        print(f"  {key}: {value}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"summary": report, "runs": runs}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
