"""Train a target, a draft or a head: the shipped checkpoints, or new ones like them.

  python -m experiments.train --config=configs/train.py:target --workdir=DIR
  python -m experiments.train --config=configs/train.py:draft --workdir=DIR    # distils the target
  python -m experiments.train --config=configs/train.py:eagle --workdir=DIR    # or :medusa, a head
  python -m experiments.train --config=configs/train.py:tiny --workdir=/tmp/tiny

Re-running the same command resumes from the newest orbax checkpoint in DIR; DIR also
holds config.json and metrics.jsonl (loss, tokens/s, held-out loss, bits per byte, α̂).
`python -m experiments.card` then measures the numbers a checkpoint's card reports.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from specjax.training import lm as train_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file[:variant].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the model.")
flags.mark_flags_as_required(["config", "workdir"])
# An empty --workdir= would be the current directory (the repo root, whose checkpoints/
# holds the shipped models).
flags.register_validator("workdir", lambda w: w is None or bool(w.strip()),
                         "--workdir must be a directory path, not empty")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  config = _CONFIG.value
  if config.get("head"):  # an EAGLE / Medusa head on a frozen target
    from specjax.training import heads as train_heads
    train_heads.train(config, _WORKDIR.value)
  else:
    train_lib.train(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
