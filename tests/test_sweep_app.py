"""What a newcomer's first sweep tells them: a summary whose recommendation is measured or
supported by a prediction that fits, a legend for its symbols, a workdir whose
config.json describes every row, and config mistakes as one line from the app.

Rows here are made up (no model runs): the summary and the workdir checks only read them.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import sweep as sweep_config
from experiments import plots
from experiments import run as run_lib

ROOT = Path(__file__).parent.parent


def fake_row(drafter="ngram", gamma=2, temperature=0.0, speedup=1.2, ledger=1.2, call=1.2,
             **changes):
  row = dict(
      drafter=drafter, gamma=gamma, temperature=temperature, top_p=1.0, batch_size=1,
      repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
      no_repeat_ngram_size=0, gamma_policy="fixed", verify_rule="exact", tree=None,
      alpha_hat=0.95, acceptance_rate=0.9, tokens_per_target_call=2.0, expected_tokens=2.1,
      drafting=1.0, c=0.001, v=1.0, tokens_per_s=1000 * speedup,
      target_only_tokens_per_s=1000.0, speedup=speedup, speedup_min=speedup * 0.97,
      speedup_max=speedup * 1.03, predicted_speedup=ledger, round_ratio=1.1,
      predicted_call_speedup=call, ceiling_call_speedup=None if call is None else call * 1.3,
      acceptance_by_position=[0.9] * gamma)
  row.update(changes)
  return row


def issue_rows():
  """The issue's sweep: the ledger predicts 2-4x where 1.0-1.4x was measured (it leaves
  out the call's prefill and fixed work), the whole call's prediction is within 3%."""
  rows = []
  for drafter, base in (("ngram", 1.1), ("model", 0.9)):
    for gamma in (1, 2, 4):
      for t in (0.0, 1.0):
        measured = base + 0.08 * gamma - 0.2 * t
        rows.append(fake_row(drafter, gamma, t, speedup=measured, ledger=2.0 + 0.5 * gamma,
                             call=measured * (1.03 if gamma % 2 else 0.98)))
  return rows


def recommendation(summary: str) -> str:
  return summary.split("## Recommendation", 1)[1].split("\n\n")[1]


def test_a_poor_ledger_fit_recommends_nothing_from_the_ledger():
  rows = issue_rows()
  summary = plots.summary_table(rows)
  # At α̂ 0.95 and c 0.001 the ledger's optimum lies far past the measured γ (the issue's
  # γ = 15); it is neither printed nor recommended.
  assert "The ledger, which fits" not in summary
  named = [int(g) for g in re.findall(r"γ(?: ?= ?| at )(\d+)", summary)]
  assert named and max(named) <= 4, named  # no γ past the grid is named anywhere
  assert "0 of 12 points by the ledger's E/(γc+v) (decoding rounds only), it does not fit" \
      in summary
  assert "12 of 12 by the whole call's" in summary and "it fits." in summary
  assert "Nothing here is recommended from the ledger's prediction" in summary
  best = max(rows, key=lambda r: r["speedup"])
  said = recommendation(summary)
  assert said.startswith(f"The {best['drafter']} drafter at γ={best['gamma']}, "
                         f"T={best['temperature']:g}, batch 1: the best measured point")
  measured = {(r["drafter"], r["gamma"]) for r in rows}
  for drafter, gamma in re.findall(r"the (\w+) drafter at γ=(\d+)", said, flags=re.I):
    assert (drafter.lower(), int(gamma)) in measured, said
  assert "ranks it first as well" in said  # the fitting prediction agrees
  assert "largest γ measured" in said  # γ = 4 is the grid's edge: say so


def test_a_fitting_prediction_that_ranks_another_point_first_says_so():
  rows = [fake_row("ngram", 1, speedup=1.30, call=1.25),
          fake_row("ngram", 2, speedup=1.26, call=1.35),
          fake_row("ngram", 4, speedup=1.10, call=1.12)]
  said = recommendation(plots.summary_table(rows))
  assert said.startswith("The ngram drafter at γ=1, T=0, batch 1: the best measured point")
  assert "ranks the ngram drafter at γ=2, T=0, batch 1 first (1.35x predicted" in said
  assert "closer than the prediction's fit" in said


def test_a_fitting_prediction_far_from_the_best_measured_asks_for_more_timing():
  rows = [fake_row("ngram", g, speedup=s, call=c) for g, s, c in (
      (1, 1.30, 1.25), (2, 1.26, 1.40), (4, 1.10, 1.12), (6, 1.05, 1.05), (8, 1.0, 1.0))]
  said = recommendation(plots.summary_table(rows))
  assert said.startswith("The ngram drafter at γ=1, T=0, batch 1: the best measured point")
  assert "ranks the ngram drafter at γ=2, T=0, batch 1 first (1.40x predicted" in said
  assert "more than the prediction's fit apart; time both again" in said


def test_a_poor_whole_call_fit_recommends_only_what_was_measured():
  rows = [fake_row("ngram", g, speedup=s, ledger=s, call=2 * s)
          for g, s in ((1, 1.2), (2, 1.3), (4, 1.1))]
  summary = plots.summary_table(rows)
  assert "0 of 3 by the whole call's (round ρ, prefill and host work measured), it does " \
         "not fit" in summary
  assert "Nothing here is recommended from the whole call's prediction" in summary
  said = recommendation(summary)
  assert said.startswith("The ngram drafter at γ=2") and "ranks" not in said
  # The ledger fits these rows: its optimum stays within the γ range measured.
  line = next(l for l in summary.splitlines() if l.startswith("The ledger, which fits"))
  assert int(re.search(r"at γ=(\d+), predicted", line).group(1)) <= 4


def test_nothing_faster_recommends_target_only():
  rows = [fake_row("model", g, speedup=0.9, ledger=0.9, call=0.9) for g in (1, 2)]
  assert recommendation(plots.summary_table(rows)).startswith("Target-only decoding")


def test_without_call_costs_the_summary_says_what_is_missing():
  rows = [fake_row("ngram", g, speedup=1.2, ledger=3.0, call=None) for g in (1, 2)]
  summary = plots.summary_table(rows)
  assert "the whole call was not timed (call_costs off)" in summary
  assert recommendation(summary).startswith("The ngram drafter at γ=")


def test_the_summary_explains_its_symbols_and_the_plots_use_them(tmp_path, monkeypatch):
  summary = plots.summary_table(issue_rows())
  for name in ("α̂", "accept rate", "E(α̂, L)", "c", "v(γ)", "round ρ", "predicted (ledger)",
               "predicted (call)", "ceiling (call)", "speedup (min–max)"):
    assert f"- **{name}**: " in summary, name
  headers = {h for h, _, _ in plots.SUMMARY_COLUMNS}
  assert set(plots.LEGEND) - {"tok/s"} <= headers
  figures = []
  monkeypatch.setattr(plots.plt, "close", figures.append)
  plots.write_report(issue_rows(), tmp_path)
  texts = []
  for fig in figures:
    for ax in fig.axes:
      texts += [ax.get_xlabel(), ax.get_ylabel()]
      if ax.get_legend():
        texts += [t.get_text() for t in ax.get_legend().get_texts()]
  assert any("E(α̂, L)" in t for t in texts)
  assert not [t for t in texts if "E(α̂" in t and "E(α̂, L)" not in t], texts
  for name in ("predicted (ledger)", "predicted (call)", "ceiling (call)", "speedup (min–max)",
               "accept rate", "tokens/call"):
    assert any(name in t for t in texts), name


def smoke_points(cfg):
  """The grid points of the smoke config, as run_sweep builds them."""
  points = [dict(drafter=d, gamma=cfg.gamma[0], temperature=float(cfg.temperature[0]))
            for d in cfg.drafter]
  points += [dict(drafter=run_lib._tree_drafter(cfg), gamma=2, temperature=1.0,
                  tree=[list(t) if isinstance(t, tuple) else t for t in tree])
             for tree in cfg.trees]
  return points


def done_workdir(path: Path, cfg=None) -> Path:
  """A workdir holding every point of `cfg` (the smoke config), rows made up."""
  cfg = cfg or sweep_config.get_config("smoke")
  run_lib._write_config(cfg, path)
  rows = [fake_row(**p) for p in smoke_points(cfg)]
  (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_a_grid_that_loses_values_is_refused_and_one_that_grows_is_not(tmp_path):
  workdir = done_workdir(tmp_path / "run")
  before = {p.name: p.read_bytes() for p in workdir.iterdir()}
  cfg = sweep_config.get_config("smoke")
  cfg.temperature = (0.5,)  # the issue's change: 1.0's rows would go undescribed
  with pytest.raises(ValueError, match=re.escape(
      "grid values this config leaves out (temperature: [1.0] measured, [0.5] now); its "
      "config.json would no longer describe them") + r".*--config.temperature='\(0.5, 1.0\)'"):
    run_lib.run_sweep(cfg, workdir, progress=False)
  cfg = sweep_config.get_config("smoke")
  cfg.drafter, cfg.trees = ("ngram",), ()
  with pytest.raises(ValueError, match=r"drafter: \['model', 'eagle'\] measured.*"
                                       r"--config.drafter='\(\"ngram\", \"model\", \"eagle\"\)'"
                                       r" --config.trees='\(\[2, 1\],\)'"):
    run_lib.check_workdir(cfg, workdir)
  assert before == {p.name: p.read_bytes() for p in workdir.iterdir()}
  cfg = sweep_config.get_config("smoke")
  cfg.temperature, cfg.gamma = (1, 0.5), (2, 3)  # 1 is the 1.0 measured: a superset
  assert run_lib.check_workdir(cfg, workdir) is None
  # A run stopped before its n-gram and EAGLE points may drop those drafters: no row
  # was measured with them (config.json's grid alone had them).
  rows = run_lib.read_rows(workdir / "results.jsonl")
  kept = [r for r in rows if r["drafter"] == "model"]
  assert 0 < len(kept) < len(rows)
  (workdir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
  cfg = sweep_config.get_config("smoke")
  cfg.drafter = ("model",)
  assert run_lib.check_workdir(cfg, workdir) is None


@pytest.mark.parametrize("temperature", [(0.5,), (1.0,)], ids=["changed", "same"])
def test_config_json_describes_every_row_after_a_rerun(tmp_path, monkeypatch, temperature):
  """Whether a rerun with another grid is refused or not, config.json describes every row
  of results.jsonl afterwards (with nothing new to run, it is rewritten)."""
  workdir = done_workdir(tmp_path / "run")
  monkeypatch.setattr(run_lib.common, "load_pair", lambda *a, **k: pytest.fail("loaded"))
  cfg = sweep_config.get_config("smoke")
  cfg.temperature = temperature
  if temperature == (0.5,):  # drops the 1.0 the rows were measured at
    with pytest.raises(ValueError, match="leaves out"):
      run_lib.run_sweep(cfg, workdir, progress=False)
  else:
    run_lib.run_sweep(cfg, workdir, progress=False)
  rows = run_lib.read_rows(workdir / "results.jsonl")
  assert len(rows) == 4
  saved = json.loads((workdir / "config.json").read_text())
  for r in rows:
    for field in run_lib.GRID_FIELDS + tuple(run_lib.PROCESSOR_FIELDS):
      assert r[field] in saved[field], (field, r)
    assert r.get("tree") in [None, *saved["trees"]]


def test_progress_shows_only_the_axes_that_vary():
  cfg = sweep_config.get_config("smoke")
  points = [dict(p, top_p=1.0, batch_size=1, **run_lib.PROCESSOR_FIELDS)
            for p in smoke_points(cfg)]
  label = run_lib.progress_label(points[-1], points)
  assert label == "drafter=model tree=(2, 1)", label
  assert run_lib.progress_label(points[1], points) == "drafter=ngram"
  assert run_lib.progress_label(points[0], points[:1]) == ""


def app(*args, cwd=ROOT):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="")
  return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["--config=configs/no_such.py"], r"--config=configs/no_such.py: no config file "
                                      r"'configs/no_such.py'"),
    (["--config=configs/sweep.py:smoke", "--config.typo=1"],
     r"--config.typo: configs/sweep.py has no field 'typo'; its fields: batch_size, .*gamma"),
    (["--config=configs/sweep.py:huge"], r"--config=configs/sweep.py:huge: ValueError: "
                                         r"unknown configs/sweep.py variant 'huge'"),
    (["--config=configs/sweep.py:smoke", "--config.gamma=(0,)"],
     r"error: config.gamma: every γ must be an int >= 1"),
], ids=["missing-file", "unknown-field", "unknown-variant", "bad-value"])
def test_config_mistakes_are_one_line(tmp_path, args, message):
  done = app(*args, f"--workdir={tmp_path / 'run'}")
  assert done.returncode != 0
  assert "Traceback" not in done.stderr, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and re.search(message, lines[0]), done.stderr
  assert not (tmp_path / "run").exists()


def test_the_app_ends_with_where_the_results_are(tmp_path):
  workdir = done_workdir(tmp_path / "run")  # nothing left to run: no model loads
  done = app("--config=configs/sweep.py:smoke", f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip().splitlines()[-1].startswith(
      f"wrote {workdir / 'summary.md'} (4 points)")
  assert "Unable to initialize backend" not in done.stderr  # no TPU here, and no news
  assert "## Recommendation" in (workdir / "summary.md").read_text()


def test_an_unsupported_regex_escape_is_named():
  from specjax.processors import constraints

  class Chars:
    vocab_size = 4

    def decode(self, ids):
      return "".join("ab01"[i] for i in ids)

  with pytest.raises(ValueError, match=r"\\U0010ffff") as e:
    constraints.regex(r"[^\x00-\U0010ffff]", Chars())
  assert "unicode properties" not in str(e.value)
  with pytest.raises(ValueError, match=r"\\p\{L\}"):
    constraints.regex(r"\p{L}+", Chars())
  with pytest.raises(ValueError, match="lookbacks"):  # other messages pass through
    constraints.regex(r"(?<=a)b", Chars())
