"""Decoder-only transformer (Flax NNX) and the pure functions that run it.

The module tree is built once; `nnx.split` separates a static `graphdef` from the
parameters, which travel as a plain nested dict through `jax.jit`-ed functions and are
merged back inside. Attention is written by hand (`specjax.models.layers.attend`, not Flax's
decode cache) because every row of a batch writes at its own position and a verify pass
writes several tokens.

The heavy ops (dense products, the embedding lookup, cached attention, and where a
backend offers it a whole layer) run on the backend being traced (`specjax.backends`,
chosen once per compiled program): the model's own jnp code on an accelerator, specjax's
few-row kernels over weights laid out in panels on a CPU (`backends.cpu`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import backends
from specjax.models import kv_cache
from specjax.models import quantization
from specjax.models.config import ModelConfig
from specjax.models.layers import (attend, attend_in_parts, attend_written, rope, rope_angles,
                                   rope_frequencies, split_fused)

Params = dict[str, Any]


# Tensor parallelism (applied by `specjax.models.sharding`): the axis of each weight that is
# split over the mesh's 'model' axis, keyed by the tail of its parameter path. Anything
# not listed (norms, position embeddings, the biases added after a split contraction)
# is replicated. The fused kernels split into whole heads / units because `specjax.shard`
# first lays them out in as many groups as the 'model' axis has devices (`qkv_groups`,
# `mlp_groups`); where that is impossible the part stays replicated (docs/SCALING.md).
MODEL_AXIS = {
    ("embed", "embedding"): 0,  # vocabulary
    ("lm_head", "kernel"): 1,  # vocabulary
    ("attn", "qkv", "kernel"): 1,  # heads: each group holds whole q, k and v heads
    ("attn", "qkv", "bias"): 0,
    ("attn", "out", "kernel"): 0,  # heads (the output is summed over devices)
    ("mlp", "up", "kernel"): 1,  # hidden units: each group holds [gate | up]
    ("mlp", "up", "bias"): 0,
    ("mlp", "down", "kernel"): 0,  # hidden units (summed over devices)
}


class Dense(nnx.Linear):
  """nnx.Linear, its product run by the current backend (`backends.current`)."""

  def __call__(self, x):
    bias = None if self.bias is None else self.bias[...]
    return backends.current().dense(x, self.kernel[...], bias, super().__call__)


class Embed(nnx.Embed):
  """nnx.Embed, looked up and used as the tied LM head by the current backend."""

  def __call__(self, tokens):
    return backends.current().lookup(self.embedding[...], tokens, super().__call__)

  def attend(self, x):
    return backends.current().dense(x, self.embedding[...], None, super().attend)


def host_layout(params: Params, backend: backends.Backend | None = None) -> Params:
  """params laid out for `backend` (default: `backends.current`) before a compiled call
  (`backends.Backend.host_layout`): on a CPU with specjax's kernels, in panels."""
  return (backend or backends.current()).host_layout(params)


def _dense(rngs, d_in, d_out, bias, std):
  return Dense(d_in, d_out, use_bias=bias, rngs=rngs,
               kernel_init=nnx.initializers.normal(std))


def _norm(cfg: ModelConfig, rngs):
  if cfg.norm == "rmsnorm":
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
  return nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # q, k and v in one matmul: fewer, larger ops are what a small model needs on CPU.
    self.qkv = _dense(rngs, cfg.d_model, (h + 2 * kvh) * d, cfg.qkv_bias, 0.02)
    self.out = _dense(rngs, h * d, cfg.d_model, cfg.out_bias, 0.02 / (2 * cfg.n_layers) ** 0.5)
    if cfg.qk_norm:  # only then, so other configs' parameter trees stay as they were
      self.q_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, rngs=rngs)
      self.k_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, rngs=rngs)

  def __call__(self, x, positions, cache=None, read_cache=True, mask=None):
    """x: [B, T, d_model]; positions: int[B, T]; cache: (k, v, length) or None.

    read_cache=False writes the cache without attending over it: for a prefill into an
    empty cache, where reading would only make XLA constant-fold the zero buffers.
    """
    cfg = self.cfg
    b, t, _ = x.shape
    h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = cfg.qkv_groups
    backend = backends.current()
    if backend.fuses_attention(cfg, self.qkv.kernel[...], cache, mask, t):
      # One call for RoPE, attention and the KV write, the caches updated in place.
      cos, sin = rope_angles(positions, rope_frequencies(cfg))
      out, k_buf, v_buf = backend.rope_attention(self.qkv(x), cos, sin, cache, h)
      return self.out(out), (k_buf, v_buf)
    q, k, v = split_fused(self.qkv(x), g, (h // g * d, kvh // g * d, kvh // g * d))
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kvh, d), v.reshape(b, t, kvh, d)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if cfg.position == "rope":
      freqs = rope_frequencies(cfg)
      q, k = rope(q, positions, freqs), rope(k, positions, freqs)
    if cache is None:
      return self.out(attend(q, k, v, mask=mask)), None
    if read_cache and backend.reads_valid_blocks(cache, mask):  # each row's history only
      out = attend_in_parts(q, k, v, cache, mask, backend.cache_attention)
    elif read_cache and backend.writes_first:  # one masked attention over the buffers
      k_buf, v_buf, length = cache
      k_buf, v_buf = kv_cache.write(k_buf, k, length), kv_cache.write(v_buf, v, length)
      return self.out(attend_written(q, k_buf, v_buf, length, mask)), (k_buf, v_buf)
    else:
      out = backend.attend(attend, q, k, v, cache if read_cache else None, mask,
                           laid_out=backend.laid_out(self.qkv.kernel[...]))
    k_buf, v_buf, length = cache
    # The write depends on the attention output, so XLA must read the old buffers first
    # and may then update them in place; otherwise it copies both caches every step.
    zero = (0 * out[:, :1, :1])[..., None]  # [B, 1, 1, 1]: each row waits on its own read
    k_buf = kv_cache.write(k_buf, k + zero, length)
    v_buf = kv_cache.write(v_buf, v + zero, length)
    return self.out(out), (k_buf, v_buf)


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    width = 2 * cfg.d_ff if cfg.mlp == "swiglu" else cfg.d_ff  # gate and up fused
    self.up = _dense(rngs, cfg.d_model, width, cfg.mlp_bias, 0.02)
    self.down = _dense(rngs, cfg.d_ff, cfg.d_model, cfg.mlp_bias,
                       0.02 / (2 * cfg.n_layers) ** 0.5)

  def __call__(self, x):
    hidden = self.up(x)
    if self.cfg.mlp == "swiglu":
      g = self.cfg.mlp_groups
      gate, up = split_fused(hidden, g, (self.cfg.d_ff // g,) * 2)
      hidden = jax.nn.silu(gate) * up
    else:
      hidden = jax.nn.gelu(hidden, approximate=True)
    return self.down(hidden)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = _norm(cfg, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = _norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, cache=None, read_cache=True, mask=None, live=None):
    """live: with a backend that runs the whole layer (`fused`), only each row's first
    `live` tokens are computed and their KV written; elsewhere every token is."""
    backend = backends.current()
    if self.fused(backend, cache, mask, x.shape[1]):
      cos, sin = rope_angles(positions, rope_frequencies(self.attn.cfg))
      return backend.block(self.attn.cfg, self.weights(), x, cos, sin, cache, live)
    attn_out, cache = self.attn(self.attn_norm(x), positions, cache, read_cache, mask)
    x = x + attn_out
    return x + self.mlp(self.mlp_norm(x)), cache

  def weights(self) -> backends.LayerWeights:
    return backends.LayerWeights(
        attn_norm=self.attn_norm.scale[...], qkv=self.attn.qkv.kernel[...],
        out=self.attn.out.kernel[...], mlp_norm=self.mlp_norm.scale[...],
        up=self.mlp.up.kernel[...], down=self.mlp.down.kernel[...])

  def fused(self, backend: backends.Backend, cache, mask, tokens: int) -> bool:
    """Whether `backend` runs this whole layer in its own calls (`Backend.block`)."""
    return backend.fuses_block(self.attn.cfg, self.weights(), cache, mask, tokens)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                       embedding_init=nnx.initializers.normal(0.02))
    # Compute in the embedding's own dtype (bfloat16 weights, bfloat16 forward): nnx
    # would otherwise keep the float32 it was built with.
    self.embed.dtype = None
    if cfg.position == "learned":
      self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model, rngs=rngs,
                                 embedding_init=nnx.initializers.normal(0.01))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = _norm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = _dense(rngs, cfg.d_model, cfg.vocab_size, False, 0.02)

  def __call__(self, tokens, positions, kv: kv_cache.KVState | None = None,
               read_cache: bool = True, hidden: bool = False, mask=None, live=None):
    """tokens, positions: int[B, T] -> (logits float32[B, T, V], new k/v per layer).

    hidden=True adds a third output: the residual stream after the last block, before
    the final norm, [B, T, d_model] (the features that EAGLE / Medusa heads read).
    hidden=(i, j, ...) (layer ids in 0..n_layers) adds instead the residual streams
    entering those blocks, n_layers being the last block's output, concatenated
    [B, T, len * d_model] (EAGLE-3's fused features).
    live (a traced int): only each row's first `live` tokens need be computed; where the
    layers run fused (`Block.fused`) the rest are not, and their outputs are zeros.
    """
    x = self.embed(tokens)
    if self.cfg.position == "learned":
      # Positions past max_len only occur for draft tokens that can never be committed.
      x = x + jnp.take(self.pos_embed.embedding[...], positions, axis=0, mode="clip")
    ks, vs = [], []
    # The head follows the blocks: a pass whose layers run XLA's norms (a tree's) gets
    # XLA's final norm too.
    fused = kv is not None and self.blocks[0].fused(
        backends.current(), (kv.k[0], kv.v[0], kv.length), mask, tokens.shape[1])
    taps = {}
    for i, block in enumerate(self.blocks):
      taps[i] = x
      cache = None if kv is None else (kv.k[i], kv.v[i], kv.length)
      x, new_cache = block(x, positions, cache, read_cache, mask, live)
      if new_cache is not None:
        ks.append(new_cache[0])
        vs.append(new_cache[1])
    taps[len(self.blocks)] = x
    features = (jnp.concatenate([taps[i] for i in hidden], axis=-1)
                if isinstance(hidden, tuple) else x)
    logits = head_logits(x, self.embed, self.final_norm, getattr(self, "lm_head", None),
                         fused, live)
    out = logits, (tuple(ks), tuple(vs))
    return out + (features,) if hidden else out


def head_logits(x, embed: Embed, final_norm, lm_head: Dense | None, fused: bool,
                live=None):
  """The final norm and the LM head (tied to `embed` when lm_head is None): features
  [..., d] -> float32 logits [..., V]. fused (a pass whose layers ran fused, see
  `Block.fused`): where the backend has laid the head out, an RMSNorm is done by the
  head's product (`Backend.head`), on the first `live` positions of x [B, T, d]."""
  backend = backends.current()
  head = (embed.embedding if lm_head is None else lm_head.kernel)[...]
  if (fused and backend.laid_out(head)
      and isinstance(final_norm, nnx.RMSNorm)
      and (lm_head is None or lm_head.bias is None)):
    return backend.head(x, head, final_norm.scale[...], final_norm.epsilon, live)
  x = final_norm(x)
  return (embed.attend(x) if lm_head is None else lm_head(x)).astype(jnp.float32)


# ----------------------------------------------------------------------------
# Pure functions over (graphdef, params). graphdef is static (hashable); params is a
# nested dict of arrays.


def split(module: Transformer):
  graphdef, state = nnx.split(module)
  return graphdef, nnx.to_pure_dict(state)


def merge(graphdef, params: Params) -> Transformer:
  """The module; int8 weights (`specjax.quantize`) are dequantised here, in the forward."""
  return nnx.merge(graphdef, quantization.dequantize(params))


def compute_dtype(params: Params):
  """The dtype a forward over `params` runs in, and its KV cache is kept in.

  That of the final norm's scale: every floating parameter shares it (int8 weights carry
  scales of it); logits come out in float32 whatever it is.
  """
  return params["final_norm"]["scale"].dtype


def forward(graphdef, params: Params, tokens: jax.Array, hidden: bool = False):
  """Uncached forward over whole sequences: int[B, T] -> float32[B, T, V].

  hidden=True returns (logits, features [B, T, d_model]): see `Transformer.__call__`.
  """
  module = merge(graphdef, params)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  out = module(tokens, positions, hidden=hidden)
  return (out[0], out[2]) if hidden else out[0]


def forward_cached(graphdef, params: Params, tokens: jax.Array, kv: kv_cache.KVState,
                   empty: bool = False, hidden: bool = False, positions=None, mask=None,
                   live=None):
  """Feeds tokens int[B, T] at each row's own `kv.length`; returns (logits, kv + T).

  empty=True promises every row's length is 0 (a prefill), so the cache is not read.
  hidden=True returns (logits, kv + T, features [B, T, d_model]).
  Token trees pass their own `positions` int[B, T] (length - 1 + depth) and `mask`
  (see `attend`); the T tokens are still written at slots length..length+T-1.
  live (a traced int in [1, T]): the caller reads only each row's first `live` outputs
  and keeps only their KV; a backend that fuses the layers skips the rest (`Transformer.__call__`),
  elsewhere every token is computed.
  """
  module = merge(graphdef, params)
  t = tokens.shape[1]
  if positions is None:
    positions = kv.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  logits, (ks, vs), *features = module(tokens, positions, kv, read_cache=not empty,
                                       hidden=hidden, mask=mask, live=live)
  kv = kv_cache.KVState(k=ks, v=vs, length=kv.length + t)
  return (logits, kv, features[0]) if hidden else (logits, kv)


def runs_fused(graphdef, params: Params, kv: kv_cache.KVState, tokens: int,
               backend: backends.Backend) -> bool:
  """Whether a cached pass of `tokens` tokens runs its layers in the backend's own calls
  (`Block.fused`), and so computes only the `live` tokens it is given."""
  block = merge(graphdef, params).blocks[0]
  return bool(block.fused(backend, (kv.k[0], kv.v[0], kv.length), None, tokens))


# The jitted forwards run on the process's default backend (`backends.select()`), also
# when called inside another `backends.use`: their cache key names no backend.
_on_default = backends.traced_on(lambda *args, **kwargs: backends.select())
forward_jit = jax.jit(_on_default(forward), static_argnums=0, static_argnames=("hidden",))
forward_cached_jit = jax.jit(_on_default(forward_cached), static_argnums=0,
                             static_argnames=("empty", "hidden"))


def count_params(params: Params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


class Model:
  """A model ready to use: config, parameters and (optionally) a tokenizer.

  The config is its one static identity; the graph is derived from it. Not a pytree on
  purpose: jitted code receives `graphdef` (static) and `params`.
  """

  def __init__(self, config: ModelConfig, params: Params, tokenizer=None, eos_ids=None):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"Model needs a ModelConfig, got {type(config).__name__}")
    self.config = config
    self.params = params
    self.tokenizer = tokenizer
    self._eos_ids = None if eos_ids is None else [int(i) for i in eos_ids]

  @property
  def eos_ids(self) -> list[int] | None:
    """The ids that end text: the tokenizer's, or, where it names none (no tokenizer, or
    one attached to a sentencepiece-only Hugging Face directory), those the model's
    files name (config.json, generation_config.json); None if neither. Ids past the
    embedding (a tokenizer larger than the model) are left out: the model never emits them."""
    ids = getattr(self.tokenizer, "eos_ids", None)
    if not ids and getattr(self.tokenizer, "eos_id", None) is not None:
      ids = [self.tokenizer.eos_id]
    if not ids:
      ids = self._eos_ids
    return None if ids is None else [
        int(i) for i in ids if 0 <= int(i) < self.config.vocab_size]

  @property
  def graphdef(self):
    return graphdef_for(self.config)

  @property
  def num_params(self) -> int:
    return count_params(self.params)

  def logits(self, tokens) -> jax.Array:
    """int [B, T] -> float32 [B, T, V], no cache."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if tokens.shape[1] > self.config.max_len:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={self.config.max_len}")
    return forward_jit(self.graphdef, self.params, tokens)

  def with_params(self, params: Params, config: ModelConfig | None = None) -> "Model":
    """This model (its tokenizer and end-of-text ids) with other parameters, and another
    config where the parameters' layout or shapes changed."""
    return Model(config or self.config, params, self.tokenizer, eos_ids=self._eos_ids)

  def __repr__(self):
    return f"Model({self.config}, params={self.num_params:,})"


@functools.lru_cache(maxsize=None)
def _abstract(cfg: ModelConfig):
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  return graphdef, nnx.to_pure_dict(state)


def graphdef_for(cfg: ModelConfig):
  """The static graph of a config, built without allocating weights (one per config)."""
  return _abstract(cfg)[0]


def abstract_params(cfg: ModelConfig) -> Params:
  """The params dict of `cfg` with a `jax.ShapeDtypeStruct` per leaf; nothing allocated."""
  return jax.tree_util.tree_map(lambda leaf: leaf, _abstract(cfg)[1])


def float_dtype(dtype):
  """`dtype` as a jnp dtype; ValueError unless it is a floating one."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"dtype must be a floating dtype, got {dtype!r}") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype, got {dt}")
  return dt


def cast(params: Params, dtype) -> Params:
  """Every floating parameter cast to `dtype` (int8 weights keep their bits)."""
  dt = float_dtype(dtype)
  return jax.tree_util.tree_map(
      lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def init_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Model:
  """A model with freshly initialised random weights, in `dtype` (the forward's too)."""
  dt = float_dtype(dtype)
  _, params = split(Transformer(cfg, nnx.Rngs(seed)))
  return Model(cfg, params if dt == jnp.float32 else cast(params, dt))
