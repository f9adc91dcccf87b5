r"""Drift audit: how far each verify rule's output law lies from the target's.

  python -m experiments.audit --workdir=runs/audit                  # tiny models + shipped pair
  python -m experiments.audit --parts=tiny --tiny_samples=100000    # tiny models only

For every rule it measures the total-variation distance between the law of the first
`--length` (3) generated tokens and the target's own law, at one temperature:

- tiny random models (vocab 8, sharpened like the tests' models): the target law by
  exact enumeration (all 8^3 continuations teacher-forced), the rule's law from
  `--tiny_samples` rows of one generate call;
- the shipped pair: for each held-out prompt, the TV between the empirical law of the
  rule's samples and the target law, Σ_x max(0, P̂(x) − P(x)) over the observed x (that
  sum is the whole TV, since both laws have mass 1), with P(x) teacher-forced.

Both estimates carry Monte Carlo noise. The noise floor is the same estimate for a
sample of the same size drawn from the target law itself: multinomial draws from the
exact law (tiny), target-only decoding (shipped; it samples the target law exactly). A
lossless rule sits on the floor; `z` is the excess over the floor in floor standard
deviations. Then, on the shipped pair, `common.paired_generate` times each chosen lossy
rule against the exact rule, so the drift is printed beside what it buys.

The estimators live in `experiments/drift.py` (the tests use them too).
Writes <workdir>/audit.json and <workdir>/audit.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app
from absl import flags
import numpy as np

from experiments import common
from experiments import drift
from specjax import rng
from specjax import costs
from specjax.verify import rules as rules_lib

_WORKDIR = flags.DEFINE_string("workdir", "runs/audit", "Where audit.json and audit.md go.")
_PARTS = flags.DEFINE_list("parts", ["tiny", "shipped", "speed"], "Which parts to run.")
_RULES = flags.DEFINE_list("rules", ["exact", "typical", "threshold", "synthetic"],
                           "Verify rules to audit (their default parameters).")
_SYNTHETIC_ALPHA = flags.DEFINE_float(
    "synthetic_alpha", 0.8, "Synthetic rule: per-position acceptance α, rates α^(i+1).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (both sides).")
_GAMMA = flags.DEFINE_integer("gamma", 3, "Draft length γ.")
_LENGTH = flags.DEFINE_integer("length", 3, "Generated tokens whose joint law is compared.")
_TINY_SAMPLES = flags.DEFINE_integer("tiny_samples", 20000, "Rows per rule, tiny models.")
_FLOOR_REPS = flags.DEFINE_integer("floor_reps", 200, "Multinomial floor draws, tiny models.")
_SHIPPED_SAMPLES = flags.DEFINE_integer("shipped_samples", 2000,
                                        "Rows per rule and prompt, shipped pair.")
_SHIPPED_PROMPTS = flags.DEFINE_integer("shipped_prompts", 4, "Held-out prompts, shipped pair.")
_SHIPPED_FLOOR_REPS = flags.DEFINE_integer(
    "shipped_floor_reps", 4, "Target-only samples of the same size per prompt (the floor).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 32, "Tokens per held-out prompt.")
_CHUNK = flags.DEFINE_integer("chunk", 1000, "Rows per generate call on the shipped pair.")
_SPEED_RULES = flags.DEFINE_list("speed_rules", ["typical"], "Rules timed against exact.")
_SPEED_PROMPTS = flags.DEFINE_integer("speed_prompts", 8, "Prompts for the timing.")
_SPEED_MAX_NEW = flags.DEFINE_integer("speed_max_new", 64, "New tokens per timed prompt.")
_PAIRS = flags.DEFINE_integer("pairs", 3, "Timing pairs (median kept).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampled runs.")

TINY_PROMPT = (3, 1, 3)


def rule_params(name: str, gamma: int, synthetic_alpha: float) -> dict | None:
  """The parameters each rule is audited with: its defaults; synthetic rates α^(i+1)."""
  if name == "synthetic":
    return {"rates": tuple(synthetic_alpha ** (i + 1) for i in range(gamma))}
  return None


def _rule_columns(stats: dict) -> dict:
  return {k: stats.get(k) for k in ("acceptance_rate", "alpha_hat", "tokens_per_target_call",
                                    "lossless")}


def audit_tiny(rules, temperature, gamma, length, samples, floor_reps, seed,
               synthetic_alpha) -> list[dict]:
  target, draft = drift.random_pair()
  vocab = target.config.vocab_size
  _, probs = drift.exact_law(target, TINY_PROMPT, length, temperature)
  floor = drift.floor_summary(drift.multinomial_floor(probs, samples, floor_reps, seed))
  print(f"tiny: floor for {samples} samples: mean {floor['floor_mean']:.4f}, "
        f"sd {floor['floor_sd']:.4f}, q99 {floor['floor_q99']:.4f}", flush=True)
  rows = []
  for name in rules:
    params = rule_params(name, gamma, synthetic_alpha)
    tokens, stats = drift.sample_rows(target, draft, TINY_PROMPT, samples, length,
                                      temperature, gamma, name, params, seed, chunk=samples)
    row = drift.with_excess(dict(pair="tiny (vocab 8)", rule=name, params=params,
                                 temperature=temperature, gamma=gamma, samples=samples,
                                 prompts=1, tv=drift.tv_enumerated(tokens, probs, vocab),
                                 **floor, **_rule_columns(stats)))
    rows.append(row)
    print(f"tiny {name}: TV {row['tv']:.4f} (z = {row['z']:.1f})", flush=True)
  return rows


def audit_shipped(target, draft, prompts, rules, temperature, gamma, length, samples,
                  floor_reps, seed, chunk, synthetic_alpha) -> list[dict]:
  """Per-prompt TVs against teacher-forced target probabilities, averaged over prompts."""
  per_rule = {name: {"tv": [], "stats": []} for name in rules}
  floor_means, floor_vars = [], []
  for k, prompt in enumerate(prompts):
    cache = {}

    def prob_fn(conts, prompt=prompt, cache=cache):
      missing = [tuple(c) for c in conts if tuple(c) not in cache]
      if missing:
        p = drift.continuation_probs(target, prompt, np.array(missing, np.int32), temperature)
        cache.update(zip(missing, p))
      return np.array([cache[tuple(c)] for c in conts])

    floors = []
    for r in range(floor_reps):
      tokens, _ = drift.sample_rows(target, None, prompt, samples, length, temperature, gamma,
                                    None, None, seed + 1000 * (k + 1) + 100 + r * 10, chunk)
      floors.append(drift.tv_observed(tokens, prob_fn))
    floor_means.append(np.mean(floors))
    floor_vars.append(np.var(floors, ddof=1) if len(floors) > 1 else np.nan)
    for name in rules:
      params = rule_params(name, gamma, synthetic_alpha)
      tokens, stats = drift.sample_rows(target, draft, prompt, samples, length, temperature,
                                        gamma, name, params, seed + 1000 * (k + 1), chunk)
      per_rule[name]["tv"].append(drift.tv_observed(tokens, prob_fn))
      per_rule[name]["stats"].append(stats)
    print(f"shipped prompt {k}: floor {floor_means[-1]:.4f}, "
          + ", ".join(f"{n} {per_rule[n]['tv'][-1]:.4f}" for n in rules), flush=True)
  n = len(prompts)
  floor = {"floor_mean": float(np.mean(floor_means)),
           # sd of a mean over prompts of one-sample TVs: each prompt's own spread, pooled
           "floor_sd": float(np.sqrt(np.sum(floor_vars)) / n),
           "floor_q99": float("nan")}
  rows = []
  for name in rules:
    stats = common.merge_stats(per_rule[name]["stats"])
    rows.append(drift.with_excess(dict(
        pair="shipped", rule=name, params=rule_params(name, gamma, synthetic_alpha),
        temperature=temperature, gamma=gamma, samples=samples, prompts=n,
        tv=float(np.mean(per_rule[name]["tv"])), tv_by_prompt=per_rule[name]["tv"],
        floor_by_prompt=[float(x) for x in floor_means], **floor, **_rule_columns(stats))))
  return rows


def speed_against_exact(target, draft, prompts, rule, temperature, gamma, max_new, pairs,
                        synthetic_alpha) -> dict:
  """Paired timing of `rule` (method) against the exact rule (baseline), same draft and γ."""
  kw = dict(max_new_tokens=max_new, temperature=temperature, draft=draft, gamma=gamma, seed=0,
            eos_id=None)
  timing = common.paired_generate(
      target, prompts, 1, pairs,
      method=dict(kw, verify_rule=rule, rule_params=rule_params(rule, gamma, synthetic_alpha)),
      baseline=kw)
  return {"speedup_vs_exact": timing["speedup"], "speedup_vs_exact_min": timing["speedup_min"],
          "speedup_vs_exact_max": timing["speedup_max"],
          "tokens_per_s": timing["method"]["tokens_per_s"],
          "exact_tokens_per_s": timing["baseline"]["tokens_per_s"],
          "timed_tokens_per_target_call": timing["method"]["stats"]["tokens_per_target_call"],
          "exact_tokens_per_target_call":
              timing["baseline"]["stats"]["tokens_per_target_call"]}


COLUMNS = [("pair", "pair", "s"), ("rule", "rule", "s"), ("T", "temperature", "g"),
           ("samples", "samples", "d"), ("prompts", "prompts", "d"), ("TV", "tv", ".4f"),
           ("floor", "floor_mean", ".4f"), ("floor sd", "floor_sd", ".4f"),
           ("TV − floor", "excess", ".4f"), ("z", "z", ".1f"),
           ("acceptance", "acceptance_rate", ".3f"), ("α̂", "alpha_hat", ".3f"),
           ("tokens/call", "tokens_per_target_call", ".2f"),
           ("speedup vs exact (min–max)", "speedup_vs_exact", "x")]


def main(argv):
  del argv
  rng.use_unrolled_threefry()  # the CPU's faster random bits (specjax.rng), before tracing
  for name in _RULES.value + _SPEED_RULES.value:
    if name not in rules_lib.RULES:
      raise ValueError(f"--rules / --speed_rules: unknown rule {name!r} ({rules_lib.RULES})")
  for name in _RULES.value:  # fail before any sampling on bad parameters
    rules_lib.make_rule(name, rule_params(name, _GAMMA.value, _SYNTHETIC_ALPHA.value),
                        _GAMMA.value)
  workdir = Path(_WORKDIR.value)
  workdir.mkdir(parents=True, exist_ok=True)
  settings = {k: flags.FLAGS[k].value for k in (
      "parts", "rules", "synthetic_alpha", "temperature", "gamma", "length", "tiny_samples",
      "floor_reps", "shipped_samples", "shipped_prompts", "shipped_floor_reps",
      "prompt_tokens", "speed_rules", "speed_prompts", "speed_max_new", "pairs", "seed")}
  report = {"machine": costs.machine_info(), "settings": settings, "rows": []}
  args = dict(temperature=_TEMPERATURE.value, gamma=_GAMMA.value, length=_LENGTH.value,
              synthetic_alpha=_SYNTHETIC_ALPHA.value)
  if "tiny" in _PARTS.value:
    report["rows"] += audit_tiny(_RULES.value, samples=_TINY_SAMPLES.value,
                                 floor_reps=_FLOOR_REPS.value, seed=_SEED.value, **args)
  if "shipped" in _PARTS.value or "speed" in _PARTS.value:
    target, draft = common.load_pair("stdlib-target", "stdlib-draft")
    prompts = common.heldout_prompts(target.tokenizer, "stdlib",
                                     max(_SHIPPED_PROMPTS.value, _SPEED_PROMPTS.value),
                                     _PROMPT_TOKENS.value)
  if "shipped" in _PARTS.value:
    report["rows"] += audit_shipped(
        target, draft, prompts[:_SHIPPED_PROMPTS.value], _RULES.value,
        samples=_SHIPPED_SAMPLES.value, floor_reps=_SHIPPED_FLOOR_REPS.value,
        seed=_SEED.value, chunk=_CHUNK.value, **args)
  if "speed" in _PARTS.value:
    shipped = {r["rule"]: r for r in report["rows"] if r["pair"] == "shipped"}
    for name in _SPEED_RULES.value:
      speed = speed_against_exact(target, draft, prompts[:_SPEED_PROMPTS.value], name,
                                  _TEMPERATURE.value, _GAMMA.value, _SPEED_MAX_NEW.value,
                                  _PAIRS.value, _SYNTHETIC_ALPHA.value)
      print(f"{name} vs exact on the shipped pair: {speed['speedup_vs_exact']:.2f}x "
            f"({speed['speedup_vs_exact_min']:.2f}–{speed['speedup_vs_exact_max']:.2f}), "
            f"tokens/call {speed['timed_tokens_per_target_call']:.2f} vs "
            f"{speed['exact_tokens_per_target_call']:.2f}"
            + (f"; drift TV {shipped[name]['tv']:.4f} vs floor "
               f"{shipped[name]['floor_mean']:.4f}" if name in shipped else ""), flush=True)
      if name in shipped:
        shipped[name].update(speed)
      else:
        report.setdefault("speed", {})[name] = speed
  for row in report["rows"]:
    if row["rule"] == "exact" and not row["at_floor"]:
      print(f"WARNING: the exact rule's TV on {row['pair']} is {row['z']:.1f} floor sd above "
            f"the noise floor", flush=True)
  table = common.markdown_table(report["rows"], COLUMNS)
  (workdir / "audit.json").write_text(json.dumps(report, indent=2, default=str))
  (workdir / "audit.md").write_text(
      f"Machine: {report['machine']}\n\nSettings: {settings}\n\n{table}\n")
  print(table)


if __name__ == "__main__":
  app.run(main)
