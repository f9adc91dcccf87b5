"""specjax's few-row CPU kernels compute XLA's products, and a forward over their layout
(the CPU backend's) is the forward."""

import dataclasses
import re
import os
import subprocess
import sys
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import specjax
from specjax import backends
from specjax import decode as decode_lib
from specjax.backends.cpu import kernels as cpu_kernels
from specjax.models import kv_cache
from specjax.models import layers
from specjax.prepare import prepare
from specjax.models import model as model_lib
from conftest import tiny_model


CPU = backends.CpuBackend()  # the default options


def with_options(prepared, **options):
  """`prepared` on an engine with these `backends.Options` (generate takes none itself)."""
  return dataclasses.replace(prepared, engine=dataclasses.replace(
      prepared.engine, backend_options=backends.Options(**options)))


def _rand(key, shape):
  return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


class KernelTest(parameterized.TestCase):

  def test_built_and_registered(self):
    # The CI machines have a C++ compiler: there the kernels must be in use.
    self.assertTrue(cpu_kernels.available(), cpu_kernels.status())

  @parameterized.parameters(1, 2, 5, 6, 7, 9, 13)
  def test_panel_matmul_is_the_product(self, rows):
    # K = 37: no multiple of the vector width; N = 80: five panels (chunks of unequal size).
    x, w = _rand(0, (rows, 37)), _rand(1, (37, 80))
    got = jax.jit(cpu_kernels.panel_matmul)(x, cpu_kernels.pack(w))
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)

  @parameterized.parameters((1, 37, 80), (5, 37, 80), (11, 37, 80), (9, 96, 288))
  def test_panel_matmul_does_the_ops_around_the_product(self, rows, k, n):
    # RMSNorm (as nnx.RMSNorm), SwiGLU's silu(gate) * up with gates far on both sides of
    # 0 (K = 37: a tail past the vectors), and a residual added to the product; 9 x 96 x
    # 288 is past PARALLEL_MIN_WORK (two threads, chunks of whole 4-panel passes).
    from flax import nnx
    x, w, add = _rand(0, (rows, k)), _rand(1, (k, n)), _rand(2, (rows, n))
    norm = nnx.RMSNorm(k, epsilon=1e-5, rngs=nnx.Rngs(0))
    norm.scale[...] = 1 + 0.1 * _rand(3, (k,))
    panels = cpu_kernels.pack(w)
    got = jax.jit(lambda x, s: cpu_kernels.panel_matmul(x, panels, s, 1e-5, add=add))(
        x, norm.scale[...])
    np.testing.assert_allclose(got, add + norm(x) @ w, rtol=2e-5, atol=2e-5)
    gates = 30 * _rand(4, (rows, k))
    got = jax.jit(lambda x: cpu_kernels.panel_matmul(x, panels, gated=True))(
        jnp.concatenate([gates, x], axis=1))
    np.testing.assert_allclose(got, (jax.nn.silu(gates) * x) @ w, rtol=2e-5, atol=2e-4)

  @parameterized.parameters(1, 3, 7)
  def test_prefetching_changes_no_bit(self, rows):
    # 512 x 1024 float32 panels are 2 MiB, PREFETCH_MIN_BYTES: the kernel prefetches their
    # weights for 3 or more rows (7: two row groups); without it, the same bits.
    x, w = _rand(0, (rows, 512)), _rand(1, (512, 1024))
    panels = cpu_kernels.pack(w)
    self.assertGreaterEqual(panels.size * 4, cpu_kernels.PREFETCH_MIN_BYTES)
    got = jax.jit(cpu_kernels.panel_matmul)(x, panels)
    with mock.patch.object(cpu_kernels, "PREFETCH_MIN_BYTES", 1 << 62):
      plain = jax.jit(lambda x, p: cpu_kernels.panel_matmul(x, p))(x, panels)
    np.testing.assert_array_equal(got, plain)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), rtol=2e-5, atol=2e-4)

  @parameterized.parameters((64, 96), (96, 1024))  # (96, 1024): past PARALLEL_MIN_WORK
  def test_a_row_does_not_depend_on_the_others(self, k, n):
    # Greedy speculative output equals greedy decoding only if the verify pass gives each
    # row the bits a 1-token step gives it: same kernel, same order of additions, with
    # the norm, SwiGLU and residual too.
    x, panels = _rand(4, (9, 2 * k)), cpu_kernels.pack(_rand(5, (k, n)))
    scale, add = 1 + _rand(6, (k,)), _rand(7, (9, n))
    calls = [lambda x, a: cpu_kernels.panel_matmul(x[:, :k], panels),
             lambda x, a: cpu_kernels.panel_matmul(x[:, :k], panels, scale, 1e-6, add=a),
             lambda x, a: cpu_kernels.panel_matmul(x, panels, gated=True, add=a)]
    for call in calls:
      fn = jax.jit(call)
      together = fn(x, add)
      alone = jnp.concatenate([fn(x[i:i + 1], add[i:i + 1]) for i in range(9)])
      np.testing.assert_array_equal(together, alone)

  @parameterized.parameters((1, 4, 2, 8, 1.0), (5, 4, 4, 64, 1.0), (3, 6, 2, 32, 1.0),
                            (2, 2, 1, 128, 1.0), (4, 4, 2, 64, 30.0), (3, 4, 2, 48, 1.0),
                            (2, 2, 1, 80, 1.0), (1, 2, 2, 96, 1.0))
  def test_cached_attention_is_attend(self, t, h, kvh, d, spread):
    # GQA, an odd number of query rows per KV head (3 x 3), a row with an empty cache,
    # stale NaN slots past each row's length, which the kernel must never read, and
    # (spread 30) scores so far apart that most exps underflow to 0.
    b, s = 3, 16
    keys = jax.random.split(jax.random.PRNGKey(8), 5)
    q = spread * jax.random.normal(keys[0], (b, t, h, d))
    k, v = (jax.random.normal(keys[i], (b, t, kvh, d)) for i in (1, 2))
    length = jnp.array([4, 11, 0])
    stale = jnp.arange(s)[None, None, :, None] >= length[:, None, None, None]
    k_buf, v_buf = (jnp.where(stale, jnp.nan, jax.random.normal(keys[i], (b, kvh, s, d)))
                    for i in (3, 4))
    want = layers.attend(q, k, v, (k_buf, v_buf, length))
    got = jax.jit(lambda *a: CPU.attend(layers.attend, *a[:3], a[3:], None, laid_out=True))(
        q, k, v, k_buf, v_buf, length)
    self.assertTrue(bool(jnp.all(jnp.isfinite(got))))
    # Scores of size ~spread carry float32 rounding of ~spread ulps into every weight.
    np.testing.assert_allclose(got, want, rtol=1e-5 * spread, atol=1e-5 * spread)

  def test_attention_head_dims_off_the_vector_width_keep_xla(self):
    # The kernel takes head dims in multiples of 8 and says so; attend routes others to
    # XLA's attention (the CPU backend's `attend`).
    q, k, v = jnp.ones((1, 1, 2, 12)), jnp.ones((1, 1, 1, 12)), jnp.ones((1, 1, 1, 12))
    cache = (jnp.ones((1, 1, 4, 12)), jnp.ones((1, 1, 4, 12)), jnp.array([2]))
    with self.assertRaisesRegex(Exception, "shapes do not match"):
      jax.jit(cpu_kernels.cached_attention)(q, k, v, *cache).block_until_ready()
    np.testing.assert_allclose(CPU.attend(layers.attend, q, k, v, cache, None, laid_out=True),
                               layers.attend(q, k, v, cache), rtol=1e-6)

  # (3, 1): a query row paired at T = 4, alone at 1; d = 48: the shipped draft's heads.
  @parameterized.parameters((4, 2, 64), (3, 1, 64), (4, 2, 48))
  def test_an_attention_row_is_the_1_token_step_at_its_position(self, h, kvh, d):
    # T new tokens at once, or one at a time with each written to the cache first: the
    # same bits (greedy speculative output equals greedy decoding).
    b, t, s, n = 2, 4, 16, 5
    keys = jax.random.split(jax.random.PRNGKey(9), 5)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k, v = (jax.random.normal(keys[i], (b, t, kvh, d)) for i in (1, 2))
    k_buf, v_buf = (jax.random.normal(keys[i], (b, kvh, s, d)) for i in (3, 4))
    attend = jax.jit(cpu_kernels.cached_attention)
    together = attend(q, k, v, k_buf, v_buf, jnp.full((b,), n))
    for i in range(t):
      alone = attend(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], k_buf, v_buf,
                     jnp.full((b,), n + i))
      np.testing.assert_array_equal(alone[:, 0], together[:, i])
      k_buf = k_buf.at[:, :, n + i].set(k[:, i])
      v_buf = v_buf.at[:, :, n + i].set(v[:, i])

  def _rope_case(self, key, b, t, h, kvh, d, s, length):
    keys = jax.random.split(jax.random.PRNGKey(key), 3)
    qkv = jax.random.normal(keys[0], (b, t, (h + 2 * kvh) * d))
    positions = length[:, None] + jnp.arange(t)[None, :]
    freqs = 1.0 / 10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d).astype(np.float32)
    stale = jnp.arange(s)[None, None, :, None] >= length[:, None, None, None]
    k_buf, v_buf = (jnp.where(stale, jnp.nan, jax.random.normal(keys[i], (b, kvh, s, d)))
                    for i in (1, 2))
    return qkv, layers.rope_angles(positions, freqs), positions, freqs, k_buf, v_buf

  @parameterized.parameters((1, 4, 2, 8), (5, 4, 4, 64), (3, 6, 2, 32), (4, 2, 1, 16))
  def test_rope_attention_is_rope_attend_and_write(self, t, h, kvh, d):
    # Row 1 ends past the cache (its last writes are dropped), row 2 is a prefill (length
    # 0), row 3 starts past the cache (nothing written); stale NaN slots must never be
    # read, and slots not written keep their bits.
    b, s = 4, 16
    length = jnp.array([4, 14, 0, 19])
    qkv, (cos, sin), positions, freqs, k_buf, v_buf = self._rope_case(10, b, t, h, kvh, d,
                                                                     s, length)
    q, k, v = layers.split_fused(qkv, 1, (h * d, kvh * d, kvh * d))
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kvh, d), v.reshape(b, t, kvh, d)
    q, k = layers.rope(q, positions, freqs), layers.rope(k, positions, freqs)
    want = (layers.attend(q, k, v, (k_buf, v_buf, length)),
            kv_cache.write(k_buf, k, length), kv_cache.write(v_buf, v, length))
    got = jax.jit(cpu_kernels.rope_attention, static_argnums=6)(qkv, cos, sin, k_buf,
                                                                 v_buf, length, h)
    self.assertTrue(bool(jnp.all(jnp.isfinite(got[0]))))
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)  # NaN where NaN

  def test_a_rope_attention_row_is_the_1_token_step_at_its_position(self):
    b, t, h, kvh, d, s = 2, 4, 4, 2, 64, 16
    length = jnp.array([5, 9])
    qkv, (cos, sin), *_, k_buf, v_buf = self._rope_case(11, b, t, h, kvh, d, s, length)
    fn = jax.jit(cpu_kernels.rope_attention, static_argnums=6)
    together, k_all, v_all = fn(qkv, cos, sin, k_buf, v_buf, length, h)
    for i in range(t):
      alone, k_buf, v_buf = fn(qkv[:, i:i + 1], cos[:, i:i + 1], sin[:, i:i + 1], k_buf,
                               v_buf, length + i, h)
      np.testing.assert_array_equal(alone[:, 0], together[:, i])
    np.testing.assert_array_equal(k_buf, k_all)
    np.testing.assert_array_equal(v_buf, v_all)

  def test_lookup_from_the_tied_heads_panels(self):
    table = _rand(18, (48, 24))
    tokens = jnp.array([[0, 47, 5], [16, 17, 3]])
    got = jax.jit(cpu_kernels.panel_lookup)(cpu_kernels.pack(table.T), tokens)
    np.testing.assert_array_equal(got, table[tokens])

  def test_top_is_argmax_and_the_support(self):
    # V = 2051: a tail past the vectors; a row of -inf, a row with two NaNs (the first
    # wins, as jnp.argmax's), a one-hot row; batched under vmap along any axis.
    x = _rand(12, (3, 5, 2051))
    x = x.at[0, 0].set(-jnp.inf).at[1, 2, 7].set(jnp.nan).at[1, 2, 900].set(jnp.nan)
    x = x.at[2, 4].set(jax.nn.one_hot(2050, 2051))
    index, count = jax.jit(cpu_kernels.top)(x)
    np.testing.assert_array_equal(index, jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(count, jnp.sum(x > 0, axis=-1))
    self.assertEqual(int(count[2, 4]), 1)
    for axis in (0, 1):
      got = jax.vmap(cpu_kernels.top, in_axes=axis, out_axes=axis)(x)[0]
      np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))

  def test_pack_round_trip(self):
    w = _rand(7, (5, 32))
    np.testing.assert_array_equal(cpu_kernels.unpack(cpu_kernels.pack(w)), w)
    self.assertFalse(cpu_kernels.packable(w[:, :24]))  # 24 columns: not whole panels
    self.assertFalse(cpu_kernels.packable(w.astype(jnp.bfloat16)))

  @parameterized.parameters((1, 37, 80), (5, 96, 288), (9, 37, 80), (13, 96, 1024))
  def test_bf16_panels_give_the_float32_panels_bits(self, rows, k, n):
    # Weights that are bfloat16 values: half the bytes, the same float32 products (the
    # plain product, norm + residual, SwiGLU, live rows), lookups and unpacked weights.
    w = _rand(1, (k, n)).astype(jnp.bfloat16).astype(jnp.float32)
    x, add, scale = _rand(0, (rows, k)), _rand(2, (rows, n)), 1 + 0.1 * _rand(3, (k,))
    half, full = cpu_kernels.pack_bf16(w), cpu_kernels.pack(w)
    self.assertEqual(half.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(cpu_kernels.unpack(half), w)
    cases = [lambda p: cpu_kernels.panel_matmul(x, p),
             lambda p: cpu_kernels.panel_matmul(x, p, scale, 1e-5, add=add),
             lambda p: cpu_kernels.panel_matmul(jnp.concatenate([30 * x, x], 1), p,
                                                gated=True),
             lambda p: cpu_kernels.panel_matmul(x, p, live=1, period=rows)]
    for case in cases:
      np.testing.assert_array_equal(jax.jit(case)(half), jax.jit(case)(full))
    tokens = jnp.array([[0, n - 1, 7], [8, 9, 15]])  # both halves of a panel row
    # The tied table [V, d] = w.T, looked up from its panels.
    np.testing.assert_array_equal(cpu_kernels.panel_lookup(half, tokens), w.T[tokens])

  def test_a_failed_build_names_the_compiler_and_the_error(self):
    with mock.patch.dict(os.environ, {"CXX": sys.executable}):
      with self.assertRaisesRegex(RuntimeError, "failed on fewrow.cc"):
        cpu_kernels._build(cpu_kernels.library_path().with_name("never.so"))

  def test_turned_off_by_the_environment(self):
    # A fresh process: the library is loaded once per process.
    code = ("from specjax.backends.cpu import kernels as c; "
            "print(c.available(), c.status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SPECJAX_CPU_KERNELS": "0"}, check=True)
    self.assertIn("False turned off by SPECJAX_CPU_KERNELS=0", out.stdout)


CONFIGS = {
    "gpt2": dict(vocab=16, d_model=32, n_layers=2, n_heads=4),
    "llama_gqa": dict(vocab=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, llama=True),
}


class LayoutTest(parameterized.TestCase):

  def test_every_dense_kernel_is_laid_out(self):
    model = tiny_model(**CONFIGS["llama_gqa"])
    laid = CPU.layout(model.params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(laid):
      if path[-1].key == "kernel":
        self.assertEqual(leaf.ndim, 3, path)
    # Untied: the embedding is only looked up, and stays as it is.
    self.assertEqual(laid["embed"]["embedding"].ndim, 2)

  def test_a_tied_embedding_is_laid_out_as_the_lm_head(self):
    model = tiny_model(**CONFIGS["gpt2"])
    laid = CPU.layout(model.params)
    table = model.params["embed"]["embedding"]
    np.testing.assert_array_equal(cpu_kernels.unpack(laid["embed"]["embedding"]), table.T)
    self.assertEqual(laid["pos_embed"]["embedding"].ndim, 2)  # positions: not a head
    tokens = jnp.array([[0, 5, 15, 16 - 1, 7]])
    module = model_lib.merge(model.graphdef, laid)
    np.testing.assert_array_equal(module.embed(tokens), table[tokens])
    off = backends.CpuBackend(backends.Options(kernels=False))
    chex.assert_trees_all_equal(off.layout(model.params), model.params)
    chex.assert_trees_all_equal(off.host_layout(model.params), model.params)

  @parameterized.named_parameters(
      [(f"{name}_{'_'.join(map(str, chunks))}", name, chunks)
       for name in CONFIGS for chunks in [(1,) * 12, (4, 1, 5, 2), (12,)]])
  def test_cached_forward_over_the_layout_is_the_forward(self, name, chunks):
    model = tiny_model(**CONFIGS[name])
    laid = CPU.layout(model.params)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 16)
    full = model.logits(tokens)
    # Chunks of 1..12 tokens, batch 2: 2..24 rows, in the kernel's groups of up to 9 rows.
    np.testing.assert_allclose(model_lib.forward_jit(model.graphdef, laid, tokens), full,
                               rtol=2e-5, atol=2e-5)
    fn = jax.jit(model_lib.forward_cached, static_argnums=0)
    kv, outs, start = kv_cache.init_kv(model.config, 2, 32), [], 0
    for size in chunks:
      logits, kv = fn(model.graphdef, laid, tokens[:, start:start + size], kv)
      outs.append(logits)
      start += size
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=2e-5, atol=2e-5)

  def test_a_fused_pass_row_is_the_1_token_step(self):
    # The Llama-shaped layers run fused (`Block.fused`): a 4-token cached pass gives
    # each token the logits and KV of feeding the tokens one at a time, bit for bit.
    model = tiny_model(**CONFIGS["llama_gqa"])
    laid = CPU.layout(model.params)
    module = model_lib.merge(model.graphdef, laid)
    self.assertTrue(module.blocks[0].fused(CPU, (jnp.zeros((1, 1, 1, 8)),), None, 4))
    self.assertFalse(module.blocks[0].fused(  # unless the options say so
        backends.CpuBackend(backends.Options(fused_layers=False)),
        (jnp.zeros((1, 1, 1, 8)),), None, 4))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, 16)
    fn = jax.jit(model_lib.forward_cached, static_argnums=0)
    kv = kv_cache.init_kv(model.config, 2, 16)
    _, kv = fn(model.graphdef, laid, tokens[:, :5], kv)
    together, kv_all = fn(model.graphdef, laid, tokens[:, 5:], kv)
    for i in range(4):
      alone, kv = fn(model.graphdef, laid, tokens[:, 5 + i:6 + i], kv)
      np.testing.assert_array_equal(alone[:, 0], together[:, i])
    chex.assert_trees_all_equal(kv.k, kv_all.k)
    chex.assert_trees_all_equal(kv.v, kv_all.v)

  def test_a_pass_with_live_tokens_is_the_full_pass_on_them(self):
    # A verify pass computes only the round's longest draft (`forward_cached(live=)`):
    # those tokens get the full pass's logits and KV bit for bit, the others nothing
    # (zero logits, their slots keep the old cache's bits).
    model = tiny_model(**CONFIGS["llama_gqa"])
    laid = CPU.layout(model.params)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, 16)
    fn = jax.jit(model_lib.forward_cached, static_argnums=0)
    kv = kv_cache.init_kv(model.config, 2, 16)
    _, kv = fn(model.graphdef, laid, tokens[:, :5], kv)
    kv = kv.rollback(jnp.array([5, 3]))
    full, kv_full = fn(model.graphdef, laid, tokens[:, 5:], kv)
    for live in (1, 3, 4):
      got, kv_got = fn(model.graphdef, laid, tokens[:, 5:], kv, live=jnp.int32(live))
      np.testing.assert_array_equal(got[:, :live], full[:, :live])
      np.testing.assert_array_equal(got[:, live:], 0.0)
      np.testing.assert_array_equal(kv_got.length, kv_full.length)
      slot = jnp.arange(16)[None, None, :, None]
      written = (slot >= kv.length[:, None, None, None]) & (
          slot < kv.length[:, None, None, None] + live)
      for old, new, want in zip(kv.k + kv.v, kv_got.k + kv_got.v, kv_full.k + kv_full.v):
        np.testing.assert_array_equal(new, jnp.where(written, want, old))

  def test_live_rows_of_a_product_and_of_attention(self):
    # Of each `period` rows only the first `live` are computed, each as with every row
    # (norm, SwiGLU, residual; one thread and two); the others are zeros.
    for k, n in ((32, 48), (256, 512)):
      x, panels = _rand(13, (10, 2 * k)), cpu_kernels.pack(_rand(14, (k, n)))
      scale, add = 1 + _rand(15, (k,)), _rand(16, (10, n))
      calls = [lambda x, a, **kw: cpu_kernels.panel_matmul(x[:, :k], panels, **kw),
               lambda x, a, **kw: cpu_kernels.panel_matmul(x[:, :k], panels, scale, 1e-6,
                                                           add=a, **kw),
               lambda x, a, **kw: cpu_kernels.panel_matmul(x, panels, gated=True, add=a,
                                                           **kw)]
      for call in calls:
        full = jax.jit(call)(x, add)
        for live in (0, 2, 5):
          got = jax.jit(lambda x, a, m: call(x, a, live=m, period=5))(x, add, live)
          used = (jnp.arange(10) % 5 < live)[:, None]
          np.testing.assert_array_equal(got, jnp.where(used, full, 0.0))
    b, t, h, kvh, d, s = 2, 4, 4, 2, 64, 16
    length = jnp.array([5, 14])  # row 1 runs past the cache
    qkv, (cos, sin), *_, k_buf, v_buf = KernelTest._rope_case(self, 17, b, t, h, kvh, d, s,
                                                              length)
    fn = jax.jit(cpu_kernels.rope_attention, static_argnums=6)
    out, k_all, v_all = fn(qkv, cos, sin, k_buf, v_buf, length, h)
    for live in (1, 3):
      got, k_got, v_got = fn(qkv, cos, sin, k_buf, v_buf, length, h, jnp.int32(live))
      np.testing.assert_array_equal(got[:, :live], out[:, :live])
      np.testing.assert_array_equal(got[:, live:], 0.0)
      slot = jnp.arange(s)[None, None, :, None]
      written = slot < length[:, None, None, None] + live
      np.testing.assert_array_equal(k_got, jnp.where(written, k_all, k_buf))
      np.testing.assert_array_equal(v_got, jnp.where(written, v_all, v_buf))
    with self.assertRaisesRegex(ValueError, "period"):
      cpu_kernels.panel_matmul(x[:, :32], cpu_kernels.pack(_rand(14, (32, 48))), live=1,
                               period=3)

  def test_bf16_panels_where_every_weight_is_a_bfloat16_value(self):
    # `host_layout` (a call's layout) packs bfloat16 panels only for weights that hold
    # bfloat16 values; over them a Llama-shaped (fused) cached pass, and greedy decoding
    # with a draft model and with an EAGLE head, give the float32 panels' bits.
    from specjax.models import heads as heads_lib
    rounded = lambda m: m.with_params(jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16).astype(x.dtype), m.params))
    target = rounded(tiny_model(**CONFIGS["llama_gqa"], seed=3))
    kinds = lambda p: {str(x.dtype) for path, x in jax.tree_util.tree_leaves_with_path(p)
                       if x.ndim == 3}
    self.assertEqual(kinds(model_lib.host_layout(target.params)), {"bfloat16"})
    self.assertEqual(kinds(model_lib.host_layout(tiny_model(**CONFIGS["llama_gqa"]).params)),
                     {"float32"})  # random float32 weights: float32 panels
    f32 = backends.CpuBackend(backends.Options(bf16_panels=False))
    self.assertEqual(kinds(model_lib.host_layout(target.params, f32)), {"float32"})
    # Inside a caller's jit: float32 panels for traced weights, whose values are unknown;
    # weights it closes over are checked on the host.
    self.assertEqual(kinds(jax.eval_shape(model_lib.host_layout, target.params)), {"float32"})
    self.assertEqual(kinds(jax.eval_shape(lambda: model_lib.host_layout(target.params))),
                     {"bfloat16"})
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 16)
    kv = kv_cache.init_kv(target.config, 2, 32)
    fn = jax.jit(model_lib.forward_cached, static_argnums=0)
    outs = [fn(target.graphdef, laid, tokens, kv)[0]
            for laid in (model_lib.host_layout(target.params),
                         CPU.layout(target.params))]
    np.testing.assert_array_equal(*outs)
    draft = rounded(tiny_model(**CONFIGS["llama_gqa"], seed=4))
    hc = heads_lib.HeadConfig("eagle", target.config)
    own = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype),
                                 heads_lib.init_params(hc, 1))
    head = heads_lib.Head(hc, own, heads_lib.target_fingerprint(target.config,
                                                                target.params))
    runs = {}
    for bf16 in (True, False):
      decode_lib._LAYOUTS.clear()
      runs[bf16] = []
      for kw in (dict(drafter="model", draft=draft), dict(drafter="eagle", draft=head)):
        p = with_options(prepare(target, [[1, 2, 3], [4, 5]], max_new_tokens=8, gamma=3,
                                 eos_id=None, **kw), bf16_panels=bf16)
        runs[bf16].append(p.run(jax.random.PRNGKey(0)).tokens.tolist())
        self.assertEqual(kinds(list(decode_lib._LAYOUTS.values())[-1][1]),
                         {"bfloat16" if bf16 else "float32"})
    decode_lib._LAYOUTS.clear()
    self.assertEqual(runs[True], runs[False])

  def test_a_call_reuses_the_last_layout(self):
    # `Prepared.run` lays the weights out once and keeps them for the next call with the
    # same arrays; the tokens are those of laying out inside the call.
    target = tiny_model(**CONFIGS["gpt2"], seed=3)
    draft = tiny_model(**CONFIGS["gpt2"], seed=4)
    decode_lib._LAYOUTS.clear()
    kw = dict(max_new_tokens=6, drafter="model", draft=draft, gamma=2)
    first = specjax.generate(target, [[1, 2, 3]], **kw).tokens
    self.assertLen(decode_lib._LAYOUTS, 2)
    laid = [v[1] for v in decode_lib._LAYOUTS.values()]
    self.assertEqual(laid[0]["embed"]["embedding"].ndim, 3)
    self.assertEqual(specjax.generate(target, [[1, 2, 3]], **kw).tokens, first)
    self.assertTrue(all(a is b[1] for a, b in zip(laid, decode_lib._LAYOUTS.values())))
    # A third set is kept as well (a target and two drafts compared call after call); a
    # fourth takes the place of the least recently used (the target: a call lays out its
    # target first).
    others = [tiny_model(**CONFIGS["gpt2"], seed=seed) for seed in (5, 6)]
    specjax.generate(others[0], [[1, 2, 3]], max_new_tokens=6)
    kept = [v[1] for v in decode_lib._LAYOUTS.values()]
    self.assertLen(kept, 3)
    self.assertIs(kept[0], laid[0])
    specjax.generate(others[1], [[1, 2, 3]], max_new_tokens=6)
    kept = [v[1] for v in decode_lib._LAYOUTS.values()]
    self.assertLen(kept, 3)
    self.assertIs(kept[0], laid[1])
    self.assertFalse(any(v is laid[0] for v in kept))
    # Greedy with the weights laid out in the call is greedy with them laid out before.
    with mock.patch.object(decode_lib, "_LAYOUTS_KEPT", 0):
      self.assertEqual(specjax.generate(target, [[1, 2, 3]], **kw).tokens, first)

  def test_a_head_reads_the_targets_laid_out_arrays(self):
    # A draft head's params hold the target's own embedding, final norm and LM head
    # (`Head.draft_params`): laid out, they are the target's laid-out arrays, not
    # copies; an equal array that is not the target's own is laid out on its own.
    from types import SimpleNamespace
    from specjax.models import heads as heads_lib
    engine = SimpleNamespace(mesh=None, backend=backends.select())
    for name, head_key in (("gpt2", "embed"), ("llama_gqa", "lm_head")):  # tied, untied
      target = tiny_model(**CONFIGS[name], seed=3)
      hc = heads_lib.HeadConfig("eagle", target.config)
      shared = {**heads_lib.init_params(hc, 1), **heads_lib.shared_params(target.params)}
      copied = {**shared, head_key: jax.tree_util.tree_map(jnp.copy, shared[head_key])}
      for draft, same in ((shared, True), (copied, False)):
        decode_lib._LAYOUTS.clear()
        laid = decode_lib.laid_out(engine, decode_lib.Weights(target=target.params,
                                                              draft=draft))
        panels = jax.tree_util.tree_leaves(laid.draft[head_key])[0]
        theirs = jax.tree_util.tree_leaves(laid.target[head_key])[0]
        self.assertEqual(panels.ndim, 3, name)  # the LM head's panels
        self.assertEqual(panels is theirs, same, name)
        np.testing.assert_array_equal(panels, theirs)
        self.assertIs(laid.draft["final_norm"]["scale"], laid.target["final_norm"]["scale"])
        self.assertEqual(laid.draft["fuse"]["kernel"].ndim, 3)  # the head's own: laid out
        again = decode_lib.laid_out(engine, decode_lib.Weights(target=target.params,
                                                               draft=draft))
        self.assertIs(again.draft, laid.draft)  # kept for the next call
    decode_lib._LAYOUTS.clear()


class BackendTest(parameterized.TestCase):

  @parameterized.parameters(([0.0],), ([0.0, 1.0],))
  def test_the_options_are_the_engines_and_part_of_the_programs_key(self, temperature):
    # An engine with the kernels off compiles a program of its own, without them (no
    # cache to clear: the options are a static field of the jit's key), and the same
    # tokens. Mixed temperatures keep the rule's conditional (`sampling.Paths`), whose
    # branches jax caches by function: they must not carry the kernels' trace along.
    target = tiny_model(**CONFIGS["llama_gqa"], seed=3)
    prepared = prepare(target, [[1, 2, 3]] * len(temperature), max_new_tokens=4,
                       temperature=temperature, eos_id=None)
    off = with_options(prepared, kernels=False)
    hlo = {name: decode_lib.decode.lower(
               p.engine, p.prompt_width, p.cache_size, p.laid_out, p.tokens, p.prompt_len,
               p.sampling, jax.random.PRNGKey(0)).as_text()
           for name, p in (("on", prepared), ("off", off))}
    self.assertIn("specjax_rope_attention", hlo["on"])
    self.assertEqual(re.findall(r"specjax_\w+", hlo["off"]), [])
    self.assertEqual(off.laid_out.target["embed"]["embedding"].ndim, 2)  # not laid out
    key = jax.random.PRNGKey(0)
    np.testing.assert_array_equal(prepared.run(key).tokens, off.run(key).tokens)
    decode_lib._LAYOUTS.clear()

  def test_default_options_are_fixed_once_used(self):
    backends.select()  # used
    with self.assertRaisesRegex(RuntimeError, "already in use"):
      backends.set_default_options(backends.Options(kernels=False))
    backends.set_default_options(backends.default_options())  # the same: no change
    with self.assertRaises(TypeError):
      backends.set_default_options({"kernels": False})

  def test_off_a_cpu_the_xla_backend_runs_the_models_own_ops(self):
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
      self.assertIs(type(backends.select()), backends.Backend)
      self.assertTrue(backends.select(whole_rows=True).whole_rows)
    self.assertIs(type(backends.select()), backends.CpuBackend)  # here, a CPU
    xla = backends.Backend()
    x = _rand(20, (3, 32))
    self.assertIs(xla.layout(x), x)
    np.testing.assert_array_equal(xla.dense(x, None, None, lambda y: 2 * y), 2 * x)
    np.testing.assert_array_equal(xla.argmax(x), jnp.argmax(x, -1))
    self.assertFalse(xla.kernels or xla.narrow_pass)
    self.assertFalse(xla.fuses_attention(None, None, None, None, 1))
    # On a mesh the CPU backend keeps the rows together and lays nothing out.
    mesh = backends.CpuBackend(whole_rows=True)
    self.assertFalse(mesh.kernels or mesh.rows_apart(4))
    self.assertTrue(backends.CpuBackend().rows_apart(4))

  def test_the_backends_import_nothing_above_them(self):
    # Imports point down: the backends may import the models' config, nothing else of
    # specjax outside their own package (no engine, no model).
    import ast
    import pathlib
    root = pathlib.Path(backends.__file__).parent
    for path in root.rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
          if name.startswith("specjax"):
            self.assertTrue(name.startswith("specjax.backends")
                            or name == "specjax.models.config", (path, name))


if __name__ == "__main__":
  absltest.main()
