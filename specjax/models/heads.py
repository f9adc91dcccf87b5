"""Learned draft heads that read the target's own features: EAGLE and Medusa.

Both heads reuse the target's frozen token embedding, final norm and LM head (never
copied: the draft params hold references to the target's arrays) and add a little of
their own on top of the target's last hidden state `f` (the residual stream after the
last block, before the final norm; `model.forward(..., hidden=True)`):

- **EAGLE** (Li et al., 2024): slot t fuses [f_t, embed(x_{t+1})] (each normalised
  first) with a Linear 2d -> d, runs ONE decoder layer (`model.Block`, with the head's
  own one-layer KV cache) and predicts f_{t+1}; the target's final norm + LM head turn
  that into logits for x_{t+2}. Drafting feeds the predicted feature back in with the
  drafted token.
- **EAGLE-3** (Li et al., 2025), in the layout its authors publish: slot t fuses the
  target's residual streams at `feature_layers` (low, middle, high) with an `fc`
  3d -> d, and ONE decoder layer whose attention reads [norm(embed(x_{t+1})),
  norm(h_t)] (2d wide) predicts the next hidden state h_{t+1}; its OWN final norm and LM
  head give logits over a reduced draft vocabulary (`vocab`: the target id of each
  draft id), scattered into the target's vocabulary with every other token at
  probability exactly 0. Drafting feeds h back in place of fc(features). No feature
  regression: it is trained on its own unrolled predictions (`eagle3_unroll`).
- **Medusa** (Cai et al., 2024): K residual blocks h + SiLU(W h) on f_t, each followed by
  the target's final norm + LM head; head k predicts x_{t+k+1} (k = 1..K), all from the
  same committed feature, with no dependence on the other drafted tokens.

Medusa is still exact with the standard accept/resample rule. Its y_k is drawn from
q_k = the processed head-k distribution, which depends only on the committed history
and not on y_1..y_{k-1}. Conditional on everything before position k (the committed
prefix and y_{<k}), y_k is therefore distributed as q_k, and the rule's proof at
position k needs nothing else: accept with min(1, p_k/q_k), else resample the residual.

`Head` bundles a trained head with the fingerprint of the target it was trained on.
`specjax.drafters.heads` turns a head into a drafter for the decode loop.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import backends
from specjax.models import checkpoint as checkpoint_lib
from specjax.models import layers as layers_lib
from specjax.models import model as model_lib
from specjax.models.config import ModelConfig

KINDS = ("eagle", "eagle3", "medusa")
# 'specjax': the heads this package trains. 'published': EAGLE-1/2 and Medusa-1 heads in
# their authors' layouts (`specjax.hf.heads`), on the target's final-normed features.
LAYOUTS = ("specjax", "published")
# The target's own (frozen) parameters a head reads, under the target's names.
SHARED = ("embed", "final_norm", "lm_head")
FORMAT = "specjax-head"
VERSION = 1
MANIFEST = "head.json"
PARAMS = "params.npz"


# A logit that is -inf in effect (exp underflows to exactly 0 against any real logit)
# but finite: a constraint that masks every draft token leaves a uniform q over the
# tokens it allows, not NaN; a repetition penalty that scales it stays finite.
OFF_VOCAB = -1e30


def eagle3_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's feature layers for a target of n_layers: (2, L // 2, L - 3), the inputs
  of those blocks, as its authors' code and vLLM take them; for a target too shallow
  for three distinct ones, (1, L // 2, L), L being the last block's output."""
  ids = (2, n_layers // 2, n_layers - 3)
  if len(set(ids)) == 3 and min(ids) >= 1:
    return ids
  return tuple(sorted({1, max(n_layers // 2, 1), n_layers}))


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """What a head is: its kind, the target architecture it sits on, Medusa's head count;
  for EAGLE-3, the target layers it fuses, its draft vocabulary size (None: the
  target's whole vocabulary) and its decoder layer (None: the target's block)."""

  kind: str
  target: ModelConfig
  medusa_heads: int = 4
  feature_layers: tuple[int, ...] | None = None
  draft_vocab: int | None = None
  layer: ModelConfig | None = None
  layout: str = "specjax"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"HeadConfig.kind must be one of {KINDS}, got {self.kind!r}")
    if (not isinstance(self.medusa_heads, int) or isinstance(self.medusa_heads, bool)
        or self.medusa_heads < 1):
      raise ValueError(f"HeadConfig.medusa_heads must be a positive int, got {self.medusa_heads!r}")
    if self.layout not in LAYOUTS or (self.kind == "eagle3" and self.layout != "specjax"):
      raise ValueError(f"HeadConfig.layout must be one of {LAYOUTS} ('specjax' for eagle3), "
                       f"got {self.layout!r}")
    if self.kind != "eagle3":
      for name in ("feature_layers", "draft_vocab"):
        if getattr(self, name) is not None:
          raise ValueError(f"HeadConfig.{name} is an EAGLE-3 field; a {self.kind} head has none")
      if self.layer is not None and not (self.kind == "eagle" and self.layout == "published"):
        raise ValueError("HeadConfig.layer is for EAGLE-3 and published EAGLE heads")
      self._check_layer()
      return
    layers = self.feature_layers
    if layers is None:
      object.__setattr__(self, "feature_layers", layers := eagle3_layers(self.target.n_layers))
    layers = tuple(layers) if isinstance(layers, (list, tuple)) else layers
    if (not isinstance(layers, tuple) or len(layers) < 2 or len(set(layers)) != len(layers)
        or not all(isinstance(i, int) and not isinstance(i, bool)
                   and 0 <= i <= self.target.n_layers for i in layers)):
      raise ValueError(f"HeadConfig.feature_layers must be 2 or more distinct layer ids in "
                       f"0..{self.target.n_layers} (the input of that block; "
                       f"{self.target.n_layers}: the last block's output), got {self.feature_layers!r}")
    object.__setattr__(self, "feature_layers", layers)
    v = self.draft_vocab
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)
                          or not 1 <= v <= self.target.vocab_size):
      raise ValueError(f"HeadConfig.draft_vocab must be an int in 1..{self.target.vocab_size} "
                       f"(the target's vocabulary), got {v!r}")
    self._check_layer()

  def _check_layer(self):
    if self.layer is not None:
      if self.layer.d_model != self.target.d_model:
        raise ValueError(f"an EAGLE layer's hidden size must be the target's "
                         f"{self.target.d_model} (it reads the target's embeddings), got "
                         f"{self.layer.d_model}")
      if self.layer.n_layers != 1 or self.layer.vocab_size != self.target.vocab_size:
        raise ValueError("an EAGLE layer config has n_layers 1 and the target's vocab_size")

  @property
  def layer_config(self) -> ModelConfig:
    """The EAGLE decoder layer: the target's block architecture, one layer deep."""
    return self.layer or dataclasses.replace(self.target, n_layers=1)

  @property
  def feature_dim(self) -> int:
    """Width of the target features the drafter is handed ([..., feature_dim])."""
    d = self.target.d_model
    return d * len(self.feature_layers) if self.kind == "eagle3" else d

  @property
  def hidden(self):
    """The target forward's `hidden=` argument that gives these features."""
    return self.feature_layers if self.kind == "eagle3" else True

  @property
  def vocab_size(self) -> int:
    """Tokens the head can draft."""
    return self.draft_vocab or self.target.vocab_size

  def check_target_config(self, got: ModelConfig) -> None:
    """ValueError naming what differs between a target's config and the one trained on.

    Needs no weights, so a loader can run it before reading them (`Head.check_target`
    adds the weights' fingerprint)."""
    want = self.target
    for name in ("d_model", "vocab_size"):
      if getattr(want, name) != getattr(got, name):
        raise ValueError(f"{self.kind} head was trained for a target with {name} "
                         f"{getattr(want, name)}; this target has {getattr(got, name)}")
    diff = [f.name for f in dataclasses.fields(want)
            if getattr(want, f.name) != getattr(got, f.name, None)]
    if diff:
      raise ValueError(f"{self.kind} head was trained for a different target architecture "
                       f"(differs in {', '.join(diff)})")

  def to_dict(self) -> dict[str, Any]:
    d = {"kind": self.kind, "medusa_heads": self.medusa_heads, "target": self.target.to_dict()}
    if self.kind == "eagle3":
      d |= {"feature_layers": list(self.feature_layers), "draft_vocab": self.draft_vocab}
    if self.layer is not None:
      d["layer"] = self.layer.to_dict()
    if self.layout != "specjax":
      d["layout"] = self.layout
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "HeadConfig":
    # Named, not a bare KeyError; no int() either: 2.7 heads is an error, not 2.
    missing = [k for k in ("kind", "target") if k not in d]
    if missing:
      raise ValueError(f"no HeadConfig field {', '.join(map(repr, missing))}")
    unknown = sorted(set(d) - {"kind", "target", "medusa_heads", "feature_layers",
                               "draft_vocab", "layer", "layout"})
    if unknown:
      raise ValueError(f"unknown HeadConfig fields: {unknown}")
    layers = d.get("feature_layers")
    return cls(kind=d["kind"], target=ModelConfig.from_dict(d["target"]),
               medusa_heads=d.get("medusa_heads", 4),
               feature_layers=tuple(layers) if isinstance(layers, list) else layers,
               draft_vocab=d.get("draft_vocab"),
               layer=None if d.get("layer") is None else ModelConfig.from_dict(d["layer"]),
               layout=d.get("layout", "specjax"))


class _Readout(nnx.Module):
  """The target's frozen pieces, named as in `model.Transformer` so its arrays drop in."""

  def _init_shared(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.tie = cfg.tie_embeddings
    self.embed = model_lib.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.final_norm = model_lib._norm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = model_lib._dense(rngs, cfg.d_model, cfg.vocab_size, False, 0.02)

  def readout(self, x):
    """Features [..., d] -> float32 logits [..., V], as the target's chain passes compute
    them (`model.head_logits`; fused where the target's layers run fused)."""
    return model_lib.head_logits(x, self.embed, self.final_norm,
                                 None if self.tie else self.lm_head, fused=True)


class EagleHead(_Readout):

  def __init__(self, hc: HeadConfig, rngs: nnx.Rngs):
    d = hc.target.d_model
    self._init_shared(hc.target, rngs)
    # The target's features (rms ~3 on stdlib-target) and its embeddings (rms ~0.07) are
    # normalised before they are fused, so neither half starts 50x too weak to learn from.
    self.feature_norm = model_lib._norm(hc.target, rngs)
    self.token_norm = model_lib._norm(hc.target, rngs)
    self.fuse = model_lib.Dense(2 * d, d, use_bias=True, rngs=rngs,
                                kernel_init=nnx.initializers.normal(0.02))
    self.layer = model_lib.Block(hc.layer_config, rngs)

  def inputs(self, features):
    """The target's features as the layer takes them (as they are)."""
    return features

  def __call__(self, features, next_tokens, positions, cache=None, read_cache=True, at=None,
               mask=None):
    """features [B, T, d] (f_t), next_tokens int[B, T] (x_{t+1}), positions int[B, T]

    -> (predicted f_{t+1} [B, T, d], logits for x_{t+2} [B, T, V], new (k, v) or None).
    at int[B]: only slot at[b] of each row is read (T becomes 1 in both outputs), and
    only slots up to max(at) are computed where the layer runs fused (`Block.fused`).
    mask: a token tree's attention (`layers.attend`), with the tree's own positions.
    """
    x = jnp.concatenate([self.feature_norm(features.astype(self.feature_norm.scale.dtype)),
                         self.token_norm(self.embed(next_tokens))], axis=-1)
    live = None if at is None else jnp.max(at) + 1
    x, cache = self.layer(self.fuse(x), positions, cache, read_cache, mask=mask, live=live)
    if at is not None:  # one row of the LM head, not T
      x = jnp.take_along_axis(x, at[:, None, None], axis=1)
    return x, self.readout(x), cache


class Eagle3Head(nnx.Module):
  """Parameter names follow the published layout (`fc`, `midlayer`, `norm`, `lm_head`,
  d2t as `vocab`) where specjax's own pieces allow: the loader renames only q/k/v (one
  fused `qkv`) and gate/up (one fused `up`), as for a target."""

  def __init__(self, hc: HeadConfig, rngs: nnx.Rngs):
    cfg, d = hc.layer_config, hc.target.d_model
    self.embed = model_lib.Embed(hc.target.vocab_size, d, rngs=rngs)  # the target's
    self.embed.dtype = None
    self.fc = model_lib._dense(rngs, hc.feature_dim, d, False, 0.02)
    self.midlayer = Eagle3Layer(cfg, rngs)
    self.norm = model_lib._norm(cfg, rngs)
    self.lm_head = model_lib._dense(rngs, d, hc.vocab_size, False, 0.02)
    self.vocab = nnx.Variable(jnp.arange(hc.vocab_size, dtype=jnp.int32))
    self.full_vocab = hc.draft_vocab is None

  def inputs(self, features):
    """The target's fused features [..., feature_dim] -> the layer's h [..., d]."""
    return self.fc(features.astype(self.fc.kernel.dtype))

  def readout(self, h):
    """h [..., d] -> float32 logits over the target's vocabulary [..., V]; tokens outside
    the draft vocabulary get OFF_VOCAB (probability exactly 0)."""
    # The target's readout path: one product with the norm folded in, where the backend
    # has laid the head out (`model.head_logits`).
    logits = model_lib.head_logits(h, self.embed, self.norm, self.lm_head, fused=True)
    if self.full_vocab:
      return logits
    full = jnp.full(logits.shape[:-1] + (self.embed.num_embeddings,), OFF_VOCAB, jnp.float32)
    return full.at[..., self.vocab[...]].set(logits)

  def __call__(self, features, next_tokens, positions, cache=None, read_cache=True, at=None,
               mask=None):
    """As `EagleHead.__call__`; features are the layer's h [B, T, d]: `inputs` of the
    target's, or the head's own predictions."""
    live = None if at is None else jnp.max(at) + 1
    h, cache = self.midlayer(features, self.embed(next_tokens), positions, cache,
                             read_cache, mask, live)
    if at is not None:
      h = jnp.take_along_axis(h, at[:, None, None], axis=1)
    return h, self.readout(h), cache


class Eagle3Layer(nnx.Module):
  """EAGLE-3's decoder layer: attention over [input_layernorm(e), hidden_norm(h)] (2d
  wide), added to h; then the usual norm + MLP + residual."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.hidden_norm = model_lib._norm(cfg, rngs)
    self.input_layernorm = model_lib._norm(cfg, rngs)
    self.attn = model_lib.Attention(cfg, rngs)
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.attn.qkv = model_lib._dense(rngs, 2 * cfg.d_model, (h + 2 * kvh) * hd, cfg.qkv_bias,
                                     0.02)
    self.post_attention_layernorm = model_lib._norm(cfg, rngs)
    self.mlp = model_lib.MLP(cfg, rngs)

  def joint(self, h, e):
    return jnp.concatenate([self.input_layernorm(e), self.hidden_norm(h.astype(e.dtype))],
                           axis=-1)

  def finish(self, h, attn_out):
    h = h + attn_out
    return h + self.mlp(self.post_attention_layernorm(h))

  def weights(self):
    return backends.LayerWeights(
        attn_norm=self.hidden_norm.scale[...], qkv=self.attn.qkv.kernel[...],
        out=self.attn.out.kernel[...], mlp_norm=self.post_attention_layernorm.scale[...],
        up=self.mlp.up.kernel[...], down=self.mlp.down.kernel[...])

  def __call__(self, h, e, positions, cache=None, read_cache=True, mask=None, live=None):
    """live: as `model.Block`'s, where the backend runs the layer (`joint_block`)."""
    backend, weights = backends.current(), self.weights()
    if backend.fuses_joint_block(self.cfg, weights, cache, mask, h.shape[1]):
      cos, sin = layers_lib.rope_angles(positions, layers_lib.rope_frequencies(self.cfg))
      return backend.joint_block(self.cfg, weights, self.input_layernorm.scale[...],
                                 h, e, cos, sin, cache, live)
    attn_out, cache = self.attn(self.joint(h, e), positions, cache, read_cache, mask)
    return self.finish(h, attn_out), cache


class MedusaHead(_Readout):

  def __init__(self, hc: HeadConfig, rngs: nnx.Rngs):
    d = hc.target.d_model
    self._init_shared(hc.target, rngs)
    # Zero init: every head starts as the target's own next-token prediction.
    self.heads = nnx.List([
        model_lib.Dense(d, d, use_bias=True, rngs=rngs, kernel_init=nnx.initializers.zeros)
        for _ in range(hc.medusa_heads)])

  def __call__(self, features):
    """features [..., d] (f_t) -> logits [..., K, V]; head k (index k-1) is for x_{t+k+1}."""
    h = jnp.stack([features + jax.nn.silu(head(features)) for head in self.heads], axis=-2)
    return self.readout(h)


class PublishedEagleHead(_Readout):
  """EAGLE-1/2 in its authors' layout: slot t fuses [embed(x_{t+1}), f̄_t] (f̄: the
  target's final-normed feature, as transformers returns it) with `fc`, runs one decoder
  layer with no input norm, and reads out through the target's LM head with no norm."""

  def __init__(self, hc: HeadConfig, rngs: nnx.Rngs):
    cfg, d = hc.layer_config, hc.target.d_model
    self._init_shared(hc.target, rngs)
    self.fc = model_lib.Dense(2 * d, d, use_bias=True, rngs=rngs)
    self.attn = model_lib.Attention(cfg, rngs)
    self.post_attention_layernorm = model_lib._norm(cfg, rngs)
    self.mlp = model_lib.MLP(cfg, rngs)

  def inputs(self, features):
    return self.final_norm(features.astype(self.final_norm.scale.dtype))

  def __call__(self, features, next_tokens, positions, cache=None, read_cache=True, at=None,
               mask=None):
    e = self.embed(next_tokens)
    x = self.fc(jnp.concatenate([e, features.astype(e.dtype)], axis=-1))
    attn_out, cache = self.attn(x, positions, cache, read_cache, mask)
    x = x + attn_out
    x = x + self.mlp(self.post_attention_layernorm(x))
    if at is not None:
      x = jnp.take_along_axis(x, at[:, None, None], axis=1)
    head = self.embed.attend if self.tie else self.lm_head
    return x, head(x).astype(jnp.float32), cache


class PublishedMedusaHead(_Readout):
  """Medusa-1 in its authors' layout: head k is h + SiLU(W h + b) on the target's
  final-normed feature, then its own LM head."""

  def __init__(self, hc: HeadConfig, rngs: nnx.Rngs):
    d, v = hc.target.d_model, hc.target.vocab_size
    self._init_shared(hc.target, rngs)
    self.blocks = nnx.List([model_lib.Dense(d, d, use_bias=True, rngs=rngs)
                            for _ in range(hc.medusa_heads)])
    self.lm_heads = nnx.List([model_lib.Dense(d, v, use_bias=False, rngs=rngs)
                              for _ in range(hc.medusa_heads)])

  def __call__(self, features):
    f = self.final_norm(features.astype(self.final_norm.scale.dtype))
    return jnp.stack([lm(f + jax.nn.silu(block(f))).astype(jnp.float32)
                      for block, lm in zip(self.blocks, self.lm_heads)], axis=-2)


_MODULES = {("eagle", "specjax"): EagleHead, ("eagle3", "specjax"): Eagle3Head,
            ("medusa", "specjax"): MedusaHead, ("eagle", "published"): PublishedEagleHead,
            ("medusa", "published"): PublishedMedusaHead}


def _module(hc: HeadConfig):
  return _MODULES[hc.kind, hc.layout]


@functools.lru_cache(maxsize=None)
def graphdef_for(hc: HeadConfig):
  abstract = nnx.eval_shape(lambda: _module(hc)(hc, nnx.Rngs(0)))
  return nnx.split(abstract)[0]


def shared_names(kind: str) -> tuple[str, ...]:
  """The target's parameters a head of this kind reads: EAGLE-3 has its own norm and LM
  head and reads only the embedding."""
  return ("embed",) if kind == "eagle3" else SHARED


def init_params(hc: HeadConfig, seed: int = 0) -> dict:
  """Fresh parameters of the head's own layers (the shared target pieces left out)."""
  module = _module(hc)(hc, nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(module))
  return {k: v for k, v in params.items() if k not in shared_names(hc.kind)}


def shared_params(target_params, kind: str = "eagle") -> dict:
  """The target's embedding, final norm and (untied) LM head (only the embedding for
  EAGLE-3): references, not copies."""
  return {k: target_params[k] for k in shared_names(kind) if k in target_params}


def trainable(params) -> dict:
  """The head's params that train: all but EAGLE-3's vocabulary map (integers)."""
  return {k: v for k, v in params.items() if k != "vocab"}


def eagle_apply(hc: HeadConfig, params, features, next_tokens, kv=None, empty=False,
                at=None, positions=None, mask=None, target_features=False):
  """Runs the EAGLE head on T slots; with `kv`, at each row's own `kv.length`.

  target_features: `features` are the target's (EAGLE-3's fused ones go through its
  `fc`), not the head's own predictions.

  Returns (predicted features [B, T, d], logits float32[B, T, V], kv + T or None).
  Without a cache the slots are positions 0..T-1, attended causally (training).
  at int[B]: the outputs of slot at[b] alone ([B, 1, ...]); slots past it may go
  uncomputed, their KV unwritten. A token tree passes its nodes' `positions` int[B, T]
  and `mask` (`layers.attend`); the T slots are still written at kv.length.. .
  """
  module = nnx.merge(graphdef_for(hc), params)
  b, t = next_tokens.shape
  start = jnp.zeros((b,), jnp.int32) if kv is None else kv.length
  if positions is None:
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  cache = None if kv is None else (kv.k[0], kv.v[0], kv.length)
  if target_features:
    features = module.inputs(features)
  x, logits, new = module(features, next_tokens, positions, cache, read_cache=not empty,
                          at=at, mask=mask)
  if kv is not None:
    kv = kv.replace(k=(new[0],), v=(new[1],), length=kv.length + t)
  return x, logits, kv


def eagle3_unroll(hc: HeadConfig, params, features, tokens, steps: int):
  """Training-time test: the head run `steps` times over whole windows, each step on its
  own predictions, attending as drafting does.

  features [B, T, feature_dim] (the target's, positions 0..T-1), tokens int[B, T + steps]
  (x_0..). Step k = 0..steps-1 at slot t reads (h^{k-1}_t, x_{t+k+1}) at position t + k
  (h^{-1} = fc(features)) and predicts x_{t+k+2}; its query sees step 0's keys at slots
  <= t (true features) and steps 1..k's keys at its own slot t: the cache a draft of k
  steps from anchor t holds. Returns logits float32[steps, B, T, V].
  """
  module = nnx.merge(graphdef_for(hc), params)
  layer, cfg = module.midlayer, hc.layer_config
  b, t = features.shape[:2]
  nh, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  attn = layer.attn
  freqs = layers_lib.rope_frequencies(cfg)
  causal = jnp.tril(jnp.ones((t, t), bool))
  h = module.inputs(features)
  keys, values, out = [], [], []
  for k in range(steps):
    e = module.embed(tokens[:, k + 1: k + 1 + t])
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + k, (b, t))
    q, key, v = layers_lib.split_fused(attn.qkv(layer.joint(h, e)), cfg.qkv_groups,
                                       (nh // cfg.qkv_groups * hd, kvh // cfg.qkv_groups * hd,
                                        kvh // cfg.qkv_groups * hd))
    q, key, v = q.reshape(b, t, nh, hd), key.reshape(b, t, kvh, hd), v.reshape(b, t, kvh, hd)
    if cfg.qk_norm:
      q, key = attn.q_norm(q), attn.k_norm(key)
    if cfg.position == "rope":
      q, key = layers_lib.rope(q, pos, freqs), layers_lib.rope(key, pos, freqs)
    keys.append(jnp.repeat(key, nh // kvh, axis=2).astype(jnp.float32))
    values.append(jnp.repeat(v, nh // kvh, axis=2).astype(jnp.float32))
    q = q.astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
    s0 = jnp.einsum("bthd,bshd->bhts", q, keys[0])
    s0 = jnp.where(causal, s0, -jnp.inf)
    diag = [jnp.einsum("bthd,bthd->bht", q, kj)[..., None] for kj in keys[1:]]
    w = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", w[..., :t], values[0])
    for j, vj in enumerate(values[1:]):
      o = o + w[..., t + j].transpose(0, 2, 1)[..., None] * vj
    attn_out = attn.out(o.reshape(b, t, nh * hd).astype(h.dtype))
    h = layer.finish(h, attn_out)
    out.append(module.readout(h))
  return jnp.stack(out)


def medusa_apply(hc: HeadConfig, params, features):
  """features [..., d] -> logits float32[..., K, V] (head k at index k-1 predicts t+k+1)."""
  return nnx.merge(graphdef_for(hc), params)(features)


# ----------------------------------------------------------------------------------
# Which target a head belongs to.


def target_fingerprint(config: ModelConfig, params) -> str:
  """A short hash of the target weights a head reads: embedding, final norm, LM head.

  Values are rounded to bfloat16 first, so a float32 target and its bfloat16 export print
  the same. The architecture is not hashed (`Head.check_target` compares it field by
  field), so a refactor of `ModelConfig` does not orphan trained heads.
  """
  del config  # the shapes of the hashed weights carry d_model and the vocabulary
  flat = jax.tree_util.tree_flatten_with_path(shared_params(params))[0]
  leaves = [leaf for _, leaf in flat]
  # jax arrays are immutable: the same objects hash the same, so `generate` with a head
  # skips hashing them again after its first call (numpy leaves could change in place).
  key = tuple(id(leaf) for leaf in leaves)
  immutable = all(isinstance(leaf, jax.Array) for leaf in leaves)
  hit = _FINGERPRINTS.get(key) if immutable else None
  # Weak references: the same objects, still alive (an id can be reused once one dies),
  # and a dropped target's weights are not kept alive here.
  if hit is not None and all(ref() is leaf for ref, leaf in zip(hit[0], leaves)):
    return hit[1]
  h = hashlib.sha256()
  for path, leaf in flat:
    arr = np.asarray(jax.device_get(leaf), np.float32).astype(jnp.bfloat16)
    h.update(f"{checkpoint_lib.param_key(path)}{arr.shape}".encode())
    h.update(arr.view(np.uint16).tobytes())
  digest = h.hexdigest()[:20]
  if immutable:
    _FINGERPRINTS.pop(key, None)
    _FINGERPRINTS[key] = ([weakref.ref(leaf) for leaf in leaves], digest)
    while len(_FINGERPRINTS) > 4:
      _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
  return digest


_FINGERPRINTS: dict = {}  # leaf ids -> (weak references to the leaves, digest)


class Head:
  """A trained head: config, its own params, and the fingerprint of its target.

  Like `model.Model`, not a pytree: jitted code gets `draft_params(target)` and the
  drafter (a frozen dataclass, static).
  """

  def __init__(self, config: HeadConfig, params, target_fingerprint: str,
               metadata: dict[str, Any] | None = None):
    self.config = config
    self.params = params
    self.target_fingerprint = target_fingerprint
    self.metadata = dict(metadata or {})

  @property
  def kind(self) -> str:
    return self.config.kind

  @property
  def num_params(self) -> int:
    return model_lib.count_params(self.params)

  def check_target(self, target) -> None:
    """Raises ValueError naming what differs between `target` (a Model) and the head's."""
    self.config.check_target_config(target.config)
    got = target.config
    print_ = target_fingerprint(got, target.params)
    if print_ != self.target_fingerprint:
      from specjax.models import quantization
      quantized = any(quantization.is_quantized(node) for node in jax.tree_util.tree_leaves(
          target.params, is_leaf=quantization.is_quantized))
      hint = (" (this target's weights are int8-quantized by specjax.quantize, and a head "
              "drafts only for the weights it was trained on)" if quantized else "")
      raise ValueError(f"{self.kind} head was trained for target fingerprint "
                       f"{self.target_fingerprint}; this target's weights give {print_}{hint}")

  def draft_params(self, target, check: bool = True) -> dict:
    """The drafter's params: the head's own + the target's frozen embedding/norm/head."""
    if check:
      self.check_target(target)
    return {**self.params, **shared_params(target.params, self.kind)}

  def __repr__(self):
    return (f"Head({self.kind}, d_model={self.config.target.d_model}, "
            f"params={self.num_params:,}, target={self.target_fingerprint})")


# ----------------------------------------------------------------------------------
# On disk: DIR/head.json (config, fingerprint, shapes, SHA-256 of params.npz) + params.npz,
# in the layout of `specjax.models.checkpoint` (bfloat16 kept as uint16 bit patterns).


def is_head(path: str | os.PathLike) -> bool:
  return (Path(path) / MANIFEST).is_file()


def save_head(path: str | os.PathLike, head: Head, dtype=None) -> Path:
  path = Path(path)
  if (path / checkpoint_lib.MANIFEST).is_file():
    raise checkpoint_lib.CheckpointError(f"{path} holds a model ({checkpoint_lib.MANIFEST}); "
                                         "save the head elsewhere")
  path.mkdir(parents=True, exist_ok=True)
  arrays, specs = {}, {}
  for p, leaf in jax.tree_util.tree_flatten_with_path(head.params)[0]:
    arr = np.asarray(jax.device_get(leaf))
    if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
      arr = arr.astype(jnp.dtype(dtype))
    key = checkpoint_lib.param_key(p)
    specs[key] = {"shape": list(arr.shape), "dtype": str(arr.dtype)}
    arrays[key] = arr.view(f"u{arr.itemsize}") if arr.dtype.kind == "V" else arr
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  blob = buffer.getvalue()
  checkpoint_lib.atomic_write(path / PARAMS, blob)
  manifest = {"format": FORMAT, "version": VERSION, "config": head.config.to_dict(),
              "target_fingerprint": head.target_fingerprint, "params": specs,
              "params_sha256": hashlib.sha256(blob).hexdigest(),
              "num_params": head.num_params, "metadata": head.metadata}
  checkpoint_lib.atomic_write(path / MANIFEST,
                               json.dumps(manifest, indent=2, sort_keys=True).encode())
  return path


def _read_manifest(path: Path) -> dict:
  err = checkpoint_lib.CheckpointError
  try:
    manifest = json.loads((path / MANIFEST).read_text())
  except (ValueError, OSError) as e:
    raise err(f"head manifest {path / MANIFEST} is missing or unreadable: {e}") from e
  if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
      or manifest.get("version") != VERSION):
    raise err(f"{path / MANIFEST} is not a {FORMAT} v{VERSION} manifest")
  checkpoint_lib.check_manifest(manifest, path / MANIFEST,
                                ("config", "params", "params_sha256", "target_fingerprint"))
  return manifest


def read_head_config(path: str | os.PathLike) -> HeadConfig:
  """A head directory's config, without reading its weights."""
  path = Path(path)
  return checkpoint_lib.config_from_manifest(_read_manifest(path), path / MANIFEST, HeadConfig.from_dict)


def load_head(path: str | os.PathLike, dtype=jnp.float32) -> Head:
  path = Path(path)
  dtype = None if dtype is None else model_lib.float_dtype(dtype)
  err = checkpoint_lib.CheckpointError
  manifest = _read_manifest(path)
  hc = checkpoint_lib.config_from_manifest(manifest, path / MANIFEST, HeadConfig.from_dict)
  blob = (path / PARAMS).read_bytes() if (path / PARAMS).is_file() else b""
  if hashlib.sha256(blob).hexdigest() != manifest["params_sha256"]:
    raise err(f"head file {path / PARAMS} is missing, truncated or corrupt")
  stored = np.load(io.BytesIO(blob), allow_pickle=False)
  reference = jax.eval_shape(lambda: init_params(hc))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(reference)
  checkpoint_lib.check_param_names([checkpoint_lib.param_key(p) for p, _ in leaves],
                                   manifest["params"], stored.files, f"head {path}")
  out = []
  for p, ref in leaves:
    key = checkpoint_lib.param_key(p)
    arr = checkpoint_lib.as_stored(
        stored[key], checkpoint_lib.stored_dtype(manifest["params"], key, path / MANIFEST),
        key, path)
    if arr.shape != ref.shape:
      raise err(f"head {path}: {key} has shape {arr.shape}, config needs {ref.shape}")
    if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
      arr = arr.astype(jnp.dtype(dtype))
    out.append(jnp.asarray(arr))
  return Head(hc, jax.tree_util.tree_unflatten(treedef, [x for x in out]),
              manifest["target_fingerprint"], manifest.get("metadata"))
