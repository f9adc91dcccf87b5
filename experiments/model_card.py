"""Measures every number of the model card of a target/draft pair and writes card.json.

  python -m experiments.model_card --target=stdlib-target --draft=stdlib-draft \
      --out=checkpoints/card.json

Held-out loss and bits per byte of both models, the acceptance rate α̂ = mean over
held-out positions of Σ_x min(p(x), q(x)) by teacher forcing both models on the same
text (at temperature 0 this is the argmax agreement rate), and the cost of a cached
1-token step and of a (γ+1)-token verify pass, each timed inside one fused
`lax.fori_loop` so no Python or host sync is counted.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common
from specjax import costs
from specjax.training import data
from specjax import generation
from specjax import ledger
from specjax.models.pretrained import load_pretrained
from specjax.training import lm as train_lib

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model name or directory.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model name or directory.")
_OUT = flags.DEFINE_string("out", "", "Where to write the JSON (default: print only).")
_WINDOWS = flags.DEFINE_integer("windows", 64, "Held-out windows of seq_len tokens.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per held-out window.", lower_bound=1)
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 8, "Verify passes of 2..max_gamma+1 tokens.", lower_bound=1)

# The small fixed slice tests/test_pretrained.py re-measures (fast on any CPU).
TEST_SLICE_WINDOWS = 16


def heldout_windows(tokenizer, seq_len: int, num_windows: int) -> np.ndarray:
  """Fixed windows spread over the held-out half of this interpreter's stdlib."""
  corpus = data.load_corpus(data.STDLIB, heldout_fraction=0.05)
  stream = data.token_stream(tokenizer, corpus.read("heldout"))
  return data.eval_windows(stream, seq_len, num_windows)


# The context the costs are measured at, and the γ at which c is measured.
COST_CONTEXT = 128
COST_GAMMA = 4


def step_costs(model, max_gamma: int) -> dict[str, float]:
  """Milliseconds per cached 1-token step and per (γ+1)-token pass, batch 1 (costs.py)."""
  vc = costs.verify_costs(model, 1, range(1, max_gamma + 1), context=COST_CONTEXT, repeats=7)
  out = {"step_ms": vc["step_ms"]}
  for gamma, row in vc["by_gamma"].items():
    out[f"pass_{gamma + 1}_tokens_ms"] = row["pass_ms"]
  return out


def loss_by_position_half(model, tokenizer, num_windows: int = 16) -> dict[str, float]:
  """Held-out loss on max_len-token windows, split at half the context.

  The pair trains on 256-token windows; this shows what happens past them.
  """
  length = model.config.max_len
  windows = heldout_windows(tokenizer, length, num_windows)
  nats = np.concatenate([
      np.asarray(train_lib.eval_batch(model.graphdef, model.params, jnp.asarray(windows[i: i + 4])))
      for i in range(0, len(windows), 4)])
  half = length // 2
  return {f"loss_positions_0_{half - 1}": float(nats[:, :half].mean()),
          f"loss_positions_{half}_{length - 1}": float(nats[:, half:].mean())}


def measure(target_name: str, draft_name: str, num_windows: int, seq_len: int,
            max_gamma: int) -> dict:
  target, draft = load_pretrained(target_name), load_pretrained(draft_name)
  tok = target.tokenizer
  byte_lengths = tok.token_byte_lengths()
  windows = heldout_windows(tok, seq_len, num_windows)
  test_slice = heldout_windows(tok, seq_len, TEST_SLICE_WINDOWS)
  card = {"environment": {
      **costs.machine_info(), "python": platform.python_version(),
      "heldout": f"{len(windows)} windows x {seq_len} tokens of the stdlib held-out split"}}
  for role, m in (("target", target), ("draft", draft)):
    ev = train_lib.evaluate(m.graphdef, m.params, windows, byte_lengths)
    ev_slice = train_lib.evaluate(m.graphdef, m.params, test_slice, byte_lengths)
    card[role] = {
        "name": target_name if role == "target" else draft_name,
        "num_params": m.num_params, "config": m.config.to_dict(),
        "heldout_loss": ev["loss"], "heldout_bits_per_byte": ev["bits_per_byte"],
        "heldout_bytes_per_token": ev["bytes_per_token"],
        "test_slice_loss": ev_slice["loss"], "test_slice_windows": TEST_SLICE_WINDOWS,
        **loss_by_position_half(m, tok),
        **step_costs(m, max_gamma)}
    print(f"{role}: {json.dumps(card[role], default=str)}", flush=True)
  card["pair"] = train_lib.acceptance_rate(target, draft, windows)
  # The one definition of c (costs.step_costs): a whole draft proposal (sampling
  # included, T = 1) per drafted token over a 1-token target step.
  drafter = generation.make_drafter(target, draft, "model", COST_GAMMA, "probabilistic", 1, 4)
  c = costs.step_costs(target, drafter, draft.params, 1, COST_CONTEXT, temperature=1.0)["c"]
  predictions = {}
  for gamma in range(1, max_gamma + 1):
    v = card["target"][f"pass_{gamma + 1}_tokens_ms"] / card["target"]["step_ms"]
    e = float(ledger.expected_tokens(card["pair"]["alpha_t0"], gamma))
    predictions[gamma] = {"v": v, "tokens_per_target_call": e,
                          "predicted_speedup_t0": float(ledger.predicted_speedup(
                              card["pair"]["alpha_t0"], gamma, c, v))}
  best = max(predictions, key=lambda g: predictions[g]["predicted_speedup_t0"])
  card["pair"].update({"cost_ratio_c": c, "by_gamma": predictions, "best_gamma_t0": best})
  return card


def markdown_tables(card: dict) -> str:
  """The measured numbers as the Markdown tables of checkpoints/README.md."""
  t, d, pair = card["target"], card["draft"], card["pair"]
  half = t["config"]["max_len"] // 2
  lines = [
      "| | stdlib-target | stdlib-draft |", "|---|---|---|",
      f"| parameters | {t['num_params']:,} | {d['num_params']:,} |",
      f"| held-out loss (nats/token) | {t['heldout_loss']:.4f} | {d['heldout_loss']:.4f} |",
      f"| held-out bits per byte | {t['heldout_bits_per_byte']:.4f} | "
      f"{d['heldout_bits_per_byte']:.4f} |",
      f"| loss, positions 0–{half - 1} / {half}–{2 * half - 1} | "
      f"{t[f'loss_positions_0_{half - 1}']:.3f} / {t[f'loss_positions_{half}_{2 * half - 1}']:.3f} | "
      f"{d[f'loss_positions_0_{half - 1}']:.3f} / {d[f'loss_positions_{half}_{2 * half - 1}']:.3f} |",
      f"| cached 1-token step (ms) | {t['step_ms']:.3f} | {d['step_ms']:.3f} |",
      "", f"α̂ over {pair['positions']:,} held-out positions: "
      f"**{pair['alpha_t0']:.3f} at temperature 0**, **{pair['alpha_t1']:.3f} at temperature 1**; "
      f"draft/target step cost c = {pair['cost_ratio_c']:.3f}.", "",
  ]
  rows = [dict(gamma=int(g), pass_ms=t[f"pass_{int(g) + 1}_tokens_ms"], **row)
          for g, row in sorted(pair["by_gamma"].items(), key=lambda kv: int(kv[0]))]
  lines.append(common.markdown_table(rows, [
      ("γ", "gamma", "d"), ("target pass of γ+1 tokens (ms)", "pass_ms", ".3f"),
      ("v(γ)", "v", ".2f"), ("E(α̂₀, γ) tokens/target call", "tokens_per_target_call", ".2f"),
      ("predicted speedup E / (γc + v)", "predicted_speedup_t0", ".2f")]))
  return "\n".join(lines)


def main(argv):
  del argv
  card = measure(_TARGET.value, _DRAFT.value, _WINDOWS.value, _SEQ_LEN.value, _MAX_GAMMA.value)
  text = json.dumps(card, indent=2, sort_keys=True)
  print(text)
  print(markdown_tables(card))
  if _OUT.value:
    Path(_OUT.value).write_text(text + "\n")


if __name__ == "__main__":
  app.run(main)
