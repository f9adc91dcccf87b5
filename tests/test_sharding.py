"""Sharding over a device mesh, bfloat16 and int8 models.

The main test process has one CPU device, so the multi-device checks run in
subprocesses: one with 8 virtual devices (XLA_FLAGS=--xla_force_host_platform_device_count
=8) doing every mesh check in one go, and a pair of processes with 4 devices each joined
by `jax.distributed.initialize` into one 8-device mesh. They start when the module is
set up and run while this process does the one-device tests; `MeshTest` (last) reads
what they printed.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax.generation import prepare
from specjax.models import checkpoint
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.models import quantization
from specjax.models import sharding
from conftest import exact_continuations, greedy_oracle, tiny_model, within_law

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 0, 1, 2, 3, 4], [7]]  # 3 rows: padded on dp = 2 and 8
STEPS = 10
# (target, mesh, drafter) — each flavour on each mesh, each drafter with each flavour.
RUNS = [("gpt2", (1, 8), "model"), ("gpt2", (2, 4), "ngram"), ("gpt2", (8, 1), "model"),
        ("llama", (1, 8), "ngram"), ("llama", (2, 4), "model"), ("llama", (8, 1), "ngram")]


def _loud(model, factor):
  """Every kernel scaled up: the layers, not the tied embedding, decide the next token."""
  return model.with_params(jax.tree_util.tree_map_with_path(
      lambda path, x: x * factor if getattr(path[-1], "key", None) == "kernel" else x,
      model.params))


def models():
  """Tiny targets whose heads split 8 ways, with varied greedy continuations.

  GPT-2 flavour with an untied LM head; Llama flavour with 2 KV heads (repeated to
  split) and a tied one (the embedding split by token serves both ends).
  """
  gpt2 = tiny_model(vocab=16, d_model=32, n_layers=1, n_heads=8, seed=3, tie_embeddings=False)
  llama = _loud(tiny_model(vocab=16, d_model=32, n_layers=1, n_heads=8, n_kv_heads=2,
                           llama=True, tie_embeddings=True, seed=5), 10.0)
  return ({"gpt2": gpt2, "llama": llama, "gpt2_int8": specjax.quantize(gpt2)},
          tiny_model(vocab=16, d_model=16, n_layers=1, n_heads=2, seed=4))


def _leaf_shapes(model):
  """{path: (global shape, first device's shard shape)} of every parameter."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(model.params)[0]:
    key = "/".join(str(getattr(k, "key", k)) for k in path)
    out[key] = (list(x.shape), list(x.addressable_shards[0].data.shape))
  return out


def _tick(what):
  """Process time so far, to stderr (merged into the worker's output on failure)."""
  print(f"[{time.process_time():6.1f}s cpu] {what}", file=sys.stderr, flush=True)


def worker_mesh():
  """Every 8-device check; prints one JSON line of results."""
  from specjax import decode as decode_lib
  targets, draft = models()
  res = {"devices": jax.device_count()}
  for name in ("gpt2", "llama"):
    res[f"oracle/{name}"] = [greedy_oracle(targets[name], p, STEPS) for p in PROMPTS]
  _tick("oracles")
  res["params/gpt2_int8/4"] = _leaf_shapes(specjax.shard(
      targets["gpt2_int8"], jax.make_mesh((2, 4), ("data", "model"))))
  # A checkpoint loads straight into its shards.
  with tempfile.TemporaryDirectory() as tmp:
    llama = targets["llama"]
    checkpoint.save_model(tmp, llama.config, llama.params)
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    loaded = specjax.load_pretrained(tmp, mesh=mesh)
    res["load/sharded"] = sharding.is_sharded(loaded, mesh)
    res["load/same"] = all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), loaded.params,
        specjax.shard(llama, mesh).params)))
  for name, shape, drafter in RUNS:
    mesh = jax.make_mesh(shape, ("data", "model"))
    target = specjax.shard(targets[name], mesh)
    kw = dict(draft=draft) if drafter == "model" else dict(drafter="ngram")
    # (1, 8): generate shards the target itself (same program as a pre-sharded one).
    out = specjax.generate(targets[name] if shape == (1, 8) else target, PROMPTS,
                           max_new_tokens=STEPS, gamma=3, mesh=mesh, **kw)
    res[f"greedy/{name}/{shape[0]}x{shape[1]}/{drafter}"] = out.tokens
    res[f"rows/{name}/{shape[0]}x{shape[1]}/{drafter}"] = out.stats["rows"]
    _tick(f"{name} {shape} {drafter}")
    if shape == (1, 8):
      res[f"params/{name}/{shape[1]}"] = _leaf_shapes(target)
    if (name, shape) == ("llama", (2, 4)):
      res["config/llama/4"] = [target.config.n_kv_heads, target.config.qkv_groups,
                               target.config.mlp_groups]
      # Same seed, T = 1: the tokens of one device (same compiled program as above).
      res["t1/mesh"] = specjax.generate(target, PROMPTS, max_new_tokens=STEPS, gamma=3,
                                        mesh=mesh, temperature=1.0, seed=7, **kw).tokens
      one = specjax.generate(targets[name], PROMPTS, max_new_tokens=STEPS, gamma=3,
                             temperature=1.0, seed=7, logprobs=True, top_logprobs=2,
                             prompt_logprobs=True, **kw)
      res["t1/one"], res["t1/one_logprobs"] = one.tokens, one.logprobs
      res["t1/one_top"] = one.top_logprobs
      res["t1/one_prompt"] = [one.prompt_logprobs, one.prompt_top_logprobs]
      # Streamed on the mesh, in chunks of 2 rounds: the same tokens (and logprobs) again.
      stream = specjax.stream(target, PROMPTS, max_new_tokens=STEPS, gamma=3, mesh=mesh,
                              temperature=1.0, seed=7, rounds_per_chunk=2, logprobs=True,
                              top_logprobs=2, prompt_logprobs=True, **kw)
      chunks = list(stream)
      res["t1/stream_logprobs"] = [sum((c.logprobs[i] for c in chunks), [])
                                   for i in range(len(PROMPTS))]
      res["t1/stream_top"] = [sum((c.top_logprobs[i] for c in chunks), [])
                              for i in range(len(PROMPTS))]
      res["t1/stream_first_prompt"] = [chunks[0].prompt_logprobs,
                                       chunks[0].prompt_top_logprobs]
      chunks = [c.tokens for c in chunks]
      res["t1/stream"] = [sum((c[i] for c in chunks), []) for i in range(len(PROMPTS))]
      res["t1/stream_result"] = stream.result.tokens
      res["t1/stream_result_logprobs"] = stream.result.logprobs
      res["t1/stream_prompt"] = [stream.result.prompt_logprobs,
                                 stream.result.prompt_top_logprobs]
      res["t1/reasons"] = [stream.result.finish_reasons, one.finish_reasons,
                           stream.result.stop_reasons, one.stop_reasons]
      res["t1/stream_chunks"] = len(chunks)
      # n=2 samples a prompt: on the mesh every row is prefilled, on one device each
      # prompt once; the same tokens (6 rows, padded to 8 on dp = 2).
      res["n2/mesh"], res["n2/one"] = (specjax.generate(
          t, PROMPTS, max_new_tokens=STEPS, gamma=3, temperature=1.0, seed=7, n=2,
          repetition_penalty=[1.0, 1.2, 1.4], **kw, **m).tokens
          for t, m in ((target, dict(mesh=mesh)), (targets[name], {})))
      # The raw final state (same engine and shapes: no new compile).
      args = prepare(target, PROMPTS, max_new_tokens=STEPS, temperature=0.0, top_k=0,
                     top_p=1.0, eos_id=None, draft=draft, gamma=3, mesh=mesh)
      key = sharding.put(jax.random.PRNGKey(0), jax.sharding.NamedSharding(
          args.engine.mesh, jax.sharding.PartitionSpec()))
      state = decode_lib.decode(args.engine, args.prompt_width, args.cache_size, args.weights,
                                args.tokens, args.prompt_len, args.sampling, key,
                                decode_lib.NO_ROUND_LIMIT)  # as `generate` calls it
      for side, kv in (("target", state.target_kv), ("draft", state.draft_state)):
        res[f"kv/{side}"] = {"shape": list(kv.k[0].shape),
                             "shard": list(kv.k[0].addressable_shards[0].data.shape),
                             "spec": [str(a) for a in kv.k[0].sharding.spec]}
      res["tokens_spec"] = [str(a) for a in state.tokens.sharding.spec]
      # A token tree with processors and top-k / top-p: the same tokens too.
      extra = dict(max_new_tokens=STEPS, draft=draft, tree=(2, 2, 1), temperature=0.8,
                   top_k=5, top_p=0.9, repetition_penalty=1.3, no_repeat_ngram_size=2, seed=2)
      res["tree/mesh"] = specjax.generate(target, PROMPTS, mesh=mesh, **extra).tokens
      res["tree/one"] = specjax.generate(targets[name], PROMPTS, **extra).tokens
      _tick("t1, state, tree")
  print("RESULT " + json.dumps(res), flush=True)


def worker_process(pid: int, port: int):
  """One of two processes with 4 devices each: one 8-device mesh, greedy generation."""
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=pid)
  targets, draft = models()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  target = specjax.shard(targets["llama"], mesh)
  out = specjax.generate(target, PROMPTS, max_new_tokens=STEPS, gamma=3, draft=draft, mesh=mesh)
  print("RESULT " + json.dumps({"process": pid, "processes": jax.process_count(),
                                "devices": jax.device_count(),
                                "local_devices": jax.local_device_count(),
                                "tokens": out.tokens}), flush=True)


def _env(devices: int):
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={devices}").strip()
  env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _result(proc, timeout=900):
  out, _ = proc.communicate(timeout=timeout)
  lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise AssertionError(f"worker failed (exit {proc.returncode}):\n{out[-4000:]}")
  return json.loads(lines[-1][len("RESULT "):])


_WORKERS, _RESULTS = {}, {}


def setUpModule():
  """Starts the workers, which run while this process does the one-device tests."""
  spawn = lambda args, devices: subprocess.Popen(
      [sys.executable, os.path.abspath(__file__)] + args, env=_env(devices),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  port = _free_port()
  _WORKERS.update(mesh=spawn(["mesh"], 8), p0=spawn(["process", "0", str(port)], 4),
                  p1=spawn(["process", "1", str(port)], 4))


def tearDownModule():
  for proc in _WORKERS.values():
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


def result(name):
  if name not in _RESULTS:
    try:
      _RESULTS[name] = _result(_WORKERS[name])
    except Exception as e:  # noqa: BLE001 — every test of this worker reports its failure
      _RESULTS[name] = e
  if isinstance(_RESULTS[name], Exception):
    raise _RESULTS[name]
  return _RESULTS[name]


class LayoutTest(parameterized.TestCase):
  """The grouped layout and repeated KV heads compute the same function (one device)."""

  @parameterized.named_parameters(
      ("gpt2_tp4", dict(vocab=16, d_model=32, n_heads=8), 4),
      ("llama_gqa_tp8", dict(vocab=16, d_model=32, n_heads=8, n_kv_heads=2, llama=True), 8),
      ("llama_kv3_tp2", dict(vocab=16, d_model=48, n_heads=6, n_kv_heads=3, llama=True), 2))
  def test_regrouped_weights_give_the_same_logits(self, kw, tp):
    model = tiny_model(n_layers=1, **kw)
    cfg = sharding.layout_config(model.config, tp)
    self.assertEqual(cfg.qkv_groups, tp)
    self.assertEqual(cfg.n_kv_heads % tp, 0)
    grouped = specjax.Model(cfg, sharding.regroup(model.params, model.config, cfg))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, 16)
    chex.assert_trees_all_close(grouped.logits(tokens), model.logits(tokens), atol=1e-5,
                                rtol=1e-5)
    back = sharding.unshard(grouped)
    self.assertEqual((back.config.qkv_groups, back.config.mlp_groups), (1, 1))
    if back.config == model.config:  # no KV heads were repeated: the very same weights
      chex.assert_trees_all_equal(back.params, model.params)

  def test_parts_that_do_not_divide_are_replicated(self):
    cfg = specjax.ModelConfig.llama(vocab_size=50, d_model=32, n_layers=1, n_heads=4,
                                    n_kv_heads=2, d_ff=96, max_len=16)
    p = sharding.plan(cfg, 8)
    self.assertEqual((p.attention, p.mlp, p.vocab, p.kv_heads), (False, True, False, 2))
    laid = sharding.layout_config(cfg, 8)
    self.assertEqual((laid.qkv_groups, laid.mlp_groups, laid.n_kv_heads), (1, 8, 2))
    params = model_lib.abstract_params(laid)
    specs = sharding.param_specs(laid, params, 8)
    self.assertEqual(specs["blocks"][0]["attn"]["qkv"]["kernel"], jax.sharding.PartitionSpec())
    self.assertEqual(specs["embed"]["embedding"], jax.sharding.PartitionSpec())
    self.assertEqual(specs["blocks"][0]["mlp"]["up"]["kernel"],
                     jax.sharding.PartitionSpec(None, "model"))
    self.assertEqual(sharding.kv_spec(laid, 8), jax.sharding.PartitionSpec("data", None))

  def test_llama3_8b_fits_a_v5e_chip_on_a_1x8_mesh(self):
    cfg = specjax.ModelConfig.llama(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                                    n_kv_heads=8, d_ff=14336, max_len=8192)
    laid = sharding.layout_config(cfg, 8)
    params = jax.eval_shape(lambda: jax.tree_util.tree_map(
        lambda x: jnp.zeros(x.shape, jnp.bfloat16), model_lib.abstract_params(laid)))
    specs = sharding.param_specs(laid, params, 8)
    per_device = sum(
        int(np.prod(x.shape)) * 2 // (8 if any(a == "model" for a in s) else 1)
        for x, s in zip(jax.tree_util.tree_leaves(params),
                        jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(
                            s, jax.sharding.PartitionSpec))))
    self.assertLess(per_device, 2.1e9)  # ~16 GB / 8 plus the replicated norms
    self.assertGreater(per_device, 1.9e9)


class PrecisionTest(parameterized.TestCase):

  def test_bfloat16_forward_and_cache(self):
    cfg = specjax.ModelConfig.llama(vocab_size=16, d_model=32, n_layers=2, n_heads=4,
                                    n_kv_heads=2, max_len=64)
    model = specjax.init_model(cfg, seed=1, dtype=jnp.bfloat16)
    self.assertEqual({x.dtype for x in jax.tree_util.tree_leaves(model.params)},
                     {jnp.dtype(jnp.bfloat16)})
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 16)
    full, features = model_lib.forward_jit(model.graphdef, model.params, tokens, hidden=True)
    self.assertEqual(full.dtype, jnp.float32)  # logits (and sampling) in float32
    self.assertEqual(features.dtype, jnp.bfloat16)  # the residual stream is bfloat16
    kv = kv_cache.init_kv(cfg, 2, 32, jnp.bfloat16)
    fn = jax.jit(model_lib.forward_cached, static_argnums=0)
    first, kv = fn(model.graphdef, model.params, tokens[:, :6], kv)
    rest, kv = fn(model.graphdef, model.params, tokens[:, 6:], kv)  # same shapes: one compile
    self.assertEqual(kv.k[0].dtype, jnp.bfloat16)
    chex.assert_trees_all_close(jnp.concatenate([first, rest], 1), full, atol=3e-2, rtol=3e-2)
    # The engine keeps both caches in bfloat16 too.
    draft = specjax.init_model(specjax.ModelConfig(vocab_size=16, d_model=16, n_layers=1,
                                                   n_heads=2, max_len=64), 2, jnp.bfloat16)
    args = prepare(model, [[1, 2, 3]], max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0,
                   eos_id=None, draft=draft, gamma=2)
    state = jax.eval_shape(args.prefill, jax.random.PRNGKey(0))  # traced, not run
    self.assertEqual(state.target_kv.k[0].dtype, jnp.bfloat16)
    self.assertEqual(state.draft_state.k[0].dtype, jnp.bfloat16)

  def test_loaders_take_a_dtype(self):
    model = tiny_model(vocab=16, n_layers=1, n_heads=4, n_kv_heads=2, llama=True)
    with tempfile.TemporaryDirectory() as tmp:
      checkpoint.save_model(os.path.join(tmp, "ours"), model.config, model.params)
      ours = specjax.load_pretrained(os.path.join(tmp, "ours"), dtype=jnp.bfloat16)
      from specjax import hf
      hf.export_hf(model, os.path.join(tmp, "hf"))
      theirs = hf.load_hf_model(os.path.join(tmp, "hf"), dtype=jnp.bfloat16)
    for loaded in (ours, theirs):
      self.assertEqual({x.dtype for x in jax.tree_util.tree_leaves(loaded.params)},
                       {jnp.dtype(jnp.bfloat16)})
    chex.assert_trees_all_equal(ours.params, theirs.params)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6]])
    chex.assert_trees_all_close(ours.logits(tokens), model.logits(tokens), atol=0.1, rtol=0.05)

  def test_int8_weights(self):
    model = tiny_model(vocab=16, n_layers=1, n_heads=4, n_kv_heads=2, llama=True)
    q = specjax.quantize(model, "int8")
    self.assertIsNot(q.params, model.params)
    kernel = q.params["blocks"][0]["attn"]["qkv"]["kernel"]
    self.assertEqual(kernel["int8"].dtype, jnp.int8)
    chex.assert_shape(kernel["scale"], (1, kernel["int8"].shape[1]))
    chex.assert_shape(q.params["embed"]["embedding"]["scale"], (16, 1))
    self.assertEqual(q.params["final_norm"]["scale"].dtype, jnp.float32)  # norms stay float
    # Each weight is off by at most half a step of its channel.
    w = model.params["blocks"][0]["attn"]["qkv"]["kernel"]
    err = jnp.abs(quantization.dequantize(kernel) - w)
    self.assertTrue(bool(jnp.all(err <= kernel["scale"] / 2 + 1e-7)))
    self.assertLess(quantization.weight_bytes(q.params),
                    quantization.weight_bytes(model.params) / 3)
    # Cached forward == full forward, on the quantised weights.
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 10), 0, 16)
    full = q.logits(tokens)
    kv = kv_cache.init_kv(q.config, 2, 16)
    fn = jax.jit(model_lib.forward_cached, static_argnums=0)
    a, kv = fn(q.graphdef, q.params, tokens[:, :5], kv)
    b, kv = fn(q.graphdef, q.params, tokens[:, 5:], kv)
    chex.assert_trees_all_close(jnp.concatenate([a, b], 1), full, atol=2e-5, rtol=2e-5)
    self.assertGreater(float(jnp.max(jnp.abs(full - model.logits(tokens)))), 0)  # it did change
    # Quantising again keeps every quantised weight, the embedding's too.
    chex.assert_trees_all_equal(specjax.quantize(q).params, q.params)

  def test_int8_speculative_greedy_equals_autoregressive(self):
    target = specjax.quantize(tiny_model(vocab=16, n_layers=2, seed=3))
    draft = tiny_model(vocab=16, d_model=16, n_layers=1, seed=4)
    spec = specjax.generate(target, PROMPTS, max_new_tokens=12, draft=draft, gamma=3)
    # The autoregressive greedy output: repeated argmax of the quantised full forward.
    self.assertEqual(spec.tokens, [greedy_oracle(target, p, 12) for p in PROMPTS])
    self.assertGreater(spec.stats["accepted"], 0)

  def test_int8_target_sequence_law(self):
    """Speculative sampling from the int8 target follows the int8 target's exact law."""
    target = specjax.quantize(tiny_model(vocab=8, n_layers=2, seed=0))
    draft = tiny_model(vocab=8, d_model=16, n_layers=1, seed=1)
    prompt, length, rows = [3, 1, 3], 2, 4000
    _, probs = exact_continuations(target, prompt, length)
    res = specjax.generate(target, [prompt] * rows, max_new_tokens=length, temperature=1.0,
                           seed=5, draft=draft, gamma=2)
    ok, worst = within_law(res.tokens, probs, sds=4.5)  # 64 cells: false alarms under 1e-3
    self.assertTrue(ok, f"worst z={worst}")
    self.assertLess(res.stats["acceptance_rate"], 0.95)  # the draft really disagreed


class BadInputTest(parameterized.TestCase):

  def test_bad_inputs(self):
    model = tiny_model(vocab=16)
    with self.assertRaisesRegex(ValueError, "quantize mode"):
      specjax.quantize(model, "int4")
    with self.assertRaisesRegex(ValueError, "Model"):
      specjax.quantize(model.params)
    with self.assertRaisesRegex(ValueError, "dtype"):
      specjax.init_model(model.config, dtype=jnp.int32)
    with self.assertRaisesRegex(ValueError, "jax.sharding.Mesh"):
      specjax.shard(model, (1, 1))
    wrong = jax.make_mesh((1, 1), ("x", "y"))
    with self.assertRaisesRegex(ValueError, "'data', 'model'"):
      specjax.shard(model, wrong)
    with self.assertRaisesRegex(ValueError, "'data', 'model'"):
      specjax.generate(model, [[1, 2]], max_new_tokens=2, mesh=wrong)
    with self.assertRaisesRegex(ValueError, "mesh must be"):
      specjax.generate(model, [[1, 2]], max_new_tokens=2, mesh="data")
    with self.assertRaisesRegex(ValueError, "qkv_groups"):
      specjax.ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, max_len=8,
                          qkv_groups=3)
    with self.assertRaisesRegex(ValueError, "mlp_groups"):
      specjax.ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, max_len=8,
                          mlp_groups=2)  # GELU has no fused gate|up
    with self.assertRaisesRegex(ValueError, "int8"):
      from specjax import hf
      hf.export_hf(specjax.quantize(model), tempfile.mkdtemp())


class MeshTest(parameterized.TestCase):

  @parameterized.parameters(*RUNS)
  def test_greedy_equals_one_device(self, name, shape, drafter):
    r = result("mesh")
    self.assertEqual(r["devices"], 8)
    key = f"{name}/{shape[0]}x{shape[1]}/{drafter}"
    self.assertEqual(r[f"greedy/{key}"], r[f"oracle/{name}"])
    self.assertEqual(r[f"rows/{key}"], len(PROMPTS))  # padding rows are not counted

  def test_same_seed_same_tokens_at_temperature_one(self):
    r = result("mesh")
    self.assertEqual(r["t1/mesh"], r["t1/one"])
    self.assertNotEqual(r["t1/mesh"], r["oracle/llama"])  # it really sampled
    self.assertEqual(r["t1/stream"], r["t1/one"])  # streamed on the mesh, in chunks
    self.assertEqual(r["t1/stream_result"], r["t1/one"])
    self.assertEqual(r["t1/stream_result_logprobs"], r["t1/stream_logprobs"])  # collect's
    for got, want in zip(r["t1/stream_logprobs"], r["t1/one_logprobs"]):
      self.assertEqual(len(got), len(want))
      np.testing.assert_allclose(got, want, atol=1e-4)
    self.assertEqual(r["t1/stream_first_prompt"], r["t1/stream_prompt"])  # first chunk's
    # The top 2 at each position, and the prompt's logprobs (None first), as one device's.
    [mesh_prompt, mesh_prompt_top], [one_prompt, one_prompt_top] = (r["t1/stream_prompt"],
                                                                    r["t1/one_prompt"])
    for got, want in [*zip(r["t1/stream_top"], r["t1/one_top"]),
                      *((g[1:], w[1:]) for g, w in zip(mesh_prompt_top, one_prompt_top))]:
      self.assertEqual(len(got), len(want))
      for g, w in zip(got, want):
        np.testing.assert_allclose([v for _, v in g], [v for _, v in w], atol=1e-4)
        if abs(w[0][1] - w[1][1]) > 1e-3:  # a near tie may order either way
          self.assertEqual([t for t, _ in g], [t for t, _ in w])
    for got, want in zip(mesh_prompt, one_prompt):
      self.assertEqual((got[0], want[0], len(got)), (None, None, len(want)))
      np.testing.assert_allclose(got[1:], want[1:], atol=1e-4)
    self.assertGreater(r["t1/stream_chunks"], 1)
    self.assertEqual(r["n2/mesh"], r["n2/one"])
    self.assertEqual(r["t1/reasons"], [["length"] * len(PROMPTS)] * 2  # no padding row
                     + [[None] * len(PROMPTS)] * 2)
    self.assertEqual(len(r["n2/one"]), 2 * len(PROMPTS))
    self.assertNotEqual(r["n2/one"][0], r["n2/one"][1])

  @parameterized.parameters(("gpt2", 8), ("llama", 8), ("gpt2_int8", 4))
  def test_large_parameters_are_split(self, name, tp):
    shapes = result("mesh")[f"params/{name}/{tp}"]
    split = {"embed/embedding": 0, "attn/qkv/kernel": 1, "attn/out/kernel": 0,
             "mlp/up/kernel": 1, "mlp/down/kernel": 0, "lm_head/kernel": 1, "attn/qkv/bias": 0,
             "mlp/up/bias": 0}
    seen = set()
    for path, (whole, shard) in shapes.items():
      base = "/".join(p for p in path.split("/") if p not in ("int8", "scale")
                      and not p.isdigit() and p != "blocks")
      axis = split.get(base)
      if axis is not None and whole[axis] > 1:
        want = list(whole)
        want[axis] //= tp
        self.assertEqual(shard, want, path)
        seen.add(base)
      else:
        self.assertEqual(shard, whole, path)  # norms, position embeddings, output biases
    self.assertGreaterEqual(len(seen), 5)

  def test_tree_processors_and_filters_same_tokens(self):
    r = result("mesh")
    self.assertEqual(r["tree/mesh"], r["tree/one"])

  def test_checkpoint_loads_into_its_shards(self):
    r = result("mesh")
    self.assertTrue(r["load/sharded"])
    self.assertTrue(r["load/same"])

  def test_kv_heads_are_repeated_to_split(self):
    # 2 KV heads on a model axis of 4: repeated twice, grouped 4 ways.
    self.assertEqual(result("mesh")["config/llama/4"], [4, 4, 4])

  def test_kv_buffers_split_over_data_and_model(self):
    r = result("mesh")
    target, draft = r["kv/target"], r["kv/draft"]
    b, h, s, d = target["shape"]
    self.assertEqual(b, 4)  # 3 prompts padded to a multiple of dp = 2
    self.assertEqual(target["shard"], [b // 2, h // 4, s, d])
    self.assertEqual(target["spec"][:2], ["data", "model"])
    # The draft is replicated over 'model': its cache is split by rows only.
    self.assertEqual(draft["shard"][0], draft["shape"][0] // 2)
    self.assertEqual(draft["shard"][1:], draft["shape"][1:])
    self.assertEqual(r["tokens_spec"][0], "data")

  def test_two_processes_give_the_tokens_of_one(self):
    for pid in (0, 1):
      r = result(f"p{pid}")
      self.assertEqual((r["processes"], r["devices"], r["local_devices"]), (2, 8, 4))
      self.assertEqual(r["tokens"], result("mesh")["oracle/llama"])


if __name__ == "__main__":
  if sys.argv[1] == "mesh":
    worker_mesh()
  elif sys.argv[1] == "process":
    worker_process(int(sys.argv[2]), int(sys.argv[3]))
