r"""Where the time of a cached forward goes, per op, for T new tokens; and v(γ).

  python -m experiments.profile_forward                     # stdlib-target, cache 256
  python -m experiments.profile_forward --tokens=1,2,5,9 --pairs=9 --max_gamma=8
  python -m experiments.profile_forward --rowwise_max_rows=0   # row by row off (projections, attention)
  python -m experiments.profile_forward --rounds=none,ngram,model   # + decode rounds, kernels on / off
  python -m experiments.profile_forward --off=fused --rounds=none,ngram,model  # fused layer calls on / off
  python -m experiments.profile_forward --off=bf16 --rounds=none,ngram,model   # bfloat16 panels on / off
  python -m experiments.profile_forward --trace=false --ops=false --max_gamma=4 --live_gamma=4  # narrowed passes
  python -m experiments.profile_forward --trace=false --ops=false --compare=false --products  # the kernels' own v(γ)
  python -m experiments.profile_forward --trace=false --ops=false --compare=false --max_gamma=1 --floor_tokens=0 --parts=none,ngram:2,model:1,eagle:1
  python -m experiments.profile_forward --trace=false --ops=false --compare=false --max_gamma=1 --floor_tokens=0 --host=none,ngram:4,model:1,eagle:1

Tables, each from paired, interleaved timing (the machine is shared: nothing here
is a ratio of two separate runs; each ratio is the median of per-round ratios, with its
min and max):

1. In situ: the whole cached forward (the loop of `specjax.costs.forward_cost`) run
   under `jax.profiler` with XLA:CPU's per-thunk trace events, each thunk assigned to a
   piece by the shapes of its operands (qkv / out projection, MLP up / down, LM head,
   attention dots over the cache, cache masking and copies, the KV write, the rest).
   This is where the time really goes: weights arrive cold, as in decoding.
2. In isolation: each piece alone in its own jitted `lax.fori_loop` over all layers'
   weights (the cache buffers carried as the decode loop carries them), plus
   `process_logits`, which the verify pass runs after the forward. Weights stay warmer
   here than in the whole pass. T = 1 is timed right before every other T.
3. v(γ) = (γ+1)-token pass / 1-token step for γ = 1..max_gamma, with achieved GFLOP/s,
   each pass paired with a 1-token step; with --compare, also paired with the same pass
   with --off turned off; and the per-token cost of a long pass (the compute-bound
   floor of one more verify token).
4. With --live_gamma=γ: the (γ+1)-token pass computing only L + 1 tokens (`live`, as
   a round whose longest draft is L runs it on a CPU), L = 0..γ, and the whole
   (L+1)-token pass, each paired with a 1-token step.
5. With --rounds: whole decode rounds (`costs.round_timer`: draft, verify, commit;
   γ = 4, T = 0) of each listed drafter, --off's choice on against off, paired.
6. With --products: the forward's matrix products alone through specjax's kernel
   (every laid-out weight in forward order, R rows each, R = 1..max_gamma + 1), each R
   paired with R = 1, with the weights' GB/s and the products' GFLOP/s; and the same
   number of products over the largest matrix alone (warm in cache: what the
   arithmetic allows). Their v(γ) is the part of v(γ) no change outside the kernel
   can lower.
7. With --parts: decode rounds against their parts in 1-token steps (`costs.round_parts`:
   the round, `propose`, the verify pass, and the rest), each drafter:γ listed.
8. With --host: a `generate` call's parts outside its rounds, each drafter:γ listed:
   `prepare`, the compiled call stopped after 0 rounds (its dispatch, the KV buffers and
   the prefill of both models) and `fetch`, in ms and in 1-token steps, every entry
   timed in turn after a step in each repeat.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import platform
import re
import statistics
import tempfile
import time

# Per-thunk trace events must be switched on before XLA starts (appended, never replacing
# what the user set).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import common  # noqa: E402
from specjax import costs  # noqa: E402
from specjax import backends  # noqa: E402
from specjax.backends.cpu import kernels as cpu_kernels  # noqa: E402
from specjax.models import kv_cache  # noqa: E402
from specjax.models import model as model_lib  # noqa: E402
from specjax.models.pretrained import load_pretrained  # noqa: E402
from specjax.processors import sampling  # noqa: E402

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Model name or directory.")
_CACHE = flags.DEFINE_integer("cache_size", 256, "KV slots per row.")
_CONTEXT = flags.DEFINE_integer("context", 128, "Valid history per row when timed.")
_BATCH = flags.DEFINE_integer("batch", 1, "Rows.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "5", "9"], "T values of the per-op tables.")
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 8, "v(γ) for γ = 1..max_gamma.")
_ITERS = flags.DEFINE_integer("iters", 128, "Calls per timed loop.")
_PAIRS = flags.DEFINE_integer("pairs", 7, "Timed rounds after one warm-up round.")
_TRACE = flags.DEFINE_bool("trace", True, "Print the in-situ per-op table (jax.profiler).")
_OPS = flags.DEFINE_bool("ops", True, "Print the per-op table of pieces timed alone.")
_COMPARE = flags.DEFINE_bool("compare", True, "Pair every pass with the same pass with "
                             "--off turned off.")
_OFF = flags.DEFINE_enum("off", "kernels", ["kernels", "rowwise", "fused", "bf16"], "What "
                         "--compare and --rounds turn off: kernels = specjax's few-row CPU "
                         "kernels (Options(kernels=False): the row-by-row XLA products "
                         "of before); rowwise = both, and row by row "
                         "(Options(rowwise_max_rows=0): XLA's own products with the rows "
                         "together); fused = only the fused layer calls (Options("
                         "fused_layers=False): a kernel per product and per "
                         "attention, XLA's norms, RoPE, SwiGLU, residuals and KV writes); "
                         "bf16 = bfloat16 panels (Options(bf16_panels=False): float32 "
                         "panels for bfloat16-valued weights).")
_ROWWISE = flags.DEFINE_integer("rowwise_max_rows", None, "Override "
                                "backends.Options.rowwise_max_rows for everything timed.")
_ROUNDS = flags.DEFINE_list("rounds", [], "Drafters (none, ngram, model, eagle, medusa) "
                            "whose decode rounds, γ = 4, T = 0, are timed with --off's "
                            "choice on and off.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model for the model drafter "
                             "(--rounds, --parts).")
_PARTS = flags.DEFINE_list("parts", [], "Decode rounds against their parts (propose, "
                           "verify pass, the rest), T = 0, on a held-out prompt: drafter:γ "
                           "entries, e.g. none,ngram:2,model:1,eagle:1 (heads: stdlib-eagle, "
                           "stdlib-medusa; the model: --draft).")
_HOST = flags.DEFINE_list("host", [], "A generate call's host parts (prepare, the compiled "
                         "call stopped after 0 rounds, fetch) per drafter:γ listed "
                         "(drafters as --parts).")
_LIVE = flags.DEFINE_integer("live_gamma", 0, "Also time the (γ+1)-token pass computing "
                             "only L + 1 tokens, L = 0..γ (0: off).")
_PRODUCTS = flags.DEFINE_bool("products", False, "Also time the forward's matrix products "
                               "alone, R = 1..max_gamma + 1 rows (the kernels' own v(γ)).")
_FLOOR = flags.DEFINE_integer("floor_tokens", 64, "Also time a pass of this many tokens "
                              "(per-token cost at full GEMM throughput); 0: skip.")


@contextlib.contextmanager
def rowwise_max(rows: int, kernels: bool = True, fused: bool = True, bf16: bool = True):
  """Traces inside the block run on `backends.Options(rowwise_max_rows=rows,
  kernels=kernels, fused_layers=fused, bf16_panels=bf16)` (timers lay out and compile
  here, each a program of its own)."""
  options = backends.Options(rowwise_max_rows=rows, kernels=kernels, fused_layers=fused,
                             bf16_panels=bf16)
  with backends.use(backends.select(options)):
    yield options


def switched(off: bool):
  """`rowwise_max` with --off's choice turned off (off=True) or everything on."""
  rows = backends.default_options().rowwise_max_rows
  if not off:
    return rowwise_max(rows)
  return {"kernels": lambda: rowwise_max(rows, kernels=False),
          "rowwise": lambda: rowwise_max(0, kernels=False),
          "fused": lambda: rowwise_max(rows, fused=False),
          "bf16": lambda: rowwise_max(rows, bf16=False)}[_OFF.value]()


def timed_loop(body, carry, iters):
  """`costs.loop_timer` of `iters` calls of body(carry) -> carry."""
  loop = jax.jit(lambda n, c: jax.lax.fori_loop(0, n, lambda _, c: body(c), c))
  return costs.loop_timer(loop, carry, many=iters)


def forward_timer(model, batch, t, context, cache_size, iters, live=None):
  """`costs.forward_timer`: the engine's program (weights passed in, not baked in)."""
  return costs.forward_timer(model, batch, t, context, cache_size, iters, live=live)


def piece_timers(model, batch, t, context, cache_size, iters):
  """{piece: timer} for the pieces of a forward at T = t, each over all layers' weights."""
  cfg = model.config
  module = model_lib.merge(model.graphdef, model.params)
  blocks = list(module.blocks)
  h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  x0 = jax.random.normal(jax.random.PRNGKey(0), (batch, t, cfg.d_model), jnp.float32)
  length = jnp.full((batch,), context, jnp.int32)
  bufs = tuple(jax.random.normal(jax.random.PRNGKey(i), (batch, kvh, cache_size, d))
               for i in range(2 * len(blocks)))
  fold = lambda x, y: x + 1e-3 * y[..., : x.shape[-1]]  # keeps each call dependent

  def stand_ins(x):
    # q, k, v made from the carry (the projection is timed on its own).
    reps = -(-h * d // cfg.d_model)
    q = jnp.tile(x, (1, 1, reps))[..., : h * d].reshape(batch, t, h, d)
    kv = jnp.tile(x, (1, 1, reps))[..., : kvh * d].reshape(batch, t, kvh, d)
    return q, kv, kv

  def over_layers(fn):
    def body(carry):
      for i, block in enumerate(blocks):
        carry = fn(block, i, carry)
      return carry
    return body

  def attention(block, i, carry):
    x, bufs = carry
    q, k, v = stand_ins(x)
    out = backends.current().attend(model_lib.attend, q, k, v,
                                    (bufs[2 * i], bufs[2 * i + 1], length), None)
    # Touch one slot past the history so the buffers are loop-variant (as in decoding).
    k_buf = bufs[2 * i].at[:, :, -1, :1].set(out[:, 0, None, :1])
    return fold(x, out), bufs[:2 * i] + (k_buf,) + bufs[2 * i + 1:]

  def kv_write(block, i, carry):
    x, bufs = carry
    _, k, v = stand_ins(x)
    k_buf = kv_cache.write(bufs[2 * i], k, length)
    v_buf = kv_cache.write(bufs[2 * i + 1], v, length)
    x = x + 1e-3 * k_buf[:, :1, :t, :1].reshape(batch, t, 1)
    return x, bufs[:2 * i] + (k_buf, v_buf) + bufs[2 * i + 2:]

  head = module.embed.attend if cfg.tie_embeddings else module.lm_head
  logits0 = head(x0).astype(jnp.float32)
  temperature = jnp.ones((batch,), jnp.float32)
  top_k, top_p = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), jnp.float32)
  pieces = {
      "qkv projection": (over_layers(lambda b, i, x: fold(x, b.attn.qkv(x))), x0),
      "attention over the cache": (over_layers(attention), (x0, bufs)),
      "KV write (k and v)": (over_layers(kv_write), (x0, bufs)),
      "out projection": (over_layers(lambda b, i, x: fold(x, b.attn.out(x))), x0),
      "MLP (up, SwiGLU, down)": (over_layers(lambda b, i, x: fold(x, b.mlp(x))), x0),
      "LM head": (lambda x: fold(x, head(x)), x0),  # the backend's product, row by row
      "process_logits (T=1.0)": (
          lambda z: z + 1e-3 * sampling.process_logits(z, temperature, top_k, top_p), logits0),
      "empty loop step": (lambda x: x * 0.999, x0),
  }
  return {name: timed_loop(body, carry, iters) for name, (body, carry) in pieces.items()}


# ----------------------------------------------------------------------------
# In-situ profile: XLA:CPU thunks of the whole forward, assigned to pieces by shape.

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) (\w[\w-]*)\((.*)$")
_DIMS = re.compile(r"\[([\d,]*)\]")


def _dims(shape: str) -> tuple[int, ...]:
  m = _DIMS.search(shape)
  return tuple(int(x) for x in m.group(1).split(",") if x) if m else ()


def classify_thunks(hlo_text: str, cfg, cache_size: int) -> dict[str, str]:
  """{instruction name: piece} for the instructions of a compiled forward loop."""
  shapes, instrs, comps, comp = {}, {}, collections.defaultdict(list), None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      comp = line.split(" ")[0].lstrip("%")
      for name, shape in re.findall(r"([\w.\-]+): (\w+\[[\d,]*\])", line):
        shapes[name] = shape
      continue
    m = _INSTR.match(line)
    if m:
      name, shape, op, rest = m.groups()
      shapes[name] = shape
      instrs[name] = (op, shape, rest)
      comps[comp].append(name)
  d, width = cfg.d_model, cfg.n_heads * cfg.head_dim
  weights = {
      frozenset({d, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim}): "qkv projection",
      frozenset({d, cfg.d_ff * (2 if cfg.mlp == "swiglu" else 1)}): "MLP up",
      frozenset({cfg.d_ff, d}): "MLP down",
      frozenset({width, d}): "out projection",
      frozenset({cfg.vocab_size, d}): "LM head",
  }

  def dot_piece(rest, panels=False):
    operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
    for operand in operands:
      dims = _dims(shapes.get(operand, ""))
      if panels and len(dims) == 3:  # specjax's panels [N / 16, K, 16] (cpu_kernels.pack)
        dims = (dims[1], dims[0] * dims[2])
      if len(dims) == 2 and frozenset(dims) in weights:
        return weights[frozenset(dims)]
    return "attention dots"

  def piece(name):
    op, shape, rest = instrs[name]
    called = re.search(r"calls=%([\w.\-]+)", rest)
    inner = comps.get(called.group(1), []) if called else []
    for sub in [name] + inner:
      sop, _, srest = instrs[sub]
      if sop == "dot" or (sop == "custom-call" and "specjax_" in srest):
        return dot_piece(srest, panels=sop == "custom-call")
    if op in ("scatter", "dynamic-update-slice") or "scatter" in name or \
        "dynamic-update-slice" in name:
      return "KV write"
    if cache_size in _dims(shape) and op in ("fusion", "copy", "transpose"):
      return "attention: masks, softmax, copies over the slots"
    return "rest (norms, RoPE, softmax, residuals, small ops)"
  return {name: piece(name) for name in instrs}


def in_situ(timer, piece_of, iters, rounds=1):
  """{piece: median seconds per forward} from the per-thunk trace events of `timer`."""
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir):
      for _ in range(rounds):
        timer()
    paths = [os.path.join(root, f) for root, _, files in os.walk(logdir) for f in files
             if f.endswith(".xplane.pb")]
    data = jax.profiler.ProfileData.from_file(paths[0])
  durations = collections.defaultdict(list)
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in piece_of:
          durations[event.name].append(event.duration_ns * 1e-9)
  calls = rounds * iters
  out = collections.defaultdict(float)
  for name, ds in durations.items():
    # Median duration x executions per forward: robust to a neighbour taking the core.
    out[piece_of[name]] += statistics.median(ds) * len(ds) / calls
  return out


def ratio_text(num, den):
  # Below 0.1 us the differenced times are noise (the empty loop step: the loop itself
  # adds ~0 an iteration); and a piece a T = 1 forward does not run has none.
  r = [a / b for a, b in zip(num, den) if b > 0]
  if not r or statistics.median(den) < 1e-7:
    return "-"
  return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"


def forward_flops(cfg, t, context):
  """2 x multiply-adds of a cached forward of t tokens per row (attention over context + t)."""
  q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  ff = cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
  per_token = cfg.n_layers * (cfg.d_model * (2 * q_width + 2 * kv_width) + cfg.d_model * ff
                              + 2 * q_width * (context + t)) + cfg.d_model * cfg.vocab_size
  return 2.0 * per_token * t


def print_table(title, rows, ts, times, t1_of):
  """rows: names; times[name, t]: samples; t1_of(name, t): the T=1 samples paired with t."""
  print(f"{title}\n\n| piece | " + " | ".join(f"T={t} ms" for t in ts) + " | "
        + " | ".join(f"T={t} / T=1" for t in ts[1:]) + " |")
  print("|---" * (2 * len(ts)) + "|")
  for name in rows:
    cells = [f"{statistics.median(times[name, t]) * 1e3:.3f}" for t in ts]
    ratios = [ratio_text(times[name, t], t1_of(name, t)) for t in ts[1:]]
    print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
  print()


def main(argv):
  del argv
  if _ROWWISE.value is not None:
    backends.set_default_options(backends.Options(rowwise_max_rows=_ROWWISE.value))
  model = load_pretrained(_TARGET.value)
  cfg, batch, iters, pairs = model.config, _BATCH.value, _ITERS.value, _PAIRS.value
  context, cache = _CONTEXT.value, _CACHE.value
  ts = sorted({int(t) for t in _TOKENS.value} | {1})
  print(f"cpu: {costs.machine_info()['cpu']} (platform.processor()={platform.processor()!r}, "
        f"{os.cpu_count()} cores); jax {jax.__version__} on {jax.default_backend()}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{_TARGET.value}: {model.num_params / 1e6:.2f}M params, batch {batch}, cache "
        f"{cache} slots, context {context}; medians of {pairs} interleaved rounds, "
        f"{iters} calls per timed loop; projections and attention row by row for 2.."
        f"{backends.default_options().rowwise_max_rows} rows\n")

  if _TRACE.value:
    # Each round traces one loop per T, T = 1 first.
    traced = {}
    for t in ts:
      timer = forward_timer(model, batch, t, context, cache, iters)
      hlo = timer.loop.lower(*timer.args).compile().as_text()
      traced[t] = timer, classify_thunks(hlo, cfg, cache)
    rounds = {t: [] for t in ts}
    for i in range(pairs + 1):
      for t in ts:
        profile = in_situ(*traced[t], iters)
        if i:
          rounds[t].append(profile)
    names = sorted({name for t in ts for r in rounds[t] for name in r},
                   key=lambda n: -statistics.median(r.get(n, 0.0) for r in rounds[1]))
    times = {(name, t): [r.get(name, 0.0) for r in rounds[t]] for name in names for t in ts}
    for t in ts:
      times["sum of thunks", t] = [sum(r.values()) for r in rounds[t]]
    print_table("In situ (thunk times inside the whole forward, per forward):",
                names + ["sum of thunks"], ts, times, lambda name, t: times[name, 1])

  if _OPS.value:
    timers = {}
    for t in ts:
      pieces = piece_timers(model, batch, t, context, cache, iters)
      pieces["whole forward"] = forward_timer(model, batch, t, context, cache, iters)
      for name, timer in pieces.items():
        timers[name, t] = timer
    names = list(dict.fromkeys(name for name, _ in timers))
    times = {key: [] for key in timers}
    for i in range(pairs + 1):
      for name in names:
        for t in ts[1:]:
          for key in ((name, 1), (name, t)):  # T = 1 right before each T: the pair
            s = timers[key]()
            if i:
              times[key].append(s)
    n = len(ts) - 1
    # T = 1 ran as the first half of every pair: samples k, k + n, ... go with ts[1:][k].
    print_table("Each piece alone (all layers, per forward; every row includes one empty "
                "loop step; process_logits runs after the forward):", names, ts, times,
                lambda name, t: times[name, 1][ts.index(t) - 1::n])

  # v(γ): the 1-token step right before each (γ+1)-token pass, every round; with
  # --compare, the same pair again with --off's choice turned off.
  gammas = list(range(1, _MAX_GAMMA.value + 1))
  sides = ["now"] + (["off"] if _COMPARE.value else [])
  fwd = {}
  for side in sides:
    off = side == "off"
    with switched(off):
      for t in [1] + [g + 1 for g in gammas]:
        fwd[side, t] = forward_timer(model, batch, t, context, cache, iters)
  one = {(side, g): [] for side in sides for g in gammas}
  many = {(side, g): [] for side in sides for g in gammas}
  for i in range(pairs + 1):
    for g in gammas:
      for side in sides:
        a, b = fwd[side, 1](), fwd[side, g + 1]()
        if i:
          one[side, g].append(a)
          many[side, g].append(b)
  for side in sides:
    step = [s for g in gammas for s in one[side, g]]
    t1 = statistics.median(step)
    label = "" if side == "now" else f" ({_OFF.value} off)"
    print(f"1-token step{label}: {t1 * 1e3:.3f} ms (min {min(step) * 1e3:.3f}, max "
          f"{max(step) * 1e3:.3f}), {forward_flops(cfg, 1, context) * batch / t1 / 1e9:.1f} "
          "GFLOP/s")
  head = "| γ | tokens | pass ms | v(γ) (min-max) | GFLOP/s |"
  if _COMPARE.value:
    head += " pass ms, off | v(γ), off | pass now / off |"
  print("\n" + head + "\n" + "|---" * (head.count("|") - 1) + "|")
  for g in gammas:
    ms = statistics.median(many["now", g])
    gflops = forward_flops(cfg, g + 1, context) * batch / ms / 1e9
    line = (f"| {g} | {g + 1} | {ms * 1e3:.3f} | {ratio_text(many['now', g], one['now', g])}"
            f" | {gflops:.1f} |")
    if _COMPARE.value:
      line += (f" {statistics.median(many['off', g]) * 1e3:.3f} | "
               f"{ratio_text(many['off', g], one['off', g])} | "
               f"{ratio_text(many['now', g], many['off', g])} |")
    print(line)

  if _FLOOR.value:
    # The cost of one more token when the pass is compute-bound: a long chunk's time per
    # token, paired with the 1-token step. v(γ) cannot go below 1 + γ x this / step.
    t, big, small = _FLOOR.value, [], []
    timer = forward_timer(model, batch, t, context, cache, max(iters // 8, 1))
    for i in range(pairs + 1):
      a, b = fwd["now", 1](), timer()
      if i:
        small.append(a)
        big.append(b / t)
    per = statistics.median(big)
    print(f"\nT={t} pass: {per * 1e3:.3f} ms per token "
          f"({forward_flops(cfg, t, context) * batch / t / per / 1e9:.1f} GFLOP/s) = "
          f"{ratio_text(big, small)} of a 1-token step: the floor of each extra verify "
          "token when its matmuls run at full GEMM throughput")

  if _PRODUCTS.value:
    products_table(model, _MAX_GAMMA.value + 1, iters, pairs)

  if _LIVE.value:
    live_table(model, batch, context, cache, iters, pairs, _LIVE.value)

  if _ROUNDS.value:
    round_table(model, context, pairs)

  if _PARTS.value:
    parts_table(model, pairs)

  if _HOST.value:
    host_table(model, pairs)


def live_table(model, batch, context, cache, iters, pairs, gamma):
  """The (γ+1)-token pass with L + 1 live tokens and the whole (L+1)-token pass, each
  paired with the 1-token step right before it."""
  step = forward_timer(model, batch, 1, context, cache, iters)
  timers = {}
  for length in range(gamma + 1):
    timers["narrowed", length] = forward_timer(model, batch, gamma + 1, context, cache, iters,
                                               live=length + 1)
    timers["whole", length] = forward_timer(model, batch, length + 1, context, cache, iters)
  ratios = {key: ([], []) for key in timers}
  for i in range(pairs + 1):
    for key, timer in timers.items():
      a, b = step(), timer()
      if i:
        ratios[key][0].append(b)
        ratios[key][1].append(a)
  print(f"\n| L | {gamma + 1}-token pass, L + 1 live / step | (L+1)-token pass / step |\n"
        "|---|---|---|")
  for length in range(gamma + 1):
    print(f"| {length} | {ratio_text(*ratios['narrowed', length])} | "
          f"{ratio_text(*ratios['whole', length])} |")


def products_timer(panels, rows, iters):
  """`timed_loop` of the products over `panels` in turn, R = rows: each input is the
  previous output cut or padded to the next K and RMS-normalised in the kernel, as a
  forward chains them, so nothing can be hoisted or left out. The weights are carried
  through the loop (arguments, not constants)."""
  ones = {p.shape[1]: jnp.ones((p.shape[1],), jnp.float32) for p in panels}

  def fit(x, k):
    return x[:, :k] if x.shape[1] >= k else jnp.pad(x, ((0, 0), (0, k - x.shape[1])))

  def body(carry):
    x, ps = carry
    y = x
    for p in ps:
      y = cpu_kernels.panel_matmul(fit(y, p.shape[1]), p, norm_scale=ones[p.shape[1]],
                                   eps=1e-6)
    return fit(y, x.shape[1]), ps

  x0 = jax.random.normal(jax.random.PRNGKey(0), (rows, panels[0].shape[1]), jnp.float32)
  return timed_loop(body, (x0, list(panels)), iters)


def products_table(model, max_rows, iters, pairs):
  """The forward's products alone, R = 1..max_rows rows, each paired with R = 1; and as
  many products over the largest matrix alone (its weights stay in cache)."""
  if not cpu_kernels.available():
    print(f"\n(products table skipped: specjax's kernels are not in use: "
          f"{cpu_kernels.status()})")
    return
  panels = common.laid_out_panels(model)
  largest = max(panels, key=lambda p: p.size)
  macs = sum(p.shape[0] * p.shape[1] * p.shape[2] for p in panels)
  nbytes = sum(p.size * p.dtype.itemsize for p in panels)
  ks = range(1, max_rows + 1)
  timers = {(kind, r): products_timer(ps, r, iters)
            for kind, ps in (("forward", panels), ("warm", [largest] * len(panels)))
            for r in ks}
  times = {key: [] for key in timers}
  base = {r: [] for r in ks}
  for i in range(pairs + 1):
    for r in ks:
      a, b, c = timers["forward", 1](), timers["forward", r](), timers["warm", r]()
      if i:
        base[r].append(a)
        times["forward", r].append(b)
        times["warm", r].append(c)
  warm_macs = largest.shape[0] * largest.shape[1] * largest.shape[2] * len(panels)
  print(f"\nThe forward's products alone ({len(panels)} matrices, {macs / 1e6:.2f}M "
        f"multiply-adds a row, {nbytes / 2**20:.1f} MiB of {panels[0].dtype} panels), "
        f"paired with R = 1; warm: {len(panels)} products over the largest matrix "
        f"{tuple(largest.shape)}:\n")
  print("| R | µs | weights GB/s | GFLOP/s | / R = 1 | warm µs | warm GFLOP/s |\n"
        "|---|---|---|---|---|---|---|")
  for r in ks:
    t, w = statistics.median(times["forward", r]), statistics.median(times["warm", r])
    print(f"| {r} | {t * 1e6:.0f} | {nbytes / t / 1e9:.1f} | {2 * macs * r / t / 1e9:.1f} | "
          f"{ratio_text(times['forward', r], base[r])} | {w * 1e6:.0f} | "
          f"{2 * warm_macs * r / w / 1e9:.1f} |")


def call_kwargs(name, gamma, new_tokens):
  """`specjax.generate` keyword arguments of a T = 0 call of drafter `name` (none:
  target-only) at γ; the model drafter's draft is --draft, a head's the shipped one."""
  kw = dict(max_new_tokens=new_tokens, temperature=0.0)
  if name != "none":
    kw.update(drafter=name, gamma=gamma)
  if name in common.DEFAULT_DRAFTS:
    kw["draft"] = load_pretrained(_DRAFT.value if name == "model"
                                  else common.DEFAULT_DRAFTS[name])
  return kw


def prepared_rounds(model, prompt, name, gamma, rounds):
  """`generation.prepare` of `call_kwargs`, with room for `rounds` rounds however many
  tokens each commits."""
  return costs._prepare(model, prompt, call_kwargs(name, gamma, rounds * (gamma + 1) + 8))


def round_table(model, context, pairs, rounds=16):
  """Decode rounds per drafter with specjax's CPU kernels on / off, paired."""
  prompt = jax.random.randint(jax.random.PRNGKey(0), (1, context), 0,
                              model.config.vocab_size).tolist()
  print(f"\n| drafter | round ms | {_OFF.value} off | now / off |\n|---|---|---|---|")
  for name in _ROUNDS.value:
    prepared = prepared_rounds(model, prompt, name, 0 if name == "none" else 4, rounds)
    timers = {}
    for on in (True, False):
      with switched(not on) as options:  # a round runs on its engine's options
        engine = dataclasses.replace(prepared.engine, backend_options=options)
        timers[on] = costs.round_timer(dataclasses.replace(prepared, engine=engine), rounds)
    got = costs.paired(timers[True], timers[False], pairs=pairs, timers=True)
    print(f"| {name} | {statistics.median(got['method_s']) * 1e3:.3f} | "
          f"{statistics.median(got['baseline_s']) * 1e3:.3f} | "
          f"{1 / got['ratio']:.2f} ({1 / got['ratio_max']:.2f}-{1 / got['ratio_min']:.2f}) |")


def drafter_entry(entry: str) -> tuple[str, int]:
  """'drafter:γ' of --parts and --host -> (drafter, γ); γ defaults to 4 (target-only: 0)."""
  name, _, gamma = entry.partition(":")
  return name, int(gamma) if gamma else (0 if name == "none" else 4)


def parts_table(model, pairs, rounds=64, prompt_tokens=64):
  """`costs.round_parts` of each --parts entry: where a round's time goes, in steps."""
  prompt = common.heldout_prompts(model.tokenizer, "stdlib", 1, prompt_tokens)
  print("\n| drafter | γ | round | propose | verify pass | rest | 1-token step |\n"
        "|---|---|---|---|---|---|---|")
  for entry in _PARTS.value:
    name, gamma = drafter_entry(entry)
    prepared = prepared_rounds(model, prompt, name, gamma, rounds)
    # Midway through the differenced rounds (rounds // 3 .. rounds) at 1.5 tokens a round.
    parts = costs.round_parts(model, prepared, context=prompt_tokens + rounds,
                              repeats=pairs, rounds=rounds)
    cell = lambda k: f"{parts[k]:.2f} ({parts[k + '_min']:.2f}-{parts[k + '_max']:.2f})"
    print(f"| {name} | {prepared.engine.gamma} | {cell('round')} | {cell('propose')} | "
          f"{cell('verify')} | {cell('rest')} | {parts['step_s'] * 1e3:.3f} ms |")



def host_table(model, pairs, prompt_tokens=64, new_tokens=64):
  """A `generate` call's parts outside its rounds, per --host entry (CPU_VERIFY.md,
  "Thirteenth pass"): `prepare`, the compiled call stopped after 0 rounds and waited
  for, and `fetch`. Each repeat times a 1-token step, then every entry in turn."""
  from specjax import generation
  prompt = common.heldout_prompts(model.tokenizer, "stdlib", 1, prompt_tokens)
  step = forward_timer(model, 1, 1, prompt_tokens, _CACHE.value, 32)
  entries = []
  for entry in _HOST.value:
    name, gamma = drafter_entry(entry)
    entries.append((name, gamma, call_kwargs(name, gamma, new_tokens)))
  key = jax.random.PRNGKey(0)
  parts = ("prepare", "call", "fetch")
  times = collections.defaultdict(list)
  for i in range(pairs + 1):  # the first repeat compiles
    one = step()
    for name, gamma, kw in entries:
      t0 = time.perf_counter()
      args = costs._prepare(model, prompt, kw)
      t1 = time.perf_counter()
      state = jax.block_until_ready(args.run(key, 0))
      t2 = time.perf_counter()
      generation.fetch(state, args.engine.gamma)
      t3 = time.perf_counter()
      if i:
        for part, seconds in zip(parts + ("sum",), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
          times[name, gamma, part].append(seconds)
          times[name, gamma, part, "steps"].append(seconds / one)
    if i:
      times["step"].append(one)
  print(f"\nA call's parts outside its rounds ({prompt_tokens}-token prompt, "
        f"{new_tokens} new tokens, T = 0; 1-token step "
        f"{statistics.median(times['step']) * 1e3:.3f} ms): ms (1-token steps)\n"
        "| drafter | γ | prepare | call, 0 rounds | fetch | sum |\n|---|---|---|---|---|---|")
  for name, gamma, _ in entries:
    cell = lambda part: (f"{statistics.median(times[name, gamma, part]) * 1e3:.3f} "
                         f"({statistics.median(times[name, gamma, part, 'steps']):.1f})")
    print(f"| {name} | {gamma} | " + " | ".join(cell(p) for p in parts + ("sum",)) + " |")


if __name__ == "__main__":
  app.run(main)
