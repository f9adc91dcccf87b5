r"""Speed benchmark: target-only vs speculative decoding on the same engine, side by side.

  python -m experiments.bench                      # shipped pair, batch 1 and 8, T = 0 and 1
  python -m experiments.bench --peer=transformers  # plus transformers on the same weights

For each (batch, temperature): tokens/s of both, the speedup, where a round's time goes
(draft proposal, the (γ+1)-token verify pass, the rest: verification, sampling, commit,
loop), v(γ), c, and measured / predicted speedup with the ledger's E(α̂,γ)/(γc + v(γ)).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from absl import app
from absl import flags
import jax

from experiments import common
from specjax import costs
from specjax import ledger
from specjax.generation import prepare

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes.")
_TEMPERATURE = flags.DEFINE_list("temperature", ["0", "1"], "Temperatures.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "Held-out prompts.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes (best is kept).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_PEER = flags.DEFINE_enum("peer", None, ["transformers"], "Also time a peer library.")


def bench_point(target, draft, prompts, gamma, batch, temperature, max_new, repeats):
  kw = dict(max_new_tokens=max_new, temperature=temperature, seed=0)
  base_s, base_stats, base_tokens = common.timed_generate(target, prompts, batch, repeats, **kw)
  spec_s, stats, spec_tokens = common.timed_generate(target, prompts, batch, repeats,
                                                     draft=draft, gamma=gamma, **kw)
  if temperature == 0:  # lossless at T=0 means identical text
    assert spec_tokens == base_tokens, "speculative greedy output differs from target greedy"
  context = len(prompts[0]) + max_new // 2
  sc = common.step_costs(target, draft, "model", gamma, batch, context,
                         temperature=temperature)
  rounds = 16
  args = prepare(target, prompts[:batch], max_new_tokens=rounds * (gamma + 1),
                 temperature=temperature, top_k=0, top_p=1.0, eos_id=None, draft=draft,
                 gamma=gamma)
  round_s = costs.round_cost(target, args, draft.params, rounds=rounds)
  base_args = prepare(target, prompts[:batch], max_new_tokens=rounds * (gamma + 1),
                      temperature=temperature, top_k=0, top_p=1.0, eos_id=None)
  base_round_s = costs.round_cost(target, base_args, None, rounds=rounds)
  base_tps = base_stats["committed"] / base_s
  spec_tps = stats["committed"] / spec_s
  alpha = stats["alpha_hat"]
  predicted = float(ledger.predicted_speedup(alpha, gamma, sc["c"], sc["v"]))
  measured = spec_tps / base_tps
  rest = round_s - sc["propose_s"] - sc["verify_s"]
  loop_s = stats["target_calls"] * round_s  # time inside rounds, by the fused-loop cost
  return {
      "batch": batch, "temperature": temperature, "gamma": gamma,
      "target_only_tokens_per_s": base_tps, "speculative_tokens_per_s": spec_tps,
      "speedup": measured, "predicted_speedup": predicted,
      "measured_over_predicted": measured / predicted,
      "alpha_hat": alpha, "tokens_per_target_call": stats["tokens_per_target_call"],
      "expected_tokens": float(ledger.expected_tokens(alpha, gamma)),
      "c": sc["c"], "v": sc["v"], "target_step_ms": sc["target_step_s"] * 1e3,
      "round_ms": round_s * 1e3, "draft_ms": sc["propose_s"] * 1e3,
      "verify_ms": sc["verify_s"] * 1e3, "rest_ms": rest * 1e3,
      "rest_fraction": rest / round_s,
      "target_only_round_ms": base_round_s * 1e3,
      "outside_rounds_fraction": max(0.0, 1 - loop_s / spec_s),
  }


def format_rows(rows) -> str:
  head = ("| batch | T | target-only tok/s | speculative tok/s | speedup | predicted | "
          "measured/predicted | α̂ | tokens/call | round ms | draft | verify | rest | "
          "v(γ) | c | outside rounds |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    lines.append(
        f"| {r['batch']} | {r['temperature']:g} | {r['target_only_tokens_per_s']:.0f} | "
        f"{r['speculative_tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
        f"{r['predicted_speedup']:.2f}x | {r['measured_over_predicted']:.2f} | "
        f"{r['alpha_hat']:.3f} | {r['tokens_per_target_call']:.2f} | {r['round_ms']:.2f} | "
        f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['rest_ms']:.2f} "
        f"({100 * r['rest_fraction']:.0f}%) | {r['v']:.2f} | {r['c']:.3f} | "
        f"{100 * r['outside_rounds_fraction']:.0f}% |")
  return "\n".join(lines)


def main(argv):
  del argv
  target, draft = common.load_pair(_TARGET.value, _DRAFT.value)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", _NUM_PROMPTS.value,
                                   _PROMPT_TOKENS.value)
  rows = []
  for batch in map(int, _BATCH.value):
    for temperature in map(float, _TEMPERATURE.value):
      rows.append(bench_point(target, draft, prompts, _GAMMA.value, batch, temperature,
                              _MAX_NEW.value, _REPEATS.value))
      print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
  report = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "cpu_count": os.cpu_count(),
            "backend": jax.default_backend(), "target": _TARGET.value, "draft": _DRAFT.value,
            "max_new_tokens": _MAX_NEW.value, "num_prompts": _NUM_PROMPTS.value, "rows": rows}
  print(format_rows(rows))
  if _PEER.value == "transformers":
    from experiments import bench_peer
    peer = bench_peer.run_peer_benchmark(target, draft, prompts, max_new_tokens=_MAX_NEW.value,
                                         gamma=_GAMMA.value, batch=8)
    print(bench_peer.format_table(peer))
    report["peer"] = peer
  if _OUT.value:
    Path(_OUT.value).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
