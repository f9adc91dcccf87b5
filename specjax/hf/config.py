"""Hugging Face config.json <-> `ModelConfig`, both directions, refusing what specjax lacks.

Import maps GPT-2 and the Llama family (Llama 2/3.x, Mistral, Qwen2, Qwen3) onto
`ModelConfig` and raises ValueError, naming the field, for anything it would not
compute exactly. Export picks the transformers architecture that computes a given
`ModelConfig` exactly, and writes its config.json.
"""

from __future__ import annotations

import logging
from typing import Any

from specjax.models.config import ROPE_SCALINGS, ModelConfig

log = logging.getLogger(__name__)

GPT2_TYPES = ("gpt2",)
LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = GPT2_TYPES + LLAMA_TYPES

# GELU variants that are the tanh approximation specjax computes.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Keys a RoPE parameter dict may carry besides the scaling's own parameters.
_ROPE_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def family(model_type: str) -> str:
  """'gpt2' or 'llama' (the Llama-style families); ValueError for anything else."""
  if model_type in GPT2_TYPES:
    return "gpt2"
  if model_type in LLAMA_TYPES:
    return "llama"
  raise ValueError(
      f"unsupported Hugging Face model_type {model_type!r}: specjax loads "
      f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def _require_int(hf: dict, key: str, model_type: str) -> int:
  value = hf.get(key)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{model_type} config.json: {key} must be a positive int, got {value!r}")
  return value


def _gpt2_config(hf: dict) -> ModelConfig:
  act = hf.get("activation_function", "gelu_new")
  if act not in _TANH_GELUS:
    raise ValueError(f"gpt2 activation_function {act!r} is not supported: specjax computes "
                     f"the tanh-approximate GELU ({', '.join(_TANH_GELUS)})")
  if not hf.get("scale_attn_weights", True):
    raise ValueError("gpt2 scale_attn_weights=False is not supported")
  for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
    if hf.get(flag, False):
      raise ValueError(f"gpt2 {flag}=True is not supported")
  d_model = _require_int(hf, "n_embd", "gpt2")
  n_inner = hf.get("n_inner")
  return ModelConfig(
      vocab_size=_require_int(hf, "vocab_size", "gpt2"), d_model=d_model,
      n_layers=_require_int(hf, "n_layer", "gpt2"), n_heads=_require_int(hf, "n_head", "gpt2"),
      max_len=_require_int(hf, "n_positions" if "n_positions" in hf else "n_ctx", "gpt2"),
      d_ff=n_inner or None, norm="layernorm",
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), position="learned", mlp="gelu",
      qkv_bias=True, out_bias=True, mlp_bias=True,
      tie_embeddings=_flag(hf, "tie_word_embeddings", True))


def _rope(hf: dict, model_type: str, max_position: int) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling or None) from either config style.

  transformers 5 writes `rope_parameters` (theta and scaling in one dict); 4.x writes
  `rope_theta` and `rope_scaling`. Like transformers, `rope_scaling` wins when present.
  """
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if not isinstance(params, dict):
    raise ValueError(f"{model_type} rope parameters must be a dict, got {params!r}")
  if any(isinstance(v, dict) for v in params.values()):
    raise ValueError(f"{model_type}: per-layer RoPE parameters are not supported: {params}")
  rope_type = params.get("rope_type", params.get("type", "default"))
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"{model_type}: partial_rotary_factor={partial} is not supported")
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  if rope_type in (None, "default"):
    return theta, None
  if rope_type not in ROPE_SCALINGS:
    raise ValueError(f"{model_type}: RoPE scaling {rope_type!r} is not supported (specjax "
                     f"computes plain RoPE and {', '.join(map(repr, ROPE_SCALINGS))}): {params}")
  keys = ROPE_SCALINGS[rope_type]
  unknown = sorted(set(params) - set(keys) - set(_ROPE_COMMON_KEYS))
  if unknown:
    raise ValueError(f"{model_type}: RoPE scaling {rope_type!r} with parameters specjax does "
                     f"not model: {unknown}")
  scaling = {k: params[k] for k in keys if k in params}
  # As in transformers: a top-level value wins, then the dict's, then the context length.
  original = "original_max_position_embeddings"
  scaling[original] = hf.get(original) or params.get(original) or max_position
  missing = [k for k in keys if k not in scaling]
  if missing:
    raise ValueError(f"{model_type}: RoPE scaling {rope_type!r} needs {missing}: {params}")
  return theta, {"rope_type": rope_type, **scaling}


def _flag(hf: dict, key: str, default: bool) -> bool:
  """A JSON boolean; ValueError for anything else ("false" is not False)."""
  value = hf.get(key, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"config.json {key} must be true or false, got {value!r}")
  return value


def _sliding_window(hf: dict, model_type: str, n_layers: int) -> int | None:
  """The attention window if any layer uses one, else None; ValueError if not an int >= 1."""
  window = _any_window(hf, model_type, n_layers)
  if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                             or window < 1):
    raise ValueError(f"{model_type} sliding_window must be a positive int, got {window!r}")
  return window


def _any_window(hf: dict, model_type: str, n_layers: int) -> int | None:
  if model_type in ("qwen2", "qwen3"):
    if not _flag(hf, "use_sliding_window", False):
      return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
      uses_window = any(t != "full_attention" for t in layer_types)
    else:
      uses_window = hf.get("max_window_layers", n_layers) < n_layers
    return hf.get("sliding_window") if uses_window else None
  if model_type == "mistral":
    return hf.get("sliding_window")
  return None


def _llama_config(hf: dict) -> ModelConfig:
  model_type = hf["model_type"]
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{model_type} hidden_act {act!r} is not supported (SwiGLU needs silu)")
  d_model = _require_int(hf, "hidden_size", model_type)
  n_layers = _require_int(hf, "num_hidden_layers", model_type)
  n_heads = _require_int(hf, "num_attention_heads", model_type)
  # Qwen3Config's head_dim defaults to 128, the others' to hidden_size // heads.
  head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else d_model // n_heads)
  max_len = _require_int(hf, "max_position_embeddings", model_type)
  rope_theta, rope_scaling = _rope(hf, model_type, max_len)
  window = _sliding_window(hf, model_type, n_layers)
  if window is not None and window < max_len:
    # Within the window sliding attention is full attention, so the model is exact up
    # to `window` tokens; cap max_len there rather than refuse the checkpoint.
    log.warning("%s uses sliding-window attention (window %d): max_len capped from %d to %d",
                model_type, window, max_len, window)
    max_len = window
  if model_type == "qwen2":  # q/k/v carry biases, the output projection does not
    qkv_bias, out_bias, mlp_bias = True, False, False
  elif model_type in ("llama", "qwen3"):
    qkv_bias = out_bias = _flag(hf, "attention_bias", False)
    mlp_bias = model_type == "llama" and _flag(hf, "mlp_bias", False)
  else:
    qkv_bias = out_bias = mlp_bias = False
  return ModelConfig(
      vocab_size=_require_int(hf, "vocab_size", model_type), d_model=d_model,
      n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
      max_len=max_len, d_ff=_require_int(hf, "intermediate_size", model_type),
      norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), position="rope",
      rope_theta=rope_theta, rope_scaling=rope_scaling, mlp="swiglu", qkv_bias=qkv_bias,
      out_bias=out_bias, mlp_bias=mlp_bias, qk_norm=model_type == "qwen3",
      tie_embeddings=_flag(hf, "tie_word_embeddings", False))


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
  """Maps a Hugging Face config.json dict onto `ModelConfig`; ValueError if unsupported."""
  if not isinstance(hf_config, dict) or "model_type" not in hf_config:
    raise ValueError("a Hugging Face config needs a 'model_type' field")
  model_type = hf_config["model_type"]
  kind = family(model_type)
  if hf_config.get("quantization_config"):
    raise ValueError(f"quantized checkpoints are not supported: {hf_config['quantization_config']}")
  # ModelConfig fills its own defaults, so this equals a config written by hand.
  return _gpt2_config(hf_config) if kind == "gpt2" else _llama_config(hf_config)


def export_type(cfg: ModelConfig) -> str:
  """'gpt2', 'llama', 'qwen2' or 'qwen3': the transformers architecture computing `cfg`."""
  gpt2_like = dict(position="learned", norm="layernorm", mlp="gelu", qkv_bias=True,
                   out_bias=True, mlp_bias=True, qk_norm=False)
  llama_like = dict(position="rope", norm="rmsnorm", mlp="swiglu")
  if all(getattr(cfg, k) == v for k, v in gpt2_like.items()):
    if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
      raise ValueError("GPT-2 needs n_kv_heads == n_heads and head_dim == d_model // n_heads, "
                       f"got n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}")
    return "gpt2"
  if all(getattr(cfg, k) == v for k, v in llama_like.items()):
    if cfg.qk_norm:  # Qwen3: attention_bias covers q, k, v and o alike; no MLP biases
      if cfg.qkv_bias == cfg.out_bias and not cfg.mlp_bias:
        return "qwen3"
    elif cfg.qkv_bias == cfg.out_bias:  # Llama's attention_bias covers q, k, v and o alike
      return "llama"
    elif cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias:
      return "qwen2"
    raise ValueError(
        f"no transformers architecture has qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, "
        f"out_bias={cfg.out_bias}, mlp_bias={cfg.mlp_bias} (Llama: q/k/v/o biases together; "
        "Qwen2: q/k/v only; Qwen3: q/k norms, q/k/v/o biases together, no MLP biases)")
  raise ValueError(
      "only GPT-2-style (learned positions, layernorm, gelu, all biases) and Llama-style "
      "(rope, rmsnorm, swiglu) configs can be exported, got "
      f"position={cfg.position!r}, norm={cfg.norm!r}, mlp={cfg.mlp!r}, qk_norm={cfg.qk_norm}, "
      f"biases qkv={cfg.qkv_bias} out={cfg.out_bias} mlp={cfg.mlp_bias}")


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def config_to_hf(cfg: ModelConfig, *, bos_id: int | None = None,
                 eos_id: int | list[int] | None = None) -> dict[str, Any]:
  """The config.json transformers needs to compute `cfg` exactly; ValueError if none can."""
  model_type = export_type(cfg)
  if model_type == "gpt2":
    out = dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size,
        n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=cfg.d_ff, activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_weights=True)
  else:
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    out = dict(
        architectures=[_ARCHITECTURES[model_type]], model_type=model_type,
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta/rope_scaling.
        rope_theta=cfg.rope_theta, rope_parameters={**scaling, "rope_theta": cfg.rope_theta})
    if cfg.rope_scaling:
      out["rope_scaling"] = scaling
    if model_type == "llama":
      out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif model_type == "qwen3":
      out.update(attention_bias=cfg.qkv_bias, use_sliding_window=False, sliding_window=None)
    else:
      out.update(use_sliding_window=False, sliding_window=None)
  # Written explicitly: a missing id makes transformers fall back to its own defaults.
  out.update(tie_word_embeddings=cfg.tie_embeddings, bos_token_id=bos_id, eos_token_id=eos_id,
             torch_dtype="float32")
  return out
