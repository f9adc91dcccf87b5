"""The cached forward is the full forward, however it is fed and rolled back."""


import dataclasses

import chex
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax import backends
from specjax.models import kv_cache
from specjax.models import layers
from specjax.models import model as model_lib
from specjax.prepare import prepare, seed_key
from specjax.results import build_result
from conftest import tiny_model

CONFIGS = {
    "gpt2": dict(vocab=16, d_model=32, n_layers=2, n_heads=4),
    "llama_gqa": dict(vocab=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, llama=True),
}


def _feed(model, tokens, kv, chunks):
  fn = jax.jit(model_lib.forward_cached, static_argnums=0)
  outs, start = [], 0
  for size in chunks:
    logits, kv = fn(model.graphdef, model.params, tokens[:, start:start + size], kv)
    outs.append(logits)
    start += size
  return jnp.concatenate(outs, axis=1), kv


class CachedForwardTest(parameterized.TestCase):

  @parameterized.named_parameters(
      [(f"{name}_{'_'.join(map(str, chunks))}", name, chunks)
       for name in CONFIGS for chunks in [(20,), (1,) * 20, (3, 1, 7, 2, 7), (5, 5, 5, 5)]])
  def test_chunks_equal_full_forward(self, name, chunks):
    model = tiny_model(**CONFIGS[name])
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 20), 0, 16)
    full = model.logits(tokens)
    kv = kv_cache.init_kv(model.config, 3, 32)
    cached, kv = _feed(model, tokens, kv, chunks)
    chex.assert_shape(cached, (3, 20, 16))
    chex.assert_trees_all_close(cached, full, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(kv.length, [20, 20, 20])

  @parameterized.named_parameters(("gpt2", "gpt2"), ("llama_gqa", "llama_gqa"))
  def test_rows_at_different_lengths(self, name):
    model = tiny_model(**CONFIGS[name])
    tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 24), 0, 16)
    full = model.logits(tokens)
    # Row b has seen lens[b] tokens; feeding the next 4 must give the full-forward logits.
    lens = np.array([3, 11, 17])
    kv = kv_cache.init_kv(model.config, 3, 32)
    _, kv = model_lib.forward_cached(model.graphdef, model.params, tokens[:, :20], kv)
    kv = kv.rollback(lens)
    chunk = jnp.stack([tokens[b, lens[b]:lens[b] + 4] for b in range(3)])
    logits, kv = model_lib.forward_cached(model.graphdef, model.params, chunk, kv)
    want = jnp.stack([full[b, lens[b]:lens[b] + 4] for b in range(3)])
    chex.assert_trees_all_close(logits, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(kv.length, lens + 4)

  @parameterized.named_parameters(("nan", np.nan), ("huge", 1e30))
  def test_rollback_over_poisoned_slots(self, poison):
    model = tiny_model(**CONFIGS["llama_gqa"])
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 0, 16)
    other = jax.random.randint(jax.random.PRNGKey(4), (2, 6), 0, 16)
    full = model.logits(tokens)
    kv = kv_cache.init_kv(model.config, 2, 32)
    _, kv = model_lib.forward_cached(model.graphdef, model.params, tokens[:, :10], kv)
    # A rejected draft: 6 wrong tokens go in, then the cache is rolled back to 10 and
    # every slot past the valid length is poisoned.
    _, kv = model_lib.forward_cached(model.graphdef, model.params, other, kv)
    kv = kv.rollback(jnp.array([10, 10]))
    slot = jnp.arange(kv.size)[None, None, :, None]
    poison_fn = lambda buf: jnp.where(slot >= 10, poison, buf)
    kv = kv.replace(k=tuple(map(poison_fn, kv.k)), v=tuple(map(poison_fn, kv.v)))
    logits, _ = model_lib.forward_cached(model.graphdef, model.params, tokens[:, 10:], kv)
    self.assertTrue(bool(jnp.all(jnp.isfinite(logits))))
    chex.assert_trees_all_close(logits, full[:, 10:], atol=2e-5, rtol=2e-5)

  def test_both_forms_of_the_cached_value_sum(self):
    # On a CPU a 1-token step's weighted sum over cached values is written V-first (the
    # accelerators' form is the plain product): both must agree, with GQA and stale NaN slots.
    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    b, h, kvh, d, s = 2, 4, 2, 8, 10
    q = jax.random.normal(keys[0], (b, 1, h, d))
    k, v = (jax.random.normal(keys[i], (b, 1, kvh, d)) for i in (1, 2))
    length = jnp.array([4, 7])
    stale = jnp.arange(s)[None, None, :, None] >= length[:, None, None, None]
    k_buf, v_buf = (jnp.where(stale, jnp.nan, jax.random.normal(keys[i], (b, kvh, s, d)))
                    for i in (3, 4))
    outs = []
    for values_left in (True, False):
      outs.append(layers.attend(q, k, v, (k_buf, v_buf, length), values_left=values_left))
    self.assertTrue(bool(jnp.all(jnp.isfinite(outs[0]))))
    chex.assert_trees_all_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)

  @parameterized.named_parameters(("step", 1, False), ("chain", 3, False), ("tree", 4, True))
  def test_writing_first_attends_alike(self, t, tree):
    # The accelerators' order (the new K/V written, then one masked attention over the
    # buffers) against the CPU's (the cache read, then the chunk): GQA, NaN stale slots,
    # rows at different lengths, a tree's chunk and slot masks.
    keys = jax.random.split(jax.random.PRNGKey(6), 6)
    b, h, kvh, d, s = 2, 4, 2, 8, 12
    q = jax.random.normal(keys[0], (b, t, h, d))
    k, v = (jax.random.normal(keys[i], (b, t, kvh, d)) for i in (1, 2))
    length = jnp.array([3, 7])
    stale = jnp.arange(s)[None, None, :, None] >= length[:, None, None, None]
    k_buf, v_buf = (jnp.where(stale, jnp.nan, jax.random.normal(keys[i], (b, kvh, s, d)))
                    for i in (3, 4))
    mask = None
    if tree:  # nodes 0 <- 1, 0 <- 2 <- 3; the history's slots seen but slot 1 of row 0
      chunk = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
      slots = jnp.broadcast_to(jnp.arange(s)[None, None, :] < length[:, None, None], (b, t, s))
      mask = (chunk, slots.at[0, :, 1].set(False))
    want = layers.attend(q, k, v, (k_buf, v_buf, length), mask)
    got = layers.attend_written(q, kv_cache.write(k_buf, k, length),
                                kv_cache.write(v_buf, v, length), length, mask)
    self.assertTrue(bool(jnp.all(jnp.isfinite(got))))
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)

  @parameterized.named_parameters(("gpt2", "gpt2"), ("llama_gqa", "llama_gqa"))
  def test_writing_first_equals_full_forward(self, name):
    # The model's cached pass in the accelerators' order, forced on here.
    model = tiny_model(**CONFIGS[name])
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 20), 0, 16)
    full = model.logits(tokens)
    kv = kv_cache.init_kv(model.config, 3, 32)
    outs = []
    with backends.use(backends.select(backends.Options(write_first=True))):
      for start, size in ((0, 3), (3, 1), (4, 7), (11, 9)):
        logits, kv = model_lib.forward_cached(model.graphdef, model.params,
                                              tokens[:, start:start + size], kv)
        outs.append(logits)
    chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), full, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(kv.length, [20, 20, 20])

  def test_writes_past_the_buffer_are_dropped(self):
    buf = jnp.zeros((2, 4), jnp.int32)
    out = kv_cache.write(buf, jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([0, 2]))
    np.testing.assert_array_equal(out, [[1, 2, 3, 0], [0, 0, 4, 5]])
    # KV buffers [B, H, S, D] take [B, T, H, D]; an overflowing write must not shift left
    # onto valid history.
    kv = jnp.zeros((1, 2, 6, 1))
    new = jnp.arange(1.0, 4.0)[None, :, None, None] * jnp.array([1.0, 10.0])[None, None, :, None]
    out = kv_cache.write(kv, new, jnp.array([4]))
    np.testing.assert_array_equal(out[0, :, :, 0], [[0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 10, 20]])


class ConfigTest(parameterized.TestCase):

  def test_public_api(self):
    cfg = specjax.ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=2, max_len=64)
    model = specjax.init_model(cfg, seed=0)
    logits = model.logits(jnp.zeros((2, 5), jnp.int32))
    chex.assert_shape(logits, (2, 5, 8))
    self.assertEqual(logits.dtype, jnp.float32)
    self.assertGreater(model.num_params, 0)

  @parameterized.named_parameters(
      ("heads", dict(d_model=30, n_heads=4)),
      ("kv_heads", dict(n_heads=4, n_kv_heads=3)),
      ("norm", dict(norm="batchnorm")),
      ("zero_layers", dict(n_layers=0)))
  def test_bad_config(self, kw):
    base = dict(vocab_size=8, d_model=32, n_layers=1, n_heads=2, max_len=64)
    base.update(kw)
    with self.assertRaises(ValueError):
      specjax.ModelConfig(**base)

  def test_same_seed_same_weights(self):
    cfg = specjax.ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, max_len=16)
    chex.assert_trees_all_equal(specjax.init_model(cfg, 3).params,
                                specjax.init_model(cfg, 3).params)

  def test_logits_rejects_too_long(self):
    model = tiny_model(max_len=8)
    with self.assertRaisesRegex(ValueError, "max_len"):
      model.logits(jnp.zeros((1, 9), jnp.int32))


@pytest.mark.parametrize("kw", [dict(), dict(gamma=3), dict(tree=(2, 1))])
def test_engine_writing_first_changes_no_token(kw):
  # The decode (prefill, verify passes of a chain and of a tree, rollback) in the
  # accelerators' order gives the CPU order's tokens and logprobs at T = 0.
  target, draft = tiny_model(vocab=8, seed=3), tiny_model(vocab=8, d_model=16, seed=5)
  if kw:
    kw = dict(kw, draft=draft)
  outs = []
  for first in (False, True):
    p = prepare(target, [[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=0.0,
                logprobs=True, **kw)
    options = backends.Options(kernels=False, write_first=first)
    p = dataclasses.replace(p, engine=dataclasses.replace(p.engine, backend_options=options))
    outs.append(build_result(target, p.engine, p.run(seed_key(0)), p.stops))
  assert outs[0].tokens == outs[1].tokens
  flat = lambda r: [x for row in r.logprobs for x in row]
  np.testing.assert_allclose(flat(outs[1]), flat(outs[0]), atol=1e-5)
