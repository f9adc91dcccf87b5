r"""n samples of a prompt: `generate(..., n=N)` against the prompt repeated N times.

  python -m experiments.bench_samples --samples=8 --out=docs/results/samples.json

Both sides give the same tokens (checked on every call): n=N prefills the prompt once
and copies its caches to its N rows, where the repeated batch prefills N copies. For
each held-out prompt the two calls are timed alternately, the order flipping from
prompt to prompt and pass to pass; reported: the median call of each, the median and
quartiles of repeated / n (the speedup), and the prefill's share of a repeated call
(its prefill alone, `decode.start`, timed the same way against the call).
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import jax

import specjax
from experiments import common
from specjax import costs
from specjax import decode as decode_lib
from specjax import generation

_DRAFTER = flags.DEFINE_enum("drafter", "ngram", ["model", "ngram"], "Drafter.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per prompt (n).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 192, "Tokens per prompt.")
_PROMPTS = flags.DEFINE_integer("prompts", 4, "Held-out prompts (one per call).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Passes over the prompts.")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "New tokens per sample.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def _quartiles(xs):
  q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
  return {"median": statistics.median(xs), "q1": q[0], "q3": q[2]}


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def compare_samples(target, prompts, n: int, kw: dict, repeats: int) -> dict:
  """n=`n` against [prompt] * n, one prompt a call, interleaved; the tokens checked
  equal on every call. Returns the medians, quartiles of repeated / n and of the
  repeated batch's prefill over its call, and the pairs timed."""
  sides = {"n": lambda p, seed: specjax.generate(target, [p], n=n, seed=seed, **kw),
           "repeated": lambda p, seed: specjax.generate(target, [p] * n, seed=seed, **kw)}

  def prefill(p):  # the repeated batch's prefill alone, as the call compiles it
    args = generation.prepare(target, [p] * n, **{"top_k": 0, "top_p": 1.0, "eos_id": None,
                                                  **kw})
    return lambda: jax.block_until_ready(decode_lib.start(
        args.engine, args.prompt_width, args.cache_size,
        decode_lib.laid_out(args.engine, args.weights), args.tokens, args.prompt_len,
        args.sampling, generation.seed_key(0)))

  prefills = [prefill(p) for p in prompts]
  for i, p in enumerate(prompts):  # compile and warm
    for side in sides.values():
      side(p, i)
    prefills[i]()
  times = {name: [] for name in sides}
  ratios, shares = [], []
  for r in range(repeats):
    for i, p in enumerate(prompts):
      order = list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]
      got = {}
      for name in order:
        t, out = _timed(lambda: sides[name](p, i))
        times[name].append(t)
        got[name] = out.tokens
      if got["n"] != got["repeated"]:
        raise AssertionError(f"n={n} and the repeated prompt gave different tokens")
      ratios.append(times["repeated"][-1] / times["n"][-1])
      t_prefill, _ = _timed(prefills[i])
      shares.append(t_prefill / times["repeated"][-1])
  return dict(call_s={k: statistics.median(v) for k, v in times.items()},
              repeated_over_n=_quartiles(ratios),
              prefill_share_of_repeated=_quartiles(shares), calls=len(ratios))


def main(argv):
  del argv
  draft_name = "stdlib-draft" if _DRAFTER.value == "model" else None
  target, draft = common.load_pair("stdlib-target", draft_name)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value,
                                   _PROMPT_TOKENS.value)
  n = _SAMPLES.value
  kw = dict(max_new_tokens=_NEW.value, temperature=_TEMPERATURE.value, gamma=_GAMMA.value,
            **(dict(draft=draft) if draft else dict(drafter="ngram")))
  row = dict(samples=n, prompt_tokens=_PROMPT_TOKENS.value, max_new_tokens=_NEW.value,
             drafter=_DRAFTER.value, gamma=_GAMMA.value, temperature=_TEMPERATURE.value,
             **compare_samples(target, prompts, n, kw, _REPEATS.value),
             machine=costs.machine_info())
  q, s = row["repeated_over_n"], row["prefill_share_of_repeated"]
  print(f"n={n}, {_PROMPT_TOKENS.value}-token prompts, {_NEW.value} new tokens, "
        f"{_DRAFTER.value} γ={_GAMMA.value}, T={_TEMPERATURE.value}: n "
        f"{1e3 * row['call_s']['n']:.1f} ms, repeated {1e3 * row['call_s']['repeated']:.1f} "
        f"ms; repeated / n {q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f}); the repeated "
        f"batch's prefill {s['median']:.2f} of its call ({row['calls']} pairs)")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(row, f, indent=1)


if __name__ == "__main__":
  app.run(main)
