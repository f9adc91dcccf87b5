"""The sweep runs end to end (the ':smoke' variant on the shipped pair) and fails fast on
bad configs."""

import json
from pathlib import Path

import pytest

from configs import sweep as sweep_config
from experiments import common
from experiments import run as run_lib
from experiments import plots
from conftest import tiny_model

FIELDS = {"drafter", "gamma", "temperature", "top_p", "batch_size", "rows", "rounds",
          "target_calls", "drafted", "accepted", "committed", "acceptance_rate", "alpha_hat",
          "tokens_per_target_call", "speedup_min", "speedup_max", "expected_tokens", "tokens_per_s",
          "target_only_tokens_per_s", "speedup", "c", "v", "predicted_speedup",
          "acceptance_by_position", "committed_hist", "acceptance_by_sibling",
          "alpha_by_sibling", "drafting"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("smoke")
  cfg = sweep_config.get_config("smoke")
  rows = run_lib.run_sweep(cfg, workdir, progress=False)
  return cfg, workdir, rows


def test_smoke_sweep_writes_everything(smoke):
  cfg, workdir, rows = smoke
  grid = ((len(cfg.drafter) * len(cfg.gamma) + len(cfg.trees)) * len(cfg.temperature)
          * len(cfg.top_p) * len(cfg.batch_size))
  assert len(rows) == grid
  on_disk = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
  assert len(on_disk) == grid
  assert json.loads((workdir / "config.json").read_text())["gamma"] == list(cfg.gamma)
  summary = (workdir / "summary.md").read_text()
  assert "| drafter |" in summary and "tree (2,1)" in summary
  for name in plots.PLOTS:
    assert (workdir / name).stat().st_size > 1000, name


def test_smoke_counts_agree(smoke):
  cfg, _, rows = smoke
  for r in rows:
    assert FIELDS <= set(r), FIELDS - set(r)
    assert 0 <= r["accepted"] <= r["drafted"] <= r["gamma"] * r["rounds"]
    if r.get("tree") is None:  # rounds by draft length: γ, or 0 for an n-gram miss
      hist = r["length_hist"]
      assert sum(hist) == r["rounds"] and hist[1:-1] == [0] * (r["gamma"] - 1)
      assert r["drafted"] == r["gamma"] * hist[-1]
      assert r["drafting"] == hist[-1] / r["rounds"]
      if r["drafter"] != "ngram":
        assert r["drafting"] == 1.0
    # Each round commits its accepted tokens plus one; stops only ever cut that short.
    assert r["committed"] <= r["accepted"] + r["rounds"]
    assert r["committed"] == r["rows"] * cfg.max_new_tokens  # stop_at_eos is off
    assert sum(r["committed_hist"]) == r["rounds"]
    for key in ("acceptance_rate", "alpha_hat"):
      assert 0.0 <= r[key] <= 1.0
    assert all(0.0 <= a <= 1.0 for a in r["acceptance_by_position"] if a == a)
    assert 1.0 <= r["tokens_per_target_call"] <= r["gamma"] + 1
    assert r["tokens_per_s"] > 0 and r["target_only_tokens_per_s"] > 0
    assert r["v"] > 0 and r["c"] >= 0
    # The spread of the per-round ratios (tests/test_costs.py) travels with each row.
    assert r["v_min"] > 0 and r["c_min"] >= 0 and r["v_max"] >= r["v_min"]


def test_policy_and_rule_axes(tmp_path):
  cfg = sweep_config.get_config("smoke")
  cfg.drafter, cfg.trees, cfg.temperature, cfg.gamma = ("ngram",), (), (1.0,), (3,)
  cfg.gamma_policy, cfg.verify_rule = ("fixed", "ledger"), ("exact", "typical")
  # Off in the smoke config. 48 tokens: rounds enough to time past the host's jitter.
  cfg.call_costs, cfg.max_new_tokens = True, 48
  # The axes, not the shipped pair (the smoke sweep runs that): a tiny target compiles fast.
  target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
  prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4, 5]]
  rows = run_lib.run_sweep(cfg, tmp_path, progress=False, models=(target, None),
                           prompts=prompts)
  assert len(rows) == 4
  for r in rows:
    assert r["lossless"] == (r["verify_rule"] == "exact")
    if r["gamma_policy"] == "fixed":  # γ, or nothing without an n-gram match
      assert r["drafted"] == 3 * r["length_hist"][3]
      assert r["length_hist"][0] + r["length_hist"][3] == r["rounds"]
    assert 0 < r["drafted"] <= 3 * r["rounds"] and r["draft_steps"] > 0
    assert r["round_ratio_min"] <= r["round_ratio"] <= r["round_ratio_max"]
    assert r["fixed_method"] > 0 and r["fixed_baseline"] > 0  # prefill and host work
    assert r["predicted_call_speedup"] > 0, r
    # Every draft accepted, at the same round cost: no acceptance predicts more.
    assert r["ceiling_call_speedup"] >= r["predicted_call_speedup"], r
  summary = (tmp_path / "summary.md").read_text()
  assert "γ policy ledger" in summary and "rule typical" in summary
  assert "of 4 points by the ledger" in summary and "round ρ" in summary
  assert "ceiling (call)" in summary


def test_rerun_skips_done_points(smoke):
  cfg, workdir, rows = smoke
  again = run_lib.run_sweep(cfg, workdir, progress=False)  # nothing left: no model loads
  assert again == rows
  assert len((workdir / "results.jsonl").read_text().splitlines()) == len(rows)


@pytest.mark.parametrize("field,value,message", [
    ("gamma", (0,), "config.gamma"),
    ("drafter", ("tree",), "config.drafter"),
    ("temperature", (-1.0,), "config.temperature"),
    ("top_p", (0.0,), "config.top_p"),
    ("batch_size", (0,), "config.batch_size"),
    ("draft_sample", "top1", "config.draft_sample"),
    ("trees", ((2, 0),), "config.trees"),
    ("repetition_penalty", (0.0,), "config.repetition_penalty"),
    ("no_repeat_ngram_size", (-1,), "config.no_repeat_ngram_size"),
    ("eagle_head", "", "config.eagle_head"),
    ("gamma_policy", ("adaptive",), "config.gamma_policy"),
    ("verify_rule", ("synthetic",), "config.verify_rule"),
    ("cost_rounds", 0, "config.cost_rounds"),
    ("temperature", (float("nan"),), "config.temperature"),
    ("presence_penalty", (float("inf"),), "config.presence_penalty"),
    ("seed", -1, "config.seed"),
    ("ngram_min", 0, "config.ngram_min"),
    ("batch_size", (True,), r"config.batch_size: takes numbers or names, not True"),
    ("temperature", (0.0, True), r"config.temperature: takes numbers"),
    ("gamma", (2, 1, 2), r"config.gamma: repeats 2 "),
    ("eagle_head", "stdlib-draft", r"config.eagle_head: 'stdlib-draft' is a model, not a head"),
    ("eagle_head", "stdlib-medusa", r"config.eagle_head: 'stdlib-medusa' is a medusa head"),
    # '((2,2,1,1))' on the command line is one flat tuple, not a tuple of one tree.
    ("trees", (2, 2, 1, 1), r"config.trees: is a tuple of trees.*'\(\(2,2,1,1\),\)'"),
    ("trees", (("dynamic", 6, 3),), r"config.trees: a dynamic tree in a config is"),
    ("trees", (("dynamic", 6, 3, 2, (1.5,)),), r"config.trees: DynamicTree alpha must be"),
])
def test_bad_config_fails_at_once(tmp_path, field, value, message):
  cfg = sweep_config.get_config("smoke")
  cfg[field] = value
  with pytest.raises(ValueError, match=message):
    run_lib.run_sweep(cfg, tmp_path)
  assert not (tmp_path / "results.jsonl").exists()
  assert not (tmp_path / "config.json").exists()  # a rerun's config is kept


@pytest.mark.parametrize("changes,message", [
    (dict(drafter=("ngram", "model")), "needs the draft model or an EAGLE head first"),
])
def test_a_dynamic_tree_the_sweep_cannot_run_fails_at_once(tmp_path, changes, message):
  cfg = sweep_config.get_config("smoke")
  cfg.trees = (("dynamic", 6, 3, 2),)
  for field, value in changes.items():
    cfg[field] = value
  with pytest.raises(ValueError, match=message):
    run_lib.run_sweep(cfg, tmp_path)
  assert not (tmp_path / "config.json").exists()


def test_a_sweep_runs_a_dynamic_eagle_tree(tmp_path):
  """Its row's E is the measured tokens per round (no fixed shape to price)."""
  cfg = sweep_config.get_config("smoke")
  cfg.drafter, cfg.trees = ("eagle",), (("dynamic", 6, 3, 2),)
  rows = run_lib.run_sweep(cfg, tmp_path, progress=False)
  (row,) = [r for r in rows if r.get("tree")]
  assert row["drafter"] == "eagle" and row["gamma"] == 3 and row["lossless"]
  assert row["expected_tokens"] == row["tokens_per_target_call"] > 1.0
  assert (tmp_path / "summary.md").exists()


def test_a_dynamic_tree_is_swept_as_the_static_trees_are():
  cfg = sweep_config.get_config("smoke")
  cfg.drafter, cfg.repetition_penalty = ("eagle", "model"), (1.0, 1.2)
  cfg.trees = ((2, 1), ("dynamic", 6, 3, 2, (0.6, 0.3)))
  grid = run_lib.grid_points(cfg)
  static = [p for p in grid if p.get("tree") == [2, 1]]
  dynamic = [p for p in grid if p.get("tree") == ["dynamic", 6, 3, 2, [0.6, 0.3]]]
  assert {p["repetition_penalty"] for p in static} == {1.0, 1.2}
  assert {p["repetition_penalty"] for p in dynamic} == {1.0, 1.2}
  assert {p["drafter"] for p in static + dynamic} == {"eagle"}
  assert all(p["gamma"] == 3 for p in dynamic)
  assert run_lib._as_tree(dynamic[0]["tree"]) == ("dynamic", 6, 3, 2, (0.6, 0.3))
  from specjax import arguments, trees
  assert arguments.make_tree(run_lib._as_tree(dynamic[0]["tree"]), None) == trees.DynamicTree(
      6, 3, 2, alpha=(0.6, 0.3))


@pytest.mark.parametrize("changes,message", [
    # Only the models know the context: every point's arguments are checked once they load.
    (dict(prompt_tokens=510), r"grid point .*exceeds the target's context"),
    (dict(drafter=("medusa",), gamma=(9,), trees=()), "at most 4 tokens"),
])
def test_points_no_run_could_take_fail_before_any_timing(tmp_path, changes, message):
  cfg = sweep_config.get_config("smoke")
  for field, value in changes.items():
    cfg[field] = value
  with pytest.raises(ValueError, match=message):
    run_lib.run_sweep(cfg, tmp_path, progress=False)
  assert not (tmp_path / "results.jsonl").exists()
  assert not (tmp_path / "config.json").exists()


def test_a_head_for_another_target_fails_with_the_way_out(tmp_path):
  cfg = sweep_config.get_config("smoke")
  cfg.drafter = ("ngram", "eagle")  # stdlib-eagle, trained on stdlib-target
  target = tiny_model(vocab=16, n_layers=2, seed=3)
  with pytest.raises(ValueError, match=r"d_model.*leave 'eagle' out of --config.drafter"):
    run_lib.run_sweep(cfg, tmp_path, progress=False, models=(target, None),
                      prompts=[[1, 2, 3]])
  assert not (tmp_path / "results.jsonl").exists()


def _unreadable_checkpoint(path, **kw):
  """A checkpoint whose config is fine and whose weights cannot be read."""
  from specjax.models import checkpoint
  model = tiny_model(**kw)
  checkpoint.save_model(path, model.config, model.params)
  (path / checkpoint.PARAMS).write_bytes(b"truncated")
  return path


def test_a_misfit_pair_fails_before_any_weights_load(tmp_path):
  from experiments import common
  cfg = sweep_config.get_config("smoke")
  cfg.drafter = ("ngram", "eagle")
  cfg.target = str(_unreadable_checkpoint(tmp_path / "target", vocab=16, n_layers=2))
  # The head's misfit, not the target's truncated weights: nothing was read.
  with pytest.raises(ValueError, match=r"d_model.*leave 'eagle' out of --config.drafter"):
    run_lib.run_sweep(cfg, tmp_path / "run", progress=False)
  draft = _unreadable_checkpoint(tmp_path / "draft", vocab=32)
  with pytest.raises(ValueError, match=r"draft .* \(vocab 32\) and target .* \(vocab 16\) differ"):
    common.load_pair(cfg.target, str(draft))
  with pytest.raises(ValueError, match="truncated or corrupt"):  # a fit: the weights are read
    common.load_pair(cfg.target, None)


def test_a_workdir_of_other_settings_is_refused_and_kept(smoke, tmp_path):
  """A rerun adds grid points; rows measured under other settings (a target, a budget)
  would be reported as this config's, so the run stops and touches nothing."""
  import shutil
  cfg, workdir, _ = smoke
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  before = {p.name: p.read_bytes() for p in copy.iterdir()}
  other = sweep_config.get_config("smoke")
  other.max_new_tokens = cfg.max_new_tokens + 1
  other.target = "stdlib-draft"
  with pytest.raises(ValueError, match=r"max_new_tokens: .* there.*target: 'stdlib-target'"):
    run_lib.run_sweep(other, copy, progress=False)
  other = sweep_config.get_config("smoke")
  other.gamma = tuple(cfg.gamma) + (3,)  # a grid field: only the new points run
  assert run_lib.check_workdir(other, copy) is None
  foreign = tmp_path / "train"
  foreign.mkdir()
  (foreign / "config.json").write_text(json.dumps({"corpus": "stdlib", "steps": 10}))
  with pytest.raises(ValueError, match="not a sweep's config"):
    run_lib.run_sweep(cfg, foreign, progress=False)
  assert json.loads((foreign / "config.json").read_text()) == {"corpus": "stdlib", "steps": 10}
  assert before == {p.name: p.read_bytes() for p in copy.iterdir()}


def _no_loading(*args, **kwargs):
  raise AssertionError("a model or head was loaded")


def test_a_rerun_reads_ints_as_the_floats_it_measured(smoke, tmp_path, monkeypatch):
  """Temperature 1 is the point measured at 1.0: a rerun neither times it again nor
  appends it twice."""
  import shutil
  cfg, workdir, rows = smoke
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  before = (copy / "results.jsonl").read_text()
  monkeypatch.setattr(run_lib.common, "load_pair", _no_loading)
  again = sweep_config.get_config("smoke")
  assert again.temperature == (1.0,) and again.top_p == (1.0,)
  again.update(temperature=(1,), top_p=(1,), repetition_penalty=(1,), presence_penalty=(0,),
               frequency_penalty=(0,))
  assert run_lib.run_sweep(again, copy, progress=False) == rows
  assert (copy / "results.jsonl").read_text() == before
  row = dict(rows[0], temperature=1, top_p=1)  # as a row written from such a config reads
  assert run_lib.point_key(row) == run_lib.point_key(rows[0])


def test_a_workdir_stopped_before_its_first_row_takes_a_changed_config(tmp_path):
  """config.json is written before the first point is measured; with no rows yet there
  is nothing measured under the old settings to protect."""
  cfg = sweep_config.get_config("smoke")
  old = sweep_config.get_config("smoke")
  old.max_new_tokens = cfg.max_new_tokens + 1
  run_lib._write_config(old, tmp_path)
  assert run_lib.check_workdir(cfg, tmp_path) is None
  (tmp_path / "results.jsonl").write_text('{"drafter": "ng')  # cut short: no row
  assert run_lib.check_workdir(cfg, tmp_path) is None
  (tmp_path / "results.jsonl").write_text('{"drafter": "ngram"}\n')
  with pytest.raises(ValueError, match="measured with other settings.*max_new_tokens"):
    run_lib.check_workdir(cfg, tmp_path)


def _file_in_the_way(tmp_path):
  (tmp_path / "afile").write_text("")
  return tmp_path / "afile" / "run"


def _dir_named(name):
  def make(tmp_path):
    (tmp_path / "run" / name).mkdir(parents=True)
    return tmp_path / "run"
  return make


@pytest.mark.parametrize("workdir,corpus,message", [
    (lambda p: p / "run", "/nonexistent/corpus",
     r"config.corpus: corpus source '/nonexistent/corpus' does not exist"),
    (lambda p: p / "run", None, r"config.corpus: corpus directory .*empty has no UTF-8"),
    (_file_in_the_way, "stdlib", r"--workdir .*afile/run: .*afile is a file, not a directory"),
    (_dir_named("config.json"), "stdlib", r"run/config.json is not a file"),
    (_dir_named("results.jsonl"), "stdlib", r"run/results.jsonl is not a file"),
    # No folder can be made in /proc, even as root (for whom os.access says yes).
    (lambda p: Path("/proc/specjax_sweep/run"), "stdlib",
     r"--workdir /proc/specjax_sweep/run cannot be written \(No such file"),
], ids=["no-corpus", "empty-corpus", "file-in-the-way", "config-dir", "results-dir",
        "unwritable"])
def test_odd_paths_fail_before_anything_loads(tmp_path, monkeypatch, workdir, corpus, message):
  monkeypatch.setattr(run_lib.common, "load_pair", _no_loading)
  monkeypatch.setattr(run_lib, "load_pretrained", _no_loading)
  monkeypatch.setattr(run_lib, "read_config", _no_loading)
  (tmp_path / "empty").mkdir()
  cfg = sweep_config.get_config("smoke")
  cfg.corpus = corpus or str(tmp_path / "empty")
  workdir = workdir(tmp_path)
  existed = workdir.exists()
  with pytest.raises(ValueError, match=message):
    run_lib.run_sweep(cfg, workdir, progress=False)
  assert workdir.exists() == existed  # the write check leaves no folder behind


def test_stop_at_eos_needs_a_target_with_an_eos(tmp_path):
  cfg = sweep_config.get_config("smoke")
  cfg.update(drafter=("ngram",), trees=(), stop_at_eos=True)
  target = tiny_model(vocab=16, n_layers=2, seed=3)  # no tokenizer
  with pytest.raises(ValueError, match=r"config.stop_at_eos: the target in models= names no "
                                       r"end-of-text token.*stop_at_eos=False"):
    run_lib.run_sweep(cfg, tmp_path, progress=False, models=(target, None),
                      prompts=[[1, 2, 3]])
  assert not (tmp_path / "config.json").exists()


def test_call_costs_need_two_rounds(tmp_path):
  cfg = sweep_config.get_config("smoke")
  cfg.update(call_costs=True, max_new_tokens=1)
  with pytest.raises(ValueError, match=r"config.max_new_tokens: must be >= 2 with call_costs"):
    run_lib.run_sweep(cfg, tmp_path)
  assert not (tmp_path / "config.json").exists()


def test_a_cut_last_row_runs_again_and_a_bad_one_is_named(tmp_path):
  path = tmp_path / "results.jsonl"
  path.write_text('{"a": 1}\n{"a": 2, "b"')  # stopped while writing
  assert run_lib.read_rows(path) == [{"a": 1}]
  assert run_lib.read_rows(path, repair=True) == [{"a": 1}]
  assert path.read_text() == '{"a": 1}\n'  # the next row starts its own line
  path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
  with pytest.raises(ValueError, match="line 2: not a JSON row"):
    run_lib.read_rows(path)


def test_rules_variant_compares_the_lossless_rules():
  cfg = sweep_config.get_config("rules")
  assert cfg.verify_rule == ("exact", "block") and cfg.gamma == (2, 4, 6)
  run_lib.validate(cfg)  # the sweep runs the block rule
  assert sweep_config.get_config("").verify_rule == ("exact",)  # the default is unchanged


def test_unknown_variant():
  with pytest.raises(ValueError, match="variant"):
    sweep_config.get_config("huge")


@pytest.mark.parametrize("drafters,want", [(("model", "ngram"), "model"), (("ngram",), "ngram"),
                                           (("medusa", "model"), "medusa"),
                                           (("eagle",), "eagle"), (("ngram", "model"), "ngram")])
def test_tree_axis_follows_the_first_drafter(drafters, want):
  cfg = sweep_config.get_config("smoke")
  cfg.drafter = drafters
  assert run_lib._tree_drafter(cfg) == want
  cfg.trees = ()
  assert run_lib._tree_drafter(cfg) is None


def test_bench_calls_compares_lossless_variants_against_target_only():
  from conftest import greedy_oracle
  from experiments import common
  target = tiny_model(vocab=16, n_layers=2, seed=3, llama=True)
  prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]
  out = common.compare_calls(
      target, prompts, dict(max_new_tokens=6, temperature=0.0),
      {"fixed": dict(drafter="ngram", gamma=3),
       "ledger": dict(drafter="ngram", gamma=3, gamma_policy="ledger",
                      draft_cost=(0.05, 1.5))}, rounds=1)
  assert list(out) == ["target-only", "fixed", "ledger"]
  want = [greedy_oracle(target, p, 6) for p in prompts]
  for name, row in out.items():
    assert row["tokens"] == want  # every side is lossless: the target's greedy tokens
    assert row["call_s"] > 0
  assert out["target-only"]["tokens_per_round"] == 1.0
  assert out["target-only"]["drafted_per_round"] == 0.0
  assert out["fixed"]["tokens_per_round"] > 1.0  # the repeating prompts match
  assert "against_first" in out["ledger"] and "against_first" not in out["fixed"]


def test_bench_samples_times_n_against_the_prompt_repeated():
  from experiments import common
  target = tiny_model(vocab=16, n_layers=2, seed=3)
  out = common.compare_samples(
      target, [[1, 2, 3, 1, 2], [4, 5, 4]], 3,
      dict(max_new_tokens=4, temperature=1.0, drafter="ngram", gamma=2), repeats=1)
  assert out["calls"] == 2 and set(out["call_s"]) == {"n", "repeated"}
  assert out["repeated_over_n"]["median"] > 0
  assert 0 < out["prefill_share_of_repeated"]["median"]


def test_bench_refuses_a_flag_its_part_does_not_read():
  # One app, many parts: a flag another part reads is a mistake, named before anything runs.
  import os
  import subprocess
  import sys
  repo = Path(__file__).resolve().parents[1]
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--part=peer", "--pairs=3"], cwd=repo,
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=300)
  assert result.returncode != 0
  assert "--part=peer does not read --pairs" in result.stderr, result.stderr[-2000:]


def test_bench_parts_name_the_drafter_they_time():
  # A part's generate keywords carry its --drafter and --gamma with the draft it loaded;
  # prompt lookup with a draft named is refused (the parts used to time the model
  # drafter and record 'ngram').
  _, draft, kw = common.drafter_pair("stdlib-target", "model", None, 3)
  assert kw == dict(drafter="model", gamma=3, draft=draft) and draft is not None
  _, draft, kw = common.drafter_pair("stdlib-target", "ngram", None, 3)
  assert draft is None and kw == dict(drafter="ngram", gamma=3)
  with pytest.raises(ValueError, match="--drafter=ngram drafts from the context"):
    common.drafter_pair("stdlib-target", "ngram", "stdlib-draft", 3)
