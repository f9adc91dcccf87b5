r"""A decode round inside a whole `generate` call against the same round in `round_timer`'s loop.

  python -m experiments.call_rounds                        # none, ngram:2, ngram:4, model:1
  python -m experiments.call_rounds --sides=none,eagle:1 --pairs=31

The ledger prices a round from its parts, timed in loops of their own (`costs`); a
whole call runs the same `decode_round` inside `decode`'s while_loop, after the
prefill, with the condition and the round limit around it. This times, per side, one
round both ways on the first held-out prompt at T = 0 (the default sweep's shapes: a
64-token prompt, 64 new tokens):

  in a call: `costs.call_timer` (a `generate` call's work) stopped after R and after
    R / 4 rounds, differenced over the rounds between (prefill and host work cancel);
  in the loop: `costs.round_timer` of R rounds less R / 4 from the same prefilled state.

R = new tokens / (γ + 1), so no row reaches its budget first. Each pair times every side
both ways, sides in an order that rotates from pair to pair. Reported: each side's
round both ways in µs and in target-only rounds, and the median (min–max) of the
per-pair ratio call / loop.
"""

from __future__ import annotations

import statistics

from absl import app
from absl import flags

from experiments import common
from specjax import costs
from specjax.models.pretrained import load_pretrained

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model (name or directory).")
_SIDES = flags.DEFINE_list("sides", ["none", "ngram:2", "ngram:4", "model:1"],
                           "drafter:γ per side (none: target-only); model and heads use the "
                           "shipped drafts.")
_PAIRS = flags.DEFINE_integer("pairs", 21, "Interleaved rounds of timing.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens of the prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per call.")


def side_kwargs(side: str) -> tuple[dict, int]:
  """generate's keyword arguments (T = 0) and γ for 'drafter:γ' or 'none'."""
  name, _, gamma = side.partition(":")
  kw = dict(max_new_tokens=_NEW.value, temperature=0.0, eos_id=None)
  if name == "none":
    return kw, 0
  kw.update(drafter=name, gamma=int(gamma or 4))
  if name in common.DEFAULT_DRAFTS:
    kw["draft"] = load_pretrained(common.DEFAULT_DRAFTS[name])
  return kw, kw["gamma"]


def main(argv):
  del argv
  target = load_pretrained(_TARGET.value)
  prompt = common.heldout_prompts(target.tokenizer, "stdlib", 1, _PROMPT_TOKENS.value)[:1]
  sides = {}
  for side in _SIDES.value:
    kw, gamma = side_kwargs(side)
    many = _NEW.value // (gamma + 1)  # rounds no row can finish its budget within
    if many < 4:
      raise ValueError(f"{side}: --max_new_tokens={_NEW.value} leaves {many} rounds of "
                       f"{gamma + 1} tokens to time; it needs at least 4")
    sides[side] = (costs.call_timer(target, prompt, kw), many, many // 4,
                   costs.round_timer(costs._prepare(target, prompt, kw), many, many // 4))
  times = {(side, way): [] for side in sides for way in ("call", "loop")}
  names = list(sides)
  for i in range(_PAIRS.value):
    for side in names[i % len(names):] + names[:i % len(names)]:
      call, many, few, loop = sides[side]
      # Untimed first: `decode.laid_out` keeps three parameter sets laid out; with more
      # sides' sets in rotation, a side's first call would lay its draft out again.
      call(1)
      (short, _), (long, ran) = call(few), call(many)
      if ran != many:
        raise RuntimeError(f"{side}: the call stopped after {ran} of {many} rounds")
      times[(side, "call")].append((long - short) / (many - few))
      times[(side, "loop")].append(loop())
  base = {way: statistics.median(times[(names[0], way)]) for way in ("call", "loop")}
  print(f"{costs.machine_info()}")
  print(f"rounds in target-only rounds of the same way ({names[0]!r} is the unit)")
  rows = []
  for side in names:
    med = {way: statistics.median(times[(side, way)]) for way in ("call", "loop")}
    ratio = [c / lp for c, lp in zip(times[(side, "call")], times[(side, "loop")]) if lp > 0]
    rows.append({"side": side, "call_us": med["call"] * 1e6, "loop_us": med["loop"] * 1e6,
                 "call_rel": med["call"] / base["call"], "loop_rel": med["loop"] / base["loop"],
                 "ratio": statistics.median(ratio), "ratio_min": min(ratio),
                 "ratio_max": max(ratio)})
  print(common.markdown_table(rows, [
      ("side", "side", "s"), ("round in a call (µs)", "call_us", ".1f"),
      ("in the loop (µs)", "loop_us", ".1f"), ("in a call (rounds)", "call_rel", ".2f"),
      ("in the loop (rounds)", "loop_rel", ".2f"), ("call / loop", "ratio", ".2f")]))


if __name__ == "__main__":
  app.run(main)
