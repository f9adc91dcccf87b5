"""Training jobs: the shipped stdlib target and draft, and a tiny one for tests.

  python -m experiments.train --config=configs/train.py:target --workdir=/work/runs/target
  python -m experiments.train --config=configs/train.py:draft --workdir=/work/runs/draft
  python -m experiments.train --config=configs/train.py:eagle --workdir=/work/runs/eagle
  python -m experiments.train --config=configs/train.py:medusa --workdir=/work/runs/medusa
  python -m experiments.train --config=configs/train.py:eagle3 --workdir=/work/runs/eagle3
  python -m experiments.train --config=configs/train.py:tiny --workdir=/tmp/tiny

Any field can be overridden on the command line, e.g. `--config.steps=100`.
"""

import pathlib

import ml_collections

import specjax


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Data: 'stdlib' (this interpreter's standard library), a directory, or a text file.
  c.corpus = "stdlib"
  c.heldout_fraction = 0.05
  c.tokenizer = ""  # a tokenizer.json to reuse; empty: the teacher's, else train one
  c.vocab_size = 2048  # for a newly trained tokenizer
  c.seq_len = 256
  c.batch_size = 16
  c.seed = 0
  # Model: ModelConfig fields plus style 'llama' (RMSNorm/RoPE/SwiGLU) or 'gpt2'.
  c.model = ml_collections.ConfigDict()
  # Optimizer.
  c.steps = 1000
  c.lr = 1e-3
  c.warmup_steps = 100
  c.end_lr_fraction = 0.1
  c.weight_decay = 0.1
  c.grad_clip = 1.0
  c.b1 = 0.9
  c.b2 = 0.95
  # Distillation from a teacher (a pretrained name or checkpoint directory).
  c.teacher = ""
  c.distill = ""  # '', 'fkl', 'rkl' or 'tvd'
  c.distill_weight = 1.0
  # Bookkeeping.
  c.log_every = 50
  c.eval_every = 500
  c.eval_windows = 64
  c.eval_batch_size = 8
  c.checkpoint_every = 250
  c.export_dir = ""  # empty: WORKDIR/model (WORKDIR/head for the eagle / medusa variants)
  c.export_dtype = ""  # e.g. 'bfloat16' for the shipped files; empty keeps float32
  return c


def model(vocab_size, d_model, n_layers, n_heads, d_ff, max_len=512):
  return ml_collections.ConfigDict(dict(
      style="llama", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
      n_heads=n_heads, d_ff=d_ff, max_len=max_len, tie_embeddings=True))


def get_config(arg: str = "target") -> ml_collections.ConfigDict:
  c = base()
  if arg == "target":
    # ~3.7M parameters, 5.7M tokens: ~1.6k tokens/s on an idle CPU core, ~0.8k on a busy one.
    c.model = model(2048, 256, 4, 4, 704)
    c.steps = 1400
    c.warmup_steps = 100
    c.lr = 2e-3
    c.eval_every = 250
    c.checkpoint_every = 100
    c.export_dtype = "bfloat16"
  elif arg == "draft":
    # Distilled from the shipped target: its tokenizer, its soft distribution.
    c.teacher = "stdlib-target"
    c.distill = "fkl"
    # ~0.38M parameters: about a tenth of the target's multiply-adds per token.
    c.model = model(2048, 96, 2, 2, 192)
    c.steps = 1500
    c.warmup_steps = 100
    c.lr = 3e-3
    c.weight_decay = 0.0
    c.eval_every = 250
    c.checkpoint_every = 100
    c.export_dtype = "bfloat16"
  elif arg in ("eagle", "medusa", "eagle3"):
    # A head on the frozen shipped target (specjax.training.heads): its features are
    # computed on the fly, only the head trains.
    c.head = arg
    c.teacher = "stdlib-target"
    c.distill_weight = 1.0  # soft cross-entropy against the target's T = 1 distribution
    c.feature_noise = 0.0  # EAGLE: uniform noise on the input features
    c.batch_size = 8
    c.warmup_steps = 50
    c.lr = 3e-3
    c.weight_decay = 0.0
    c.log_every = 25
    c.eval_every = 250
    c.eval_windows = 32
    c.checkpoint_every = 100
    c.export_dtype = "bfloat16"
    if arg == "eagle3":
      # Its residual streams entering block 1, block 2 and after block 4 (HeadConfig's
      # default for a 4-layer target), fused; its own norm and LM head over the target's
      # most frequent tokens; trained on its own unrolled predictions (training-time
      # test), no feature regression. ~1.5k tokens/s on two otherwise idle CPU cores:
      # 2,000 steps in about 56 minutes (the shipped head was resumed to 4,000).
      c.feature_layers = ()  # empty: heads.eagle3_layers(target layers)
      c.draft_vocab = 1792  # 99.8% of the training stream (the 2,048-token vocabulary)
      c.ttt_steps = 4
      c.ttt_decay = 0.8
      c.steps = 2000
      c.eval_every = 500
    else:
      c.medusa_heads = 4
      c.feature_weight = 1.0  # EAGLE: smooth-L1 regression onto the next feature
      c.medusa_decay = 0.8  # Medusa: weight of head k is decay^(k-1)
      # ~1.2k tokens/s on one busy CPU core (the target's forward is half the cost).
      c.steps = 1200 if arg == "eagle" else 600
  elif arg == "tiny":
    # Seconds on a CPU: the specjax sources as corpus, a 300-token BPE, a 2-layer model.
    c.corpus = str(pathlib.Path(specjax.__file__).parent)
    c.heldout_fraction = 0.3
    c.vocab_size = 300
    c.model = model(300, 32, 2, 2, 64, max_len=64)
    c.seq_len = 32
    c.batch_size = 4
    c.steps = 20
    c.warmup_steps = 2
    c.log_every = 5
    c.eval_every = 10
    c.eval_windows = 4
    c.checkpoint_every = 10
  else:
    raise ValueError(f"unknown variant {arg!r}; use target, draft, eagle, eagle3, medusa or tiny")
  return c
