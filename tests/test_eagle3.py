"""EAGLE-3 heads: fused target features, the reduced draft vocabulary, training-time test,
and the drafter through the engine (chains and trees, greedy equality, the law)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.drafters import heads as head_drafters
from specjax.models import heads as heads_lib
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.processors.sampling import Sampling, process_logits
from specjax.training import heads as train_heads
from conftest import tiny_model

V, D, GAMMA = 16, 32, 3
VOCAB = (0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13)  # the draft vocabulary: 11 of 16 tokens


@functools.lru_cache(maxsize=None)
def e3_target():
  """A 4-layer llama target (features fused from blocks 1, 2 and the last output)."""
  model = tiny_model(vocab=V, d_model=D, n_layers=4, llama=True, seed=0, sharpness=3.0)
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  params["final_norm"]["scale"] = params["final_norm"]["scale"] * 8
  return model.with_params(params)


def e3_head(target, draft_vocab=VOCAB, seed=1, scale=3.0, layers=None):
  """An EAGLE-3 head with random weights (peaked outputs) on `target`."""
  hc = heads_lib.HeadConfig("eagle3", target.config, feature_layers=layers,
                            draft_vocab=None if draft_vocab is None else len(draft_vocab))
  own = heads_lib.init_params(hc, seed)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
  own = jax.tree_util.tree_map(
      lambda x: x + 0.3 * scale * jax.random.normal(next(keys), x.shape) / x.shape[0] ** 0.5
      if x.ndim == 2 else x, own)
  if draft_vocab is not None:
    own["vocab"] = jnp.asarray(draft_vocab, jnp.int32)
  return heads_lib.Head(hc, own, heads_lib.target_fingerprint(target.config, target.params))


TOKENS = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4],
                   [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3]], np.int32)
N = np.array([7, 5], np.int32)
P, SIZE = 8, 32


def fused(target, hc, tokens):
  return model_lib.forward(target.graphdef, target.params, jnp.asarray(tokens),
                           hidden=hc.hidden)[1]


def test_fused_features_are_the_residual_streams_entering_the_layers():
  target = e3_target()
  hc = e3_head(target).config
  assert hc.feature_layers == (1, 2, 4) and hc.feature_dim == 3 * D
  toks = jnp.asarray(TOKENS[:, :12])
  feats = fused(target, hc, toks)
  # Layer 4 = the last block's output = the EAGLE-1 feature; layer 1 = block 0's output.
  last = model_lib.forward(target.graphdef, target.params, toks, hidden=True)[1]
  np.testing.assert_allclose(feats[..., 2 * D:], last, atol=1e-6)
  blocks = target.params["blocks"]
  first = {**target.params, "blocks": {0: blocks[0]} if isinstance(blocks, dict) else blocks[:1]}
  graph1 = model_lib.graphdef_for(dataclasses.replace(target.config, n_layers=1))
  out1 = model_lib.forward(graph1, first, toks, hidden=True)[1]
  np.testing.assert_allclose(feats[..., :D], out1, atol=1e-5)
  # Cached passes give the same fused features.
  kv = kv_cache.init_kv(target.config, 2, SIZE)
  _, kv, f1 = model_lib.forward_cached(target.graphdef, target.params, toks[:, :7], kv,
                                       empty=True, hidden=hc.hidden)
  _, _, f2 = model_lib.forward_cached(target.graphdef, target.params, toks[:, 7:], kv,
                                      hidden=hc.hidden)
  np.testing.assert_allclose(jnp.concatenate([f1, f2], 1), feats, atol=1e-5)


def test_training_time_test_attends_as_drafting_does():
  """Step k of `eagle3_unroll` at slot t gives the logits a cached draft of k steps from
  anchor t gives (the head's KV of true slots <= t, then its own predictions)."""
  target = e3_target()
  head = e3_head(target)
  hc, params = head.config, head.draft_params(target)
  toks = jnp.asarray(TOKENS[:, :16])
  feats = fused(target, hc, toks)
  steps, t = 3, 12
  unrolled = heads_lib.eagle3_unroll(hc, params, feats[:, :t], toks, steps)
  assert unrolled.shape == (steps, 2, t, V)
  for anchor in (0, 5, 11):
    kv = kv_cache.init_kv(hc.layer_config, 2, SIZE)
    h, logits, kv = heads_lib.eagle_apply(hc, params, feats[:, :anchor + 1],
                                          toks[:, 1: anchor + 2], kv, empty=True,
                                          target_features=True)
    np.testing.assert_allclose(logits[:, -1], unrolled[0, :, anchor], atol=1e-4)
    h = h[:, -1:]
    for k in range(1, steps):
      h, logits, kv = heads_lib.eagle_apply(hc, params, h,
                                            toks[:, anchor + k + 1: anchor + k + 2], kv)
      np.testing.assert_allclose(logits[:, 0], unrolled[k, :, anchor], atol=1e-4)


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (0.8, 5)])
def test_proposal_matches_the_unrolled_reference_and_never_leaves_the_vocabulary(
    temperature, top_k):
  target = e3_target()
  head = e3_head(target)
  drafter = head_drafters.for_head(head.config, GAMMA)
  assert drafter.feature_layers == (1, 2, 4)
  params = head.draft_params(target)
  state = jax.jit(drafter.prefill)(params, drafter.init(2, SIZE), jnp.asarray(TOKENS),
                                   jnp.asarray(N), fused(target, head.config, TOKENS[:, :P]))
  sampling = Sampling.create(2, temperature=temperature, top_k=top_k, top_p=1.0)
  ys, qs, _ = jax.jit(drafter.propose)(params, state, jnp.asarray(TOKENS), jnp.asarray(N),
                                       jax.random.PRNGKey(5), sampling)
  outside = np.setdiff1d(np.arange(V), VOCAB)
  assert np.all(np.asarray(qs)[..., outside] == 0.0)
  assert set(np.asarray(ys).ravel().tolist()) <= set(VOCAB)
  for b in range(2):
    n = int(N[b])
    row = np.concatenate([TOKENS[b, :n], np.asarray(ys[b]), [0]])[None]
    feats = fused(target, head.config, TOKENS[b:b + 1, :n - 1])
    logits = heads_lib.eagle3_unroll(head.config, params, feats, jnp.asarray(row), GAMMA)
    ref = process_logits(logits[:, 0, n - 2], temperature, top_k, 1.0)
    np.testing.assert_allclose(qs[b], ref, atol=2e-5)


def run(target, head, prompts, temperature, tree=None, gamma=GAMMA, max_new=12, seed=0,
        **kw):
  return specjax.generate(target, prompts, max_new_tokens=max_new, temperature=temperature,
                          draft=head, gamma=None if tree is not None else gamma, tree=tree,
                          seed=seed, **kw)


@pytest.mark.parametrize("tree", [None, (2, 2, 1), specjax.DynamicTree(6, 3, 2)],
                         ids=["chain", "static", "dynamic"])
def test_greedy_speculation_equals_target_greedy(tree):
  target = e3_target()
  head = e3_head(target)
  prompts = [TOKENS[0, :7].tolist(), TOKENS[1, :3].tolist()]
  expected = specjax.generate(target, prompts, max_new_tokens=12, temperature=0.0).tokens
  out = run(target, head, prompts, 0.0, tree)
  assert out.tokens == expected and out.stats["lossless"]
  assert out.stats["target_calls"] < 12 * 2  # some drafts were accepted


def test_three_token_law_with_a_reduced_vocabulary():
  """q is 0 on the tokens outside the draft vocabulary, p is not: the residual must give
  them their mass. Whole continuations follow the target's law at T = 1 with top-p."""
  from conftest import LAW_ROWS, target_and_draft, within_law
  small, _ = target_and_draft()  # vocabulary 8, 2 layers
  head = e3_head(small, draft_vocab=(0, 2, 3, 5, 6))
  prompt, length = [3, 1, 3], 3
  res = run(small, head, [prompt] * LAW_ROWS, 1.0, gamma=2, max_new=length, seed=4,
            top_p=0.9)
  # top-p = 0.9 on the target: the law is the processed one, computed exactly.
  probs = _top_p_law(small, prompt, length, 0.9)
  ok, worst = within_law(res.tokens, probs)
  assert ok, f"worst z={worst}"
  assert 0.05 < res.stats["acceptance_rate"] < 0.95
  assert set(np.asarray(res.tokens).ravel().tolist()) - {0, 2, 3, 5, 6}  # residual tokens


def test_tree_three_token_law_with_a_reduced_vocabulary():
  """EAGLE-3 trees (children drawn without replacement from a q that is 0 on 3 of the 8
  tokens) follow the target's law at T = 1."""
  from conftest import LAW_ROWS, exact_continuations, target_and_draft, within_law
  small, _ = target_and_draft()
  head = e3_head(small, draft_vocab=(0, 2, 3, 5, 6))
  prompt, length = [3, 1, 3], 3
  res = specjax.generate(small, [prompt] * LAW_ROWS, max_new_tokens=length, draft=head,
                         tree=(2, 2), temperature=1.0, seed=5)
  _, probs = exact_continuations(small, prompt, length)
  ok, worst = within_law(res.tokens, probs)
  assert ok, f"worst z={worst}"
  assert 0.05 < res.stats["acceptance_rate"] < 0.95


def _top_p_law(model, prompt, length, top_p):
  """P(x_1..x_L | prompt) under top-p sampling of the target (float64)."""
  import itertools
  vocab = model.config.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=length)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  logits = np.asarray(model.logits(jnp.asarray(seqs)), np.float64)
  total = np.ones(len(conts))
  for i in range(length):
    row = logits[:, len(prompt) - 1 + i]
    p = np.exp(row - row.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    p /= p.sum(-1, keepdims=True)
    total *= p[np.arange(len(conts)), conts[:, i]]
  return total


def test_training_lowers_the_loss_and_exports_a_loadable_head(tmp_path):
  target = e3_target()
  rng = np.random.default_rng(0)
  base = rng.integers(0, V, 23)
  stream = np.concatenate([base] * 130).astype(np.int32)  # periodic: learnable
  config = ml_collections.ConfigDict(dict(
      head="eagle3", teacher="tiny", feature_layers=(), draft_vocab=12, ttt_steps=3,
      ttt_decay=0.8, distill_weight=1.0, feature_noise=0.0, seq_len=16, batch_size=4,
      seed=0, steps=30, lr=1e-2, warmup_steps=1, end_lr_fraction=0.1, weight_decay=0.0,
      grad_clip=1.0, b1=0.9, b2=0.95, log_every=10, eval_every=15, eval_windows=2,
      eval_batch_size=2, checkpoint_every=15, export_dir="", export_dtype="",
      corpus="synthetic"))
  train_heads.validate(config)
  windows = np.stack([stream[i: i + 17] for i in range(0, 40, 5)])
  hc = train_heads.head_config_from(config, target)
  vocab = train_heads.draft_vocabulary(stream, hc)
  counts = np.bincount(stream, minlength=V)
  outside = np.setdiff1d(np.arange(V), vocab)
  assert len(vocab) == 12 and np.all(np.diff(vocab) > 0)  # distinct, in id order
  assert counts[vocab].min() >= counts[outside].max()  # the most frequent 12
  before = train_heads.acceptance_rate(
      hc, target, {**heads_lib.trainable(heads_lib.init_params(hc)), "vocab": vocab}, windows)
  head = train_heads.run(config, tmp_path / "run", target, stream, stream[:600])
  after = train_heads.acceptance_rate(hc, target, head.params, windows)
  assert after["alpha_t0"] > before["alpha_t0"] + 0.2
  assert after["alpha_t1"] > before["alpha_t1"] + 0.1
  loaded = specjax.load_pretrained(tmp_path / "run" / "head")
  assert loaded.kind == "eagle3" and loaded.config == head.config
  np.testing.assert_array_equal(loaded.params["vocab"], vocab)
  prompts = [TOKENS[0, :5].tolist()]
  expected = specjax.generate(target, prompts, max_new_tokens=8).tokens
  assert specjax.generate(target, prompts, max_new_tokens=8, draft=loaded).tokens == expected


@pytest.mark.parametrize("kwargs,message", [
    (dict(feature_layers=(1,)), "2 or more distinct"),
    (dict(feature_layers=(1, 1, 2)), "2 or more distinct"),
    (dict(feature_layers=(1, 2, 5)), "in 0..4"),
    (dict(draft_vocab=0), "draft_vocab"),
    (dict(draft_vocab=17), "draft_vocab"),
])
def test_a_bad_eagle3_config_names_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    heads_lib.HeadConfig("eagle3", e3_target().config, **kwargs)
  with pytest.raises(ValueError, match="EAGLE-3 field"):
    heads_lib.HeadConfig("eagle", e3_target().config, draft_vocab=4)


def test_a_bad_eagle3_training_config_fails_before_work():
  config = ml_collections.ConfigDict(dict(head="eagle3", teacher="x", ttt_steps=0, seq_len=8))
  with pytest.raises(ValueError, match="ttt_steps"):
    train_heads.validate(_valid(config))


def _valid(c):
  base = ml_collections.ConfigDict(dict(
      corpus="stdlib", heldout_fraction=0.05, tokenizer="", vocab_size=2048, seq_len=16,
      batch_size=4, seed=0, model=ml_collections.ConfigDict(), steps=10, lr=1e-3,
      warmup_steps=1, end_lr_fraction=0.1, weight_decay=0.0, grad_clip=1.0, b1=0.9,
      b2=0.95, teacher="", distill="", distill_weight=1.0, log_every=1, eval_every=5,
      eval_windows=2, eval_batch_size=2, checkpoint_every=5, export_dir="",
      export_dtype=""))
  base.update(c)
  return base


@pytest.mark.parametrize("at", [None, (1, 0)])
def test_the_cpu_backends_fused_layer_is_the_layers_own_ops(at):
  """Over the CPU backend's laid-out weights the layer runs as `joint_block` (the two
  halves of its attention input as two products into one sum): a cached pass gives the
  h, logits and KV of the layer's own ops over the same panels; with `at`, at those
  slots, and the KV of the slots up to max(at), the later ones left unwritten.
  bfloat16 panels (`host_layout` of bfloat16-exact weights): float32 ones keep the
  unfused layer."""
  from specjax import backends
  target = e3_target()
  head = e3_head(target)
  hc, params = head.config, head.draft_params(target)
  scales = iter(range(2, 9))  # every norm its own scale, so none can stand in for another
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * (1 + 0.3 * jnp.cos(jnp.arange(x.shape[0]) * next(scales)))
      if path[-1].key == "scale" else x, params)
  params = jax.tree_util.tree_map(  # bfloat16 values, float32 arrays
      lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x, params)
  ran = []

  class Counted(backends.CpuBackend):
    def joint_block(self, *args, **kwargs):
      ran.append(True)
      return super().joint_block(*args, **kwargs)

  cpu = Counted()
  laid = cpu.host_layout(params)
  layer = nnx.merge(heads_lib.graphdef_for(hc), laid).midlayer
  fresh = kv_cache.init_kv(hc.layer_config, 2, SIZE)
  cache = (fresh.k[0], fresh.v[0], fresh.length)
  assert layer.weights().qkv.dtype == jnp.bfloat16
  assert cpu.fuses_joint_block(hc.layer_config, layer.weights(), cache, None, 3)
  assert not cpu.fuses_joint_block(
      hc.layer_config, nnx.merge(heads_lib.graphdef_for(hc), cpu.layout(params)).midlayer
      .weights(), cache, None, 3)  # float32 panels
  feats = fused(target, hc, TOKENS[:, :P])
  toks = jnp.asarray(TOKENS[:, 1:P + 1])
  at = None if at is None else jnp.asarray(at, jnp.int32)

  def apply(p):
    h, _, kv = jax.jit(lambda p, kv: heads_lib.eagle_apply(
        hc, p, feats[:, :5], toks[:, :5], kv, empty=True, target_features=True))(p, fresh)
    h = h[:, -3:]
    return jax.jit(lambda p, kv: heads_lib.eagle_apply(hc, p, h, toks[:, 5:8], kv, at=at))(
        p, kv)

  class Unfused(backends.CpuBackend):
    def fuses_joint_block(self, *args):
      return False

  with backends.use(cpu):
    got = apply(laid)
  assert ran  # the pass went through joint_block
  with backends.use(Unfused()):  # the layer's own ops over the same panels
    want = apply(laid)
  for g, w in zip(got[:2], want[:2]):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
  written = 5 + (3 if at is None else int(jnp.max(at)) + 1)
  for g, w in zip(got[2].k + got[2].v, want[2].k + want[2].v):
    np.testing.assert_allclose(g[:, :, :written], w[:, :, :written], rtol=1e-4, atol=1e-4)
    if at is not None:  # past max(at): not computed, the fresh cache's zeros
      np.testing.assert_array_equal(g[:, :, written:8], 0.0)
      assert np.all(np.abs(np.asarray(w[:, :, written:8])).sum(-1) > 0)
