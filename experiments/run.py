r"""The sweep: γ x temperature x top-p x drafter x batch size, measured against theory.

  python -m experiments.run --config=configs/sweep.py --workdir=runs/sweep

Leaves in the workdir: config.json, results.jsonl (one row per grid point; a rerun skips
points already there, and may add grid values but not drop them, so config.json describes
every row), summary.md (with a legend and a recommendation), and PNG plots. A config
mistake ends the run with one line naming the file or the field.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging as stdlib_logging
import math
import os
import re
from pathlib import Path

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
import tqdm

from experiments import common
from experiments import plots
from specjax import costs
from specjax import arguments
from specjax import compile_guard
from specjax import ledger
from specjax import policies
from specjax import rng
from specjax import trees as trees_lib
from specjax.models import heads as heads_lib
from specjax.models.pretrained import load_pretrained, read_config
from specjax.prepare import prepare
from specjax.training import data as data_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sweep.py", "Sweep config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where results go.", required=True)
flags.register_validator("workdir", lambda d: d is None or bool(d.strip()),
                         "--workdir must name a directory (empty: the current one)")

class SweepError(ValueError):
  """A config, workdir or grid point the sweep refuses: `main` prints it as one line."""


GRID_FIELDS = ("drafter", "gamma", "temperature", "top_p", "batch_size")
# Processor axes: neutral values mean off; rows written before they existed read as off.
PROCESSOR_FIELDS = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "no_repeat_ngram_size": 0,
                    # γ policy and verify rule: 'fixed' / 'exact' = today's chain.
                    "gamma_policy": "fixed", "verify_rule": "exact"}
# Numbers on these axes are floats: temperature 0 and 0.0 are one point (one key, one row).
FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")


def _as_float(field, value):
  return float(value) if field in FLOAT_FIELDS else value


def validate(cfg) -> None:
  """Fails at once, naming the field, before any model is loaded."""

  def fail(field, message):
    raise SweepError(f"config.{field}: {message} (got {cfg[field]!r})")

  for field in GRID_FIELDS + tuple(PROCESSOR_FIELDS):
    if not isinstance(cfg[field], (tuple, list)) or not cfg[field]:
      fail(field, "must be a non-empty tuple")
    if any(isinstance(v, bool) for v in cfg[field]):
      fail(field, "takes numbers or names, not True / False")
    repeated = sorted({json.dumps(v) for v in cfg[field] if list(cfg[field]).count(v) > 1})
    if repeated:  # a point twice would be timed twice and written twice
      fail(field, f"repeats {', '.join(repeated)}")
  for r in cfg.repetition_penalty:
    if not isinstance(r, (int, float)) or not 0 < r < math.inf:
      fail("repetition_penalty", "penalties must be finite numbers > 0 (1 = off)")
  for n in cfg.no_repeat_ngram_size:
    if not isinstance(n, int) or n < 0:
      fail("no_repeat_ngram_size", "sizes must be ints >= 0 (0 = off)")
  for p in cfg.gamma_policy:
    if p not in policies.POLICIES:
      fail("gamma_policy", f"policies are {policies.POLICIES}")
  for r in cfg.verify_rule:
    if r not in ("exact", "block", "typical", "threshold"):
      fail("verify_rule", "the sweep runs 'exact', 'block', 'typical' and 'threshold' (with their "
           "default settings; 'synthetic' is experiments.bench --part=synthetic's)")
  if "confidence" in cfg.gamma_policy and not 0 < cfg.draft_confidence < 1:
    fail("draft_confidence", "must be in (0, 1)")
  for d in cfg.drafter:
    if d not in arguments.DRAFTERS:
      fail("drafter", f"unknown drafter {d!r}; use one of {arguments.DRAFTERS}")
  if any(not isinstance(t, (tuple, list)) for t in cfg.trees):  # '((2,2,1,1))' is one flat tuple
    fail("trees", "is a tuple of trees, each a tuple: one tree is '((2,2,1,1),)', "
         "with the comma")
  for tree in cfg.trees:
    try:
      made = arguments.make_tree(tree, None)
    except ValueError as e:
      fail("trees", str(e))
    if isinstance(made, trees_lib.DynamicTree):
      if _tree_drafter(cfg) not in ("model", "eagle", "eagle3"):
        fail("trees", f"a dynamic tree needs the draft model or an EAGLE head first in "
             f"drafter, got {cfg.drafter[0]!r}")
  if ("model" in cfg.drafter or _tree_drafter(cfg) == "model") and not cfg.draft:
    fail("draft", "drafter 'model' needs a draft model")
  for d in arguments.HEAD_DRAFTERS:
    if d in cfg.drafter and not cfg.get(f"{d}_head"):
      fail(f"{d}_head", f"drafter {d!r} needs a {d} head (a shipped name or a directory)")
  for g in cfg.gamma:
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
      fail("gamma", "every γ must be an int >= 1")
  for t in cfg.temperature:
    if not isinstance(t, (int, float)) or not 0 <= t < math.inf:
      fail("temperature", "temperatures must be finite numbers >= 0")
  for field in ("presence_penalty", "frequency_penalty"):
    for v in cfg[field]:
      if not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(field, "penalties must be finite numbers (0 = off)")
  if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < 2**32:
    fail("seed", "must be an int in [0, 2**32)")
  for p in cfg.top_p:
    if not isinstance(p, (int, float)) or not 0 < p <= 1:
      fail("top_p", "top_p values must be in (0, 1]")
  for b in cfg.batch_size:
    if not isinstance(b, int) or b < 1:
      fail("batch_size", "batch sizes must be ints >= 1")
  for field in ("num_prompts", "prompt_tokens", "max_new_tokens", "timing_pairs", "cost_rounds"):
    if not isinstance(cfg[field], int) or cfg[field] < 1:
      fail(field, "must be an int >= 1")
  if not (isinstance(cfg.ngram_min, int) and isinstance(cfg.ngram_max, int)
          and 1 <= cfg.ngram_min <= cfg.ngram_max):
    fail("ngram_min", f"need ints 1 <= ngram_min <= ngram_max (ngram_max={cfg.ngram_max!r})")
  if not isinstance(cfg.top_k, int) or cfg.top_k < 0:
    fail("top_k", "must be an int >= 0")
  if not isinstance(cfg.get("call_costs", False), bool):
    fail("call_costs", "must be True or False")
  if cfg.get("call_costs", False) and cfg.max_new_tokens < 2:  # one round: no round cost
    fail("max_new_tokens", "must be >= 2 with call_costs (a call's round cost is measured "
         "from calls stopped after 1 round and after more)")
  if cfg.draft_sample not in ("probabilistic", "greedy"):
    fail("draft_sample", "must be 'probabilistic' or 'greedy'")


def _check_heads(cfg, heads: dict, check) -> None:
  """check(head) for each head; a head trained on another target stops the sweep with
  the way out."""
  for kind, head in heads.items():
    try:
      check(head)
    except ValueError as e:
      raise SweepError(f"{e}. The sweep's drafters include {kind!r} with "
                       f"{kind}_head={cfg[f'{kind}_head']!r}: name a head trained on "
                       f"{cfg.target!r} (--config.{kind}_head=DIR) or leave {kind!r} out "
                       f"of --config.drafter") from None


def point_specs(cfg, point: dict, base: dict, heads: dict, draft, draft_cost):
  """(target-only, method) `specjax.generate` keyword arguments of a grid point; the
  ledger policy gets `draft_cost` = (c, v(γ))."""
  methods = {k: point[k] for k in ("gamma_policy", "verify_rule")}
  sampling = dict(base, temperature=point["temperature"], top_p=point["top_p"],
                  **{k: point[k] for k in PROCESSOR_FIELDS if k not in methods})
  if point["gamma_policy"] == "ledger":
    methods["draft_cost"] = draft_cost
  if point["gamma_policy"] == "confidence":
    methods["draft_confidence"] = cfg.draft_confidence
  tree = _as_tree(point.get("tree"))
  spec = dict(sampling, **methods, drafter=point["drafter"], ngram_min=cfg.ngram_min,
              ngram_max=cfg.ngram_max, **(dict(tree=tree) if tree else dict(gamma=point["gamma"])))
  if point["drafter"] == "model" or point["drafter"] in heads:
    spec.update(draft=heads.get(point["drafter"], draft), draft_sample=cfg.draft_sample)
  return sampling, spec


def _write_config(cfg, workdir: Path):
  workdir.mkdir(parents=True, exist_ok=True)
  # Renamed into place: a run stopped mid-write leaves no half a config to refuse later.
  tmp = workdir / "config.json.tmp"
  tmp.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
  tmp.replace(workdir / "config.json")


def _grid_value(field, value) -> str:
  """One grid value as a comparable key: 1 and 1.0 are one temperature, a tree is JSON."""
  return json.dumps(_as_float(field, value), sort_keys=True)


def _as_tuple(values) -> str:
  """values as a --config tuple literal: '(0.0, 1.0, 0.5)', '("model",)'."""
  items = ", ".join(json.dumps(v) for v in values)
  return f"({items},)" if len(values) == 1 else f"({items})"


def point_key(point: dict) -> str:
  key = {k: point[k] for k in GRID_FIELDS}
  key["tree"] = point.get("tree")
  key.update({k: point.get(k, off) for k, off in PROCESSOR_FIELDS.items()})
  # A row written from an int (temperature 0) is the point 0.0.
  return json.dumps({k: _as_float(k, v) for k, v in key.items()}, sort_keys=True)


def read_rows(path: Path, repair: bool = False) -> list[dict]:
  """The rows in `path`. A last line cut short (a run stopped while writing it) is left
  out, and with repair=True removed from the file, so the next row starts a line."""
  if not path.exists():
    return []
  rows = []
  lines = path.read_text().splitlines()
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except ValueError as e:
      if i == len(lines) - 1:  # a run stopped while writing its last row: rerun that point
        logging.warning("%s: line %d is cut short; its point runs again", path, i + 1)
        if repair:
          tmp = path.with_suffix(".tmp")
          tmp.write_text("".join(line + "\n" for line in lines[:i]))
          tmp.replace(path)
        continue
      raise SweepError(f"{path}, line {i + 1}: not a JSON row ({e}); move the file "
                       "away or use another --workdir") from None
  return rows


def _check_writable(workdir: Path) -> None:
  """Writes and removes a file in `workdir` (permissions, a read-only disk: os.access
  cannot tell for root), leaving the folders as they were."""
  missing = [p for p in (workdir, *workdir.parents) if not p.exists()]  # deepest first
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / f".write_probe.{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise SweepError(f"--workdir {workdir} cannot be written ({e.strerror or e}): use "
                     "another --workdir") from None
  finally:
    for path in missing:
      try:
        path.rmdir()
      except OSError:
        break


def check_workdir(cfg, workdir: Path) -> None:
  """Refuses a workdir whose rows were measured under other settings: a rerun adds grid
  points to a sweep, so every field outside the grid must be what config.json says.
  Also a workdir that could not be written, before anything loads."""
  saved_path, results = workdir / "config.json", workdir / "results.jsonl"
  # The nearest folder that exists must be one: mkdir would fail only once models load.
  there = next(p for p in (workdir, *workdir.parents) if p.exists())
  if not there.is_dir():
    raise SweepError(f"--workdir {workdir}: {there} is a file, not a directory")
  for path in (saved_path, results):
    if path.exists() and not path.is_file():
      raise SweepError(f"--workdir {workdir}: {path} is not a file: use another --workdir")
  _check_writable(workdir)
  rows = read_rows(results)
  if not saved_path.exists():
    if rows:
      raise SweepError(f"{results} has rows but {saved_path} is missing, so the settings "
                       "they were measured under are unknown: use another --workdir")
    return
  try:
    saved = json.loads(saved_path.read_text())
  except (ValueError, OSError) as e:
    raise SweepError(f"{saved_path} is not readable JSON ({e}): use another --workdir") from None
  now = json.loads(json.dumps(cfg.to_dict()))
  if not isinstance(saved, dict) or not {"drafter", "gamma", "target"} <= set(saved):
    raise SweepError(f"{saved_path} is not a sweep's config (another job's workdir?): "
                     "use another --workdir")
  if not rows:  # a run stopped before its first row: nothing measured, config.json rewritten
    return
  grid = set(GRID_FIELDS) | set(PROCESSOR_FIELDS) | {"trees"}
  differ = sorted(k for k in set(saved) | set(now)
                  if k not in grid and saved.get(k) != now.get(k))
  if differ:
    listed = "; ".join(f"{k}: {saved.get(k)!r} there, {now.get(k)!r} now" for k in differ)
    raise SweepError(f"{workdir} holds a sweep measured with other settings ({listed}); "
                     "its rows would be reported as this config's. Use another --workdir, "
                     "or set those fields as they were (grid fields may grow)")
  # config.json is rewritten with this config's grid, so it must still hold every value
  # a row there was measured at: a grid may drop values no row has, never one a row has.
  dropped = {}
  for k in sorted(grid):
    here = {_grid_value(k, v) for v in now.get(k) or []}
    key, off = ("tree", None) if k == "trees" else (k, PROCESSOR_FIELDS.get(k))
    measured = (row.get(key, off) for row in rows)
    missing = {_grid_value(k, v): v for v in measured
               if not (k == "trees" and v is None) and _grid_value(k, v) not in here}
    if missing:
      dropped[k] = list(now.get(k) or []) + list(missing.values())
  if dropped:
    listed = "; ".join(f"{k}: {v[len(now.get(k) or []):]!r} measured, {now.get(k)!r} now"
                       for k, v in dropped.items())
    flags_out = " ".join(f"--config.{k}='{_as_tuple(v)}'" for k, v in dropped.items())
    raise SweepError(f"{workdir} holds rows measured at grid values this config leaves out "
                     f"({listed}); its config.json would no longer describe them. Use "
                     f"another --workdir, or keep those values (only the new points run): "
                     f"{flags_out}")


def run_sweep(cfg, workdir: str | Path, progress: bool = True, models=None,
              prompts=None, mesh=None) -> list[dict]:
  """Runs every grid point not yet in results.jsonl; returns all rows.

  models: (target, draft) already loaded (say in bfloat16, or sharded) instead of
    loading cfg.target / cfg.draft by name; draft may be None without a 'model' drafter.
  prompts: token-id lists instead of held-out windows of cfg.corpus (say chat prompts,
    `experiments.prompts.select`); cfg.num_prompts and cfg.prompt_tokens are then unused.
  mesh: passed to every `specjax.generate` call (a target placed by `specjax.shard`).
  """
  validate(cfg)
  workdir = Path(workdir)
  check_workdir(cfg, workdir)
  corpus = None
  if prompts is None:  # read now (a fraction of a second), not once the models load
    try:
      corpus = data_lib.load_corpus(cfg.corpus)
    except ValueError as e:
      raise SweepError(f"config.corpus: {e}") from None
  results_path = workdir / "results.jsonl"
  rows = read_rows(results_path, repair=True)
  done = {point_key(r) for r in rows}
  grid = grid_points(cfg)
  # Heads are small: load them first (a bad name fails before the models load).
  for d in arguments.HEAD_DRAFTERS:
    if d in cfg.drafter:
      found = read_config(cfg[f"{d}_head"])
      if found is not None and getattr(found, "kind", None) != d:
        what = f"a {found.kind} head" if hasattr(found, "kind") else "a model, not a head"
        raise SweepError(f"config.{d}_head: {cfg[f'{d}_head']!r} is {what}; drafter {d!r} "
                         f"needs a {d} head")
  heads = {d: load_pretrained(cfg[f"{d}_head"]) for d in arguments.HEAD_DRAFTERS
           if d in cfg.drafter}
  if "medusa" in heads:  # K heads draft at most K tokens
    k = heads["medusa"].config.medusa_heads
    medusa = [p for p in grid if p["drafter"] == "medusa"]
    dropped = sorted({p["gamma"] for p in medusa if p["gamma"] > k})
    if medusa and len(dropped) == len({p["gamma"] for p in medusa}):
      raise SweepError(f"config.gamma: the Medusa head {cfg.medusa_head!r} has {k} heads, so "
                       f"it drafts at most {k} tokens; every Medusa γ or tree depth in "
                       f"{dropped} is larger")
    if dropped:
      logging.warning("Medusa points at γ (or tree depth) %s skipped: the head drafts at "
                      "most %d tokens", dropped, k)
    grid = [p for p in grid if p["drafter"] != "medusa" or p["gamma"] <= k]
  todo = [p for p in grid if point_key(p) not in done]
  logging.info("%d grid points, %d already done", len(grid), len(grid) - len(todo))
  if not todo:
    _write_config(cfg, workdir)
    plots.write_report(rows, workdir)
    return rows

  if models is not None:
    target, draft = models
  else:
    needs_draft = "model" in cfg.drafter or _tree_drafter(cfg) == "model"
    target_config = read_config(cfg.target)  # the heads' fit, before any weights load
    if target_config is not None and not isinstance(target_config, heads_lib.HeadConfig):
      _check_heads(cfg, heads, lambda head: head.config.check_target_config(target_config))
    target, draft = common.load_pair(cfg.target, cfg.draft if needs_draft else None)
  _check_heads(cfg, heads, lambda head: head.check_target(target))  # and the weights'
  named = "the target in models=" if models is not None else f"target {cfg.target!r}"
  if prompts is None and target.tokenizer is None:
    raise SweepError(f"{named} has no tokenizer: prompts come from text")
  eos_ids = list(target.eos_ids or [])
  if cfg.stop_at_eos and not eos_ids:
    raise SweepError(f"config.stop_at_eos: {named} names no end-of-text token to stop at; "
                     "set --config.stop_at_eos=False")
  if prompts is None:
    prompts = common.heldout_prompts(target.tokenizer, corpus, cfg.num_prompts,
                                     cfg.prompt_tokens, seed=cfg.seed)
  if not prompts:
    raise SweepError("no prompts")
  context = max(len(p) for p in prompts) + cfg.max_new_tokens // 2
  base = dict(max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k, seed=cfg.seed,
              eos_id=eos_ids if cfg.stop_at_eos else None)
  if mesh is not None:
    base["mesh"] = mesh
  batches = -(-len(prompts) // min(cfg.batch_size))
  if cfg.seed + batches > 2**32:  # batch i of a point decodes with seed + i
    raise SweepError(f"config.seed: seed + {batches} batches of prompts must stay below 2**32 "
                     f"(got {cfg.seed!r})")
  for point in todo:  # every point's arguments checked before anything is compiled
    sampling, spec = point_specs(cfg, point, base, heads, draft,
                                 draft_cost=(0.1, 1.5))  # a stand-in for the measured pair
    for kwargs in (sampling, spec):
      try:
        prepare(target, prompts, **{k: v for k, v in kwargs.items() if k != "seed"})
      except ValueError as e:
        raise SweepError(f"grid point {point_key(point)}: {e}") from e
  _write_config(cfg, workdir)
  step_costs = {}
  machine = costs.machine_info()

  bar = tqdm.tqdm(todo, desc="sweep", disable=not progress)
  for point in bar:
    compile_guard.release_near_map_limit()  # a long sweep compiles program after program
    bar.set_postfix_str(progress_label(point, todo))
    # A greedy draft skips sampling, so its cost depends on whether T is 0.
    tree = _as_tree(point.get("tree"))
    ckey = (point["drafter"], point["gamma"], point["batch_size"], point["temperature"] == 0,
            tree)
    drafter_model = heads.get(point["drafter"], draft)  # the model or the head
    if ckey not in step_costs:
      step_costs[ckey] = common.step_costs(
          target, drafter_model, point["drafter"], point["gamma"], point["batch_size"], context,
          (cfg.ngram_min, cfg.ngram_max), cfg.draft_sample, repeats=cfg.cost_rounds,
          temperature=point["temperature"], tree=tree)
    sampling, spec = point_specs(cfg, point, base, heads, draft,  # the ledger's: c and v
                                 draft_cost=(step_costs[ckey]["c"], step_costs[ckey]["v"]))
    timing = common.paired_generate(target, prompts, point["batch_size"], cfg.timing_pairs,
                                    method=spec, baseline=sampling)
    calls = None
    if cfg.get("call_costs", False) and mesh is None:
      # Each side's call stopped after 1 and R rounds. A difference of two calls swings
      # more than a timing loop: twice the repeats (~0.3 s each).
      calls = costs.call_costs(target, prompts[:point["batch_size"]], spec, sampling,
                               repeats=2 * cfg.cost_rounds + 1)
    row = make_row(point, timing, step_costs[ckey], machine, calls)
    rows.append(row)
    with results_path.open("a") as f:
      f.write(json.dumps(row) + "\n")
  plots.write_report(rows, workdir)
  return rows


def progress_label(point: dict, points: list[dict]) -> str:
  """The axes of `point` that vary across `points` ('drafter=ngram γ=4 T=0.0'): the
  constants of the grid say nothing about which point runs."""
  short = {"gamma": "γ", "temperature": "T", "batch_size": "batch"}
  varying = [k for k in point
             if len({_grid_value(k, p.get(k)) for p in points}) > 1]
  return " ".join(f"{short.get(k, k)}={_as_tree(point[k]) if k == 'tree' else point[k]}"
                  for k in varying)


def make_row(point, timing, sc, machine, calls=None) -> dict:
  gamma = point["gamma"]
  stats = timing["method"]["stats"]
  alpha = stats["alpha_hat"]
  tree = _as_tree(point.get("tree"))
  # Rounds drafting fewer than γ (no n-gram match, an adaptive policy) commit
  # E(α̂, L) and, on a CPU, verify L + 1 tokens: the ledger over the measured lengths.
  hist = stats.get("length_hist") if not tree else None
  steps = (stats["draft_steps"] / stats["target_calls"] if stats.get("target_calls")
           else gamma)  # draft steps a round ran (the n-gram drafter: γ, matched or not)
  made = arguments.make_tree(tree, None) if tree else None
  if isinstance(made, trees_lib.DynamicTree):
    # No fixed shape to price: the measured tokens per round stand in for E.
    expected, verify = float(stats["tokens_per_target_call"]), sc["v"]
  elif tree:
    # α̂ by sibling rank: a later sibling is tried against what p has left.
    expected = ledger.tree_expected_tokens(made.parents,
                                           stats.get("alpha_by_sibling") or alpha)
    verify = sc["v"]
  elif hist and sum(hist):
    # A batch's pass is as wide as its longest draft (pass_hist), every row's cost.
    expected, verify = ledger.by_length(alpha, hist, sc["v"], stats.get("pass_hist"))
  else:
    expected, verify = float(ledger.expected_tokens(alpha, gamma)), sc["v"]
  predicted = expected / (steps * sc["c"] + verify)
  whole = {}
  if calls:  # the whole call: measured round cost and the fixed part of a call (prefill, host)
    rounds = None  # N / E for trees and adaptive lengths
    if not tree and point.get("gamma_policy", "fixed") == "fixed":
      # The rounds a row needs for its budget, from the rate measured at each draft
      # position (what α̂ pools), the last round cut short.
      commits = (ledger.commits_by_length(stats["acceptance_by_position"], hist) if hist
                 else ledger.commits_by_position(stats["acceptance_by_position"], gamma))
      rounds = ledger.rounds_to_commit(commits, calls["new_tokens"])
    whole = dict(
        predicted_call_speedup=float(ledger.predicted_call_speedup(
            expected, calls["new_tokens"], calls["round"], calls["fixed_method"],
            calls["fixed_baseline"], rounds)),
        # Were every draft accepted: γ + 1 tokens a round (a tree's γ is its depth),
        # its rounds counted as the prediction counts them.
        ceiling_call_speedup=ledger.ceiling_call_speedup(
            gamma + 1, calls["new_tokens"], calls["round"], calls["fixed_method"],
            calls["fixed_baseline"], cut_last=rounds is not None),
        predicted_rounds=rounds,
        round_ratio=calls["round"], round_ratio_min=calls["round_min"],
        round_ratio_max=calls["round_max"], fixed_method=calls["fixed_method"],
        fixed_baseline=calls["fixed_baseline"], call_repeats_kept=calls["repeats_kept"])
  return dict(
      point,
      rows=stats["rows"], rounds=stats["rounds"], target_calls=stats["target_calls"],
      drafted=stats["drafted"], accepted=stats["accepted"], committed=stats["committed"],
      acceptance_rate=stats["acceptance_rate"], alpha_hat=alpha, lossless=stats["lossless"],
      alpha_positions=ledger.alpha_from_positions(stats["accepted_at"], stats["rounds"],
                                                  stats["verified_at"]),
      draft_steps=stats["draft_steps"],
      tokens_per_target_call=stats["tokens_per_target_call"],
      expected_tokens=expected,
      acceptance_by_position=stats["acceptance_by_position"],
      acceptance_by_sibling=stats["acceptance_by_sibling"],
      alpha_by_sibling=stats["alpha_by_sibling"],
      committed_hist=stats["committed_hist"], length_hist=hist,
      drafting=1.0 - hist[0] / sum(hist) if hist and sum(hist) else 1.0,
      seconds=timing["method"]["seconds"], tokens_per_s=timing["method"]["tokens_per_s"],
      target_only_tokens_per_s=timing["baseline"]["tokens_per_s"],
      speedup=timing["speedup"], speedup_min=timing["speedup_min"],
      speedup_max=timing["speedup_max"], timing_pairs=timing["pairs"],
      c=sc["c"], v=sc["v"], target_step_ms=sc["target_step_s"] * 1e3,
      **{k: sc[k] for k in ("c_min", "c_max", "v_min", "v_max")},
      draft_propose_ms=sc["propose_s"] * 1e3,
      predicted_speedup=predicted, machine=machine, **whole,
  )


def grid_points(cfg) -> list[dict]:
  """Every point of the sweep's grid: the product of its axes, then the trees'."""
  fields = GRID_FIELDS + tuple(PROCESSOR_FIELDS)
  grid = [dict(zip(fields, values)) for values in itertools.product(
      *(tuple(_as_float(f, v) for v in cfg[f]) for f in fields))]
  # Token trees: points whose γ is the tree's depth, at every processor setting (each node
  # is processed with its own root-to-node history); n-gram, Medusa or EAGLE trees when the
  # first drafter is 'ngram', 'medusa' or 'eagle', model-drafter trees otherwise.
  base = [p for p in grid if p["drafter"] == cfg.drafter[0] and p["gamma"] == cfg.gamma[0]
          and p["gamma_policy"] == "fixed" and p["verify_rule"] == "exact"]
  for tree in cfg.trees:  # each tree over the chain points only (not the previous trees')
    depth = arguments.make_tree(tree, None).depth
    grid += [dict(p, drafter=_tree_drafter(cfg), gamma=depth, tree=_tree_json(tree))
             for p in base]
  return grid


def _tree_drafter(cfg):
  """Which drafter the `trees` axis uses: the first drafter if it is 'ngram', 'medusa',
  'eagle' or 'eagle3', else 'model' (None without trees)."""
  if not cfg.trees:
    return None
  return (cfg.drafter[0] if cfg.drafter[0] in ("ngram", "medusa", "eagle", "eagle3")
          else "model")


def _as_tree(tree):
  """A tree from JSON (lists) back to the hashable form generate takes."""
  if not tree:
    return None
  return tuple(tuple(x) if isinstance(x, list) else x for x in tree)


def _tree_json(tree):
  """A config's tree as its JSON row value (lists)."""
  return [list(x) if isinstance(x, (list, tuple)) else x for x in tree]


def config_error(argv: list[str], error: Exception) -> str:
  """One line for a config mistake found while parsing the flags: the config file that
  cannot be read, the field it does not have (with the ones it has), or the file's own
  message."""
  arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if arg is None and "--config" in argv[:-1]:
    arg = argv[argv.index("--config") + 1]
  arg = arg or _CONFIG.default
  path, _, variant = arg.partition(":")
  if not os.path.isfile(path):
    return f"--config={arg}: no config file {path!r} (from {os.getcwd()})"
  if isinstance(error, (AttributeError, KeyError, TypeError)):
    try:
      spec = importlib.util.spec_from_file_location("_sweep_config", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      cfg = module.get_config(variant) if variant else module.get_config()
    except Exception:  # noqa: BLE001  the flags' own message below is all there is
      cfg = None
    names = [a[len("--config."):].split("=", 1)[0] for a in argv
             if a.startswith("--config.") and cfg is not None]
    for name in names:
      node, parts = cfg, name.split(".")
      for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if not hasattr(node, "keys"):
          return (f"--config.{name}: the field {where!r} of {path} is a "
                  f"{type(node).__name__}, with no fields of its own")
        if part not in node:
          return (f"--config.{name}: {path}{' field ' + where if where else ''} has no "
                  f"field {part!r}; its fields: {', '.join(sorted(node.keys()))}")
        node = node[part]
  text = str(error).strip()
  # A config file's exception comes back inside the flag's message, traceback and all.
  raised = [line.strip() for line in text.splitlines()
            if re.match(r"\s*[A-Za-z_.]*(Error|Exception): ", line)]
  if raised:
    return f"--config={arg}: {raised[-1]}"
  first = text.splitlines()[0] if text else ""
  if isinstance(error, flags.Error):  # absl's own: an unknown flag, a missing --workdir
    return first or type(error).__name__
  return f"--config={arg}: {type(error).__name__}: {first}"  # raised loading the file


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing; a config mistake exits with one line instead of tracebacks."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # a config file that failed to load raises only when read
  except Exception as e:  # noqa: BLE001  every parsing failure is the command line's
    logging.debug("flag parsing failed", exc_info=True)
    raise SystemExit(f"{Path(argv[0]).name}: {config_error(argv, e)}") from None
  return rest


def main(argv):
  del argv
  rng.use_unrolled_threefry()  # the CPU's faster random bits (specjax.rng), before tracing
  # On a machine without a TPU, jax says so at INFO on every run.
  stdlib_logging.getLogger("jax._src.xla_bridge").setLevel(stdlib_logging.WARNING)
  workdir = Path(_WORKDIR.value)
  try:
    rows = run_sweep(_CONFIG.value, workdir)
  except SweepError as e:  # the sweep's messages name the field or path and the way out
    logging.debug("the sweep stopped", exc_info=True)
    raise SystemExit(f"error: {e}") from None
  print(f"wrote {workdir / 'summary.md'} ({len(rows)} points), with results.jsonl, "
        f"config.json and {len(plots.PLOTS)} plots beside it")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
