"""Ship a trained head: bfloat16 export + the numbers its card reports, measured on it.

  python -m experiments.head_card --head=/work/runs/eagle/head --out=checkpoints/stdlib-eagle

Saves the head in bfloat16, reloads it, and records in its head.json metadata:
α̂ (T = 0 and T = 1) over the card's 64 held-out windows of 256 tokens and over the
first `--test_windows` of them (the slice tests/test_heads.py re-measures), and, through
the engine's own decode loop, tokens committed per target call at γ = `--gamma` on
held-out prompts, with the shipped stdlib-draft measured on the same prompts alongside.
"""

import json

import jax
import numpy as np
from absl import app, flags

from specjax.training import data
from specjax import generation
from specjax.models import heads
from specjax.models import pretrained
from specjax.training import heads as train_heads

_HEAD = flags.DEFINE_string("head", None, "Directory of the trained head (float32 export).")
_OUT = flags.DEFINE_string("out", None, "Where the bfloat16 head goes.")
_WINDOWS = flags.DEFINE_integer("windows", 64, "Held-out windows for α̂.", lower_bound=1)
_TEST_WINDOWS = flags.DEFINE_integer("test_windows", 8, "Windows of the test slice.", lower_bound=1)
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length of the decode measurement.", lower_bound=1)
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Held-out prompts for the decode measurement.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Tokens per prompt.", lower_bound=1)
_NEW = flags.DEFINE_integer("max_new", 64, "New tokens per prompt.")
flags.mark_flags_as_required(["head", "out"])


def heldout_windows(tokenizer, seq_len: int, num_windows: int) -> np.ndarray:
  """The windows of `experiments.model_card.heldout_windows` (not imported: its flags)."""
  corpus = data.load_corpus(data.STDLIB, heldout_fraction=0.05)
  stream = data.token_stream(tokenizer, corpus.read("heldout"))
  return data.eval_windows(stream, seq_len, num_windows)


def decode_stats(target, prompts, gamma, temperature, head=None, draft=None, seed=0):
  """Committed tokens per target call and acceptance of one batch through the engine."""
  args = generation.prepare(target, prompts, max_new_tokens=_NEW.value, temperature=temperature,
                            top_k=0, top_p=1.0, eos_id=None, gamma=gamma,
                            draft=head if head is not None else draft,
                            drafter=None if head is not None or draft is not None else "ngram")
  stats = jax.device_get(args.run(jax.random.PRNGKey(seed)).stats)
  rounds, drafted = int(np.sum(stats.rounds)), int(np.sum(stats.drafted))
  return {"tokens_per_call": float(np.sum(stats.committed)) / rounds,
          "acceptance_rate": float(np.sum(stats.accepted)) / drafted}


def main(argv):
  del argv
  target = pretrained.load_pretrained("stdlib-target")
  trained = heads.load_head(_HEAD.value)
  if trained.metadata.get("target") != "stdlib-target":
    raise ValueError(f"{_HEAD.value} was not trained on stdlib-target")
  # The print of the target it was trained on, by this code's `target_fingerprint`.
  trained.target_fingerprint = heads.target_fingerprint(target.config, target.params)
  trained.check_target(target)
  heads.save_head(_OUT.value, trained, dtype="bfloat16")
  head = heads.load_head(_OUT.value)  # measure exactly what ships
  windows = heldout_windows(target.tokenizer, 256, _WINDOWS.value)
  full = train_heads.acceptance_rate(head.config, target, head.params, windows)
  test = train_heads.acceptance_rate(head.config, target, head.params,
                                     windows[: _TEST_WINDOWS.value])
  prompts = [w[: _PROMPT_LEN.value].tolist() for w in windows[:: max(1, len(windows) //
                                                                          _PROMPTS.value)]]
  prompts = prompts[: _PROMPTS.value]
  draft = pretrained.load_pretrained("stdlib-draft")
  gamma = min(_GAMMA.value, head.config.medusa_heads) if head.kind == "medusa" else _GAMMA.value
  engine = {}
  for temperature in (0.0, 1.0):
    engine[f"T{temperature:g}"] = {
        "head": decode_stats(target, prompts, gamma, temperature, head=head),
        "stdlib-draft": decode_stats(target, prompts, gamma, temperature, draft=draft)}
  card = {"heldout": f"{len(windows)} windows x 256 tokens of the stdlib held-out split",
          "alpha_t0": full["alpha_t0"], "alpha_t1": full["alpha_t1"],
          "positions": full["positions"],
          "per_head": {k: v for k, v in full.items() if k.startswith("alpha_t") and "_" in k[7:]},
          "test_slice_windows": _TEST_WINDOWS.value, "test_slice_alpha_t0": test["alpha_t0"],
          "test_slice_alpha_t1": test["alpha_t1"],
          "decode": {"gamma": gamma, "prompts": len(prompts), "prompt_len": _PROMPT_LEN.value,
                     "max_new_tokens": _NEW.value, **engine}}
  head.metadata = {**trained.metadata, "card": card}
  heads.save_head(_OUT.value, head, dtype="bfloat16")
  print(json.dumps(card, indent=2))


if __name__ == "__main__":
  app.run(main)
