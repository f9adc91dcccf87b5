"""The sweep over draft length γ, temperature, top-p, drafter and batch size.

  python -m experiments.run --config=configs/sweep.py --workdir=runs/sweep
  python -m experiments.run --config=configs/sweep.py:smoke --workdir=/tmp/smoke
  python -m experiments.run --config=configs/sweep.py --config.gamma=4 --config.temperature='(0.0,1.0)'

Variants: '' (default: a few minutes on a 2-core CPU with the shipped pair), 'smoke'
(seconds; the test suite runs it), 'full' (a larger grid for a GPU/TPU runtime),
'gpt2' (a public pair from local Hugging Face directories or the hub; see docs/HF.md).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.target = "stdlib-target"  # a shipped name, a checkpoint / HF directory, or a hub id
  c.draft = "stdlib-draft"
  c.drafter = ("model", "ngram")
  c.gamma = (1, 2, 3, 4, 6)
  c.temperature = (0.0, 0.7, 1.0)
  c.top_p = (1.0,)
  c.top_k = 0
  c.batch_size = (1,)
  c.draft_sample = "probabilistic"
  c.ngram_min = 1
  c.ngram_max = 4
  c.num_prompts = 8  # prompts per grid point, from the held-out split of the corpus
  c.prompt_tokens = 64
  c.max_new_tokens = 64
  c.corpus = "stdlib"  # where prompts come from: 'stdlib', a directory or a text file
  c.stop_at_eos = False  # off: every row decodes max_new_tokens, so rows compare evenly
  c.timing_repeats = 2  # best of n timed passes over the prompts
  c.seed = 0

  variant = (arg or "").strip()
  if variant == "smoke":
    c.gamma = (2,)
    c.temperature = (0.0, 1.0)
    c.num_prompts = 2
    c.prompt_tokens = 16
    c.max_new_tokens = 8
    c.timing_repeats = 1
  elif variant == "full":
    c.gamma = (1, 2, 3, 4, 5, 6, 8, 10, 12)
    c.temperature = (0.0, 0.3, 0.7, 1.0, 1.3)
    c.top_p = (1.0, 0.9)
    c.batch_size = (1, 8, 32)
    c.num_prompts = 64
    c.prompt_tokens = 128
    c.max_new_tokens = 128
    c.timing_repeats = 3
  elif variant == "gpt2":
    c.target = "gpt2-large"
    c.draft = "distilgpt2"
    c.gamma = (2, 3, 4, 5, 6)
    c.temperature = (0.0, 1.0)
    c.batch_size = (1, 8)
    c.num_prompts = 16
    c.prompt_tokens = 64
    c.max_new_tokens = 96
  elif variant:
    raise ValueError(f"unknown configs/sweep.py variant {variant!r}; "
                     "known: '', 'smoke', 'full', 'gpt2'")
  return c
