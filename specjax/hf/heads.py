"""Published draft heads, as specjax `Head`s: EAGLE-3, EAGLE-1/2 and Medusa-1 directories
in their authors' layouts (`load_published`; `load_pretrained(dir, target=...)`).

EAGLE-3's layout (EAGLE's `eagle3` release, as vLLM's `llama_eagle3.py` and SGLang read it):
config.json with `architectures` naming an Eagle3 model (e.g. `LlamaForCausalLMEagle3`),
`hidden_size`, `intermediate_size`, heads, `rms_norm_eps`, `rope_theta`,
`vocab_size` (the target's) and `draft_vocab_size`, optionally
`eagle_config.eagle_aux_hidden_state_layer_ids`; weights in model.safetensors or
pytorch_model.bin:

  fc.weight                         [d, 3 d]   the fused features' projection
  midlayer.self_attn.{q,k,v}_proj   [*, 2 d]   attention over [norm(embeds), norm(h)]
  midlayer.self_attn.o_proj, midlayer.mlp.{gate,up,down}_proj
  midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
  norm.weight, lm_head.weight       [draft_vocab, d]
  d2t                               int[draft_vocab]: target id = draft id + d2t[id]
  t2d                               bool[vocab] (optional; checked against d2t)
  embed_tokens.weight               (optional; must be the target's own embedding)

`midlayer.` may also be spelled `layers.0.`, and everything but lm_head may carry a
`model.` prefix (trainers' variants). The feature layers default to vLLM's (2, L // 2,
L - 3) of an L-layer target; they are the inputs of those blocks, concatenated in layer
order. Every check that needs no weights runs before any is read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.hf import config as hf_config
from specjax.hf.files import CheckpointTensors, read_config
from specjax.models import heads as heads_lib
from specjax.models.model import float_dtype


def is_eagle3_config(config: dict) -> bool:
  archs = config.get("architectures") or []
  return (any("eagle3" in str(a).lower() for a in archs)
          or ("draft_vocab_size" in config and config.get("num_hidden_layers") == 1))


def _need(ok: bool, where: str, field: str, message: str):
  if not ok:
    raise ValueError(f"{where}: {field} {message}")


def head_config(config: dict, target, where: str = "EAGLE-3 head") -> heads_lib.HeadConfig:
  """The HeadConfig of a published EAGLE-3 config.json on `target` (a specjax Model);
  ValueError naming the field that does not fit the target."""
  tc = target.config
  _llama_target(tc, where)
  for field, want in (("hidden_size", tc.d_model), ("vocab_size", tc.vocab_size)):
    _need(config.get(field) == want, where, field,
          f"is {config.get(field)!r}; the target's is {want}")
  if "target_hidden_size" in config:
    _need(config["target_hidden_size"] == tc.d_model, where, "target_hidden_size",
          f"is {config['target_hidden_size']!r}; the target's hidden size is {tc.d_model}")
  _need(config.get("num_hidden_layers") == 1, where, "num_hidden_layers",
        f"is {config.get('num_hidden_layers')!r}; an EAGLE-3 head has one decoder layer")
  _need(not config.get("norm_before_residual", False), where, "norm_before_residual",
        "is true; specjax's EAGLE-3 layer adds the un-normalised hidden state")
  eagle = config.get("eagle_config") or {}
  _need(isinstance(eagle, dict), where, "eagle_config", "must be an object")
  _need(eagle.get("use_aux_hidden_state", True), where, "eagle_config.use_aux_hidden_state",
        "is false (an EAGLE-1 style head on the last hidden state); not an EAGLE-3 head")
  ids = eagle.get("eagle_aux_hidden_state_layer_ids",
                  config.get("eagle_aux_hidden_state_layer_ids"))
  n = tc.n_layers
  if ids is None:
    ids = (2, n // 2, n - 3)
  _need(isinstance(ids, (list, tuple)) and len(set(ids)) == len(ids) >= 2
        and all(isinstance(i, int) and 0 <= i < n for i in ids), where,
        "eagle_aux_hidden_state_layer_ids",
        f"must be distinct layer ids of the {n}-layer target (0..{n - 1}); got {ids!r}")
  draft_vocab = config.get("draft_vocab_size", tc.vocab_size)
  _need(isinstance(draft_vocab, int) and 1 <= draft_vocab <= tc.vocab_size, where,
        "draft_vocab_size", f"must be an int in 1..{tc.vocab_size}; got {draft_vocab!r}")
  family = config.get("model_type", "llama")
  _need(family in ("llama", "qwen3"), where, "model_type",
        f"is {family!r}; specjax loads Llama- and Qwen3-style EAGLE-3 layers")
  layer = hf_config._llama_config({
      **config, "model_type": family, "vocab_size": tc.vocab_size, "num_hidden_layers": 1,
      "max_position_embeddings": tc.max_len, "tie_word_embeddings": False})
  layer = dataclasses.replace(layer, max_len=tc.max_len)
  return heads_lib.HeadConfig("eagle3", tc, feature_layers=tuple(sorted(ids)),
                              draft_vocab=draft_vocab, layer=layer)


def _plan(hc: heads_lib.HeadConfig, names) -> dict:
  """specjax path -> (layout, [(tensor name, shape)]), with the checkpoint's spelling."""
  cfg, d = hc.layer_config, hc.target.d_model
  hd = cfg.head_dim
  q, kv, f = cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.d_ff
  names = set(names)
  model = "model." if any(n.startswith("model.") for n in names) else ""
  mid = model + ("layers.0." if any(n.startswith(model + "layers.0.") for n in names)
                 else "midlayer.")
  plan = {
      ("fc", "kernel"): ("transpose", [(model + "fc.weight", (d, hc.feature_dim))]),
      ("midlayer", "attn", "qkv", "kernel"): ("concat_transpose", [
          (mid + "self_attn.q_proj.weight", (q, 2 * d)),
          (mid + "self_attn.k_proj.weight", (kv, 2 * d)),
          (mid + "self_attn.v_proj.weight", (kv, 2 * d))]),
      ("midlayer", "attn", "out", "kernel"): ("transpose", [(mid + "self_attn.o_proj.weight",
                                                             (d, q))]),
      ("midlayer", "mlp", "up", "kernel"): ("concat_transpose", [
          (mid + "mlp.gate_proj.weight", (f, d)), (mid + "mlp.up_proj.weight", (f, d))]),
      ("midlayer", "mlp", "down", "kernel"): ("transpose", [(mid + "mlp.down_proj.weight",
                                                             (d, f))]),
      ("norm", "scale"): ("copy", [(model + "norm.weight", (d,))]),
      ("lm_head", "kernel"): ("transpose", [("lm_head.weight", (hc.vocab_size, d))]),
  }
  for ours in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
    plan[("midlayer", ours, "scale")] = ("copy", [(mid + ours + ".weight", (d,))])
  if cfg.qkv_bias:
    plan[("midlayer", "attn", "qkv", "bias")] = ("concat", [
        (mid + f"self_attn.{p}_proj.bias", (s,)) for p, s in (("q", q), ("k", kv), ("v", kv))])
  if cfg.out_bias:
    plan[("midlayer", "attn", "out", "bias")] = ("copy", [(mid + "self_attn.o_proj.bias", (d,))])
  if cfg.qk_norm:
    plan[("midlayer", "attn", "q_norm", "scale")] = ("copy", [(mid + "self_attn.q_norm.weight",
                                                               (hd,))])
    plan[("midlayer", "attn", "k_norm", "scale")] = ("copy", [(mid + "self_attn.k_norm.weight",
                                                               (hd,))])
  return plan, model


def load_eagle3(path: str | os.PathLike, target, dtype=jnp.float32) -> heads_lib.Head:
  """A published EAGLE-3 head directory as a `Head` drafting for `target`."""
  path = Path(path)
  where = f"EAGLE-3 head {path}"
  hc = head_config(read_config(path / "config.json"), target, where)
  tensors = CheckpointTensors(path)
  plan, model = _plan(hc, tensors.names())
  present = set(tensors.names())
  v, vd = hc.target.vocab_size, hc.vocab_size
  embeds = [model + "embed_tokens.weight", "embed_tokens.weight"]
  _check(tensors, plan, {"d2t", "t2d", *embeds}, where)
  if "d2t" not in present and vd != v:
    raise ValueError(f"{where}: missing tensor(s) ['d2t'] (the layout in specjax/hf/heads.py)")
  if "d2t" in present and tensors.shape("d2t") != (vd,):
    raise ValueError(f"{where}: tensor 'd2t' has shape {tensors.shape('d2t')}; "
                     f"draft_vocab_size {vd} implies ({vd},)")
  params = _load(tensors, plan, where, dtype)
  vocab = np.arange(vd)
  if "d2t" in present:
    vocab = vocab + np.asarray(tensors.load("d2t"), np.int64)
  if vocab.min() < 0 or vocab.max() >= v or len(np.unique(vocab)) != vd:
    raise ValueError(f"{where}: d2t maps draft ids outside the target's {v} tokens or onto "
                     "the same token twice")
  if "t2d" in present:
    t2d = np.asarray(tensors.load("t2d")).astype(bool)
    if t2d.shape != (v,) or t2d.sum() != vd or not t2d[vocab].all():
      raise ValueError(f"{where}: t2d does not mark exactly the {vd} target tokens d2t maps to")
  params["vocab"] = jnp.asarray(vocab, jnp.int32)
  _check_embed(tensors, embeds, target, where)
  return heads_lib.Head(hc, params, heads_lib.target_fingerprint(target.config, target.params),
                        {"source": str(path), "format": "EAGLE-3 (EAGLE authors' layout)"})


# --- EAGLE-1/2 and Medusa-1 in their authors' layouts --------------------------------
#
# EAGLE-1/2 (EAGLE's `cnets.py` `Model`, as vLLM's `llama_eagle.py` reads it): a Llama
# config.json with num_hidden_layers 1 and weights
#   fc.weight [d, 2d] (+ fc.bias)  over [embed(x_{t+1}), the target's final-normed f_t]
#   layers.0.self_attn.{q,k,v,o}_proj, layers.0.mlp.{gate,up,down}_proj,
#   layers.0.post_attention_layernorm.weight   (no input_layernorm on layer 0)
#   embed_tokens.weight (optional; the target's)
# read out through the target's own LM head, with no norm.
# Medusa-1 (FasterDecoding's `medusa_model.py`): config.json with medusa_num_heads and
# medusa_num_layers; medusa_lm_head.safetensors (or .pt) with, for head i,
#   {i}.0.linear.weight [d, d], {i}.0.linear.bias [d]   ResBlock: h + SiLU(W h + b)
#   {i}.1.weight [vocab, d]                             its own LM head
# on the target's final-normed last hidden state.

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def published_kind(path: Path) -> str | None:
  """'eagle3', 'eagle' or 'medusa' for a published head directory, else None."""
  path = Path(path)
  if any((path / f).is_file() for f in MEDUSA_FILES):
    return "medusa"
  try:
    config = read_config(path / "config.json")
  except ValueError:
    return None
  if is_eagle3_config(config):
    return "eagle3"
  if "medusa_num_heads" in config:
    return "medusa"
  if config.get("num_hidden_layers") == 1 and config.get("model_type") == "llama":
    try:
      names = set(CheckpointTensors(path).names())
    except ValueError:
      return None
    if "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names:
      return "eagle"
  return None


def load_published(path: str | os.PathLike, target, dtype=jnp.float32) -> heads_lib.Head:
  """A published EAGLE-3, EAGLE-1/2 or Medusa-1 head directory as a `Head` for `target`."""
  kind = published_kind(Path(path))
  loader = {"eagle3": load_eagle3, "eagle": load_eagle, "medusa": load_medusa}.get(kind)
  if loader is None:
    raise ValueError(f"{path} is not a published EAGLE-3, EAGLE or Medusa head directory")
  return loader(path, target, dtype)


def _llama_target(tc, where):
  _need(tc.norm == "rmsnorm" and tc.position == "rope" and tc.mlp == "swiglu", where,
        "target", f"must be a Llama-family model (RMSNorm, RoPE, SwiGLU); got norm={tc.norm}, "
        f"position={tc.position}, mlp={tc.mlp}")


def _read(tensors, plan: dict, optional: set, where: str, dtype) -> dict:
  """params from `plan` (specjax path -> (layout, [(name, shape)])), every name and
  shape checked first (`_check`); `optional` names may be present and are not read here."""
  _check(tensors, plan, optional, where)
  return _load(tensors, plan, where, dtype)


def _check(tensors, plan: dict, optional: set, where: str):
  expected = {name: shape for _, sources in plan.values() for name, shape in sources}
  present = set(tensors.names())
  missing = sorted(set(expected) - present)
  if missing:
    raise ValueError(f"{where}: missing tensor(s) {missing[:8]} (the layout in "
                     "specjax/hf/heads.py)")
  unexpected = sorted(present - set(expected) - optional)
  if unexpected:
    raise ValueError(f"{where}: tensor(s) with no place in this head: {unexpected[:8]}")
  for name, shape in expected.items():
    if tensors.shape(name) != shape:
      raise ValueError(f"{where}: tensor {name!r} has shape {tensors.shape(name)}; the config "
                       f"and the target imply {shape}")


def _load(tensors, plan: dict, where: str, dtype) -> dict:
  from specjax.hf.weights import _set, assemble
  params, dt = {}, float_dtype(dtype)
  for key, (layout, sources) in plan.items():
    arrays = [np.asarray(tensors.load(name), np.float32) for name, _ in sources]
    for (name, _), a in zip(sources, arrays):
      if not np.isfinite(a).all():
        raise ValueError(f"{where}: tensor {name!r} holds NaN or inf values")
    _set(params, key, jnp.asarray(assemble(layout, arrays), dt))
  return params


def _check_embed(tensors, names, target, where):
  for embed in names:
    if embed in set(tensors.names()):
      own = np.asarray(tensors.load(embed), np.float32)
      theirs = np.asarray(target.params["embed"]["embedding"], np.float32)
      if own.shape != theirs.shape or not np.allclose(own, theirs, rtol=1e-2, atol=1e-3):
        raise ValueError(f"{where}: {embed} differs from the target's embedding; specjax's "
                         "heads read the target's own (is this the head's target?)")


def load_eagle(path: str | os.PathLike, target, dtype=jnp.float32) -> heads_lib.Head:
  """A published EAGLE-1/2 head directory as a `Head` drafting for `target`."""
  path = Path(path)
  where = f"EAGLE head {path}"
  config = read_config(path / "config.json")
  tc = target.config
  _llama_target(tc, where)
  for field, want in (("hidden_size", tc.d_model), ("vocab_size", tc.vocab_size)):
    _need(config.get(field) == want, where, field,
          f"is {config.get(field)!r}; the target's is {want}")
  _need(config.get("num_hidden_layers") == 1, where, "num_hidden_layers",
        f"is {config.get('num_hidden_layers')!r}; specjax reads one-layer EAGLE heads")
  _need(not config.get("add_para_norm", False), where, "add_para_norm",
        "is true (a HASS head with input norms); not the EAGLE-1/2 layout")
  layer = hf_config._llama_config({
      **config, "model_type": "llama", "vocab_size": tc.vocab_size, "num_hidden_layers": 1,
      "max_position_embeddings": tc.max_len, "tie_word_embeddings": False})
  layer = dataclasses.replace(layer, max_len=tc.max_len)
  hc = heads_lib.HeadConfig("eagle", tc, layer=layer, layout="published")
  cfg, d = layer, tc.d_model
  q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
  tensors = CheckpointTensors(path)
  mid = "layers.0."
  plan = {
      ("fc", "kernel"): ("transpose", [("fc.weight", (d, 2 * d))]),
      ("attn", "qkv", "kernel"): ("concat_transpose", [
          (mid + "self_attn.q_proj.weight", (q, d)), (mid + "self_attn.k_proj.weight", (kv, d)),
          (mid + "self_attn.v_proj.weight", (kv, d))]),
      ("attn", "out", "kernel"): ("transpose", [(mid + "self_attn.o_proj.weight", (d, q))]),
      ("mlp", "up", "kernel"): ("concat_transpose", [
          (mid + "mlp.gate_proj.weight", (f, d)), (mid + "mlp.up_proj.weight", (f, d))]),
      ("mlp", "down", "kernel"): ("transpose", [(mid + "mlp.down_proj.weight", (d, f))]),
      ("post_attention_layernorm", "scale"): ("copy", [
          (mid + "post_attention_layernorm.weight", (d,))]),
  }
  if cfg.qkv_bias:
    plan[("attn", "qkv", "bias")] = ("concat", [
        (mid + f"self_attn.{p}_proj.bias", (s,)) for p, s in (("q", q), ("k", kv), ("v", kv))])
  if cfg.out_bias:
    plan[("attn", "out", "bias")] = ("copy", [(mid + "self_attn.o_proj.bias", (d,))])
  has_bias = "fc.bias" in set(tensors.names())
  if has_bias:
    plan[("fc", "bias")] = ("copy", [("fc.bias", (d,))])
  params = _read(tensors, plan, {"embed_tokens.weight"}, where, dtype)
  if not has_bias:  # vLLM's EAGLE fc has no bias; ours is zero then
    params["fc"]["bias"] = jnp.zeros((d,), float_dtype(dtype))
  _check_embed(tensors, ["embed_tokens.weight"], target, where)
  return heads_lib.Head(hc, params, heads_lib.target_fingerprint(tc, target.params),
                        {"source": str(path), "format": "EAGLE-1/2 (EAGLE authors' layout)"})


def load_medusa(path: str | os.PathLike, target, dtype=jnp.float32) -> heads_lib.Head:
  """A published Medusa-1 head directory as a `Head` drafting for `target`."""
  path = Path(path)
  where = f"Medusa head {path}"
  config = read_config(path / "config.json")
  tc = target.config
  _llama_target(tc, where)
  k = config.get("medusa_num_heads")
  _need(isinstance(k, int) and not isinstance(k, bool) and k >= 1, where, "medusa_num_heads",
        f"must be an int >= 1; got {k!r}")
  layers = config.get("medusa_num_layers", 1)
  _need(layers == 1, where, "medusa_num_layers",
        f"is {layers!r}; specjax reads Medusa heads of one residual block")
  for field, want in (("hidden_size", tc.d_model), ("vocab_size", tc.vocab_size)):
    if field in config:
      _need(config[field] == want, where, field, f"is {config[field]!r}; the target's is {want}")
  file = next((path / f for f in MEDUSA_FILES if (path / f).is_file()), None)
  if file is None:
    raise ValueError(f"{where}: no weights; expected one of {', '.join(MEDUSA_FILES)}")
  tensors = CheckpointTensors(path, file)
  d, v = tc.d_model, tc.vocab_size
  plan = {}
  for i in range(k):
    plan[("blocks", i, "kernel")] = ("transpose", [(f"{i}.0.linear.weight", (d, d))])
    plan[("blocks", i, "bias")] = ("copy", [(f"{i}.0.linear.bias", (d,))])
    plan[("lm_heads", i, "kernel")] = ("transpose", [(f"{i}.1.weight", (v, d))])
  params = _read(tensors, plan, set(), where, dtype)
  hc = heads_lib.HeadConfig("medusa", tc, medusa_heads=k, layout="published")
  return heads_lib.Head(hc, params, heads_lib.target_fingerprint(tc, target.params),
                        {"source": str(path), "format": "Medusa-1 (FasterDecoding's layout)"})
