"""Training the drafts: language models (optionally distilled from the target) and heads.

  data.py    a corpus split by file, batches from its token stream
  lm.py      next-token / distillation training with optax, orbax checkpoints, eval
  heads.py   EAGLE / Medusa heads on a frozen target's features
  workdir.py a run's workdir: resumable fields, derived files, metrics and log lines
"""
