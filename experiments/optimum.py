r"""How far a tree node's rule is from the multi-draft optimum, on a real pair.

  python -m experiments.optimum                                  # shipped pair, T = 0.7, 1
  python -m experiments.optimum --temperatures=1 --windows=4 --out=runs/optimum.json

At each position of held-out windows the target's p and the draft's q (teacher forced,
both through the sampler's `process_logits`) give, exactly (`specjax.verify.optimum`):
  one draft      Σ min(p, q): a chain's acceptance, which no rule with one draft beats;
  node rule      P(a child accepted) at a node of 2 children drawn without replacement
                 under specjax's recursive node rule (the static trees' sampled nodes);
  optimum        the most any lossless rule accepts from those 2 children;
  optimum iid    the same for 2 i.i.d. children (what drafting with replacement allows).
It reports their means over positions; gap = optimum − node rule.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app
from absl import flags
import jax
import numpy as np

from experiments import common
from specjax.models.pretrained import load_pretrained
from specjax.processors.sampling import process_logits
from specjax.verify import optimum

_TARGET = flags.DEFINE_string("target", "stdlib-target", "Target: a shipped name or directory.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft model: a shipped name or directory.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0.7", "1.0"], "Temperatures (> 0).")
_WINDOWS = flags.DEFINE_integer("windows", 8, "Held-out windows.")
_LENGTH = flags.DEFINE_integer("length", 64, "Tokens per window (every position is a node).")
_OUT = flags.DEFINE_string("out", None, "Write the results here (JSON).")


def node_acceptance(p: np.ndarray, q: np.ndarray) -> dict:
  """p, q [N, V] float64 -> each quantity's mean over the N nodes, and the gaps' quartiles."""
  rows = {"one draft": [], "node rule": [], "optimum": [], "optimum iid": []}
  for pi, qi in zip(p, q):  # one node at a time: the node rule's pass is V x V
    rows["one draft"].append(float(optimum.node_rule_acceptance(pi, qi, 1)))
    rows["node rule"].append(float(optimum.node_rule_acceptance(pi, qi, 2)))
    rows["optimum"].append(float(optimum.optimal_acceptance(pi, qi, 2)))
    rows["optimum iid"].append(float(optimum.optimal_acceptance(pi, qi, 2, replacement=True)))
  gap = np.array(rows["optimum"]) - np.array(rows["node rule"])
  out = {name: float(np.mean(v)) for name, v in rows.items()}
  out["gap"] = float(np.mean(gap))
  out["gap quartiles"] = common.quartiles(gap.tolist())
  out["nodes"] = len(gap)
  return out


def measure(target, draft, windows: np.ndarray, temperatures) -> dict:
  tl = np.asarray(jax.device_get(target.logits(windows)), np.float64)
  dl = np.asarray(jax.device_get(draft.logits(windows)), np.float64)
  res = {}
  for t in temperatures:
    if not t > 0:
      raise app.UsageError(f"--temperatures must be > 0 (at 0 every node is a point mass), "
                           f"got {t}")
    p = np.asarray(process_logits(tl, t, 0, 1.0), np.float64).reshape(-1, tl.shape[-1])
    q = np.asarray(process_logits(dl, t, 0, 1.0), np.float64).reshape(-1, dl.shape[-1])
    p /= p.sum(-1, keepdims=True)  # float32 sums to 1 within 1e-6; the LP bounds want it exact
    q /= q.sum(-1, keepdims=True)
    res[str(t)] = node_acceptance(p, q)
  return res


def summary(res: dict) -> str:
  lines = ["| T | one draft | node rule (2 children) | optimum (2, without replacement) | "
           "optimum (2, i.i.d.) | gap (median, quartiles) |", "|---|---|---|---|---|---|"]
  for t, r in res.items():
    g = r["gap quartiles"]
    lines.append(f"| {t} | {r['one draft']:.4f} | {r['node rule']:.4f} | {r['optimum']:.4f} | "
                 f"{r['optimum iid']:.4f} | {r['gap']:.4f} ({g['median']:.4f}, "
                 f"{g['q1']:.4f}–{g['q3']:.4f}) |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  temperatures = [float(t) for t in _TEMPERATURES.value]
  target, draft = load_pretrained(_TARGET.value), load_pretrained(_DRAFT.value)
  if target.config.vocab_size != draft.config.vocab_size:
    raise app.UsageError(f"target and draft vocabularies differ: {target.config.vocab_size} "
                         f"and {draft.config.vocab_size}")
  windows = common.heldout_windows(target.tokenizer, _LENGTH.value, _WINDOWS.value)
  res = measure(target, draft, windows, temperatures)
  print(summary(res))
  if _OUT.value:
    Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
    Path(_OUT.value).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
