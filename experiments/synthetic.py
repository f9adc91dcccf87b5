"""Engine speed at a chosen acceptance (the library of `bench --part=synthetic`).

For each (batch, γ, α): speculative decoding whose verify rule accepts position i with
probability α^(i+1) (`specjax.verify.rules.SyntheticRule`, not lossless: the text is
meaningless, only the speed is measured), timed against target-only decoding on the same
engine, prompts and process (`common.paired_generate`, alternating). `run` reports
tokens/s of both, the paired speedup with its spread, tokens per target call against
E(α, γ), and (config.predict) the ledger's E(α, γ) / (γc + v(γ)) from measured c and
v(γ); it writes <workdir>/config.json, results.json and summary.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import specjax
from specjax import costs
from specjax import ledger


def validate(cfg) -> None:
  for a in cfg.alpha:
    if not 0 <= a <= 1:
      raise ValueError(f"config.alpha: every α must be in [0, 1], got {cfg.alpha!r}")
  for g in cfg.gamma:
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
      raise ValueError(f"config.gamma: every γ must be an int >= 1, got {cfg.gamma!r}")
  for b in cfg.batch_size:
    if not isinstance(b, int) or b < 1:
      raise ValueError(f"config.batch_size: ints >= 1, got {cfg.batch_size!r}")
  if cfg.target["vocab_size"] != cfg.draft["vocab_size"]:
    raise ValueError("config.target and config.draft need the same vocab_size")
  if cfg.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"config.dtype must be 'float32' or 'bfloat16', got {cfg.dtype!r}")


def random_model(kwargs: dict, dtype: str, seed: int):
  model = specjax.init_model(specjax.ModelConfig.llama(**dict(kwargs)), seed=seed)
  if dtype != "float32":
    model = model.with_params(jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)),
                                                     model.params))
  return model


def synthetic_rates(alpha: float, gamma: int) -> tuple[float, ...]:
  """Unconditional P(position i accepted) when each is accepted with probability α
  after its predecessor: α^(i+1)."""
  return tuple(float(alpha) ** (i + 1) for i in range(gamma))


def bench_point(target, draft, prompts, batch, gamma, alpha, cfg, step) -> dict:
  kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
  method = dict(kw, draft=draft, gamma=gamma, verify_rule="synthetic",
                rule_params={"rates": synthetic_rates(alpha, gamma)})
  timing = common.paired_generate(target, prompts, batch, cfg.pairs, method=method,
                                  baseline=kw)
  stats = timing["method"]["stats"]
  row = {"batch": batch, "gamma": gamma, "alpha": alpha,
         "tokens_per_s": timing["method"]["tokens_per_s"],
         "target_only_tokens_per_s": timing["baseline"]["tokens_per_s"],
         "speedup": timing["speedup"], "speedup_min": timing["speedup_min"],
         "speedup_max": timing["speedup_max"],
         "tokens_per_target_call": stats["tokens_per_target_call"],
         "expected_tokens": float(ledger.expected_tokens(alpha, gamma)),
         "acceptance_by_position": stats["acceptance_by_position"],
         "lossless": stats["lossless"]}
  if step is not None:
    predicted = float(ledger.predicted_speedup(alpha, gamma, step["c"], step["v"]))
    row.update(c=step["c"], v=step["v"], predicted_speedup=predicted,
               measured_over_predicted=timing["speedup"] / predicted)
  return row


COLUMNS = [("batch", "batch", "d"), ("γ", "gamma", "d"), ("α", "alpha", "g"),
           ("tokens/call", "tokens_per_target_call", ".2f"), ("E(α,γ)", "expected_tokens", ".2f"),
           ("tok/s", "tokens_per_s", ".0f"), ("target-only tok/s", "target_only_tokens_per_s", ".0f"),
           ("speedup (min–max)", "speedup", "x"), ("predicted", "predicted_speedup", "x"),
           ("c", "c", ".3f"), ("v(γ)", "v", ".2f")]


def run(cfg, workdir: Path) -> list[dict]:
  validate(cfg)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
  target = random_model(cfg.target, cfg.dtype, cfg.seed)
  draft = random_model(cfg.draft, cfg.dtype, cfg.seed + 1)
  rng = np.random.default_rng(cfg.seed)
  prompts = rng.integers(0, cfg.target["vocab_size"],
                         (cfg.num_prompts, cfg.prompt_tokens)).tolist()
  rows = []
  for batch in cfg.batch_size:
    for gamma in cfg.gamma:
      step = None
      if cfg.predict:
        step = common.step_costs(target, draft, "model", gamma, batch,
                                 cfg.prompt_tokens + cfg.max_new_tokens // 2,
                                 temperature=cfg.temperature)
      for alpha in cfg.alpha:
        rows.append(bench_point(target, draft, prompts, batch, gamma, alpha, cfg, step))
        print(common.markdown_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
  table = common.markdown_table(rows, COLUMNS)
  machine = costs.machine_info()
  (workdir / "results.json").write_text(json.dumps({"machine": machine, "rows": rows},
                                                   indent=2))
  (workdir / "summary.md").write_text(f"Machine: {machine}\n\n{table}\n")
  print(table)
  return rows
