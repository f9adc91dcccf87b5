r"""Sharding, memory and precision, measured (informational; docs/BENCHMARKS.md).

  python -m experiments.bench_sharding --out=sharding.json

Three parts:
  1. tokens/s of speculative decoding with the shipped pair at batch 8 on meshes
     (dp, tp) of 8 virtual CPU devices against the same call on one device, timed
     alternately (A B A B, median ratio with min–max), the draft replicated and split;
  2. per-device parameter and KV-cache bytes of a Llama-3-8B-shaped config on a (1, 8)
     mesh, from the shardings of `jax.eval_shape` structures (nothing is allocated),
     against a 16 GiB TPU v5e chip;
  3. total-variation distance between the next-token distributions of the shipped
     target in float32, bfloat16 and int8, teacher-forced over held-out prompts.

The 8 devices are host-platform devices forced by XLA_FLAGS (set here when absent): they
share this machine's cores, so a mesh cannot be faster than one device for real here;
part 1 measures what sharding costs in collectives and partitioned programs.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import specjax  # noqa: E402
from experiments import common  # noqa: E402
from specjax import backends  # noqa: E402
from specjax import costs  # noqa: E402
from specjax.models import kv_cache  # noqa: E402
from specjax.models import model as model_lib  # noqa: E402
from specjax.models import quantization  # noqa: E402
from specjax.models import sharding  # noqa: E402

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model.")
_MESHES = flags.DEFINE_list("meshes", ["1x8", "2x4", "8x1"], "Meshes dp x tp.")
_DRAFT_PLACEMENTS = flags.DEFINE_list("draft_placements", ["replicate", "shard"],
                                      "How the draft is placed on a mesh.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Held-out prompts (speed).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")
_PAIRS = flags.DEFINE_integer("pairs", 3, "Mesh/one-device timing pairs (median kept).")
_TV_PROMPTS = flags.DEFINE_integer("tv_prompts", 32, "Held-out prompts for the TV distance.")
_TV_TOKENS = flags.DEFINE_integer("tv_tokens", 128, "Tokens per TV prompt (every position).")
_KV_BATCH = flags.DEFINE_integer("kv_batch", 8, "Rows of the 8B KV cache.")
_KV_TOKENS = flags.DEFINE_integer("kv_tokens", 8192, "Slots per row of the 8B KV cache.")
_ROWWISE = flags.DEFINE_integer("rowwise_max_rows", -1, "Set backends.Options.rowwise_max_rows "
                                "(0: off; -1: leave the default).")
_SKIP = flags.DEFINE_list("skip", [], "Parts to skip: memory, tv, speed.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

V5E_HBM = 16 * 2 ** 30  # bytes of HBM on one TPU v5e chip
LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 d_ff=14336, max_len=8192, norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})


def mesh_of(text: str):
  dp, tp = (int(x) for x in text.split("x"))
  return jax.make_mesh((dp, tp), ("data", "model"))


# ----------------------------------------------------------------------------
# 1. Speed.


def speed(target, draft, prompts):
  kw = dict(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, seed=0,
            gamma=_GAMMA.value, eos_id=None)
  batch = prompts[:_BATCH.value]
  out = {}

  def one_device():
    out["one"] = specjax.generate(target, batch, draft=draft, **kw)

  rows = []
  for text in _MESHES.value:
    mesh = mesh_of(text)
    placed = specjax.shard(target, mesh)
    for placement in _DRAFT_PLACEMENTS.value:
      if placement == "shard" and mesh.shape["model"] == 1:
        continue  # the same program as replicated
      prepared = specjax.generation.prepare(
          placed, batch, draft=draft, top_k=0, top_p=1.0, eos_id=None,
          **{k: v for k, v in kw.items() if k != "seed"})
      run = sharding.distribute(prepared, mesh, shard_draft=placement == "shard")
      key = jax.random.PRNGKey(0)

      def on_mesh():
        out["mesh"] = run.run(key)

      timing = costs.paired(on_mesh, one_device, pairs=_PAIRS.value)
      state = out["mesh"]
      tokens = [state.tokens[i, state.prompt_len[i]:state.n[i]].tolist()
                for i in range(len(batch))]
      committed = int(np.sum(state.n - state.prompt_len))
      one_s, mesh_s = np.median(timing["baseline_s"]), np.median(timing["method_s"])
      row = {"mesh": text, "draft": placement,
             "mesh_tokens_per_s": committed / mesh_s,
             "one_device_tokens_per_s": committed / one_s,
             "speed_ratio": timing["ratio"], "speed_ratio_min": timing["ratio_min"],
             "speed_ratio_max": timing["ratio_max"],
             "same_tokens": tokens == out["one"].tokens,
             "plan": {k: v for k, v in vars(sharding.plan(target.config,
                                                          mesh.shape["model"])).items()}}
      print(row, flush=True)
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------
# 2. Memory of an 8B target, from shardings alone.


def _bytes_per_device(tree, shardings) -> int:
  leaves = jax.tree_util.tree_leaves(tree)
  specs = jax.tree_util.tree_leaves(shardings)
  return sum(int(np.prod(s.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
             for x, s in zip(leaves, specs))


def memory(mesh_text: str, dtype, quantized: bool):
  mesh = sharding.check_mesh(mesh_of(mesh_text))
  tp = mesh.shape["model"]
  cfg = sharding.layout_config(specjax.ModelConfig.llama(**LLAMA3_8B), tp)

  def build():  # traced by eval_shape: nothing is allocated
    params = model_lib.cast(jax.tree_util.tree_map(
        lambda x: jnp.zeros(x.shape, x.dtype), model_lib.abstract_params(cfg)), dtype)
    return quantization._quantize_tree(params) if quantized else params

  params = jax.eval_shape(build)
  specs = sharding.param_specs(cfg, params, tp)
  param_shardings = jax.tree_util.tree_map(
      lambda s: jax.sharding.NamedSharding(mesh, s), specs,
      is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
  kv = jax.eval_shape(lambda: kv_cache.init_kv(cfg, _KV_BATCH.value, _KV_TOKENS.value, dtype))
  kv_sharding = jax.sharding.NamedSharding(mesh, sharding.kv_spec(cfg, tp))
  kv_shardings = kv.replace(k=tuple(kv_sharding for _ in kv.k),
                            v=tuple(kv_sharding for _ in kv.v),
                            length=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                                "data")))
  param_bytes = _bytes_per_device(params, param_shardings)
  kv_bytes = _bytes_per_device(kv, kv_shardings)
  return {"mesh": mesh_text, "weights": "int8" if quantized else jnp.dtype(dtype).name,
          "num_params": model_lib.count_params(model_lib.abstract_params(cfg)),
          "param_gib_per_device": param_bytes / 2 ** 30,
          "kv_gib_per_device": kv_bytes / 2 ** 30,
          "kv_rows": _KV_BATCH.value, "kv_slots": _KV_TOKENS.value,
          "total_gib_per_device": (param_bytes + kv_bytes) / 2 ** 30,
          "fits_v5e_16gib": param_bytes + kv_bytes < V5E_HBM}


# ----------------------------------------------------------------------------
# 3. TV distance between precisions.


def tv_distances(target, prompts):
  variants = {"bfloat16": target.with_params(model_lib.cast(target.params, jnp.bfloat16)),
              "int8": specjax.quantize(target),
              "int8_bfloat16": specjax.quantize(
                  target.with_params(model_lib.cast(target.params, jnp.bfloat16)))}
  tokens = jnp.asarray(prompts, jnp.int32)
  ref = []
  for i in range(0, len(prompts), 8):
    ref.append(jax.nn.softmax(target.logits(tokens[i:i + 8]), axis=-1))
  ref = jnp.concatenate(ref)
  out = {}
  for name, model in variants.items():
    probs = jnp.concatenate([jax.nn.softmax(model.logits(tokens[i:i + 8]), axis=-1)
                             for i in range(0, len(prompts), 8)])
    tv = 0.5 * jnp.sum(jnp.abs(probs - ref), axis=-1)  # [prompts, positions]
    out[name] = {"tv_mean": float(jnp.mean(tv)), "tv_median": float(jnp.median(tv)),
                 "tv_p99": float(jnp.quantile(tv, 0.99)), "tv_max": float(jnp.max(tv)),
                 "argmax_agreement": float(jnp.mean(jnp.argmax(probs, -1)
                                                    == jnp.argmax(ref, -1))),
                 "weight_mib": quantization.weight_bytes(model.params) / 2 ** 20,
                 "positions": int(tv.size)}
    print(name, out[name], flush=True)
  out["float32"] = {"weight_mib": quantization.weight_bytes(target.params) / 2 ** 20}
  return out


def main(argv):
  del argv
  if _ROWWISE.value >= 0:
    backends.set_default_options(backends.Options(rowwise_max_rows=_ROWWISE.value))
  target, draft = common.load_pair(_TARGET.value, _DRAFT.value)
  report = {"machine": costs.machine_info(), "target": _TARGET.value, "draft": _DRAFT.value,
            "batch": _BATCH.value, "gamma": _GAMMA.value, "temperature": _TEMPERATURE.value,
            "max_new_tokens": _MAX_NEW.value,
            "cpu_rowwise_max_rows": backends.default_options().rowwise_max_rows}
  if "memory" not in _SKIP.value:
    report["memory"] = [memory(m, jnp.bfloat16, q) for m in ("1x1", "1x8")
                        for q in (False, True)]
    for row in report["memory"]:
      print(row, flush=True)
  if "tv" not in _SKIP.value:
    tv_prompts = common.heldout_prompts(target.tokenizer, "stdlib", _TV_PROMPTS.value,
                                        _TV_TOKENS.value, seed=1)
    report["tv"] = tv_distances(target, tv_prompts)
  if "speed" not in _SKIP.value:
    prompts = common.heldout_prompts(target.tokenizer, "stdlib", _NUM_PROMPTS.value,
                                     _PROMPT_TOKENS.value)
    report["speed"] = speed(target, draft, prompts)
  if _OUT.value:
    Path(_OUT.value).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
