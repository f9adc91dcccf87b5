"""Hugging Face checkpoints in and out: GPT-2 and the Llama family (Llama 2/3.x, Mistral,
Qwen2, Qwen3).

Import reads a model directory (config.json, safetensors weights, tokenizer.json) or a
hub id, maps the config onto `ModelConfig` and the tensors onto specjax's parameter
tree; export writes the same layout back, so one set of weights runs in both stacks.
Everything that can be checked before loading weights is: unsupported architectures or
features, missing or unexpected tensors, and every tensor's shape.

  config.py   config.json <-> ModelConfig
  weights.py  the weight plan: which HF tensors make each parameter, import and export
  files.py    model directories and hub ids: reading, loading, exporting
"""

from specjax.hf.config import (GPT2_TYPES, LLAMA_TYPES, SUPPORTED_MODEL_TYPES, config_from_hf,
                               config_to_hf)
from specjax.hf.files import WEIGHT_FILES, CheckpointTensors, export_hf, load_hf_model
from specjax.hf.weights import pad_vocab, params_from_hf, params_to_hf

__all__ = ["GPT2_TYPES", "LLAMA_TYPES", "SUPPORTED_MODEL_TYPES", "WEIGHT_FILES",
           "CheckpointTensors", "config_from_hf", "config_to_hf", "export_hf", "load_hf_model",
           "pad_vocab", "params_from_hf", "params_to_hf"]
