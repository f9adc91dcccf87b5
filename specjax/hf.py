"""Hugging Face checkpoints in and out: GPT-2 and the Llama family (Llama, Mistral, Qwen2).

Import reads a model directory (config.json, safetensors weights, tokenizer.json) or a
hub id, maps the config onto `ModelConfig` and the tensors onto specjax's parameter
tree; export writes the same layout back, so one set of weights runs in both stacks.

One table per family (`_plan`) lists, for every specjax parameter, the Hugging Face
tensors it is made of and how: copied, transposed (torch Linear weights are [out, in],
ours [in, out]) or transposed and concatenated (our fused q|k|v and gate|up kernels).
Import and export both read that table, so they cannot disagree.

Everything that can be checked before loading weights is: unsupported architectures or
features, missing or unexpected tensors, and every tensor's shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model import Model, Params, graphdef_for

log = logging.getLogger(__name__)

GPT2_TYPES = ("gpt2",)
LLAMA_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = GPT2_TYPES + LLAMA_TYPES

# GELU variants that are the tanh approximation specjax computes.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Buffers some checkpoints carry that hold no weights (causal masks, RoPE tables).
_IGNORED_TENSORS = re.compile(r"(^|\.)attn\.(masked_)?bias$|rotary_emb\.inv_freq$")

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


# ----------------------------------------------------------------------------
# Configs.


def _family(model_type: str) -> str:
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
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _rope_theta(hf: dict, model_type: str) -> float:
  """RoPE base from either config style: v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict):
    raise ValueError(f"{model_type} rope parameters must be a dict, got {params!r}")
  if any(isinstance(v, dict) for v in params.values()):
    raise ValueError(f"{model_type}: per-layer RoPE parameters are not supported: {params}")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in (None, "default"):
    raise ValueError(f"{model_type}: RoPE scaling {rope_type!r} is not supported "
                     f"(only plain RoPE): {params}")
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"{model_type}: partial_rotary_factor={partial} is not supported")
  return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _sliding_window(hf: dict, model_type: str, n_layers: int) -> int | None:
  """The attention window if any layer uses one, else None."""
  if model_type == "qwen2":
    if not hf.get("use_sliding_window", False):
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
  head_dim = hf.get("head_dim") or d_model // n_heads
  max_len = _require_int(hf, "max_position_embeddings", model_type)
  window = _sliding_window(hf, model_type, n_layers)
  if window is not None and window < max_len:
    # Within the window sliding attention is full attention, so the model is exact up
    # to `window` tokens; cap max_len there rather than refuse the checkpoint.
    log.warning("%s uses sliding-window attention (window %d): max_len capped from %d to %d",
                model_type, window, max_len, window)
    max_len = window
  if model_type == "qwen2":  # q/k/v carry biases, the output projection does not
    qkv_bias, out_bias, mlp_bias = True, False, False
  elif model_type == "llama":
    qkv_bias = out_bias = bool(hf.get("attention_bias", False))
    mlp_bias = bool(hf.get("mlp_bias", False))
  else:
    qkv_bias = out_bias = mlp_bias = False
  return ModelConfig(
      vocab_size=_require_int(hf, "vocab_size", model_type), d_model=d_model,
      n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
      max_len=max_len, d_ff=_require_int(hf, "intermediate_size", model_type),
      norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), position="rope",
      rope_theta=_rope_theta(hf, model_type), mlp="swiglu", qkv_bias=qkv_bias,
      out_bias=out_bias, mlp_bias=mlp_bias,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
  """Maps a Hugging Face config.json dict onto `ModelConfig`; ValueError if unsupported."""
  if not isinstance(hf_config, dict) or "model_type" not in hf_config:
    raise ValueError("a Hugging Face config needs a 'model_type' field")
  model_type = hf_config["model_type"]
  family = _family(model_type)
  if hf_config.get("quantization_config"):
    raise ValueError(f"quantized checkpoints are not supported: {hf_config['quantization_config']}")
  cfg = _gpt2_config(hf_config) if family == "gpt2" else _llama_config(hf_config)
  # Defaults back to None, so a config equals (and jit-caches like) the one it came from.
  defaults = dict(n_kv_heads=cfg.n_heads, head_dim=cfg.d_model // cfg.n_heads,
                  d_ff=4 * cfg.d_model)
  return dataclasses.replace(
      cfg, **{k: None for k, v in defaults.items() if getattr(cfg, k) == v})


def _export_type(cfg: ModelConfig) -> str:
  """'gpt2', 'llama' or 'qwen2': the transformers architecture that computes `cfg` exactly."""
  gpt2_like = dict(position="learned", norm="layernorm", mlp="gelu", qkv_bias=True,
                   out_bias=True, mlp_bias=True)
  llama_like = dict(position="rope", norm="rmsnorm", mlp="swiglu")
  if all(getattr(cfg, k) == v for k, v in gpt2_like.items()):
    if cfg.kv_heads != cfg.n_heads or cfg.dim_per_head * cfg.n_heads != cfg.d_model:
      raise ValueError("GPT-2 needs n_kv_heads == n_heads and head_dim == d_model // n_heads, "
                       f"got n_kv_heads={cfg.kv_heads}, head_dim={cfg.dim_per_head}")
    return "gpt2"
  if all(getattr(cfg, k) == v for k, v in llama_like.items()):
    if cfg.qkv_bias == cfg.out_bias:  # Llama's attention_bias covers q, k, v and o alike
      return "llama"
    if cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias:
      return "qwen2"
    raise ValueError(
        f"no transformers architecture has qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, "
        f"mlp_bias={cfg.mlp_bias} (Llama: q/k/v/o biases together; Qwen2: q/k/v only)")
  raise ValueError(
      "only GPT-2-style (learned positions, layernorm, gelu, all biases) and Llama-style "
      "(rope, rmsnorm, swiglu) configs can be exported, got "
      f"position={cfg.position!r}, norm={cfg.norm!r}, mlp={cfg.mlp!r}, "
      f"biases qkv={cfg.qkv_bias} out={cfg.out_bias} mlp={cfg.mlp_bias}")


def config_to_hf(cfg: ModelConfig, *, bos_id: int | None = None,
                 eos_id: int | None = None) -> dict[str, Any]:
  """The config.json transformers needs to compute `cfg` exactly; ValueError if none can."""
  model_type = _export_type(cfg)
  if model_type == "gpt2":
    out = dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size,
        n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=cfg.ff_dim, activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_weights=True)
  else:
    out = dict(
        architectures=["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.dim_per_head, hidden_act="silu", max_position_embeddings=cfg.max_len,
        rms_norm_eps=cfg.norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta.
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if model_type == "llama":
      out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    else:
      out.update(use_sliding_window=False, sliding_window=None)
  # Written explicitly: a missing id makes transformers fall back to its own defaults.
  out.update(tie_word_embeddings=cfg.tie_embeddings, bos_token_id=bos_id, eos_token_id=eos_id,
             torch_dtype="float32")
  return out


# ----------------------------------------------------------------------------
# The parameter table.


@dataclasses.dataclass(frozen=True)
class _Slot:
  """One specjax parameter and the Hugging Face tensors it is made of."""
  path: tuple  # key path into the specjax params dict
  sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF tensor name, HF shape)
  layout: str  # 'copy' | 'transpose' | 'concat' (1-D) | 'concat_transpose' (2-D)


def _plan(cfg: ModelConfig, model_type: str, prefix: str) -> list[_Slot]:
  """Every specjax parameter of `cfg`, with its Hugging Face source tensors."""
  d, v, f = cfg.d_model, cfg.vocab_size, cfg.ff_dim
  q_dim, kv_dim = cfg.n_heads * cfg.dim_per_head, cfg.kv_heads * cfg.dim_per_head
  slots = []

  def add(path, layout, *sources):
    slots.append(_Slot(path, tuple(sources), layout))

  if _family(model_type) == "gpt2":
    # GPT-2's Conv1D weights are already [in, out], and c_attn is already q|k|v.
    p = prefix
    add(("embed", "embedding"), "copy", (p + "wte.weight", (v, d)))
    add(("pos_embed", "embedding"), "copy", (p + "wpe.weight", (cfg.max_len, d)))
    for i in range(cfg.n_layers):
      h, b = f"{p}h.{i}.", ("blocks", i)
      for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
        add(b + (ours, "scale"), "copy", (h + theirs + ".weight", (d,)))
        add(b + (ours, "bias"), "copy", (h + theirs + ".bias", (d,)))
      for ours, theirs, d_in, d_out in (("attn", "qkv"), "attn.c_attn", d, 3 * d), \
                                       (("attn", "out"), "attn.c_proj", d, d), \
                                       (("mlp", "up"), "mlp.c_fc", d, f), \
                                       (("mlp", "down"), "mlp.c_proj", f, d):
        add(b + ours + ("kernel",), "copy", (h + theirs + ".weight", (d_in, d_out)))
        add(b + ours + ("bias",), "copy", (h + theirs + ".bias", (d_out,)))
    add(("final_norm", "scale"), "copy", (p + "ln_f.weight", (d,)))
    add(("final_norm", "bias"), "copy", (p + "ln_f.bias", (d,)))
  else:
    p = prefix
    add(("embed", "embedding"), "copy", (p + "embed_tokens.weight", (v, d)))
    for i in range(cfg.n_layers):
      h, b = f"{p}layers.{i}.", ("blocks", i)
      add(b + ("attn_norm", "scale"), "copy", (h + "input_layernorm.weight", (d,)))
      add(b + ("mlp_norm", "scale"), "copy", (h + "post_attention_layernorm.weight", (d,)))
      qkv = [(h + "self_attn.q_proj", q_dim), (h + "self_attn.k_proj", kv_dim),
             (h + "self_attn.v_proj", kv_dim)]
      add(b + ("attn", "qkv", "kernel"), "concat_transpose",
          *[(n + ".weight", (out, d)) for n, out in qkv])
      if cfg.qkv_bias:
        add(b + ("attn", "qkv", "bias"), "concat", *[(n + ".bias", (out,)) for n, out in qkv])
      add(b + ("attn", "out", "kernel"), "transpose", (h + "self_attn.o_proj.weight", (d, q_dim)))
      if cfg.out_bias:
        add(b + ("attn", "out", "bias"), "copy", (h + "self_attn.o_proj.bias", (d,)))
      gate_up = [(h + "mlp.gate_proj", f), (h + "mlp.up_proj", f)]
      add(b + ("mlp", "up", "kernel"), "concat_transpose",
          *[(n + ".weight", (out, d)) for n, out in gate_up])
      add(b + ("mlp", "down", "kernel"), "transpose", (h + "mlp.down_proj.weight", (d, f)))
      if cfg.mlp_bias:
        add(b + ("mlp", "up", "bias"), "concat", *[(n + ".bias", (out,)) for n, out in gate_up])
        add(b + ("mlp", "down", "bias"), "copy", (h + "mlp.down_proj.bias", (d,)))
    add(("final_norm", "scale"), "copy", (p + "norm.weight", (d,)))
  if not cfg.tie_embeddings:
    add(("lm_head", "kernel"), "transpose", ("lm_head.weight", (v, d)))
  return slots


def _prefix(model_type: str, names) -> str:
  """The name prefix this checkpoint uses: 'transformer.' / 'model.' or none (base models)."""
  wanted = "transformer." if _family(model_type) == "gpt2" else "model."
  return wanted if any(n.startswith(wanted) for n in names) else ""


def _assemble(layout: str, arrays: list[np.ndarray]) -> np.ndarray:
  if layout == "copy":
    return arrays[0]
  if layout == "transpose":
    return arrays[0].T
  if layout == "concat":
    return np.concatenate(arrays)
  return np.concatenate([a.T for a in arrays], axis=1)  # concat_transpose


def _disassemble(layout: str, array: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
  if layout == "copy":
    return [array]
  if layout == "transpose":
    return [array.T]
  cuts = np.cumsum(sizes)[:-1]
  if layout == "concat":
    return np.split(array, cuts)
  return [part.T for part in np.split(array, cuts, axis=1)]  # concat_transpose


def _set(tree: dict, path: tuple, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


# ----------------------------------------------------------------------------
# Reading checkpoints.


class _CheckpointTensors:
  """Names and shapes of a checkpoint's tensors up front; the arrays on demand."""

  def __init__(self, directory: Path):
    self._file_of: dict[str, Path] = {}
    self._shapes: dict[str, tuple[int, ...]] = {}
    self._torch_state = None
    if (directory / "model.safetensors").is_file():
      self._read_safetensors([directory / "model.safetensors"])
    elif (directory / "model.safetensors.index.json").is_file():
      self._read_safetensors(self._shards(directory / "model.safetensors.index.json"))
    elif (directory / "pytorch_model.bin").is_file():
      self._read_torch([directory / "pytorch_model.bin"])
    elif (directory / "pytorch_model.bin.index.json").is_file():
      self._read_torch(self._shards(directory / "pytorch_model.bin.index.json"))
    else:
      raise ValueError(f"no weights in {directory}: expected one of {', '.join(_WEIGHT_FILES)}")

  @staticmethod
  def _shards(index_path: Path) -> list[Path]:
    weight_map = json.loads(index_path.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index_path} has no 'weight_map'")
    shards = sorted({index_path.parent / name for name in weight_map.values()})
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
      raise ValueError(f"{index_path} names shard files that are missing: {missing}")
    return shards

  def _read_safetensors(self, files: list[Path]):
    try:
      from safetensors import safe_open
    except ImportError as e:
      raise ValueError("reading Hugging Face weights needs safetensors "
                       "(pip install 'specjax[hf]')") from e
    for path in files:
      with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
          self._file_of[name] = path
          self._shapes[name] = tuple(f.get_slice(name).get_shape())

  def _read_torch(self, files: list[Path]):
    try:
      import torch
    except ImportError as e:
      raise ValueError("this checkpoint has only pytorch_model.bin weights, which need torch "
                       "(pip install 'specjax[hf]'); safetensors weights do not") from e
    self._torch_state = {}
    for path in files:
      self._torch_state.update(torch.load(str(path), map_location="cpu", weights_only=True,
                                          mmap=True))
    self._shapes = {k: tuple(t.shape) for k, t in self._torch_state.items()}

  def names(self) -> list[str]:
    return list(self._shapes)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._shapes[name]

  def load(self, name: str) -> np.ndarray:
    if self._torch_state is not None:
      import torch
      tensor = self._torch_state[name]
      if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16 of its own
        tensor = tensor.float()
      return tensor.numpy()
    from safetensors import safe_open
    with safe_open(str(self._file_of[name]), framework="numpy") as f:
      return f.get_tensor(name)


def _check_tensors(slots: list[_Slot], tensors: _CheckpointTensors, cfg: ModelConfig,
                   model_type: str, where: str):
  """Missing, unexpected and mis-shaped tensors, all reported before any array is read."""
  expected = {name: shape for slot in slots for name, shape in slot.sources}
  present = set(tensors.names())
  missing = sorted(set(expected) - present)
  if missing:
    raise ValueError(f"{where}: {len(missing)} tensor(s) the {model_type} config needs are "
                     f"missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  for name, shape in expected.items():
    if tensors.shape(name) != shape:
      raise ValueError(f"{where}: tensor {name!r} has shape {tensors.shape(name)}, but the "
                       f"config implies {shape}")
  unexpected = sorted(
      n for n in present - set(expected)
      if not _IGNORED_TENSORS.search(n)
      # A tied head may still be stored; transformers ignores it too.
      and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if unexpected:
    raise ValueError(
        f"{where}: tensor(s) with no place in a {model_type} model as configured (a feature "
        f"specjax does not model, or a config that does not match the weights): "
        f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")


def _float_dtype(dtype) -> np.dtype:
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"dtype must be a floating dtype, got {dtype!r}") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype, got {dt}")
  return dt


def params_from_hf(cfg: ModelConfig, model_type: str, tensors, dtype=jnp.float32,
                   where: str = "checkpoint") -> Params:
  """specjax params from Hugging Face tensors.

  `tensors` is a mapping name -> array (numpy or torch-free arrays), or a
  `_CheckpointTensors`. Shapes are all checked before anything is converted.
  """
  dt = _float_dtype(dtype)
  if isinstance(tensors, dict):
    tensors = _MappingTensors(tensors)
  slots = _plan(cfg, model_type, _prefix(model_type, tensors.names()))
  _check_tensors(slots, tensors, cfg, model_type, where)
  params: Params = {}
  for slot in slots:
    arrays = [tensors.load(name).astype(dt, copy=False) for name, _ in slot.sources]
    _set(params, slot.path, jnp.asarray(_assemble(slot.layout, arrays)))
  # The table and the module tree must agree leaf for leaf; a mismatch is a bug here.
  want = jax.tree_util.tree_structure(_abstract_params(cfg))
  got = jax.tree_util.tree_structure(params)
  assert want == got, f"parameter tree mismatch:\n{want}\n!=\n{got}"
  return params


class _MappingTensors:
  """`_CheckpointTensors`' interface over an in-memory dict of arrays."""

  def __init__(self, arrays: dict):
    self._arrays = arrays

  def names(self):
    return list(self._arrays)

  def shape(self, name):
    return tuple(self._arrays[name].shape)

  def load(self, name):
    return np.asarray(self._arrays[name])


def _abstract_params(cfg: ModelConfig) -> Params:
  from flax import nnx
  from specjax.model import Transformer
  abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.state(abstract))


# ----------------------------------------------------------------------------
# Loading and exporting models.


def _resolve(path_or_id: str | os.PathLike) -> Path:
  """A local directory as is; anything else is a hub id fetched with huggingface_hub."""
  if not isinstance(path_or_id, (str, os.PathLike)) or not str(path_or_id):
    raise ValueError(f"expected a model directory or a hub id, got {path_or_id!r}")
  path = Path(path_or_id).expanduser()
  if path.is_dir():
    return path
  text = str(path_or_id)
  if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
    raise ValueError(f"{text!r} is not a model directory (and does not look like a hub id)")
  try:
    from huggingface_hub import snapshot_download
  except ImportError as e:
    raise ValueError(f"{text!r} is not a local directory, and downloading it needs "
                     "huggingface_hub (pip install 'specjax[hf]')") from e
  files = ["config.json", "generation_config.json", "tokenizer.json"]
  try:
    local = Path(snapshot_download(text, allow_patterns=files + ["*.safetensors",
                                                                  "*.safetensors.index.json"]))
    if not any((local / name).is_file() for name in _WEIGHT_FILES[:2]):
      # Older repositories have only torch pickles.
      local = Path(snapshot_download(text, allow_patterns=files + ["pytorch_model*.bin*"]))
  except Exception as e:  # network, offline mode, missing repo: all end up here
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
    hint = ("HF_HUB_OFFLINE is set and the model is not in the local cache"
            if offline else "no network, or no such repository on the Hub")
    raise ValueError(f"could not fetch {text!r} from the Hugging Face Hub ({hint}): "
                     f"{type(e).__name__}: {e}. Pass a local model directory instead.") from e
  return local


def _load_tokenizer(directory: Path, hf_config: dict):
  """The directory's tokenizer.json as a specjax Tokenizer, ending text where config.json says."""
  path = directory / "tokenizer.json"
  if not path.is_file():
    return None
  import tokenizers
  from specjax.tokenizer import Tokenizer
  try:
    raw = tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # the Rust side raises a bare Exception
    raise ValueError(f"cannot read tokenizer file {path}: {e}") from e
  eos = hf_config.get("eos_token_id")
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  # config.json names the end-of-text token; the tokenizer file alone can only guess it.
  eos_token = raw.id_to_token(eos) if isinstance(eos, int) else None
  return Tokenizer(raw, eos_token=eos_token)


def load_hf_model(path_or_id: str | os.PathLike, dtype=jnp.float32) -> Model:
  """A Hugging Face GPT-2 / Llama / Mistral / Qwen2 checkpoint as a specjax `Model`.

  Args:
    path_or_id: a local directory holding config.json and safetensors weights
      (model.safetensors or a sharded index; pytorch_model.bin with torch installed),
      or a hub id such as 'distilgpt2' or 'Qwen/Qwen2.5-0.5B', downloaded (or taken from
      the local cache) with huggingface_hub.
    dtype: parameter dtype (float32, bfloat16, float16).

  The tokenizer (tokenizer.json) is attached as `model.tokenizer` when present.
  Raises ValueError for unsupported architectures or features and for missing,
  unexpected or mis-shaped tensors, naming them.
  """
  dt = _float_dtype(dtype)
  directory = _resolve(path_or_id)
  config_path = directory / "config.json"
  if not config_path.is_file():
    raise ValueError(f"{directory} has no config.json")
  hf_config = json.loads(config_path.read_text())
  cfg = config_from_hf(hf_config)
  tensors = _CheckpointTensors(directory)
  params = params_from_hf(cfg, hf_config["model_type"], tensors, dt, where=str(directory))
  return Model(cfg, graphdef_for(cfg), params, _load_tokenizer(directory, hf_config))


def params_to_hf(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Hugging Face tensors (names and layouts of the architecture `config_to_hf` picks)."""
  model_type = _export_type(cfg)
  prefix = "transformer." if model_type == "gpt2" else "model."
  out = {}
  for slot in _plan(cfg, model_type, prefix):
    array = np.asarray(jax.device_get(_get(params, slot.path)))
    sizes = [shape[0] for _, shape in slot.sources]
    for (name, shape), part in zip(slot.sources, _disassemble(slot.layout, array, sizes)):
      if part.shape != shape:
        raise ValueError(f"parameter {'/'.join(map(str, slot.path))} gives {name!r} of shape "
                         f"{part.shape}, expected {shape}")
      out[name] = np.ascontiguousarray(part)
  return out


def _tokenizer_saver(tokenizer):
  """A function writing `tokenizer` as tokenizer.json, or None if it is not that kind."""
  import tokenizers
  from specjax.tokenizer import Tokenizer
  if isinstance(tokenizer, (Tokenizer, tokenizers.Tokenizer)):
    return lambda path: tokenizer.save(str(path))
  return None


def export_hf(model: Model, out_dir: str | os.PathLike) -> Path:
  """Writes `model` as a Hugging Face directory transformers loads with AutoModelForCausalLM.

  GPT-2-style configs become GPT2LMHeadModel, Llama-style ones LlamaForCausalLM (or
  Qwen2ForCausalLM for q/k/v biases without an output bias). Writes config.json,
  model.safetensors and, when the model has a tokenizer, tokenizer.json. Returns the
  directory. Raises ValueError for configs no transformers architecture computes.
  """
  if not isinstance(model, Model):
    raise ValueError(f"export_hf expects a specjax Model, got {type(model).__name__}")
  cfg = model.config
  _export_type(cfg)  # refuse before writing anything
  save_tokenizer = None if model.tokenizer is None else _tokenizer_saver(model.tokenizer)
  eos_id = getattr(model.tokenizer, "eos_id", None)
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    eos_id = None
  hf_config = config_to_hf(cfg, bos_id=eos_id, eos_id=eos_id)
  tensors = params_to_hf(cfg, model.params)
  dtypes = {str(a.dtype) for a in tensors.values()}
  hf_config["torch_dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"

  from safetensors.numpy import save_file
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  # transformers refuses safetensors files without format metadata.
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  if save_tokenizer is not None:
    save_tokenizer(out / "tokenizer.json")
  return out
