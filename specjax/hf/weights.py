"""The weight plan: which Hugging Face tensors make each specjax parameter, and how.

One table per family (`plan`) lists, for every specjax parameter, the Hugging Face
tensors it is made of and how: copied, transposed (torch Linear weights are [out, in],
ours [in, out]) or transposed and concatenated (our fused q|k|v and gate|up kernels).
Import (`params_from_hf`) and export (`params_to_hf`) both read that table, so they
cannot disagree. Every tensor's presence and shape is checked before any is converted.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from specjax.hf.config import export_type, family
from specjax.models.config import ModelConfig
from specjax.models.model import Model, Params, abstract_params, float_dtype

# Buffers some checkpoints carry that hold no weights (causal masks, RoPE tables).
_IGNORED_TENSORS = re.compile(r"(^|\.)attn\.(masked_)?bias$|rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Slot:
  """One specjax parameter and the Hugging Face tensors it is made of."""
  path: tuple  # key path into the specjax params dict
  sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF tensor name, HF shape)
  layout: str  # 'copy' | 'transpose' | 'concat' (1-D) | 'concat_transpose' (2-D)


def plan(cfg: ModelConfig, model_type: str, prefix: str) -> list[Slot]:
  """Every specjax parameter of `cfg`, with its Hugging Face source tensors."""
  d, v, f = cfg.d_model, cfg.vocab_size, cfg.d_ff
  hd = cfg.head_dim
  q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
  slots = []

  def add(path, layout, *sources):
    slots.append(Slot(path, tuple(sources), layout))

  p = prefix
  if family(model_type) == "gpt2":
    # GPT-2's Conv1D weights are already [in, out], and c_attn is already q|k|v.
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
      if cfg.qk_norm:  # Qwen3: one RMSNorm scale of head_dim, shared by every head
        add(b + ("attn", "q_norm", "scale"), "copy", (h + "self_attn.q_norm.weight", (hd,)))
        add(b + ("attn", "k_norm", "scale"), "copy", (h + "self_attn.k_norm.weight", (hd,)))
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
  wanted = "transformer." if family(model_type) == "gpt2" else "model."
  return wanted if any(n.startswith(wanted) for n in names) else ""


def assemble(layout: str, arrays: list[np.ndarray]) -> np.ndarray:
  """One specjax parameter from its Hugging Face tensors."""
  if layout == "copy":
    return arrays[0]
  if layout == "transpose":
    return arrays[0].T
  if layout == "concat":
    return np.concatenate(arrays)
  return np.concatenate([a.T for a in arrays], axis=1)  # concat_transpose


def disassemble(layout: str, array: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
  """`assemble` undone: the Hugging Face tensors of one parameter (first dims `sizes`)."""
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


class MappingTensors:
  """The checkpoint-tensors interface (names, shape, load) over a dict of arrays."""

  def __init__(self, arrays: dict):
    self._arrays = arrays

  def names(self):
    return list(self._arrays)

  def shape(self, name):
    return tuple(self._arrays[name].shape)

  def load(self, name):
    return np.asarray(self._arrays[name])


def _check_tensors(slots: list[Slot], tensors, cfg: ModelConfig, model_type: str, where: str):
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


def params_from_hf(cfg: ModelConfig, model_type: str, tensors, dtype=jnp.float32,
                   where: str = "checkpoint", host: bool = False) -> Params:
  """specjax params from Hugging Face tensors.

  `tensors` is a dict name -> array, or an object with `names()`, `shape(name)` and
  `load(name)` (`specjax.hf.files.CheckpointTensors`). Shapes are all checked before
  anything is converted.
  """
  dt = float_dtype(dtype)
  if isinstance(tensors, dict):
    tensors = MappingTensors(tensors)
  slots = plan(cfg, model_type, _prefix(model_type, tensors.names()))
  _check_tensors(slots, tensors, cfg, model_type, where)
  params: Params = {}
  for slot in slots:
    arrays = [tensors.load(name).astype(dt, copy=False) for name, _ in slot.sources]
    for (name, _), a in zip(slot.sources, arrays):
      # safetensors files carry no checksum: overwritten bytes read as NaN or inf, and
      # every logit with them (a forward would emit token 0 on and on).
      if not np.isfinite(a).all():
        raise ValueError(f"{where}: tensor {name!r} holds NaN or inf values (a corrupt or "
                         "cut-short weight file?)")
    array = assemble(slot.layout, arrays)  # host=True: numpy, for `specjax.shard`
    _set(params, slot.path, np.ascontiguousarray(array) if host else jnp.asarray(array))
  # The table and the module tree must agree leaf for leaf; a mismatch is a bug here.
  want = jax.tree_util.tree_structure(abstract_params(cfg))
  got = jax.tree_util.tree_structure(params)
  assert want == got, f"parameter tree mismatch:\n{want}\n!=\n{got}"
  return params


def params_to_hf(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Hugging Face tensors (names and layouts of the architecture `config_to_hf` picks)."""
  model_type = export_type(cfg)
  prefix = "transformer." if model_type == "gpt2" else "model."
  out = {}
  for slot in plan(cfg, model_type, prefix):
    array = np.asarray(jax.device_get(_get(params, slot.path)))
    sizes = [shape[0] for _, shape in slot.sources]
    for (name, shape), part in zip(slot.sources, disassemble(slot.layout, array, sizes)):
      if part.shape != shape:
        raise ValueError(f"parameter {'/'.join(map(str, slot.path))} gives {name!r} of shape "
                         f"{part.shape}, expected {shape}")
      out[name] = np.ascontiguousarray(part)
  return out


def pad_vocab(model: Model, vocab_size: int) -> Model:
  """`model` with zero embedding (and head) rows appended up to `vocab_size` tokens.

  For a draft whose target has a larger (padded) embedding table, e.g. Qwen2.5-0.5B
  (151936 rows) drafting for Qwen2.5-7B (152064): the new tokens get logit 0 and are
  past the tokenizer. Speculative sampling stays exact for any draft distribution, so
  the output still follows the target; only the acceptance rate could change.
  """
  cfg = model.config
  if not isinstance(vocab_size, int) or vocab_size < cfg.vocab_size:
    raise ValueError(f"vocab_size must be an int >= the model's {cfg.vocab_size}, "
                     f"got {vocab_size!r}")
  extra = vocab_size - cfg.vocab_size
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  embed = params["embed"]["embedding"]
  params["embed"]["embedding"] = jnp.pad(embed, ((0, extra), (0, 0)))
  if not cfg.tie_embeddings:
    params["lm_head"]["kernel"] = jnp.pad(params["lm_head"]["kernel"], ((0, 0), (0, extra)))
  new_cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
  return model.with_params(params, new_cfg)
