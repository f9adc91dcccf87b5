r"""Where the time of a cached forward goes, per op, for T new tokens; and v(γ).

  python -m experiments.profile_forward                     # stdlib-target, cache 256
  python -m experiments.profile_forward --tokens=1,2,5,9 --pairs=9 --max_gamma=8

Every piece of one layer (qkv projection, attention over the cache, the KV write, the
out projection, the MLP) and of the top (LM head, `process_logits`) is timed alone in
its own jitted `lax.fori_loop`, fed the real weights at the real shapes, with the
cache buffers carried through the loop as the decode loop carries them. `whole` is
the full cached forward, timed exactly as `specjax.costs.forward_cost` times it; `rest`
= whole − the sum of the pieces (norms, RoPE, embedding, residuals, the loop itself).

The machine is shared, so nothing here is a ratio of two separate passes: each round
times every (piece, T) once, and T = 1 is timed right before every other T of the same
piece; each ratio is the median of the per-round ratios, with its min and max.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax import model as model_lib
from specjax import sampling
from specjax.pretrained import load_pretrained

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Model name or directory.")
_CACHE = flags.DEFINE_integer("cache_size", 256, "KV slots per row.")
_CONTEXT = flags.DEFINE_integer("context", 128, "Valid history per row when timed.")
_BATCH = flags.DEFINE_integer("batch", 1, "Rows.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "5", "9"], "T values of the per-op table.")
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 8, "v(γ) for γ = 1..max_gamma.")
_ITERS = flags.DEFINE_integer("iters", 64, "Calls per timed loop.")
_PAIRS = flags.DEFINE_integer("pairs", 7, "Timed rounds after one warm-up round.")
_OPS = flags.DEFINE_bool("ops", True, "Print the per-op table.")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return "?"


def timed_loop(body, carry, iters):
  """A () -> seconds-per-iteration timer of `iters` calls of body(carry) -> carry, jitted."""
  loop = jax.jit(lambda c: jax.lax.fori_loop(0, iters, lambda _, c: body(c), c))
  jax.block_until_ready(loop(carry))  # compile + warm

  def run():
    start = time.perf_counter()
    jax.block_until_ready(loop(carry))
    return (time.perf_counter() - start) / iters
  return run


def forward_timer(model, batch, t, context, cache_size, iters):
  """The loop of `costs.forward_cost`, kept compiled so it can be timed again and again."""
  graphdef = model.graphdef
  kv = kv_cache.init_kv(model.config, batch, cache_size)
  kv = kv.rollback(jnp.full((batch,), context, jnp.int32))

  def body(carry):
    kv, tokens = carry
    logits, new_kv = model_lib.forward_cached(graphdef, model.params, tokens, kv)
    return new_kv.rollback(kv.length), jnp.argmax(logits, -1).astype(jnp.int32)
  return timed_loop(body, (kv, jnp.zeros((batch, t), jnp.int32)), iters)


def piece_timers(model, batch, t, context, cache_size, iters):
  """{piece: timer} for one layer's pieces and the top of the model, at T = t."""
  cfg = model.config
  module = model_lib.merge(model.graphdef, model.params)
  block = module.blocks[0]
  h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  x0 = jax.random.normal(jax.random.PRNGKey(0), (batch, t, cfg.d_model), jnp.float32)
  length = jnp.full((batch,), context, jnp.int32)
  buf = jax.random.normal(jax.random.PRNGKey(1), (batch, kvh, cache_size, d), jnp.float32)
  fold = lambda x, y: x + 1e-3 * y[..., : x.shape[-1]]  # keeps each call dependent

  def split_qkv(x):
    # Stand-ins for q, k, v built from the carry (the projection is timed on its own).
    q = jnp.tile(x, (1, 1, -(-h * d // cfg.d_model)))[..., : h * d].reshape(batch, t, h, d)
    kv = x[..., : kvh * d].reshape(batch, t, kvh, d) if kvh * d <= cfg.d_model else \
        q[:, :, :kvh]
    return q, kv, kv

  def attention(carry):
    x, k_buf, v_buf = carry
    q, k, v = split_qkv(x)
    out = model_lib.attend(q, k, v, (k_buf, v_buf, length))
    # Touch one slot past the history so the buffers are loop-variant (as in decoding).
    k_buf = k_buf.at[:, :, -1, :1].set(out[:, 0, None, :1])
    return fold(x, out), k_buf, v_buf

  def kv_write(carry):
    x, k_buf, v_buf = carry
    _, k, v = split_qkv(x)
    k_buf = kv_cache.write(k_buf, k, length)
    v_buf = kv_cache.write(v_buf, v, length)
    return x + 1e-3 * k_buf[:, :1, :t, :1].reshape(batch, t, 1), k_buf, v_buf

  temperature = jnp.ones((batch,), jnp.float32)
  top_k, top_p = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), jnp.float32)
  pieces = {
      "qkv projection": (lambda x: fold(x, block.attn.qkv(x)), x0),
      "attention (read)": (attention, (x0, buf, buf)),
      "KV write (k and v)": (kv_write, (x0, buf, buf)),
      "out projection": (lambda x: fold(x, block.attn.out(x)), x0),
      "MLP": (lambda x: fold(x, block.mlp(x)), x0),
  }
  per_layer = set(pieces)
  if cfg.tie_embeddings:
    head = lambda x: module.embed.attend(x)
  else:
    head = lambda x: module.lm_head(x)
  logits0 = head(x0).astype(jnp.float32)
  pieces["LM head"] = (lambda x: fold(x, head(x)), x0)
  pieces["process_logits (T=1.0)"] = (
      lambda z: z + 1e-3 * sampling.process_logits(z, temperature, top_k, top_p), logits0)
  pieces["loop alone"] = (lambda x: x * 0.999, x0)
  timers = {name: timed_loop(body, carry, iters) for name, (body, carry) in pieces.items()}
  return timers, {name: cfg.n_layers if name in per_layer else 1 for name in pieces}


def forward_flops(cfg, t, context):
  """2 x multiply-adds of a cached forward of t tokens per row (attention over context + t)."""
  q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  ff = cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
  per_token = cfg.n_layers * (cfg.d_model * (2 * q_width + 2 * kv_width) + cfg.d_model * ff
                              + 2 * q_width * (context + t)) + cfg.d_model * cfg.vocab_size
  return 2.0 * per_token * t


def ratio_text(num, den):
  r = [a / b for a, b in zip(num, den)]
  return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"


def main(argv):
  del argv
  model = load_pretrained(_TARGET.value)
  cfg, batch, iters, pairs = model.config, _BATCH.value, _ITERS.value, _PAIRS.value
  context, cache = _CONTEXT.value, _CACHE.value
  print(f"cpu: {cpu_model()} (platform.processor()={platform.processor()!r}, "
        f"{os.cpu_count()} cores); jax {jax.__version__} on {jax.default_backend()}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{_TARGET.value}: {model.num_params / 1e6:.2f}M params, batch {batch}, cache "
        f"{cache} slots, context {context}; medians of {pairs} interleaved rounds, "
        f"{iters} calls per timed loop\n")

  if _OPS.value:
    ts = sorted({int(t) for t in _TOKENS.value} | {1})
    timers, mult = {}, {}
    for t in ts:
      pieces, mult = piece_timers(model, batch, t, context, cache, iters)
      pieces["whole forward"] = forward_timer(model, batch, t, context, cache, iters)
      for name, timer in pieces.items():
        timers[name, t] = timer
    names = list(dict.fromkeys(name for name, _ in timers))
    mult["whole forward"] = 1
    times = {key: [] for key in timers}
    for i in range(pairs + 1):
      for name in names:
        for t in ts[1:]:
          for key in ((name, 1), (name, t)):  # T = 1 right before each T: the pair
            s = timers[key]() * mult[name]
            if i:
              times[key].append(s)
    med = {key: statistics.median(v) for key, v in times.items()}
    print("| piece (per forward) | " + " | ".join(f"T={t} ms" for t in ts) + " | "
          + " | ".join(f"T={t} / T=1" for t in ts[1:]) + " |")
    print("|---" * (2 * len(ts)) + "|")
    for name in names:
      # T = 1 ran as the first half of every pair: t1[k::n] are the samples paired with T_k.
      t1, n = times[name, 1], len(ts) - 1
      ratios = [ratio_text(times[name, t], t1[k::n]) for k, t in enumerate(ts[1:])]
      print(f"| {name} | " + " | ".join(f"{med[name, t] * 1e3:.3f}" for t in ts) + " | "
            + " | ".join(ratios) + " |")
    parts = [name for name in names
             if name not in ("whole forward", "loop alone") and not name.startswith("process")]
    rest = [med["whole forward", t] - sum(med[name, t] for name in parts) for t in ts]
    print("| rest (whole - pieces) | " + " | ".join(f"{r * 1e3:.3f}" for r in rest) + " |"
          + " |" * n)
    print("\nPer-layer pieces are one layer's time x n_layers. Each row includes one empty "
          "loop step ('loop alone'). process_logits runs after the forward (verify), so it "
          "is not part of 'whole forward'.\n")

  # v(γ): the 1-token step right before each (γ+1)-token pass, every round.
  gammas = list(range(1, _MAX_GAMMA.value + 1))
  fwd = {t: forward_timer(model, batch, t, context, cache, iters) for t in [1] + [g + 1 for g in gammas]}
  one, many = {g: [] for g in gammas}, {g: [] for g in gammas}
  for i in range(pairs + 1):
    for g in gammas:
      a, b = fwd[1](), fwd[g + 1]()
      if i:
        one[g].append(a)
        many[g].append(b)
  step = [s for g in gammas for s in one[g]]
  t1 = statistics.median(step)
  print(f"1-token step: {t1 * 1e3:.3f} ms (min {min(step) * 1e3:.3f}, max "
        f"{max(step) * 1e3:.3f}), {forward_flops(cfg, 1, context) * batch / t1 / 1e9:.1f} "
        "GFLOP/s\n")
  print("| γ | tokens | pass ms | v(γ) (min-max) | GFLOP/s |")
  print("|---|---|---|---|---|")
  for g in gammas:
    ms = statistics.median(many[g])
    gflops = forward_flops(cfg, g + 1, context) * batch / ms / 1e9
    print(f"| {g} | {g + 1} | {ms * 1e3:.3f} | {ratio_text(many[g], one[g])} | {gflops:.1f} |")


if __name__ == "__main__":
  app.run(main)
