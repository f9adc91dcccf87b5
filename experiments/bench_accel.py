r"""What an accelerator does with the engine: bandwidth, v(γ) and speedups, in one timed run.

  python -m experiments.bench_accel --out=runs/accel            # a GPU or TPU, ~6 min
  python -m experiments.bench_accel --out=runs/accel --small    # tiny shapes, any backend

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

`--budget_s` bounds the run: a stage that would start after it is skipped and says so.
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import common
from experiments import synthetic
from specjax import costs
from specjax.models import model as model_lib
from specjax.models.pretrained import load_pretrained

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
  lines = ["# The engine on an accelerator (experiments.bench_accel)", ""]
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
  for key, part in res.items():
    if isinstance(part, dict) and "error" in part:
      lines.append(f"- stage {key} failed: {part['error']}")
  return "\n".join(lines) + "\n"


def define_flags():
  """The app's flags, defined only when it runs (tests import the module beside others)."""
  flags.DEFINE_string("out", "runs/accel", "Where accel.json and summary.md go.")
  flags.DEFINE_bool("small", False, "Tiny shapes and grids (a CPU check of the script).")
  flags.DEFINE_float("budget_s", 420.0, "Skip stages that would start after this.")
  flags.DEFINE_list("stages", ["machine", "bandwidth", "synthetic", "shipped"],
                    "Stages to run, in order.")
  flags.DEFINE_list("synthetic_batches", ["1", "8"], "Batch sizes of 'synthetic'.")
  flags.DEFINE_list("synthetic_pair", ["tinyllama-1.1b", "llama-68m"],
                    "Target and draft shapes of 'synthetic' (keys of SHAPES).")
  flags.DEFINE_float("shipped_reserve_s", 120.0,
                    "Seconds of the budget the synthetic grid leaves for 'shipped'.")


def main(argv):
  del argv
  f = flags.FLAGS
  start = time.monotonic()
  deadline = start + f.budget_s
  out = Path(f.out)
  out.mkdir(parents=True, exist_ok=True)
  res: dict = {}
  small = f.small
  for stage in f.stages:
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
      elif stage == "synthetic":
        later = f.stages[f.stages.index(stage):]
        res[stage] = stage_synthetic(small, deadline - f.shipped_reserve_s * ("shipped" in later),
                                     f.synthetic_batches, f.synthetic_pair)
      else:
        raise ValueError(f"unknown stage {stage!r}")
    except Exception as e:  # noqa: BLE001 - one broken stage must not lose the others
      res[stage] = {"error": f"{type(e).__name__}: {e}"}
    if isinstance(res[stage], dict):
      res[stage]["stage_s"] = time.monotonic() - t0
    print(f"stage {stage}: {time.monotonic() - t0:.1f} s", flush=True)
    (out / "accel.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "summary.md").write_text(summary(res))
  print(summary(res))


if __name__ == "__main__":
  define_flags()
  app.run(main)
