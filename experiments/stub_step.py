"""The decode loop's work beyond the forward, with the forward replaced by a stub.

    python -m experiments.stub_step [--vocab 128256] [--batch 1] [--repeats 7]

The stub's logits are rows of a fixed random table picked by the input tokens (so the
argmax moves), its cache only grows: what a step costs beyond it is the loop's own work
(processing, the rule, the commit, the stats). Timed, interleaved, as the difference of
calls of R2 and R1 rounds (one compiled program each):
  stub     a fori_loop over the stub alone (one logit fed back as the token);
  minimal  the same loop with an argmax picking the next token (T=1: a softmax and a
           Gumbel draw, `sampling.sample`);
  engine   `generate`'s program, target-only, at each temperature given, its while
           loop testing `done` every K rounds for each K of --check_every;
  static   with --static: the static trip count `generate` compiles off a CPU where
           nothing ends a row early (forced on; a program per budget: R1 and R2 new
           tokens, the whole budget).
Reported per step: medians and quartiles over `repeats`, and (engine - stub) /
(minimal - stub), the work beyond the forward against the minimal loop's; for each K
and the static count, the per-repeat ratio of its step to K = 1's (median [min, max]).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import backends
from specjax.models import model as model_lib
from specjax.models.config import ModelConfig
from specjax.models.model import init_model
from specjax.prepare import prepare, seed_key
from specjax.processors.sampling import argmax, sample

_TABLE_ROWS = 61


def _stub_logits(table, tokens):
  # The added term makes a fresh [.., V] array each step, as a forward's LM head does.
  return table[tokens % _TABLE_ROWS] + (tokens % 7)[..., None].astype(table.dtype) * 1e-3


def stub_forward(table):
  def forward_cached(graphdef, params, tokens, kv, empty=False, hidden=False, **_):
    logits = _stub_logits(table, tokens)
    kv = kv.rollback(kv.length + tokens.shape[1])
    if hidden:
      return logits, kv, jnp.zeros(tokens.shape + (1,), logits.dtype)
    return logits, kv
  return forward_cached


def _time(fn):
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--vocab", type=int, default=128256)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--rounds", type=int, nargs=2, default=(8, 72))
  ap.add_argument("--temperatures", type=float, nargs="+", default=(0.0, 1.0))
  ap.add_argument("--check_every", type=int, nargs="+", default=(1,),
                  help="the engine's K values (Engine.check_every), each timed")
  ap.add_argument("--static", action="store_true",
                  help="also time the static trip count (a program per budget)")
  a = ap.parse_args(argv)
  r1, r2 = a.rounds
  if not 0 < r1 < r2:
    raise SystemExit(f"--rounds must be 0 < R1 < R2, got {a.rounds}")
  if min(a.check_every) < 1:
    raise SystemExit(f"--check_every must be >= 1, got {a.check_every}")
  ks = sorted(set(a.check_every) | {1})
  table = jax.random.normal(jax.random.PRNGKey(0), (_TABLE_ROWS, a.vocab)) * 3
  model_lib.forward_cached = stub_forward(table)  # traced by every program below

  cfg = ModelConfig(vocab_size=a.vocab, d_model=8, n_layers=1, n_heads=1, max_len=r2 + 16)
  model = init_model(cfg)
  prompts = [[1, 2, 3]] * a.batch

  @functools.partial(jax.jit, static_argnums=2)
  def loop(rounds, token, pick):
    def body(i, tok):
      logits = _stub_logits(table, tok)
      # stub: one logit keeps the data dependence; minimal: the argmax a greedy step
      # needs, as the engine's backend computes it; sampled: softmax and a Gumbel draw
      if pick == "sampled":
        key = jax.random.fold_in(jax.random.PRNGKey(0), i)
        return sample(key, jax.nn.softmax(logits, axis=-1))
      return (argmax(logits) if pick else logits[:, 0] > 0).astype(jnp.int32)
    with backends.use(backends.select()):
      return jax.lax.fori_loop(0, rounds, body, token)

  tok = jnp.ones((a.batch,), jnp.int32)
  cases = {"stub": lambda r: loop(r, tok, None), "minimal": lambda r: loop(r, tok, "argmax")}
  if any(t > 0 for t in a.temperatures):
    cases["minimal T=1"] = lambda r: loop(r, tok, "sampled")
  def engine(p, k):  # the while loop (the limit cuts the budget), testing every K rounds
    p = dataclasses.replace(p, engine=dataclasses.replace(p.engine, check_every=k))
    return lambda r: p.run(seed_key(0), r).tokens

  for t in a.temperatures:
    p = prepare(model, prompts, max_new_tokens=r2 + 4, temperature=t, eos_id=None)
    for k in ks:
      cases[f"engine T={t:g}" + (f" K={k}" if len(ks) > 1 else "")] = engine(p, k)
    if a.static:  # whole budgets of R1 and R2 tokens: the loop of that static count
      fixed = {r: prepare(model, prompts, max_new_tokens=r, temperature=t, eos_id=None)
               for r in (r1, r2)}
      fixed = {r: dataclasses.replace(f, engine=dataclasses.replace(f.engine, static_trip=True))
               for r, f in fixed.items()}  # on, whatever the platform's default
      assert all(f.rounds == r for r, f in fixed.items())
      cases[f"static T={t:g}"] = (lambda f: lambda r: f[r].run(seed_key(0)).tokens)(fixed)
  times = {k: [] for k in cases}
  for k, fn in cases.items():  # compile, warm
    jax.block_until_ready(fn(r1)), jax.block_until_ready(fn(r2))
  for _ in range(a.repeats):  # interleaved
    for k, fn in cases.items():
      times[k].append((_time(lambda: fn(r2)) - _time(lambda: fn(r1))) / (r2 - r1))
  med = {k: float(np.median(v)) for k, v in times.items()}
  print(f"vocab {a.vocab}, batch {a.batch}, {a.repeats} interleaved repeats; per step, µs "
        "(median [quartiles])")
  for k, v in times.items():
    q1, q3 = np.percentile(v, [25, 75]) * 1e6
    extra = ""
    base = None
    if len(ks) > 1 and k.startswith("engine") and not k.endswith(" K=1"):
      base = k.rsplit(" ", 1)[0] + " K=1"
    elif k.startswith("static"):
      base = "engine" + k[len("static"):] + (" K=1" if len(ks) > 1 else "")
    if base is not None:  # paired: each repeat's ratio to K = 1 timed beside it
      ratio = np.asarray(v) / np.asarray(times[base])
      extra = (f"  /K=1: {np.median(ratio):.3f}x [{ratio.min():.3f}, {ratio.max():.3f}]")
    elif k.startswith("engine"):
      ref = "minimal" if " T=0" in k else "minimal T=1"
      extra = (f"  beyond the stub: {(med[k] - med['stub']) / (med[ref] - med['stub']):.2f}x"
               f" {ref}'s; whole step {med[k] / med[ref]:.2f}x")
    print(f"  {k:18s} {med[k] * 1e6:8.1f} [{q1:.1f}, {q3:.1f}]{extra}")


if __name__ == "__main__":
  main()
