"""The decode kernel's cached attention (`Options(decode_kernel=True)`, backends.pallas):
jax's Pallas GPU kernel, interpreted on the CPU, gives the dense sums over each row's
history; merged with the chunk (layers.attend_in_parts) it is `attend`, for a step, a
chain and trees; the model and the engine give the same logits and tokens with it."""

import dataclasses
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from specjax import backends
from specjax.backends import pallas
from specjax.models import kv_cache
from specjax.models import layers
from specjax.models import model as model_lib
from specjax.prepare import prepare, seed_key
from specjax.results import build_result
from conftest import tiny_model

KERNEL = backends.Options(kernels=False, decode_kernel=True)


def _inputs(t, b=3, h=4, kvh=2, d=16, s=64, seed=6):
  """Queries, the chunk's K/V, and buffers whose slots past each row's length hold large
  finite garbage (rejected drafts'): rows at lengths 0, 5 and 41."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(keys[0], (b, t, h, d))
  k, v = (jax.random.normal(keys[i], (b, t, kvh, d)) for i in (1, 2))
  length = jnp.array([0, 5, 41])[:b]
  stale = jnp.arange(s)[None, None, :, None] >= length[:, None, None, None]
  k_buf, v_buf = (jnp.where(stale, 30.0, jax.random.normal(keys[i], (b, kvh, s, d)))
                  for i in (3, 4))
  return q, k, v, k_buf, v_buf, length


class KernelTest(parameterized.TestCase):

  def test_splits(self):
    self.assertEqual(pallas.splits(4096), (16, 128))
    self.assertEqual(pallas.splits(64), (4, 16))
    self.assertEqual(pallas.splits(192), (4, 16))  # 192 / 8 = 24 is no multiple of 16
    self.assertEqual(pallas.splits(16), (1, 16))
    self.assertIsNone(pallas.splits(8))
    self.assertIsNone(pallas.splits(40))

  @parameterized.parameters(1, 3)
  def test_interpreted_kernel_gives_the_dense_sums(self, t):
    q, _, _, k_buf, v_buf, length = _inputs(t)
    qg = q.reshape(*q.shape[:2], 2, 2, q.shape[-1]) * 0.25
    o, l, m = pallas.cache_attention(qg, k_buf, v_buf, length, interpret=True)
    ro, rl, rm = pallas.cache_attention_dense(qg, k_buf, v_buf, length)
    np.testing.assert_array_equal(np.asarray(l[0]), 0.0)  # no history
    # The sums are relative to each one's maximum: compare them normalised, and m where
    # there is a history.
    chex.assert_trees_all_close(o[1:] / l[1:, ..., None], ro[1:] / rl[1:, ..., None],
                                atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(m[1:], rm[1:], atol=1e-5)
    chex.assert_trees_all_close(l[1:], rl[1:], rtol=1e-5)

  @parameterized.named_parameters(("step", 1, None), ("chain", 4, None), ("tree", 4, "tree"),
                                  ("row_trees", 4, "rows"))
  def test_in_parts_is_attend(self, t, tree):
    q, k, v, k_buf, v_buf, length = _inputs(t)
    mask = None
    if tree == "tree":  # nodes 0 <- 1, 0 <- 2 <- 3
      mask = (jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool), None)
    elif tree == "rows":  # one tree per row, as a dynamic tree's
      chunk = jnp.stack([jnp.eye(4, dtype=bool).at[:, 0].set(True),
                         jnp.tril(jnp.ones((4, 4), bool)),
                         jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], bool)])
      mask = (chunk, None)
    want = layers.attend(q, k, v, (k_buf, v_buf, length), mask)
    for part in (pallas.cache_attention_dense,
                 lambda *a: pallas.cache_attention(*a, interpret=True)):
      got = layers.attend_in_parts(q, k, v, (k_buf, v_buf, length), mask, part)
      chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)

  def test_a_merge_that_drops_the_history_is_caught(self):
    """The comparison above fails for a merge that ignores the kernel's sums."""
    q, k, v, k_buf, v_buf, length = _inputs(1)
    want = layers.attend(q, k, v, (k_buf, v_buf, length))
    none = lambda qg, *_: (jnp.zeros(qg.shape, jnp.float32), jnp.zeros(qg.shape[:-1]),
                           jnp.full(qg.shape[:-1], jnp.finfo(jnp.float32).min))
    got = layers.attend_in_parts(q, k, v, (k_buf, v_buf, length), None, none)
    self.assertGreater(float(jnp.abs(got - want)[1:].max()), 1e-2)

  def test_used_where_it_fits_and_refused_on_a_tpu(self):
    backend = backends.Backend(KERNEL)
    buf = jnp.zeros((1, 1, 64, 16))
    cache = (buf, buf, jnp.zeros((1,), jnp.int32))
    self.assertTrue(backend.reads_valid_blocks(cache, None))
    self.assertTrue(backend.reads_valid_blocks(cache, (jnp.ones((2, 2), bool), None)))
    self.assertFalse(backend.reads_valid_blocks(cache, (jnp.ones((2, 2), bool),
                                                        jnp.ones((1, 2, 64), bool))))
    small = jnp.zeros((1, 1, 40, 16))
    self.assertFalse(backend.reads_valid_blocks((small, small, cache[2]), None))
    for head in (8, 80):  # too small for Triton's products, or not a power of 2
      other = jnp.zeros((1, 1, 64, head))
      self.assertFalse(backend.reads_valid_blocks((other, other, cache[2]), None))
    self.assertFalse(backends.Backend().reads_valid_blocks(cache, None))
    self.assertFalse(backends.Backend(KERNEL, whole_rows=True).reads_valid_blocks(cache, None))
    with mock.patch.object(jax, "default_backend", lambda: "tpu"):
      with self.assertRaisesRegex(ValueError, "Pallas GPU decode kernel"):
        backend.reads_valid_blocks(cache, None)


def test_model_with_the_kernel_equals_the_full_forward():
  model = tiny_model(vocab=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, llama=True)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 20), 0, 16)
  full = model.logits(tokens)
  kv = kv_cache.init_kv(model.config, 3, 32)
  outs = []
  with backends.use(backends.select(KERNEL)):
    for start, size in ((0, 3), (3, 1), (4, 7), (11, 9)):
      logits, kv = model_lib.forward_cached(model.graphdef, model.params,
                                            tokens[:, start:start + size], kv)
      outs.append(logits)
  chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kw", [dict(), dict(gamma=3), dict(tree=(2, 1))])
def test_engine_with_the_kernel_changes_no_token(kw):
  """Prefill, 1-token steps, a chain's and a tree's verify passes and their rollbacks,
  the draft's cache too: the tokens and logprobs at T = 0 of XLA's attention."""
  target, draft = tiny_model(vocab=8, seed=3), tiny_model(vocab=8, d_model=16, seed=5)
  if kw:
    kw = dict(kw, draft=draft)
  outs, traced = [], []
  real = pallas.cache_attention
  count = lambda *a, **k: traced.append(1) or real(*a, **k)
  for options in (backends.Options(kernels=False), KERNEL):
    p = prepare(target, [[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=0.0,
                logprobs=True, **kw)
    p = dataclasses.replace(p, engine=dataclasses.replace(p.engine, backend_options=options))
    with mock.patch.object(pallas, "cache_attention", count):
      outs.append(build_result(target, p.engine, p.run(seed_key(0)), p.stops))
    assert bool(traced) == (options is KERNEL)  # the kernel's program ran it
  assert outs[0].tokens == outs[1].tokens
  flat = lambda r: [x for row in r.logprobs for x in row]
  np.testing.assert_allclose(flat(outs[1]), flat(outs[0]), atol=1e-5)
