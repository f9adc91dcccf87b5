r"""Speed benchmark: target-only vs speculative decoding on the same engine, side by side.

  python -m experiments.bench                      # shipped pair, batch 1 and 8, T = 0 and 1
  python -m experiments.bench --peer=transformers  # plus transformers on the same weights

For each (batch, temperature): tokens/s of both, the speedup, where a round's time goes
(draft proposal, the (γ+1)-token verify pass, the rest: verification, sampling, commit,
loop), v(γ), c, and measured / predicted speedup with the ledger's E(α̂,γ)/(γc + v(γ)).
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app
from absl import flags

from experiments import common
from specjax import costs
from specjax import ledger

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length γ.")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes.")
_TEMPERATURE = flags.DEFINE_list("temperature", ["0", "1"], "Temperatures.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "Held-out prompts.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 64, "Tokens per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_PAIRS = flags.DEFINE_integer("pairs", 3, "Speculative/target-only timing pairs (median kept).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_PEER = flags.DEFINE_enum("peer", None, ["transformers"], "Also time a peer library.")


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
# The processors' share of a round is measured paired in `experiments.bench_processors`.

VERIFY_COLUMNS = [("γ", "gamma", "d"), ("(γ+1)-token pass ms", "pass_ms", ".3f"),
                  ("v(γ)", "v", ".2f"), ("GFLOP/s", "gflops", ".1f")]


def verify_table(target, batch: int, context: int) -> tuple[dict, str]:
  """v(γ) for γ = 1..8 and the achieved GFLOP/s of each pass: regressions show here."""
  vc = costs.verify_costs(target, batch, range(1, 9), context=context)
  rows = [dict(gamma=g, **r) for g, r in vc["by_gamma"].items()]
  text = (f"batch {batch}, context {context}: 1-token step {vc['step_ms']:.3f} ms "
          f"({vc['step_gflops']:.1f} GFLOP/s)\n" + common.markdown_table(rows, VERIFY_COLUMNS))
  return vc, text


def main(argv):
  del argv
  target, draft = common.load_pair(_TARGET.value, _DRAFT.value)
  prompts = common.heldout_prompts(target.tokenizer, "stdlib", _NUM_PROMPTS.value,
                                   _PROMPT_TOKENS.value)
  report = {"machine": costs.machine_info(), "target": _TARGET.value, "draft": _DRAFT.value,
            "max_new_tokens": _MAX_NEW.value, "num_prompts": _NUM_PROMPTS.value}
  verify, text = verify_table(target, 1, _PROMPT_TOKENS.value + _MAX_NEW.value // 2)
  print(text, flush=True)
  report["verify_costs"] = verify
  rows = []
  for batch in map(int, _BATCH.value):
    for temperature in map(float, _TEMPERATURE.value):
      rows.append(bench_point(target, draft, prompts, _GAMMA.value, batch, temperature,
                              _MAX_NEW.value, _PAIRS.value))
      print(common.markdown_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
  report["rows"] = rows
  print(common.markdown_table(rows, COLUMNS))
  if _PEER.value == "transformers":
    from experiments import peer as peer_lib
    peer = peer_lib.run_peer_benchmark(target, draft, prompts, max_new_tokens=_MAX_NEW.value,
                                         gamma=_GAMMA.value, batch=8)
    print(peer_lib.format_table(peer))
    report["peer"] = peer
  if _OUT.value:
    Path(_OUT.value).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
