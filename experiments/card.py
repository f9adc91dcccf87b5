r"""The numbers a shipped checkpoint's card reports, measured: a target/draft pair, or a head.

  python -m experiments.card --target=stdlib-target --draft=stdlib-draft \
      --out=checkpoints/card.json                                       # the pair's card
  python -m experiments.card --head=/work/runs/eagle/head --out=checkpoints/stdlib-eagle
  python -m experiments.card --head=/work/runs/medusa/head --out=checkpoints/stdlib-medusa
  python -m experiments.card --head=/work/runs/eagle3/head --out=checkpoints/stdlib-eagle3 \
      --prompts=32 --more_gammas=6 --beside=stdlib-eagle

What does a checkpoint measure, so its card can say it? Without --head, the pair: held-out
loss and bits per byte of both models, the acceptance rate α̂ = mean over held-out
positions of Σ_x min(p(x), q(x)) by teacher forcing both on the same text (at
temperature 0 the argmax agreement rate), the cost of a cached 1-token step and of a
(γ+1)-token verify pass (each inside one fused `lax.fori_loop`: no Python or host sync
counted), and the ledger's predicted speedup by γ; printed as JSON and as the tables of
checkpoints/README.md, written to --out (a JSON file) when given.

With --head (a trained EAGLE / Medusa head's float32 export): saves it to --out in
bfloat16, reloads it, and records in its head.json metadata α̂ (T = 0 and 1) over the
held-out windows and over the first --test_windows of them (the slice tests/test_heads.py
re-measures), and, through the engine's decode loop, tokens committed per target call at
γ = --gamma on held-out prompts, the shipped --draft measured on the same prompts beside it;
with --more_gammas and --beside (other shipped heads), every head at every γ on the same
prompts, and each --beside head's propose step timed against this one's, alternately.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common
from specjax import rng
from specjax import costs
from specjax import prepare as prepare_lib
from specjax import ledger
from specjax.models import heads
from specjax.models.pretrained import load_pretrained
from specjax.training import heads as train_heads
from specjax.training import lm as train_lib

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target model name or directory.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model name or directory (with "
                             "--head: the draft measured beside the head).")
_HEAD = flags.DEFINE_string("head", None, "A trained head's directory (float32 export): make "
                            "the head's card instead of the pair's.")
_OUT = flags.DEFINE_string("out", "", "The pair's card.json (default: print only); with "
                           "--head, where the bfloat16 head goes (required).")
_WINDOWS = flags.DEFINE_integer("windows", 64, "Held-out windows of seq_len tokens.",
                                lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per held-out window.", lower_bound=1)
# The pair only.
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 8, "Verify passes of 2..max_gamma+1 tokens.",
                                  lower_bound=1)
# The head only.
_TEST_WINDOWS = flags.DEFINE_integer("test_windows", 8, "Windows of the head's test slice.",
                                     lower_bound=1)
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length of the head's decode measurement.",
                              lower_bound=1)
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Held-out prompts for the head's decode "
                                "measurement.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Tokens per prompt.", lower_bound=1)
_NEW = flags.DEFINE_integer("max_new", 64, "New tokens per prompt.")
_MORE_GAMMAS = flags.DEFINE_list("more_gammas", [], "Further draft lengths of the head's "
                                 "decode measurement (card['decode_by_gamma']).")
_BESIDE = flags.DEFINE_list("beside", [], "Shipped heads measured beside this one: the same "
                            "prompts at every γ, and their propose step timed against this "
                            "one's, alternately (card['beside']).")

PAIR_ONLY = ("max_gamma",)
HEAD_ONLY = ("test_windows", "gamma", "prompts", "prompt_len", "max_new", "more_gammas",
             "beside")

# The small fixed slice tests/test_pretrained.py re-measures (fast on any CPU).
TEST_SLICE_WINDOWS = 16
# The context the costs are measured at, and the γ at which c is measured.
COST_CONTEXT = 128
COST_GAMMA = 4


# ----------------------------------------------------------------------------------
# A target/draft pair.


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
  windows = common.heldout_windows(tokenizer, length, num_windows)
  nats = np.concatenate([
      np.asarray(train_lib.eval_batch(model.graphdef, model.params,
                                       jnp.asarray(windows[i: i + 4])))
      for i in range(0, len(windows), 4)])
  half = length // 2
  return {f"loss_positions_0_{half - 1}": float(nats[:, :half].mean()),
          f"loss_positions_{half}_{length - 1}": float(nats[:, half:].mean())}


def measure_pair(target_name: str, draft_name: str, num_windows: int, seq_len: int,
                 max_gamma: int) -> dict:
  target, draft = load_pretrained(target_name), load_pretrained(draft_name)
  tok = target.tokenizer
  byte_lengths = tok.token_byte_lengths()
  windows = common.heldout_windows(tok, seq_len, num_windows)
  test_slice = common.heldout_windows(tok, seq_len, TEST_SLICE_WINDOWS)
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
  c = common.step_costs(target, draft, "model", COST_GAMMA, 1, COST_CONTEXT,
                        temperature=1.0)["c"]
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


# ----------------------------------------------------------------------------------
# A head.


def decode_stats(target, prompts, gamma, temperature, max_new, head=None, draft=None, seed=0):
  """Committed tokens per target call and acceptance of one batch through the engine."""
  args = prepare_lib.prepare(target, prompts, max_new_tokens=max_new, temperature=temperature,
                            top_k=0, top_p=1.0, eos_id=None, gamma=gamma,
                            draft=head if head is not None else draft,
                            drafter=None if head is not None or draft is not None else "ngram")
  stats = jax.device_get(args.run(jax.random.PRNGKey(seed)).stats)
  rounds, drafted = int(np.sum(stats.rounds)), int(np.sum(stats.drafted))
  return {"tokens_per_call": float(np.sum(stats.committed)) / rounds,
          "acceptance_rate": float(np.sum(stats.accepted)) / drafted}


def ship_head(head_dir: str, out: str, target_name: str, draft_name: str) -> dict:
  """Exports the head in bfloat16 to `out` and writes its measured card into its metadata."""
  target = load_pretrained(target_name)
  trained = heads.load_head(head_dir)
  if trained.metadata.get("target") != target_name:
    raise ValueError(f"{head_dir} was not trained on {target_name}")
  # The print of the target it was trained on, by this code's `target_fingerprint`.
  trained.target_fingerprint = heads.target_fingerprint(target.config, target.params)
  trained.check_target(target)
  heads.save_head(out, trained, dtype="bfloat16")
  head = heads.load_head(out)  # measure exactly what ships
  windows = common.heldout_windows(target.tokenizer, _SEQ_LEN.value, _WINDOWS.value)
  full = train_heads.acceptance_rate(head.config, target, head.params, windows)
  test = train_heads.acceptance_rate(head.config, target, head.params,
                                     windows[: _TEST_WINDOWS.value])
  prompts = [w[: _PROMPT_LEN.value].tolist()
             for w in windows[:: max(1, len(windows) // _PROMPTS.value)]]
  prompts = prompts[: _PROMPTS.value]
  draft = load_pretrained(draft_name)
  gamma = min(_GAMMA.value, head.config.medusa_heads) if head.kind == "medusa" else _GAMMA.value
  engine = {}
  for temperature in (0.0, 1.0):
    engine[f"T{temperature:g}"] = {
        "head": decode_stats(target, prompts, gamma, temperature, _NEW.value, head=head),
        draft_name: decode_stats(target, prompts, gamma, temperature, _NEW.value, draft=draft)}
  card = {"heldout": f"{len(windows)} windows x {_SEQ_LEN.value} tokens of the stdlib "
                     "held-out split",
          "alpha_t0": full["alpha_t0"], "alpha_t1": full["alpha_t1"],
          "positions": full["positions"],
          "per_head": {k: v for k, v in full.items() if k.startswith("alpha_t") and "_" in k[7:]},
          "test_slice_windows": _TEST_WINDOWS.value, "test_slice_alpha_t0": test["alpha_t0"],
          "test_slice_alpha_t1": test["alpha_t1"],
          "decode": {"gamma": gamma, "prompts": len(prompts), "prompt_len": _PROMPT_LEN.value,
                     "max_new_tokens": _NEW.value, **engine}}
  gammas = [gamma] + [int(g) for g in _MORE_GAMMAS.value if int(g) != gamma]
  beside = {name: load_pretrained(name) for name in _BESIDE.value}
  if len(gammas) > 1 or beside:
    card["decode_by_gamma"] = {
        str(g): {f"T{t:g}": {"head": decode_stats(target, prompts, g, t, _NEW.value, head=head),
                             **{name: decode_stats(target, prompts, g, t, _NEW.value, head=other)
                                for name, other in beside.items()}}
                 for t in (0.0, 1.0)} for g in gammas}
  if beside:
    card["beside"] = {name: step_beside(target, head, other) for name, other in beside.items()}
  head.metadata = {**trained.metadata, "card": card}
  heads.save_head(out, head, dtype="bfloat16")
  return card


def step_beside(target, head, other, pairs: int = 9) -> dict:
  """One propose call (γ = COST_GAMMA, batch 1, T = 1) of `head` against `other`'s, timed
  alternately; ratio = other's time / head's (> 1: `head` drafts faster), and each one's
  c (`costs.step_costs`)."""
  from specjax import arguments, timing
  timers = []
  for h in (head, other):
    drafter = arguments.make_drafter(target, h, None, COST_GAMMA, "probabilistic", 1, 4)
    timers.append(timing.propose_timer(drafter, h.draft_params(target), 1,
                                       target.config.vocab_size, COST_CONTEXT))
  res = timing.paired(timers[0], timers[1], pairs=pairs, timers=True)
  cs = [common.step_costs(target, h, h.kind, COST_GAMMA, 1, COST_CONTEXT)["c"]
        for h in (head, other)]
  return {"gamma": COST_GAMMA, "context": COST_CONTEXT, "step_ratio": res["ratio"],
          "step_ratio_min": res["ratio_min"], "step_ratio_max": res["ratio_max"],
          "c_head": cs[0], "c_beside": cs[1]}


def main(argv):
  del argv
  rng.use_unrolled_threefry()  # the CPU's faster random bits (specjax.rng), before tracing
  if _HEAD.value:
    common.refuse_flags(PAIR_ONLY, "is a flag of the pair's card (no --head)")
    if not _OUT.value:
      raise app.UsageError("--head needs --out: where the bfloat16 head goes")
    print(json.dumps(ship_head(_HEAD.value, _OUT.value, _TARGET.value, _DRAFT.value), indent=2))
    return
  common.refuse_flags(HEAD_ONLY, "is a flag of a head's card (--head)")
  card = measure_pair(_TARGET.value, _DRAFT.value, _WINDOWS.value, _SEQ_LEN.value,
                      _MAX_GAMMA.value)
  text = json.dumps(card, indent=2, sort_keys=True)
  print(text)
  print(markdown_tables(card))
  if _OUT.value:
    Path(_OUT.value).write_text(text + "\n")


if __name__ == "__main__":
  app.run(main)
