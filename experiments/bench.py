r"""The speed and cost ledger: how fast is speculative decoding here, and where does the time go?

  python -m experiments.bench                          # --part=pair: shipped pair, batch 1 and 8
  python -m experiments.bench --part=peer              # against transformers on the same weights
  python -m experiments.bench --part=accel --out=runs/accel           # a GPU or TPU, within --budget_s
  python -m experiments.bench --part=accel --out=runs/accel --small   # tiny shapes, any backend
  python -m experiments.bench --part=synthetic --config=configs/bench.py --out=runs/synth
  python -m experiments.bench --part=stream --out=docs/results/stream.json
  python -m experiments.bench --part=sharding --out=sharding.json
  python -m experiments.bench --part=processors --out=docs/results/processors.json
  python -m experiments.bench --part=samples --out=docs/results/samples.json
  python -m experiments.bench --part=calls --drafter=ngram \
      --variants='fixed={}' --variants='ledger={"gamma_policy": "ledger"}'

Every part times a method against its baseline in the same process, alternately
(A B A B ...), and reports the median ratio with its spread. The parts:

  pair        target-only vs speculative on the same engine, per (batch, T): tokens/s, the
              speedup, a round's parts (draft proposal, the (γ+1)-token verify pass, the
              rest), v(γ), c, measured / predicted speedup by the ledger's
              E(α̂,γ)/(γc + v(γ)) and by whole calls; first v(γ) for γ = 1..8 with GFLOP/s.
  peer        specjax against transformers on identical weights (`experiments/peer.py`):
              greedy, speculative and prompt lookup on both stacks, outputs compared.
  accel       one budgeted run on an accelerator (`experiments/accel.py`): bandwidth of a
              1-token step against the datasheet and a copy, v(γ), the shipped pair's
              speedups, the synthetic-acceptance grid on Llama shapes; with
              --stages=machine,roofline [--peer], the engine's decode step against a
              minimal fori_loop decode (and transformers) on the same weights.
  synthetic   engine speed at a chosen acceptance on random-weight models
              (`experiments/synthetic.py`, configs/bench.py): speedup against α and γ.
  stream      `specjax.stream` against `generate`, whole calls per prompt: stream / generate
              and the first chunk's time, per chunk size (rounds a chunk).
  sharding    speed on meshes of 8 (virtual CPU) devices against one device, per-device
              memory of a Llama-3-8B shape on a (1, 8) mesh, TV distance of bfloat16 and
              int8 from float32 (`experiments/accel.py`).
  processors  the history-dependent processors' share of a speculative round (and three
              tracked stop strings'): a round with them against without.
  samples     `generate(..., n=N)` against the prompt repeated N times: the same tokens,
              one prefill instead of N.
  calls       whole `generate` calls of several settings (--variants) against target-only
              and against the first variant, per prompt, interleaved.

Flags left unset take the part's default (`PARTS`); a flag the part does not read is
refused. --out is a JSON file, or a directory for accel and synthetic.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import types
from pathlib import Path

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

import specjax
from experiments import common
from specjax import backends
from specjax import rng
from specjax import costs
from specjax import ledger

# Each part's flags and their defaults; a flag left unset takes its part's default.
_SHIPPED = dict(target="stdlib-target", draft="stdlib-draft")
PARTS = {
    "pair": dict(_SHIPPED, gamma=4, batch=[1, 8], temperature=[0.0, 1.0], num_prompts=16,
                 prompt_tokens=64, max_new_tokens=128, pairs=3, out=None),
    "peer": dict(_SHIPPED, gamma=4, batch=[8], num_prompts=8, prompt_tokens=64,
                 max_new_tokens=64, repeats=3, ngram_max=3, torch_threads=1, out=None),
    "accel": dict(out="runs/accel", small=False, budget_s=420.0,
                  stages=["machine", "bandwidth", "synthetic", "shipped"],
                  synthetic_batches=[1, 8], synthetic_pair=["tinyllama-1.1b", "llama-68m"],
                  shipped_reserve_s=120.0, peer=False),
    "synthetic": dict(config=None, out="runs/bench_synthetic"),
    "stream": dict(target="stdlib-target", draft=None, drafter="model", gamma=2,
                   temperature=[0.0], rounds_per_chunk=[1, 4, 16], num_prompts=8,
                   prompt_tokens=64, max_new_tokens=64, repeats=3, out=None),
    "sharding": dict(_SHIPPED, meshes=["1x8", "2x4", "8x1"],
                     draft_placements=["replicate", "shard"], batch=[8], gamma=4,
                     temperature=[0.0], num_prompts=8, prompt_tokens=64, max_new_tokens=64,
                     pairs=3, tv_prompts=32, tv_tokens=128, kv_batch=8, kv_tokens=8192,
                     rowwise_max_rows=-1, skip=[], out=None),
    "processors": dict(_SHIPPED, gamma=4, batch=[1, 8], temperature=[0.0, 1.0],
                       num_prompts=8, prompt_tokens=64, pairs=7,
                       sets=["processors", "stop_strings"], out=None),
    "samples": dict(target="stdlib-target", draft=None, drafter="ngram", gamma=4,
                    temperature=[1.0], samples=8, num_prompts=4, prompt_tokens=192,
                    max_new_tokens=32, repeats=3, out=None),
    "calls": dict(target="stdlib-target", draft=None, drafter="ngram", gamma=4,
                  temperature=[0.0], variants=["fixed={}"], num_prompts=8, prompt_tokens=64,
                  max_new_tokens=64, repeats=5, out=None),
}
_BY_PART = "(default: by --part, see PARTS)"

_PART = flags.DEFINE_enum("part", "pair", list(PARTS), "What to measure.")
flags.DEFINE_string("target", None, f"Target: a shipped name, directory or hub id {_BY_PART}.")
flags.DEFINE_string("draft", None, "Draft model or head: name, directory or hub id "
                    f"(stream, samples, calls: the drafter's shipped one) {_BY_PART}.")
flags.DEFINE_enum("drafter", None, ["model", "ngram", "eagle", "eagle3", "medusa"],
                  f"Drafter (stream, samples, calls) {_BY_PART}.")
flags.DEFINE_integer("gamma", None, f"Draft length γ {_BY_PART}.")
flags.DEFINE_list("batch", None, f"Batch sizes (peer, sharding: one) {_BY_PART}.")
flags.DEFINE_list("temperature", None, "Temperatures (stream, sharding, samples, calls: one) "
                  f"{_BY_PART}.")
flags.DEFINE_integer("num_prompts", None, f"Held-out prompts {_BY_PART}.")
flags.DEFINE_integer("prompt_tokens", None, f"Tokens per prompt {_BY_PART}.")
flags.DEFINE_integer("max_new_tokens", None, f"New tokens per prompt {_BY_PART}.")
flags.DEFINE_integer("pairs", None, f"Timing pairs, median kept {_BY_PART}.")
flags.DEFINE_integer("repeats", None, f"Interleaved passes over the prompts {_BY_PART}.")
flags.DEFINE_string("out", None, "Write the results here: a JSON file, a directory for accel "
                    f"and synthetic {_BY_PART}.")
# peer
flags.DEFINE_integer("ngram_max", None, "peer: longest suffix prompt lookup matches.")
flags.DEFINE_integer("torch_threads", None, "peer: torch threads for transformers "
                     "(0: torch's default).")
# accel
flags.DEFINE_bool("small", None, "accel: tiny shapes and grids (a check of the script on "
                  "any backend).")
flags.DEFINE_float("budget_s", None, "accel: skip stages that would start after this.")
flags.DEFINE_list("stages", None, "accel: stages to run, in order (machine, bandwidth, "
                  "synthetic, shipped, roofline).")
flags.DEFINE_bool("peer", None, "accel: the roofline stage also times transformers' "
                  "static-cache generate on the same weights (where torch is importable).")
flags.DEFINE_list("synthetic_batches", None, "accel: batch sizes of the synthetic stage.")
flags.DEFINE_list("synthetic_pair", None, "accel: target and draft shapes of the synthetic "
                  "stage (keys of accel.SHAPES).")
flags.DEFINE_float("shipped_reserve_s", None, "accel: seconds of the budget the synthetic "
                   "grid leaves for the shipped stage.")
# synthetic
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "synthetic: the benchmark config file[:variant] (default: this "
    "checkout's configs/bench.py; name it to override fields, --config.gamma=...).")
BENCH_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "bench.py"
# stream
flags.DEFINE_list("rounds_per_chunk", None, "stream: chunk sizes.")
# sharding
flags.DEFINE_list("meshes", None, "sharding: meshes dp x tp.")
flags.DEFINE_list("draft_placements", None, "sharding: how the draft is placed on a mesh "
                  "(replicate, shard).")
flags.DEFINE_integer("tv_prompts", None, "sharding: held-out prompts for the TV distance.")
flags.DEFINE_integer("tv_tokens", None, "sharding: tokens per TV prompt (every position).")
flags.DEFINE_integer("kv_batch", None, "sharding: rows of the 8B KV cache.")
flags.DEFINE_integer("kv_tokens", None, "sharding: slots per row of the 8B KV cache.")
flags.DEFINE_integer("rowwise_max_rows", None, "sharding: set backends.Options.rowwise_max_rows "
                     "(0: off; -1: leave the default).")
flags.DEFINE_list("skip", None, "sharding: parts to skip (memory, tv, speed).")
# processors
PROCESSOR_SETS = {"processors": common.PROCESSORS,
                  # Text stop strings that the held-out continuations do not hold: tracked,
                  # never hit, so both loops run every round.
                  "stop_strings": dict(stop_sequences=["\n\n\n\n\n\n", "#" * 12, "\x07"])}
flags.DEFINE_list("sets", None, f"processors: what to time against none {list(PROCESSOR_SETS)}.")
# samples
flags.DEFINE_integer("samples", None, "samples: samples per prompt (n).")
# calls
flags.DEFINE_multi_string("variants", None, "calls: name=JSON of generate keyword arguments "
                          "over the drafter's, one flag per side.")


def settings(part: str) -> types.SimpleNamespace:
  """The part's settings: each flag it reads as given, else its default; a flag given that
  the part does not read is a UsageError."""
  given = {name for name in _FLAG_NAMES if flags.FLAGS[name].present}
  stray = sorted(given - set(PARTS[part]))
  if stray:
    raise app.UsageError(f"--part={part} does not read --{', --'.join(stray)}")
  out = {}
  for name, default in PARTS[part].items():
    value = getattr(flags.FLAGS, name) if name in given else default
    if isinstance(default, list) and default and not isinstance(default[0], str):
      value = [type(default[0])(v) for v in value]
    out[name] = value
  return types.SimpleNamespace(**out)


def _one(s, name: str):
  values = getattr(s, name)
  if len(values) != 1:
    raise app.UsageError(f"--part={_PART.value} takes one --{name}, got {values}")
  return values[0]


def _write(path: str | None, result) -> None:
  if path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def _drafter_pair(s):
  """`common.drafter_pair` of the part's --target, --drafter, --draft and --gamma."""
  try:
    return common.drafter_pair(s.target, s.drafter, s.draft, s.gamma)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


# ----------------------------------------------------------------------------------
# pair: target-only vs speculative on the same engine.


def bench_point(target, draft, prompts, gamma, batch, temperature, max_new, pairs):
  kw = dict(max_new_tokens=max_new, temperature=temperature, seed=0, eos_id=None)
  timing = common.paired_generate(target, prompts, batch, pairs,
                                  method=dict(kw, draft=draft, gamma=gamma), baseline=kw)
  spec, base = timing["method"], timing["baseline"]
  if temperature == 0:  # lossless at T=0 means identical text
    assert spec["tokens"] == base["tokens"], "speculative greedy output differs from target greedy"
  stats = spec["stats"]
  context = len(prompts[0]) + max_new // 2
  sc = common.step_costs(target, draft, "model", gamma, batch, context,
                         temperature=temperature)
  # Each side's call stopped after 1 and R rounds, in turn: a round's time, the fixed part.
  calls = costs.call_costs(target, prompts[:batch], dict(kw, draft=draft, gamma=gamma), kw)
  round_s, base_round_s = calls["round_method_s"], calls["round_baseline_s"]
  alpha = stats["alpha_hat"]
  predicted = float(ledger.predicted_speedup(alpha, gamma, sc["c"], sc["v"]))
  expected = float(ledger.expected_tokens(alpha, gamma))
  rounds = ledger.rounds_to_commit(
      ledger.commits_by_position(stats["acceptance_by_position"], gamma), max_new)
  predicted_call = float(ledger.predicted_call_speedup(
      expected, max_new, calls["round"], calls["fixed_method"], calls["fixed_baseline"], rounds))
  rest = round_s - sc["propose_s"] - sc["verify_s"]
  loop_s = stats["target_calls"] * round_s  # time inside rounds, by the measured round
  return {
      "batch": batch, "temperature": temperature, "gamma": gamma,
      "target_only_tokens_per_s": base["tokens_per_s"],
      "speculative_tokens_per_s": spec["tokens_per_s"],
      "speedup": timing["speedup"], "speedup_min": timing["speedup_min"],
      "speedup_max": timing["speedup_max"], "predicted_speedup": predicted,
      "measured_over_predicted": timing["speedup"] / predicted,
      "predicted_call_speedup": predicted_call,
      "measured_over_predicted_call": timing["speedup"] / predicted_call,
      # Every draft accepted, at the same round cost and fixed parts: an upper bound.
      "ceiling_call_speedup": ledger.ceiling_call_speedup(
          gamma + 1, max_new, calls["round"], calls["fixed_method"], calls["fixed_baseline"]),
      "round_ratio": calls["round"], "fixed_method": calls["fixed_method"],
      "fixed_baseline": calls["fixed_baseline"],
      "alpha_hat": alpha, "tokens_per_target_call": stats["tokens_per_target_call"],
      "expected_tokens": expected,
      "c": sc["c"], "v": sc["v"], "target_step_ms": sc["target_step_s"] * 1e3,
      "round_ms": round_s * 1e3, "draft_ms": sc["propose_s"] * 1e3,
      "verify_ms": sc["verify_s"] * 1e3, "rest_ms": rest * 1e3,
      "rest_percent": 100 * rest / round_s,
      "target_only_round_ms": base_round_s * 1e3,
      "outside_rounds_percent": 100 * max(0.0, 1 - loop_s / spec["seconds"]),
  }


COLUMNS = [
    ("batch", "batch", "d"), ("T", "temperature", "g"),
    ("target-only tok/s", "target_only_tokens_per_s", ".0f"),
    ("speculative tok/s", "speculative_tokens_per_s", ".0f"),
    ("speedup (min–max)", "speedup", "x"), ("predicted", "predicted_speedup", "x"),
    ("measured/predicted", "measured_over_predicted", ".2f"),
    ("predicted (call)", "predicted_call_speedup", "x"),
    ("measured/predicted (call)", "measured_over_predicted_call", ".2f"),
    ("ceiling (call)", "ceiling_call_speedup", "x"),
    ("α̂", "alpha_hat", ".3f"),
    ("tokens/call", "tokens_per_target_call", ".2f"), ("round ms", "round_ms", ".2f"),
    ("draft", "draft_ms", ".2f"), ("verify", "verify_ms", ".2f"), ("rest", "rest_ms", ".2f"),
    ("rest %", "rest_percent", ".0f"), ("v(γ)", "v", ".2f"), ("c", "c", ".3f"),
    ("outside rounds %", "outside_rounds_percent", ".0f")]
# The processors' share of a round is measured paired in --part=processors.

VERIFY_COLUMNS = [("γ", "gamma", "d"), ("(γ+1)-token pass ms", "pass_ms", ".3f"),
                  ("v(γ)", "v", ".2f"), ("GFLOP/s", "gflops", ".1f")]


def verify_table(target, batch: int, context: int) -> tuple[dict, str]:
  """v(γ) for γ = 1..8 and the achieved GFLOP/s of each pass: regressions show here."""
  vc = costs.verify_costs(target, batch, range(1, 9), context=context)
  rows = [dict(gamma=g, **r) for g, r in vc["by_gamma"].items()]
  text = (f"batch {batch}, context {context}: 1-token step {vc['step_ms']:.3f} ms "
          f"({vc['step_gflops']:.1f} GFLOP/s)\n" + common.markdown_table(rows, VERIFY_COLUMNS))
  return vc, text


def part_pair(s):
  target, draft = common.load_pair(s.target, s.draft)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.num_prompts, s.prompt_tokens)
  report = {"machine": costs.machine_info(), "target": s.target, "draft": s.draft,
            "max_new_tokens": s.max_new_tokens, "num_prompts": s.num_prompts}
  verify, text = verify_table(target, 1, s.prompt_tokens + s.max_new_tokens // 2)
  print(text, flush=True)
  report["verify_costs"] = verify
  rows = []
  for batch in s.batch:
    for temperature in s.temperature:
      rows.append(bench_point(target, draft, prompts, s.gamma, batch, temperature,
                              s.max_new_tokens, s.pairs))
      print(common.markdown_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
  report["rows"] = rows
  print(common.markdown_table(rows, COLUMNS))
  _write(s.out, report)


# ----------------------------------------------------------------------------------
# peer, accel, synthetic, sharding: the measurement lives in peer.py, accel.py, synthetic.py.


def part_peer(s):
  from experiments import peer
  from specjax.models.pretrained import load_pretrained
  target, draft = load_pretrained(s.target), load_pretrained(s.draft)
  prompts = peer.default_prompts(target, s.num_prompts, s.prompt_tokens)
  result = peer.run_peer_benchmark(target, draft, prompts, max_new_tokens=s.max_new_tokens,
                                   gamma=s.gamma, batch=_one(s, "batch"),
                                   ngram_max=s.ngram_max, repeats=s.repeats,
                                   torch_threads=s.torch_threads)
  print(peer.format_table(result))
  _write(s.out, result)


def part_accel(s):
  from experiments import accel
  accel.run(Path(s.out), small=s.small, budget_s=s.budget_s, stages=s.stages,
            synthetic_batches=s.synthetic_batches, synthetic_pair=s.synthetic_pair,
            shipped_reserve_s=s.shipped_reserve_s, peer=s.peer)


def part_synthetic(s):
  import importlib.util
  from experiments import synthetic
  cfg = _CONFIG.value
  if cfg is None:
    spec = importlib.util.spec_from_file_location("bench_config", BENCH_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
  synthetic.run(cfg, Path(s.out))


def part_sharding(s):
  from experiments import accel
  # 8 host-platform devices unless XLA_FLAGS names a count: they share this machine's
  # cores, so a mesh cannot be faster than one device for real here; the speed part
  # measures what sharding costs in collectives and partitioned programs.
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # a backend already started: the devices are what they are
      pass
  if jax.device_count() < 8:
    raise app.UsageError(f"--part=sharding needs 8 devices, this process has "
                         f"{jax.device_count()}: set XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8 on a CPU")
  if s.rowwise_max_rows >= 0:
    backends.set_default_options(backends.Options(rowwise_max_rows=s.rowwise_max_rows))
  target, draft = common.load_pair(s.target, s.draft)
  report = {"machine": costs.machine_info(), "target": s.target, "draft": s.draft,
            "batch": _one(s, "batch"), "gamma": s.gamma,
            "temperature": _one(s, "temperature"), "max_new_tokens": s.max_new_tokens,
            "cpu_rowwise_max_rows": backends.default_options().rowwise_max_rows}
  if "memory" not in s.skip:
    report["memory"] = [accel.memory(m, jnp.bfloat16, q, s.kv_batch, s.kv_tokens)
                        for m in ("1x1", "1x8") for q in (False, True)]
    for row in report["memory"]:
      print(row, flush=True)
  if "tv" not in s.skip:
    tv_prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.tv_prompts, s.tv_tokens,
                                        seed=1)
    report["tv"] = accel.tv_distances(target, tv_prompts)
  if "speed" not in s.skip:
    prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.num_prompts,
                                     s.prompt_tokens)
    report["speed"] = accel.mesh_speed(
        target, draft, prompts[:report["batch"]], s.meshes, s.draft_placements, s.gamma,
        report["temperature"], s.max_new_tokens, s.pairs)
  _write(s.out, report)


# ----------------------------------------------------------------------------------
# stream: specjax.stream against generate.


def part_stream(s):
  target, _, drafter = _drafter_pair(s)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.num_prompts, s.prompt_tokens)
  temperature = _one(s, "temperature")
  kw = dict(max_new_tokens=s.max_new_tokens, temperature=temperature, seed=0, eos_id=None,
            **drafter)
  rows = []
  for k in s.rounds_per_chunk:
    ratios, first, chunks = [], [], []
    for p in prompts:  # compile and warm both sides on every prompt's shapes
      specjax.generate(target, [p], **kw)
      list(specjax.stream(target, [p], rounds_per_chunk=k, **kw))
    for r in range(s.repeats):
      for i, p in enumerate(prompts):
        times = {}

        def gen():
          start = time.perf_counter()
          times["tokens"] = specjax.generate(target, [p], **kw).tokens
          times["generate"] = time.perf_counter() - start

        def stream():
          start = time.perf_counter()
          got = []
          for chunk in specjax.stream(target, [p], rounds_per_chunk=k, **kw):
            times.setdefault("first", time.perf_counter() - start)
            got.append(chunk)
          times["stream"] = time.perf_counter() - start
          times["chunks"] = len(got)
          times["streamed"] = [sum((c.tokens[0] for c in got), [])]

        for fn in ((gen, stream) if (r + i) % 2 == 0 else (stream, gen)):
          fn()
        if times["streamed"] != times["tokens"]:
          raise AssertionError(f"prompt {i}: the stream's tokens differ from generate's")
        ratios.append(times["stream"] / times["generate"])
        first.append(times["first"] / times["generate"])
        chunks.append(times["chunks"])
    row = dict(rounds_per_chunk=k, stream_over_generate=common.quartiles(ratios),
               first_chunk_share=common.quartiles(first), chunks=statistics.median(chunks),
               drafter=s.drafter, gamma=s.gamma, temperature=temperature,
               calls=len(ratios), machine=costs.machine_info())
    rows.append(row)
    a, f = row["stream_over_generate"], row["first_chunk_share"]
    print(f"{k:3d} rounds a chunk: {row['chunks']:.0f} chunks, stream / generate "
          f"{a['median']:.3f} ({a['q1']:.3f}-{a['q3']:.3f}), first chunk at "
          f"{f['median']:.3f} ({f['q1']:.3f}-{f['q3']:.3f}) of generate's time", flush=True)
  _write(s.out, rows)


# ----------------------------------------------------------------------------------
# processors: their share of a round.

ROUNDS = 16  # rounds per fused loop of --part=processors


def part_processors(s):
  from specjax.prepare import prepare
  for name in s.sets:
    if name not in PROCESSOR_SETS:
      raise app.UsageError(f"--sets takes {list(PROCESSOR_SETS)}, got {name!r}")
  target, draft = common.load_pair(s.target, s.draft)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.num_prompts, s.prompt_tokens)
  rows = []
  for name in s.sets:
    for batch in s.batch:
      for temperature in s.temperature:
        kw = dict(max_new_tokens=ROUNDS * (s.gamma + 1), temperature=temperature,
                  top_k=0, top_p=1.0, eos_id=None, draft=draft, gamma=s.gamma)
        on = costs.round_timer(prepare(target, prompts[:batch], **kw, **PROCESSOR_SETS[name]),
                               ROUNDS)
        off = costs.round_timer(prepare(target, prompts[:batch], **kw), ROUNDS)
        t = costs.paired(on, off, pairs=s.pairs, timers=True)  # ratio = off / on
        row = dict(set=name, batch=batch, temperature=temperature, gamma=s.gamma,
                   round_ms=statistics.median(t["baseline_s"]) * 1e3,
                   round_with_processors_ms=statistics.median(t["method_s"]) * 1e3,
                   share=1 - t["ratio"], share_min=1 - t["ratio_max"],
                   share_max=1 - t["ratio_min"], machine=costs.machine_info())
        rows.append(row)
        print(f"{name}: batch {batch}, T={temperature:g}: round {row['round_ms']:.2f} ms, "
              f"with {row['round_with_processors_ms']:.2f} ms: {100 * row['share']:.0f}% "
              f"({100 * row['share_min']:.0f}–{100 * row['share_max']:.0f}%) of the round",
              flush=True)
  _write(s.out, rows)


# ----------------------------------------------------------------------------------
# samples: n=N against the prompt repeated N times.


def part_samples(s):
  target, _, drafter = _drafter_pair(s)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.num_prompts, s.prompt_tokens)
  temperature = _one(s, "temperature")
  kw = dict(max_new_tokens=s.max_new_tokens, temperature=temperature, eos_id=None, **drafter)
  row = dict(samples=s.samples, prompt_tokens=s.prompt_tokens,
             max_new_tokens=s.max_new_tokens, drafter=s.drafter, gamma=s.gamma,
             temperature=temperature,
             **common.compare_samples(target, prompts, s.samples, kw, s.repeats),
             machine=costs.machine_info())
  q, share = row["repeated_over_n"], row["prefill_share_of_repeated"]
  print(f"n={s.samples}, {s.prompt_tokens}-token prompts, {s.max_new_tokens} new tokens, "
        f"{s.drafter} γ={s.gamma}, T={temperature}: n {1e3 * row['call_s']['n']:.1f} ms, "
        f"repeated {1e3 * row['call_s']['repeated']:.1f} ms; repeated / n "
        f"{q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f}); the repeated batch's prefill "
        f"{share['median']:.2f} of its call ({row['calls']} pairs)")
  _write(s.out, row)


# ----------------------------------------------------------------------------------
# calls: whole calls of several settings against target-only.


def part_calls(s):
  target, draft, spec = _drafter_pair(s)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", s.num_prompts, s.prompt_tokens)
  temperature = _one(s, "temperature")
  base = dict(max_new_tokens=s.max_new_tokens, temperature=temperature, eos_id=None)
  variants = {}
  for item in s.variants:
    name, _, args = item.partition("=")
    variants[name] = dict(spec, **json.loads(args or "{}"))
  measured = None
  for name, kw in variants.items():
    # A 'ledger' variant with no draft_cost gets (c, v(γ)) measured once here.
    if kw.get("gamma_policy") == "ledger" and "draft_cost" not in kw:
      if measured is None:
        sc = common.step_costs(target, draft, s.drafter, s.gamma, 1, s.prompt_tokens,
                               temperature=temperature)
        measured = (sc["c"], sc["v"])
        print(f"measured c {measured[0]:.3f}, v({s.gamma}) {measured[1]:.2f}")
      kw["draft_cost"] = measured
  out = common.compare_calls(target, prompts, base, variants, s.repeats)
  fmt = lambda q: f"{q['median']:.3f}x ({q['q1']:.3f}–{q['q3']:.3f})"
  print("| side | call (ms) | speedup (quartiles) | tokens/round | drafted/round | against "
        "the first variant |\n|---|---|---|---|---|---|")
  for name, row in out.items():
    print(f"| {name} | {row['call_s'] * 1e3:.2f} | {fmt(row['speedup'])} | "
          f"{row['tokens_per_round']:.2f} | {row['drafted_per_round']:.2f} | "
          f"{fmt(row['against_first']) if 'against_first' in row else ''} |")
  _write(s.out, dict(machine=costs.machine_info(), drafter=s.drafter, gamma=s.gamma,
                     temperature=temperature, rounds=s.repeats,
                     variants={k: {a: b for a, b in v.items() if a != "draft"}
                               for k, v in variants.items()},
                     results={k: {a: b for a, b in v.items() if a != "tokens"}
                              for k, v in out.items()}))


RUN = {"pair": part_pair, "peer": part_peer, "accel": part_accel, "synthetic": part_synthetic,
       "stream": part_stream, "sharding": part_sharding, "processors": part_processors,
       "samples": part_samples, "calls": part_calls}
_FLAG_NAMES = sorted({name for part in PARTS.values() for name in part})


def main(argv):
  rng.use_unrolled_threefry()  # the CPU's faster random bits (specjax.rng), before tracing
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; the part is --part=...")
  RUN[_PART.value](settings(_PART.value))


if __name__ == "__main__":
  app.run(main)
