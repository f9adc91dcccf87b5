"""What the engine does beyond one CPU device: `bench --part=accel` and `--part=sharding`.

`--part=accel` (`run`): what an accelerator does with the engine, in one budgeted run.
Stages, each written to <out>/accel.json as soon as it ends (a run cut short keeps what
it finished), then <out>/summary.md:

1. machine: devices, versions, the memory bandwidth a device-wide copy reaches.
2. bandwidth: random-weight Llama-shaped bf16 targets (TinyLlama-1.1B and Llama-3.1-8B
   shapes) at batch 1: one cached 1-token step, the bytes it must read (weights, less the
   input embedding table, plus the KV cache), achieved GB/s against the datasheet peak and
   the measured copy; v(γ) with the achieved GFLOP/s of each pass.
3. shipped: the shipped pair (real acceptance) at T = 0: greedy speculative output against
   target-only greedy (equal, or how many rows differ), and the paired speedup over
   target-only for the model, n-gram and EAGLE drafters.
4. synthetic: the TinyLlama-1.1B / Llama-68M-shaped bf16 pair with the synthetic verify
   rule (acceptance α^(i+1) whatever the weights): paired speedup against α and γ, with the
   ledger's prediction from c and v(γ) measured on the device.
5. roofline (not in the default stages; `--stages=machine,roofline [--peer]`): on the
   same random-weight Llama shapes, batch 1 and 8, 512- and 4,096-token contexts (and
   TinyLlama at 512 in a 4,096-slot buffer, where the decode kernel skips slots), the
   per-step time of a minimal decode (a fori_loop over the model's cached 1-token step and
   argmax, with a static and with a traced trip count), of `generate`'s program
   target-only at T = 0 and T = 1 and, with `--peer`, of transformers' static-cache
   `generate` (compiled on CUDA); timed interleaved, per step = (long call - short call)
   / extra steps, medians and quartiles; GB/s of `step_bytes` against the datasheet peak
   and the measured copy, and each method's step over the minimal loop's.

`--part=sharding` (`mesh_speed`, `memory`, `tv_distances`): what sharding, memory and
precision cost: tokens/s on meshes (dp, tp) of 8 devices against one device, per-device
bytes of a Llama-3-8B shape on a (1, 8) mesh against a 16 GiB TPU v5e chip, and the TV
distance of bfloat16 and int8 from float32.
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from experiments import common
from experiments import synthetic
from specjax import backends
from specjax import checks
from specjax import costs
from specjax import prepare as prepare_lib
from specjax.processors import sampling as sampling_lib
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.models import quantization
from specjax.models import sharding
from specjax.models.pretrained import load_pretrained

STAGES = ("machine", "bandwidth", "synthetic", "shipped", "roofline")

# Datasheet HBM bandwidth (GB/s) by jax's device_kind; the measured copy is the other ceiling.
PEAK_GBPS = {"NVIDIA H200": 4800, "NVIDIA H100 80GB HBM3": 3350, "NVIDIA H100 PCIe": 2000,
             "NVIDIA A100-SXM4-80GB": 2039, "NVIDIA A100-SXM4-40GB": 1555,
             "NVIDIA L4": 300, "TPU v5 lite": 819, "TPU v6 lite": 1640, "TPU v4": 1200}

SHAPES = {
    "tinyllama-1.1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                           d_ff=5632, max_len=2048),
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      d_ff=14336, max_len=2048, rope_theta=500000.0),
    "llama-68m": dict(vocab_size=32000, d_model=768, n_layers=2, n_heads=12, d_ff=3072,
                      max_len=2048),
}
SMALL_SHAPES = {
    "tinyllama-1.1b": dict(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                           d_ff=704, max_len=512),
    "llama3-8b": dict(vocab_size=4096, d_model=384, n_layers=4, n_heads=6, n_kv_heads=2,
                      d_ff=1024, max_len=512),
    "llama-68m": dict(vocab_size=2048, d_model=64, n_layers=1, n_heads=2, d_ff=176, max_len=512),
}


def step_bytes(model, batch: int, context: int) -> int:
  """Bytes one cached 1-token step must read: every weight once (an untied input embedding
  only gathers rows), and the K and V cache up to `context`."""
  leaves = jax.tree_util.tree_leaves_with_path(model.params)
  total = sum(leaf.nbytes for _, leaf in leaves)
  if not model.config.tie_embeddings:
    total -= sum(leaf.nbytes for path, leaf in leaves if "embed" in jax.tree_util.keystr(path))
  cfg = model.config
  itemsize = jnp.dtype(model_lib.compute_dtype(model.params)).itemsize
  return total + 2 * cfg.n_layers * batch * cfg.n_kv_heads * context * cfg.head_dim * itemsize


def copy_gbps(nbytes: int = 1 << 32) -> float:
  """GB/s of a device-wide read-and-write (x + 1 over `nbytes` of bf16), best of 5."""
  x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: a + 1)
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * nbytes / best / 1e9


def stage_machine(small: bool) -> dict:
  out = costs.machine_info()
  out.update(flax=_version("flax"), peak_gbps=PEAK_GBPS.get(out["device_kind"]),
             copy_gbps=copy_gbps(1 << 26 if small else 1 << 32))
  return out


def stage_bandwidth(small: bool, peak, copy) -> dict:
  shapes = SMALL_SHAPES if small else SHAPES
  context, out = (96 if small else 512), {}
  for name, gammas in (("tinyllama-1.1b", (1, 2, 4, 8)), ("llama3-8b", (4,))):
    model = synthetic.random_model(shapes[name], "bfloat16", seed=0)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    v = costs.verify_costs(model, 1, gammas, context=context, cache_size=2 * context)
    nbytes = step_bytes(model, 1, context)
    gbps = nbytes / (v["step_ms"] / 1e3) / 1e9
    out[name] = {"params": n_params, "bytes_per_step": nbytes, "context": context,
                 "step_ms": v["step_ms"], "step_gbps": gbps,
                 "fraction_of_peak": gbps / peak if peak else None,
                 "fraction_of_copy": gbps / copy if copy else None,
                 "step_gflops": v["step_gflops"], "by_gamma": v["by_gamma"]}
    print(name, json.dumps(out[name]), flush=True)
    del model
  return {"targets": out}


def stage_shipped(small: bool) -> dict:
  target, draft = common.load_pair("stdlib-target", "stdlib-draft")
  eagle = load_pretrained("stdlib-eagle")
  n_prompts, new = (2, 16) if small else (8, 64)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", n_prompts, 64)
  kw = dict(max_new_tokens=new, temperature=0.0, seed=0, eos_id=None)
  points = [(1, "model", 4, dict(draft=draft)), (1, "ngram", 4, dict(drafter="ngram")),
            (1, "eagle", 4, dict(draft=eagle)), (8, "model", 4, dict(draft=draft))]
  rows = []
  for batch, name, gamma, extra in points:
    t = common.paired_generate(target, prompts, batch, 2 if small else 5,
                               method=dict(kw, gamma=gamma, **extra), baseline=kw)
    same = [a == b for a, b in zip(t["method"]["tokens"], t["baseline"]["tokens"])]
    rows.append({"batch": batch, "drafter": name, "gamma": gamma,
                 "speedup": t["speedup"], "speedup_min": t["speedup_min"],
                 "speedup_max": t["speedup_max"],
                 "tokens_per_s": t["method"]["tokens_per_s"],
                 "target_only_tokens_per_s": t["baseline"]["tokens_per_s"],
                 "tokens_per_target_call": t["method"]["stats"]["tokens_per_target_call"],
                 "greedy_rows_equal": sum(same), "rows": len(same)})
    print(json.dumps(rows[-1]), flush=True)
  return {"prompts": n_prompts, "max_new_tokens": new, "rows": rows}


def stage_synthetic(small: bool, deadline: float, batches=(1, 8),
                    pair=("tinyllama-1.1b", "llama-68m")) -> dict:
  shapes = SMALL_SHAPES if small else SHAPES
  target_shape, draft_shape = pair
  draft_kwargs = dict(shapes[draft_shape], vocab_size=shapes[target_shape]["vocab_size"])
  target = synthetic.random_model(shapes[target_shape], "bfloat16", 0)
  draft = synthetic.random_model(draft_kwargs, "bfloat16", 1)
  cfg = types.SimpleNamespace(max_new_tokens=32 if small else 128, temperature=1.0, seed=0,
                              pairs=2 if small else 3)
  prompt_tokens = 32 if small else 128
  prompts = jax.random.randint(jax.random.PRNGKey(0), (8, prompt_tokens), 0,
                               target.config.vocab_size).tolist()
  rows, skipped = [], []
  grid = {1: (2 if small else 4, (2, 4, 8)), 8: (8, (2, 4))}
  for batch in map(int, batches):
    n, gammas = grid[batch]
    for gamma in gammas:
      if time.monotonic() > deadline:
        skipped.append({"batch": batch, "gamma": gamma})
        continue
      step = common.step_costs(target, draft, "model", gamma, batch,
                               prompt_tokens + cfg.max_new_tokens // 2)
      for alpha in (0.6, 0.8, 0.9):
        row = synthetic.bench_point(target, draft, prompts[:n], batch, gamma, alpha, cfg, step)
        row["target_step_ms"] = step["target_step_s"] * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
  return {"pair": [target_shape, draft_shape], "rows": rows, "skipped_past_budget": skipped}


def _version(module: str) -> str | None:
  try:
    return __import__(module).__version__
  except Exception:  # noqa: BLE001 - a version we cannot read is recorded as None
    return None


def summary(res: dict) -> str:
  lines = ["# The engine on an accelerator (experiments.bench --part=accel)", ""]
  m = res.get("machine")
  if m:
    lines += [f"{m['device_kind']} × {m['device_count']}, jax {m['jax']}, flax {m['flax']}, "
              f"{m['date']}; copy {m['copy_gbps']:.0f} GB/s, datasheet {m['peak_gbps']} GB/s", ""]
  bw = res.get("bandwidth")
  if isinstance(bw, dict) and "error" not in bw:
    lines += ["| target (bf16, batch 1) | params | step ms | GB/s | of peak | of copy | "
              + " | ".join(f"v({g})" for g in (1, 2, 4, 8)) + " |",
              "|---|---|---|---|---|---|" + "---|" * 4]
    for name, r in bw["targets"].items():
      vs = [r["by_gamma"].get(g) or r["by_gamma"].get(str(g)) for g in (1, 2, 4, 8)]
      frac = lambda x: f"{x:.0%}" if x else "–"
      lines.append(f"| {name} | {r['params'] / 1e9:.2f}B | {r['step_ms']:.2f} | "
                   f"{r['step_gbps']:.0f} | {frac(r['fraction_of_peak'])} | "
                   f"{frac(r['fraction_of_copy'])} | "
                   + " | ".join(f"{x['v']:.2f}" if x else "–" for x in vs) + " |")
    lines.append("")
  for key, cols in (("shipped", [("batch", "batch", "d"), ("drafter", "drafter", "s"),
                                 ("γ", "gamma", "d"), ("speedup (min–max)", "speedup", "x"),
                                 ("tokens/call", "tokens_per_target_call", ".2f"),
                                 ("tok/s", "tokens_per_s", ".0f"),
                                 ("target-only tok/s", "target_only_tokens_per_s", ".0f"),
                                 ("greedy rows equal", "greedy_rows_equal", "d")]),
                    ("synthetic", synthetic.COLUMNS)):
    part = res.get(key)
    if isinstance(part, dict) and part.get("rows"):
      lines += [common.markdown_table(part["rows"], cols), ""]
  part = res.get("roofline")
  if isinstance(part, dict) and "rows" in part:
    lines += roofline_table(part) + [""]
  for key, part in res.items():
    if isinstance(part, dict) and "error" in part:
      lines.append(f"- stage {key} failed: {part['error']}")
  return "\n".join(lines) + "\n"


def run(out: Path, small: bool = False, budget_s: float = 420.0,
        stages=("machine", "bandwidth", "synthetic", "shipped"), synthetic_batches=(1, 8),
        synthetic_pair=("tinyllama-1.1b", "llama-68m"), shipped_reserve_s: float = 120.0,
        peer: bool = False, roofline_grid=None, decode_kernel=None) -> dict:
  """The stages in order, each written to <out>/accel.json and <out>/summary.md as soon as
  it ends; a stage that would start past `budget_s` is skipped and says so, one that
  fails records its error and the others still run."""
  stages = list(stages)
  for stage in stages:
    if stage not in STAGES:
      raise ValueError(f"unknown stage {stage!r}; known: {STAGES}")
  start = time.monotonic()
  deadline = start + budget_s
  out.mkdir(parents=True, exist_ok=True)
  res: dict = {}
  for stage in stages:
    if time.monotonic() > deadline:
      res[stage] = {"error": "skipped: past --budget_s"}
      continue
    t0 = time.monotonic()
    try:
      if stage == "machine":
        res[stage] = stage_machine(small)
      elif stage == "bandwidth":
        m = res.get("machine", {})
        res[stage] = stage_bandwidth(small, m.get("peak_gbps"), m.get("copy_gbps"))
      elif stage == "shipped":
        res[stage] = stage_shipped(small)
      elif stage == "roofline":
        m = res.get("machine") or stage_machine(small)
        res[stage] = stage_roofline(small, deadline, m.get("peak_gbps"), m.get("copy_gbps"),
                                    peer=peer, grid=roofline_grid, decode_kernel=decode_kernel)
      else:  # synthetic
        later = stages[stages.index(stage):]
        res[stage] = stage_synthetic(small, deadline - shipped_reserve_s * ("shipped" in later),
                                     synthetic_batches, synthetic_pair)
    except Exception as e:  # noqa: BLE001 - one broken stage must not lose the others
      res[stage] = {"error": f"{type(e).__name__}: {e}"}
    if isinstance(res[stage], dict):
      res[stage]["stage_s"] = time.monotonic() - t0
    print(f"stage {stage}: {time.monotonic() - t0:.1f} s", flush=True)
    (out / "accel.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "summary.md").write_text(summary(res))
  print(summary(res))
  return res


# ----------------------------------------------------------------------------------
# Roofline: the engine's decode step against a minimal loop on the same weights.

# (shape, batch, context[, buffer]) in the order they run: the rows the accelerator goals
# are stated on first, so a run cut by its budget keeps them. buffer: the KV buffer's
# slots where it is longer than the context needs (as in a call whose max_new_tokens is
# far off), the case where the decode kernel skips what XLA's attention reads.
ROOFLINE_GRID = (("tinyllama-1.1b", 1, 512), ("llama3-8b", 1, 512),
                 ("tinyllama-1.1b", 8, 512), ("llama3-8b", 8, 512),
                 ("tinyllama-1.1b", 8, 512, 4096), ("tinyllama-1.1b", 1, 512, 4096),
                 ("tinyllama-1.1b", 1, 4096), ("llama3-8b", 1, 4096),
                 ("tinyllama-1.1b", 8, 4096), ("llama3-8b", 8, 4096))
SMALL_ROOFLINE_GRID = (("tinyllama-1.1b", 1, 32), ("llama3-8b", 8, 64),
                       ("tinyllama-1.1b", 1, 32, 256))
ROOFLINE_METHODS = ("minimal static", "minimal traced", "engine T=0", "engine T=1",
                    "engine T=0 decode kernel", "transformers static cache")


def _minimal_decode(model, backend):
  """(prefill, loop): the reference decode, the model's own cached forward and argmax.
  loop(params, kv, token, out, rounds) runs `rounds` 1-token steps in a fori_loop,
  writing each step's token into out int32[B, >= rounds] (a decode keeps its tokens, as
  the engine does); `rounds` is static (a fixed trip count) or traced (a while loop whose
  predicate is data)."""
  graphdef = model.graphdef

  @jax.jit
  def prefill(params, prompts, kv):
    with backends.use(backend):
      logits, kv = model_lib.forward_cached(graphdef, backend.layout(params), prompts, kv,
                                            empty=True)
      return sampling_lib.argmax(logits[:, -1]).astype(jnp.int32), kv

  def loop(params, kv, token, out, rounds):
    with backends.use(backend):
      params = backend.layout(params)  # once, outside the loop (a no-op when laid out)

      def body(i, carry):
        tok, kv, out = carry
        logits, kv = model_lib.forward_cached(graphdef, params, tok[:, None], kv)
        tok = sampling_lib.argmax(logits[:, -1]).astype(jnp.int32)
        return tok, kv, jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], i, axis=1)
      return jax.lax.fori_loop(0, rounds, body, (token, kv, out))[2]

  return prefill, jax.jit(loop, static_argnums=4), jax.jit(loop)


def _peer_decode(model, prompts, compiled: bool, cache_len: int):
  """run(new_tokens): transformers' greedy `generate` on the same weights (bf16, on CUDA
  where it is there) with one static cache of `cache_len` slots for every call (so long
  and short calls attend over the same buffer, as the engine's do); on CUDA, generate
  compiles the forward itself (its auto-compile for a static cache), elsewhere only with
  `compiled`."""
  import torch
  import transformers
  from specjax.hf import config as hf_config
  from specjax.hf import weights as hf_weights
  device = "cuda" if torch.cuda.is_available() else "cpu"
  hf_cfg = transformers.AutoConfig.for_model(**hf_config.config_to_hf(model.config))
  with torch.device(device):
    ref = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
  state = {}
  for name, array in hf_weights.params_to_hf(model.config, model.params).items():
    bits = np.array(array, dtype=jnp.bfloat16).view(np.int16)  # a writable copy
    state[name] = torch.from_numpy(bits).view(torch.bfloat16)
  missing, unexpected = ref.load_state_dict(state, strict=False)
  if unexpected or [k for k in missing if "lm_head" not in k or not hf_cfg.tie_word_embeddings]:
    raise RuntimeError(f"transformers copy: missing {missing}, unexpected {unexpected}")
  ref.generation_config.eos_token_id = None
  ref.generation_config.pad_token_id = 0
  cache = transformers.StaticCache(config=hf_cfg, max_cache_len=cache_len)
  gen_kw = dict(do_sample=False, past_key_values=cache)
  if compiled and device == "cpu":
    gen_kw["compile_config"] = transformers.CompileConfig(_compile_all_devices=True)
  ids = torch.tensor(np.asarray(prompts), device=device)

  def run(new_tokens: int):
    with torch.inference_mode():
      cache.reset()
      out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, **gen_kw)
    if device == "cuda":
      torch.cuda.synchronize()
    return out
  return run, {"device": device, "compiled": compiled or device == "cuda",
               "transformers": transformers.__version__, "torch": torch.__version__}


def _equal_prefix(a, b) -> int:
  diff = np.nonzero(np.asarray(a) != np.asarray(b))[0]
  return int(diff[0]) if diff.size else len(a)


def _per_step(times_long, times_short, steps):
  per = (np.asarray(times_long) - np.asarray(times_short)) / steps * 1e3
  q1, med, q3 = np.percentile(per, [25, 50, 75])
  return {"step_ms": float(med), "step_ms_q1": float(q1), "step_ms_q3": float(q3),
          "samples_ms": [float(x) for x in per]}


def _check_buffer(buffer, context: int, steps: int) -> None:
  """A roofline row's KV buffer: None, or a multiple of 64 slots with room for the context,
  the steps and 64 more."""
  if buffer is not None and (not isinstance(buffer, int) or buffer % 64
                             or buffer < context + steps + 64):
    raise ValueError(f"buffer {buffer!r} must be a multiple of 64 with room for context "
                     f"{context} + {steps} steps + 64")


def roofline_point(model, shape: str, batch: int, context: int, *, rounds=(16, 144),
                   repeats: int = 5, peer: bool = False, peer_compiled: bool = True,
                   peak=None, copy=None, seed: int = 0, decode_kernel=None,
                   buffer: int | None = None) -> dict:
  """One (shape, batch, context) row: per-step time of the minimal loop (static and
  traced trip count), the engine target-only at T = 0 and T = 1, with `decode_kernel`
  (None: on a GPU) the engine at T = 0 reading its cache through the Pallas decode kernel
  (`Options(decode_kernel=True)`; on a CPU interpreted, with XLA's products: a check that
  it runs, not a speed) and, with `peer`, transformers; each the median over `repeats`
  interleaved passes of (long call - short call) / (its extra steps). buffer: the KV
  buffer's slots (a multiple of 64), every method's; None: what the context and the
  rounds need. bytes_per_step counts the valid slots only."""
  r1, r2 = rounds
  if not (isinstance(r1, int) and isinstance(r2, int) and 0 < r1 < r2):
    raise ValueError(f"rounds must be ints 0 < short < long, got {rounds!r}")
  if not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be a positive int, got {repeats!r}")
  if context + r2 + 1 > model.config.max_len:
    raise ValueError(f"context {context} + {r2} steps exceed the model's max_len "
                     f"{model.config.max_len}")
  max_new = r2 + 1
  _check_buffer(buffer, context, r2)
  if buffer is not None:
    if buffer > model.config.max_len:
      raise ValueError(f"buffer {buffer} exceeds the model's max_len {model.config.max_len}")
    # prepare sizes the cache round_up(round_up(context, 16) + max_new + 2, 64) slots
    max_new = buffer - checks.round_up(context, 16) - 8
  prompts = np.random.RandomState(seed).randint(
      0, model.config.vocab_size, (batch, context)).astype(np.int32)
  runs, extra = {}, {}
  # Generate's program (prefill + rounds; round limit traced: one program for r1 and r2).
  cache_size, preps = None, {}
  for t in (0.0, 1.0):
    p = prepare_lib.prepare(model, prompts.tolist(), max_new_tokens=max_new, temperature=t,
                            eos_id=None)
    cache_size = p.cache_size
    if buffer is not None and cache_size != buffer:
      raise AssertionError(f"prepare sized the cache {cache_size}, not the buffer {buffer}")
    preps[t] = p
    key = prepare_lib.seed_key(seed)
    runs[f"engine T={t:g}"] = (lambda p, key: lambda r: p.run(key, r).tokens)(p, key)
  on_cpu = jax.default_backend() == "cpu"
  if decode_kernel if decode_kernel is not None else jax.default_backend() == "gpu":
    options = dataclasses.replace(backends.default_options(), decode_kernel=True,
                                  kernels=not on_cpu)  # the CPU's own kernels fuse first
    p = dataclasses.replace(preps[0.0], engine=dataclasses.replace(preps[0.0].engine,
                                                                   backend_options=options))
    preps["kernel"] = p
    runs["engine T=0 decode kernel"] = (lambda p, key: lambda r: p.run(key, r).tokens)(
        p, prepare_lib.seed_key(seed))
  backend = backends.select()
  prefill, loop_static, loop_traced = _minimal_decode(model, backend)
  params = backend.layout(model.params)
  dtype = model_lib.compute_dtype(model.params)
  tok0, kv0 = prefill(params, jnp.asarray(prompts),
                      kv_cache.init_kv(model.config, batch, cache_size, dtype))
  out0 = jnp.zeros((batch, r2), jnp.int32)
  runs["minimal static"] = lambda r: loop_static(params, kv0, tok0, out0, r)
  runs["minimal traced"] = lambda r: loop_traced(params, kv0, tok0, out0, jnp.int32(r))
  # The floor is a correct greedy decode: its tokens are the engine's at T = 0, up to the
  # first near-tie (on random bf16 weights the top two logits can be one bf16 step apart,
  # and two kernel paths may break it differently): `equal_prefix` says how far they agree.
  minimal_tokens = np.concatenate([np.asarray(tok0)[:, None],
                                   np.asarray(runs["minimal static"](r2))], axis=1)
  state = preps[0.0].run(prepare_lib.seed_key(seed), r2)
  engine_tokens = [np.asarray(state.tokens[i, context:state.n[i]]) for i in range(batch)]
  width = min(min(len(t) for t in engine_tokens), minimal_tokens.shape[1])
  extra["minimal_equals_engine_greedy"] = bool(all(
      np.array_equal(t[:width], m[:width]) for t, m in zip(engine_tokens, minimal_tokens)))
  extra["tokens_compared"] = int(width)
  extra["equal_prefix"] = int(min(_equal_prefix(t[:width], m[:width])
                                  for t, m in zip(engine_tokens, minimal_tokens)))
  if "kernel" in preps:  # as far as its greedy tokens agree with XLA's attention's
    state = preps["kernel"].run(prepare_lib.seed_key(seed), r2)
    extra["kernel_equal_prefix"] = int(min(
        _equal_prefix(np.asarray(state.tokens[i, context:state.n[i]])[:width], t[:width])
        for i, t in enumerate(engine_tokens)))
  if peer:
    try:
      runs["transformers static cache"], extra["peer"] = _peer_decode(
          model, prompts, peer_compiled, context + r2 + 1)
    except ImportError as e:
      extra["peer"] = {"error": f"not run: {e}"}
  if "transformers static cache" in runs:
    theirs = np.asarray(runs["transformers static cache"](r2).cpu())[:, context:]
    w = min(theirs.shape[1], minimal_tokens.shape[1])
    extra["peer"]["tokens_equal_minimal"] = bool(np.array_equal(theirs[:, :w],
                                                                minimal_tokens[:, :w]))
  order = [m for m in ROOFLINE_METHODS if m in runs]

  def timed(fn, r):
    start = time.perf_counter()
    jax.block_until_ready(fn(r))
    return time.perf_counter() - start

  for name in order:  # compile and warm both lengths
    timed(runs[name], r1), timed(runs[name], r2)
  long, short = {m: [] for m in order}, {m: [] for m in order}
  for _ in range(repeats):  # a b c d a b c d ...
    for name in order:
      short[name].append(timed(runs[name], r1))
      long[name].append(timed(runs[name], r2))
  nbytes = step_bytes(model, batch, context + (r1 + r2) // 2)
  methods = {}
  for name in order:
    row = _per_step(long[name], short[name], r2 - r1)
    gbps = nbytes / (row["step_ms"] / 1e3) / 1e9 if row["step_ms"] > 0 else None
    row.update(gbps=gbps, tokens_per_s=batch * 1e3 / row["step_ms"] if gbps else None,
               fraction_of_peak=gbps / peak if gbps and peak else None,
               fraction_of_copy=gbps / copy if gbps and copy else None)
    methods[name] = row
  minimal = methods["minimal static"]["step_ms"]
  for row in methods.values():
    row["ratio_to_minimal"] = row["step_ms"] / minimal
  out = {"shape": shape, "batch": batch, "context": context, "cache_size": cache_size,
         "buffer": buffer,
         "rounds": [r1, r2], "repeats": repeats, "bytes_per_step": nbytes,
         "methods": methods, **extra}
  return out


def stage_roofline(small: bool, deadline: float, peak, copy, peer: bool = False,
                   grid=None, repeats=None, rounds=None, decode_kernel=None) -> dict:
  """`roofline_point` over the grid, in order, until `deadline` (later rows are listed
  as skipped); one random-weight model per shape, shared by its rows."""
  shapes = SMALL_SHAPES if small else SHAPES
  grid = list(grid or (SMALL_ROOFLINE_GRID if small else ROOFLINE_GRID))
  rounds = tuple(rounds or ((4, 36) if small else (16, 144)))
  repeats = repeats or (3 if small else 5)
  grid = [tuple(row) + (None,) * (4 - len(row)) for row in grid]  # buffer: None
  for shape, batch, context, buffer in grid:
    if shape not in shapes or batch < 1 or context < 1:
      raise ValueError(f"roofline grid row {(shape, batch, context)!r}: shape must be one of "
                       f"{sorted(shapes)}, batch and context positive")
    try:
      _check_buffer(buffer, context, rounds[1])
    except ValueError as e:
      raise ValueError(f"roofline grid row {(shape, batch, context, buffer)!r}: {e}") from None
  max_len = max(max(c + rounds[1] + 64, b or 0) for _, _, c, b in grid)
  models, rows, skipped, took = {}, [], [], {}
  for shape, batch, context, buffer in grid:
    # A row is not started if the last row of its shape, as long again (twice, at a longer
    # context: the engine's calls prefill it), would overrun.
    last_s, last_context = took.get(shape, (0.0, context))
    if time.monotonic() + last_s * (2 if context > last_context else 1) > deadline:
      skipped.append({"shape": shape, "batch": batch, "context": context, "buffer": buffer})
      continue
    t0 = time.monotonic()
    if shape not in models:
      kwargs = dict(shapes[shape], max_len=max(shapes[shape]["max_len"], max_len))
      models[shape] = synthetic.random_model(kwargs, "bfloat16", seed=0)
    row = roofline_point(models[shape], shape, batch, context, rounds=rounds, repeats=repeats,
                         peer=peer, peer_compiled=not small, peak=peak, copy=copy,
                         decode_kernel=decode_kernel, buffer=buffer)
    rows.append(row)
    row["row_s"] = time.monotonic() - t0
    took[shape] = (row["row_s"], context)
    print(json.dumps({k: v for k, v in row.items() if k != "methods"}), flush=True)
    for name, m in row["methods"].items():
      print(f"  {name:30s} {m['step_ms']:.3f} ms [{m['step_ms_q1']:.3f}, "
            f"{m['step_ms_q3']:.3f}]  ×minimal {m['ratio_to_minimal']:.2f}", flush=True)
  return {"rows": rows, "skipped_past_budget": skipped, "peak_gbps": peak, "copy_gbps": copy}


def roofline_table(part: dict) -> list[str]:
  frac = lambda x: f"{x:.0%}" if x else "–"
  lines = ["| shape | batch | context | buffer | bytes/step | method | step ms (quartiles) "
           "| GB/s | of peak | of copy | × minimal | tokens/s |", "|" + "---|" * 12]
  for r in part["rows"]:
    for name, m in r["methods"].items():
      gbps = f"{m['gbps']:.0f}" if m["gbps"] else "–"
      tps = f"{m['tokens_per_s']:.0f}" if m["tokens_per_s"] else "–"
      lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['cache_size']} | "
                   f"{r['bytes_per_step'] / 1e9:.3f} GB | {name} | {m['step_ms']:.3f} "
                   f"({m['step_ms_q1']:.3f}–{m['step_ms_q3']:.3f}) | {gbps} | "
                   f"{frac(m['fraction_of_peak'])} | {frac(m['fraction_of_copy'])} | "
                   f"{m['ratio_to_minimal']:.2f} | {tps} |")
  for s in part.get("skipped_past_budget", []):
    lines.append(f"| {s['shape']} | {s['batch']} | {s['context']} | {s['buffer'] or '–'} | "
                 "skipped: past the budget |" + " |" * 7)
  lines.append("")
  for r in part["rows"]:
    same = ("yes" if r["minimal_equals_engine_greedy"] else
            f"the first {r['equal_prefix']} in every row, then they part (look for a near-tie, "
            "roofline_point)")
    note = f"- {r['shape']}, batch {r['batch']}, context {r['context']}, buffer " \
           f"{r['cache_size']}: minimal decode's " \
           f"tokens = engine T=0's: {same} (of {r['tokens_compared']} per row)"
    if "kernel_equal_prefix" in r:
      note += (f"; the decode kernel's tokens = engine T=0's for the first "
               f"{r['kernel_equal_prefix']} in every row")
    peer = r.get("peer")
    if peer:
      note += ("; transformers " + (peer["error"] if "error" in peer else
               f"{peer['transformers']} / torch {peer['torch']} on {peer['device']}, "
               f"{'compiled' if peer['compiled'] else 'not compiled (eager)'}, greedy tokens "
               f"= the minimal decode's: {peer['tokens_equal_minimal']}"))
    lines.append(note)
  return lines


# ----------------------------------------------------------------------------------
# Sharding, memory and precision.

V5E_HBM = 16 * 2 ** 30  # bytes of HBM on one TPU v5e chip
LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 d_ff=14336, max_len=8192, norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})


def mesh_of(text: str):
  dp, tp = (int(x) for x in text.split("x"))
  return jax.make_mesh((dp, tp), ("data", "model"))


# --- Sharding 1: speed on a mesh.


def mesh_speed(target, draft, prompts, meshes=("1x8", "2x4", "8x1"),
               draft_placements=("replicate", "shard"), gamma: int = 4,
               temperature: float = 0.0, max_new_tokens: int = 64, pairs: int = 3):
  """Speculative decoding of `prompts` (one batch) on each mesh 'dp x tp', the draft
  replicated or split, against the same call on one device, timed alternately."""
  kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=0, gamma=gamma,
            eos_id=None)
  batch = prompts
  out = {}

  def one_device():
    out["one"] = specjax.generate(target, batch, draft=draft, **kw)

  rows = []
  for text in meshes:
    mesh = mesh_of(text)
    placed = specjax.shard(target, mesh)
    for placement in draft_placements:
      if placement == "shard" and mesh.shape["model"] == 1:
        continue  # the same program as replicated
      prepared = prepare_lib.prepare(
          placed, batch, draft=draft, top_k=0, top_p=1.0, eos_id=None,
          **{k: v for k, v in kw.items() if k not in ("seed", "eos_id")})
      run = prepare_lib.distribute(prepared, mesh, shard_draft=placement == "shard")
      key = jax.random.PRNGKey(0)

      def on_mesh():
        out["mesh"] = run.run(key)

      timing = costs.paired(on_mesh, one_device, pairs=pairs)
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


# --- Sharding 2: memory of an 8B target, from shardings alone.


def _bytes_per_device(tree, shardings) -> int:
  leaves = jax.tree_util.tree_leaves(tree)
  specs = jax.tree_util.tree_leaves(shardings)
  return sum(int(np.prod(s.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
             for x, s in zip(leaves, specs))


def memory(mesh_text: str, dtype, quantized: bool, kv_batch: int = 8, kv_tokens: int = 8192):
  """Per-device bytes of a Llama-3-8B-shaped target's weights and KV cache on a mesh, from
  the shardings of `jax.eval_shape` structures (nothing is allocated)."""
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
  kv = jax.eval_shape(lambda: kv_cache.init_kv(cfg, kv_batch, kv_tokens, dtype))
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
          "kv_rows": kv_batch, "kv_slots": kv_tokens,
          "total_gib_per_device": (param_bytes + kv_bytes) / 2 ** 30,
          "fits_v5e_16gib": param_bytes + kv_bytes < V5E_HBM}


# --- Sharding 3: TV distance between precisions.


def tv_distances(target, prompts):
  """Total-variation distance of the target's next-token distributions in bfloat16, int8
  and both from float32's, teacher-forced at every position of `prompts`."""
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
