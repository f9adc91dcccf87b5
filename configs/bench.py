"""Synthetic-acceptance speed curves (`python -m experiments.bench --part=synthetic`).

  python -m experiments.bench --part=synthetic --config=configs/bench.py --out=runs/synth
  python -m experiments.bench --part=synthetic --config=configs/bench.py:gpu --out=runs/synth_gpu

Random-weight Llama-shaped target and draft; the synthetic verify rule accepts each draft
position with probability α given the previous one was accepted (rates α^(i+1)), so
tokens per target call are E(α, γ) whatever the weights, and the curve shows what the
engine turns a given acceptance into.

Variants: '' (a tiny pair, about a minute on a 2-core CPU), 'gpu' (TinyLlama-1.1B and
Llama-68M shapes, 32000-token vocabulary, bfloat16; for an accelerator).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # specjax.ModelConfig.llama(**target) and (**draft); the vocabularies must match.
  c.target = dict(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=704,
                  max_len=512)
  c.draft = dict(vocab_size=2048, d_model=64, n_layers=1, n_heads=2, d_ff=176, max_len=512)
  c.dtype = "float32"  # parameter dtype: 'float32' or 'bfloat16'
  c.alpha = (0.5, 0.8, 0.95)  # per-position acceptance; the rule's rates are α^(i+1)
  c.gamma = (2, 4)
  c.batch_size = (1,)
  c.num_prompts = 2  # random prompts (token ids), one shape
  c.prompt_tokens = 32
  c.max_new_tokens = 64
  c.temperature = 1.0
  c.pairs = 2  # synthetic vs target-only timing pairs, median kept
  c.predict = True  # also time c and v(γ) and print the ledger's E(α, γ) / (γc + v(γ))
  c.seed = 0

  variant = (arg or "").strip()
  if variant == "gpu":
    c.target = dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                    d_ff=5632, max_len=2048)  # TinyLlama-1.1B
    c.draft = dict(vocab_size=32000, d_model=768, n_layers=2, n_heads=12, d_ff=3072,
                   max_len=2048)  # Llama-68M (JackFram/llama-68m)
    c.dtype = "bfloat16"
    c.alpha = (0.5, 0.7, 0.8, 0.9, 0.95)
    c.gamma = (2, 4, 8)
    c.batch_size = (1, 8)
    c.num_prompts = 8
    c.prompt_tokens = 128
    c.max_new_tokens = 128
    c.pairs = 3
  elif variant:
    raise ValueError(f"unknown configs/bench.py variant {variant!r}; known: '', 'gpu'")
  return c
