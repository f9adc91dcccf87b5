"""τ against the node budget: hand-picked, optimised static and dynamic trees (issue #52).

  python -m experiments.tree_acceptance                     # N = 14, T = 0 and 1
  python -m experiments.tree_acceptance --nodes=8,14,24 --temperature=1.0 --repeats=0
  python -m experiments.tree_acceptance --drafter=eagle     # the stdlib-eagle head
  python -m experiments.tree_acceptance --drafter=ngram --prompt_tokens=192  # prompt lookup

For each temperature and node budget N, on the shipped pair with the draft model (or the
EAGLE head, --drafter=eagle, or prompt lookup's trees, --drafter=ngram): one
batched call over --batch_prompts held-out prompts (same prompts and seed) per tree
counts τ, tokens per target call, with its standard error from the committed-per-round
histogram:
  hand-picked  `--handpicked` (2,2,1,1 by default; only where it has N nodes),
  optimised    `trees.best_static(N, α̂ by sibling rank, depth, topk)`, α̂ measured on a
               probe tree (topk root children, then a chain) at the same temperature,
  dynamic      `specjax.DynamicTree(N, depth, topk)`: raw rank scores,
  dynamic_alpha  the same with alpha=α̂ (sampled children priced by the alpha model; not
               for prompt lookup, whose dynamic tree scores by the matches' shares),
  dynamic_like   `DynamicTree.like(optimised, alpha=α̂)`: the optimised tree's nodes per
               depth, parents chosen each round.
Then dynamic_like and the optimised tree decode --num_prompts prompts one a call with the
same seeds, alternating (order flipped from call to call), for the quartiles of the
per-call ratio of the round's time (call time / rounds). Printed, and JSON lines with --out.
"""

from __future__ import annotations


from absl import app
from absl import flags

import specjax
from experiments import common
from specjax import trees

_DRAFTER = flags.DEFINE_enum("drafter", "model", ["model", "eagle", "ngram"],
                              "The tree's drafter: the draft model, the EAGLE head or prompt "
                              "lookup.")
_NODES = flags.DEFINE_list("nodes", ["14"], "Node budgets N.")
_TEMPS = flags.DEFINE_list("temperature", ["0.0", "1.0"], "Temperatures.")
_DEPTH = flags.DEFINE_integer("depth", 4, "Tree depth (dynamic and optimised).")
_TOPK = flags.DEFINE_integer("topk", 4, "Children per node at most (dynamic and optimised).")
_HAND = flags.DEFINE_list("handpicked", ["2", "2", "1", "1"], "The hand-picked static tree.")
_BATCH = flags.DEFINE_integer("batch_prompts", 64, "Prompts of each counting call.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 4, "Prompts of the paired timing (one a call).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 32, "Tokens per prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per call.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes over the prompts (0: none).")
_OUT = flags.DEFINE_string("out", None, "JSON-lines file for the rows.")


def tau(target, prompts, kw: dict, tree) -> dict:
  stats = specjax.generate(target, prompts, seed=0, tree=tree, **kw).stats
  mean, se = common.per_call(stats)
  return dict(mean=round(mean, 4), se=round(se, 4), alpha_by_sibling=stats["alpha_by_sibling"],
              lossless=stats["lossless"])


def round_ratio(target, prompts, kw: dict, first, second, repeats: int) -> dict:
  """Quartiles of the per-call round-time ratio first / second tree, alternating."""
  _, secs = common.paired_rounds(target, prompts, {"first": dict(kw, tree=first),
                                                   "second": dict(kw, tree=second)}, repeats)
  return common.quartiles([x / y for x, y in zip(secs["first"], secs["second"])])


def main(argv):
  del argv
  target, _, kw = common.drafter_pair("stdlib-target", _DRAFTER.value, None, None)
  kw.pop("gamma")
  many = common.heldout_prompts(target.tokenizer, "stdlib", _BATCH.value, _PROMPT_TOKENS.value,
                                seed=1)
  few = common.heldout_prompts(target.tokenizer, "stdlib", _PROMPTS.value, _PROMPT_TOKENS.value)
  hand = trees.Tree.from_branching(tuple(int(k) for k in _HAND.value))
  depth, topk = _DEPTH.value, _TOPK.value
  probe = (topk,) + (1,) * (depth - 1)
  rows = []
  for temperature in map(float, _TEMPS.value):
    run_kw = dict(kw, temperature=temperature, max_new_tokens=_NEW.value)
    alpha = [a if a == a else 0.0  # a rank never tried: nan
             for a in tau(target, many, run_kw, probe)["alpha_by_sibling"]]
    for nodes in map(int, _NODES.value):
      shapes = {}
      if hand.num_nodes == nodes:
        shapes["handpicked"] = hand
      shapes["optimised"] = trees.best_static(nodes, alpha, depth=depth, topk=topk)
      shapes["dynamic"] = specjax.DynamicTree(nodes, depth, topk)
      if _DRAFTER.value != "ngram":
        shapes["dynamic_alpha"] = specjax.DynamicTree(nodes, depth, topk, alpha=alpha)
      shapes["dynamic_like"] = specjax.DynamicTree.like(shapes["optimised"], alpha=alpha)
      out = {name: tau(target, many, run_kw, t) for name, t in shapes.items()}
      row = dict(drafter=_DRAFTER.value, temperature=temperature, nodes=nodes, alpha_probe=alpha,
                 optimised_parents=list(shapes["optimised"].parents),
                 dynamic_levels={k: list(t.level_sizes) for k, t in shapes.items()
                                 if k.startswith("dynamic")},
                 tau={k: {"mean": v["mean"], "se": v["se"]} for k, v in out.items()},
                 lossless=all(v["lossless"] for v in out.values()))
      static = [k for k in out if not k.startswith("dynamic")]
      row["dynamic_over"] = {f"{d}/{k}": round(out[d]["mean"] / out[k]["mean"], 4)
                             for d in out if d.startswith("dynamic") for k in static}
      if _REPEATS.value:
        row["round_ratio_dynamic_like_over_optimised"] = round_ratio(
            target, few, run_kw, shapes["dynamic_like"], shapes["optimised"], _REPEATS.value)
      rows.append(row)
      line = f"{_DRAFTER.value} T={temperature} N={nodes}: τ " + ", ".join(
          f"{k} {v['mean']:.3f} ± {v['se']:.3f}" for k, v in out.items())
      line += "; " + ", ".join(f"{k} {v:.3f}" for k, v in row["dynamic_over"].items())
      if _REPEATS.value:
        line += ("; round time dynamic_like/optimised "
                 + common.spread(row["round_ratio_dynamic_like_over_optimised"]))
      print(line, flush=True)
  if _OUT.value:
    common.write_rows(_OUT.value, rows)


if __name__ == "__main__":
  app.run(main)
