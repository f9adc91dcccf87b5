"""Static model configuration: one frozen dataclass describes GPT-2- and Llama-style models."""

from __future__ import annotations

import dataclasses
import math
import json
import numbers
from typing import Any

# RoPE frequency scalings ModelConfig computes, and the parameters each one needs.
ROPE_SCALINGS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def _rope_scaling(value) -> tuple[tuple[str, Any], ...]:
  """A rope_scaling dict (or (key, value) pairs) as sorted, validated, hashable pairs."""
  try:
    d = dict(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"ModelConfig.rope_scaling must be a dict or (key, value) pairs, "
                     f"got {value!r}") from e
  kind = d.get("rope_type")
  if kind not in ROPE_SCALINGS:
    raise ValueError(f"ModelConfig.rope_scaling rope_type {kind!r} is not supported "
                     f"(known: {', '.join(ROPE_SCALINGS)})")
  keys = ROPE_SCALINGS[kind]
  missing = [k for k in keys if k not in d]
  unknown = sorted(set(d) - set(keys) - {"rope_type"})
  if missing or unknown:
    raise ValueError(f"ModelConfig.rope_scaling for {kind!r} needs exactly {', '.join(keys)}: "
                     f"missing {missing}, unknown {unknown}")
  for k in keys:
    v = d[k]
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not v > 0:
      raise ValueError(f"ModelConfig.rope_scaling {k} must be a positive number, got {v!r}")
  if kind == "llama3":
    if not d["high_freq_factor"] > d["low_freq_factor"]:
      raise ValueError("ModelConfig.rope_scaling needs high_freq_factor > low_freq_factor, got "
                       f"{d['high_freq_factor']} and {d['low_freq_factor']}")
    if int(d["original_max_position_embeddings"]) != d["original_max_position_embeddings"]:
      raise ValueError("ModelConfig.rope_scaling original_max_position_embeddings must be an "
                       f"int, got {d['original_max_position_embeddings']!r}")
    d = {k: (int(v) if k == "original_max_position_embeddings" else float(v))
         for k, v in d.items() if k != "rope_type"} | {"rope_type": kind}
  return tuple(sorted(d.items()))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only transformer.

  The defaults describe a GPT-2-style model (LayerNorm, learned positions, GELU MLP,
  biases, tied embeddings); `ModelConfig.llama(...)` flips them to RMSNorm, RoPE,
  SwiGLU and an untied head (grouped-query attention when given `n_kv_heads` <
  `n_heads`). Frozen and hashable, so it can be
  a static argument of `jax.jit`.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  max_len: int
  n_kv_heads: int | None = None  # None: n_heads (multi-head attention)
  head_dim: int | None = None  # None: d_model // n_heads
  d_ff: int | None = None  # None: 4 * d_model
  norm: str = "layernorm"  # 'layernorm' | 'rmsnorm'
  norm_eps: float = 1e-5
  position: str = "learned"  # 'learned' | 'rope'
  rope_theta: float = 10000.0
  # RoPE frequency scaling: None, or a dict such as {'rope_type': 'llama3', 'factor': 8.0,
  # 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings':
  # 8192}, kept as sorted (key, value) pairs so the config stays hashable.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  mlp: str = "gelu"  # 'gelu' (tanh approximation, GPT-2's gelu_new) | 'swiglu'
  qkv_bias: bool = True
  out_bias: bool = True
  mlp_bias: bool = True
  tie_embeddings: bool = True
  qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
  # Layout of the fused kernels' output axis: qkv_groups consecutive groups [q | k | v]
  # of n_heads/G and n_kv_heads/G heads each, and (SwiGLU) mlp_groups groups [gate | up]
  # of d_ff/G units each. 1 is the usual layout; `specjax.shard` sets them to the
  # tensor-parallel degree, so that each device's contiguous slice holds whole heads.
  qkv_groups: int = 1
  mlp_groups: int = 1

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    for name in ("norm_eps", "rope_theta"):  # eps <= 0 gives NaNs; theta <= 0 no rotation
      value = getattr(self, name)
      if (not isinstance(value, (int, float)) or isinstance(value, bool)
          or not 0 < value < math.inf):
        raise ValueError(f"ModelConfig.{name} must be a finite number > 0, got {value!r}")
    for name in ("qkv_bias", "out_bias", "mlp_bias", "tie_embeddings", "qk_norm"):
      if not isinstance(getattr(self, name), bool):  # "false" would read as True
        raise ValueError(f"ModelConfig.{name} must be True or False, got "
                         f"{getattr(self, name)!r}")
    if self.norm not in ("layernorm", "rmsnorm"):
      raise ValueError(f"ModelConfig.norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
    if self.position not in ("learned", "rope"):
      raise ValueError(f"ModelConfig.position must be 'learned' or 'rope', got {self.position!r}")
    if self.mlp not in ("gelu", "swiglu"):
      raise ValueError(f"ModelConfig.mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
          "set head_dim explicitly")
    # One name per field: the defaults are filled here, so configs from different sources
    # (a JSON with nulls, a Hugging Face import) compare and hash equal.
    for name, default in (("n_kv_heads", self.n_heads), ("head_dim", self.d_model // self.n_heads),
                          ("d_ff", 4 * self.d_model)):
      if getattr(self, name) is None:
        object.__setattr__(self, name, default)
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
    for name in ("qkv_groups", "mlp_groups"):
      g = getattr(self, name)
      if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {g!r}")
    if self.n_kv_heads % self.qkv_groups:  # n_heads is a multiple of n_kv_heads
      raise ValueError(f"ModelConfig.qkv_groups={self.qkv_groups} must divide "
                       f"n_kv_heads={self.n_kv_heads}")
    if self.mlp_groups > 1 and (self.mlp != "swiglu" or self.d_ff % self.mlp_groups):
      raise ValueError(f"ModelConfig.mlp_groups={self.mlp_groups} needs mlp='swiglu' and a "
                       f"d_ff divisible by it, got mlp={self.mlp!r}, d_ff={self.d_ff}")
    if self.position == "rope" and self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
    if self.rope_scaling is not None:
      if self.position != "rope":
        raise ValueError("ModelConfig.rope_scaling needs position='rope', "
                         f"got position={self.position!r}")
      object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))

  @classmethod
  def llama(cls, **kwargs) -> "ModelConfig":
    """A Llama-style config: RMSNorm, RoPE, SwiGLU, no biases, untied head."""
    base = dict(norm="rmsnorm", norm_eps=1e-6, position="rope", mlp="swiglu",
                qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False)
    base.update(kwargs)
    return cls(**base)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    if self.rope_scaling is not None:
      d["rope_scaling"] = dict(self.rope_scaling)
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
    return cls(**d)
