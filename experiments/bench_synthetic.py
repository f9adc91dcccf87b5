r"""Engine speed at a chosen acceptance: the synthetic verify rule on random-weight models.

  python -m experiments.bench_synthetic --config=configs/bench.py --workdir=runs/synth
  python -m experiments.bench_synthetic --config=configs/bench.py:gpu --workdir=runs/synth_gpu

Speculative decoding with `specjax.verify.rules.SyntheticRule` (position i accepted with
probability α^(i+1)) timed against target-only decoding, for each (batch, γ, α) of the
config; what is measured and written is in `experiments/synthetic.py` (the tests call it).
Writes <workdir>/config.json, results.json and summary.md.
"""

from __future__ import annotations

from pathlib import Path

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import synthetic

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench.py", "Benchmark config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_synthetic", "Where results go.")


def main(argv):
  del argv
  synthetic.run(_CONFIG.value, Path(_WORKDIR.value))


if __name__ == "__main__":
  app.run(main)
