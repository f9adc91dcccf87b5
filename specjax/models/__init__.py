"""The models and what holds them: the transformer, its cache, its weights on disk and on devices.

  config.py         ModelConfig: one frozen dataclass for GPT-2- and Llama-style models
  model.py          the decoder (Flax NNX) and the pure functions that run it
  layers.py         RoPE, attention over a KV cache, fused projections
  kv_cache.py       fixed-size KV buffers with a per-row valid length
  heads.py          EAGLE / Medusa draft heads on the target's features, and their files
  tokenizer.py      byte-level BPE
  checkpoint.py     a model directory: config + parameters (+ tokenizer)
  pretrained.py     load_pretrained: the shipped pair by name, our checkpoints, HF models
  quantization.py   weight-only int8
  sharding.py       weights over 'model', the batch over 'data'
  tensor_layout.py  which weight axes a 'model' axis of size tp splits
"""
