"""Training: losses, a few steps that learn, distillation, and exact resume."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import train as train_configs
from specjax.models import checkpoint
from specjax.models.config import ModelConfig
from specjax.models.model import init_model
from specjax.training import data
from specjax.training import lm as train_lib
from specjax.training import workdir as workdir_lib

REPO = Path(__file__).resolve().parent.parent
TINY = ModelConfig.llama(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_len=32,
                         tie_embeddings=True)


def test_cross_entropy_matches_definition():
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 7))
  targets = jnp.array([[0, 3, 6], [1, 1, 2]])
  expected = -np.log(np.take_along_axis(np.asarray(jax.nn.softmax(logits)),
                                        np.asarray(targets)[..., None], -1)[..., 0])
  np.testing.assert_allclose(train_lib.cross_entropy(logits, targets), expected, rtol=1e-5)


def test_distill_losses():
  key1, key2 = jax.random.split(jax.random.PRNGKey(1))
  p_logits = jax.random.normal(key1, (4, 9)) * 2
  q_logits = jax.random.normal(key2, (4, 9)) * 2
  p, q = jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)
  for kind in train_lib.DISTILL_KINDS:
    chex.assert_trees_all_close(train_lib.distill_loss(p_logits, p_logits, kind),
                                jnp.zeros(4), atol=1e-6)
    assert (train_lib.distill_loss(q_logits, p_logits, kind) > 0).all()
  # TVD = 1 - sum(min(p, q)): one minus the acceptance rate of speculative sampling.
  chex.assert_trees_all_close(train_lib.distill_loss(q_logits, p_logits, "tvd"),
                              1 - jnp.minimum(p, q).sum(-1), atol=1e-6)
  chex.assert_trees_all_close(train_lib.distill_loss(q_logits, p_logits, "fkl"),
                              (p * (jnp.log(p) - jnp.log(q))).sum(-1), atol=1e-5)
  with pytest.raises(ValueError, match="distill kind"):
    train_lib.distill_loss(q_logits, p_logits, "l2")


def _periodic_stream(n=2000, period=7):
  return (np.arange(n) % period * 3 % TINY.vocab_size).astype(np.int32)


def test_few_steps_reduce_heldout_loss():
  model = init_model(TINY, seed=0)
  stream = _periodic_stream()
  optimizer = train_lib.make_optimizer(lr=2e-2, warmup_steps=2, total_steps=15)
  step = train_lib.make_train_step(model.graphdef, optimizer)
  windows = data.eval_windows(stream, 16, 4)
  before = train_lib.evaluate(model.graphdef, model.params, windows)["loss"]
  params, opt_state = model.params, optimizer.init(model.params)
  losses = []
  for i in range(15):
    params, opt_state, metrics = step(params, opt_state, jnp.asarray(data.batch_at(stream, i, 4, 16)))
    losses.append(float(metrics["loss"]))
  after = train_lib.evaluate(model.graphdef, params, windows)["loss"]
  assert losses[-1] < losses[0] - 1.0 and after < before - 1.0


def test_distillation_moves_the_student_towards_the_teacher():
  teacher = init_model(TINY, seed=1)
  # A random teacher has nearly uniform outputs; sharpen it so there is something to learn.
  teacher = teacher.with_params(jax.tree_util.tree_map(lambda x: x * 4, teacher.params))
  student = init_model(TINY, seed=2)
  tokens = jnp.asarray(data.batch_at(_periodic_stream(), 0, 4, 16))

  teacher_logits = teacher.logits(tokens[:, :-1])

  def tvd(params):
    student_logits = student.with_params(params).logits(tokens[:, :-1])
    return float(train_lib.distill_loss(student_logits, teacher_logits, "tvd").mean())

  optimizer = train_lib.make_optimizer(lr=1e-2, warmup_steps=1, total_steps=20)
  step = train_lib.make_train_step(student.graphdef, optimizer, teacher.graphdef, "fkl")
  params, opt_state = student.params, optimizer.init(student.params)
  start = tvd(params)
  for _ in range(20):
    params, opt_state, metrics = step(params, opt_state, tokens, teacher.params)
  assert "distill" in metrics and tvd(params) < 0.7 * start


def test_bad_training_arguments():
  with pytest.raises(ValueError, match="warmup_steps"):
    train_lib.make_optimizer(1e-3, warmup_steps=10, total_steps=10)
  model = init_model(TINY)
  optimizer = train_lib.make_optimizer(1e-3, 1, 10)
  with pytest.raises(ValueError, match="teacher"):
    train_lib.make_train_step(model.graphdef, optimizer, None, "fkl")
  with pytest.raises(ValueError, match="distill must be"):
    train_lib.make_train_step(model.graphdef, optimizer, model.graphdef, "mse")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
  """A handful of real source files: enough text for a 300-token BPE."""
  root = tmp_path_factory.mktemp("corpus")
  stdlib = data.stdlib_root()
  for name in ("textwrap.py", "string.py", "heapq.py", "colorsys.py", "bisect.py",
               "keyword.py", "fnmatch.py", "glob.py", "shlex.py", "this.py"):
    if (stdlib / name).is_file():
      (root / name).write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
  return root


def _tiny_config(corpus_dir, **overrides):
  config = train_configs.get_config("tiny")
  config.corpus = str(corpus_dir)
  config.update(steps=4, warmup_steps=1, checkpoint_every=2, eval_every=2, log_every=1)
  config.update(overrides)
  return config


def test_command_line_run_then_resume_matches_straight_run(corpus_dir, tmp_path, capsys):
  """4 straight steps from the command line == 2 steps, interruption, resume, 2 more."""
  straight = tmp_path / "straight"
  flags = [f"--config.{k}={v}" for k, v in dict(
      corpus=corpus_dir, steps=4, warmup_steps=1, checkpoint_every=2, eval_every=2,
      log_every=1).items()]
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/train.py:tiny",
       f"--workdir={straight}", *flags],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "tok/s" in result.stdout and "exported" in result.stdout
  assert json.loads((straight / "config.json").read_text())["steps"] == 4

  # Interrupted after step 2: only the step-2 orbax checkpoint exists.
  resumed = tmp_path / "resumed"
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / "checkpoints" / "4")
  shutil.rmtree(resumed / "model")
  capsys.readouterr()
  model = train_lib.train(_tiny_config(corpus_dir), resumed)
  assert "at step 2" in capsys.readouterr().out
  expected = checkpoint.load_model(straight / "model")
  jax.tree_util.tree_map(np.testing.assert_array_equal, model.params, expected.params)

  records = [json.loads(l) for l in (resumed / "metrics.jsonl").read_text().splitlines()]
  train_steps = [r["step"] for r in records if "train/loss" in r]
  assert train_steps == [1, 2, 3, 4]  # nothing duplicated by the resume
  assert all(r["tokens_per_s"] > 0 for r in records if "train/loss" in r)
  evals = [r for r in records if "eval/loss" in r]
  assert [r["step"] for r in evals] == [2, 4] and evals[-1]["eval/bits_per_byte"] > 0
  exported = checkpoint.load_model(resumed / "model")
  assert exported.tokenizer.vocab_size == 300 and exported.num_params == expected.num_params


def test_bfloat16_export(corpus_dir, tmp_path):
  train_lib.train(_tiny_config(corpus_dir, steps=2, export_dtype="bfloat16"), tmp_path)
  manifest = checkpoint.read_manifest(tmp_path / "model")
  assert manifest["metadata"]["train_steps"] == 2 and manifest["metadata"]["heldout_loss"] > 0
  assert {s["dtype"] for s in manifest["params"].values()} == {"bfloat16"}


def test_acceptance_rate_is_expected_overlap():
  target = init_model(TINY, seed=1)
  target = target.with_params(jax.tree_util.tree_map(lambda x: x * 3, target.params))
  draft = init_model(TINY, seed=2)
  draft = draft.with_params(jax.tree_util.tree_map(lambda x: x * 3, draft.params))
  windows = data.eval_windows(_periodic_stream(), 8, 3)
  rates = train_lib.acceptance_rate(target, draft, windows, batch_size=2)
  p = np.asarray(jax.nn.softmax(target.logits(windows[:, :-1])), np.float64)
  q = np.asarray(jax.nn.softmax(draft.logits(windows[:, :-1])), np.float64)
  np.testing.assert_allclose(rates["alpha_t1"], np.minimum(p, q).sum(-1).mean(), rtol=1e-5)
  np.testing.assert_allclose(rates["alpha_t0"], (p.argmax(-1) == q.argmax(-1)).mean())
  assert rates["positions"] == 3 * 8
  same = train_lib.acceptance_rate(target, target, windows)
  np.testing.assert_allclose([same["alpha_t0"], same["alpha_t1"]], [1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (dict(lr=float("nan")), "config.lr"),
    (dict(lr=0.0), "config.lr"),
    (dict(steps=0), "config.steps"),
    (dict(warmup_steps=4), "config.warmup_steps"),
    (dict(batch_size=0), "config.batch_size"),
    (dict(log_every=0), "config.log_every"),
    (dict(eval_batch_size=0), "config.eval_batch_size"),
    (dict(seq_len=65), "config.seq_len"),
    (dict(distill="mse"), "config.distill"),
    (dict(distill="fkl"), "needs config.teacher"),
    (dict(export_dtype="int8"), "floating dtype"),
    (dict(b2=1.0), "config.b2"),
    (dict(tokenizer="/nonexistent/tok.json"), "config.tokenizer names no file"),
    (dict(vocab_size=0), r"config.vocab_size must be an int in \[258"),
])
def test_a_bad_config_fails_before_anything_is_written(corpus_dir, tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    train_lib.train(_tiny_config(corpus_dir, **overrides), tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_teacher_that_is_a_head_or_too_short_is_refused(corpus_dir, tmp_path):
  with pytest.raises(ValueError, match="is a Head, not a model"):
    train_lib.train(_tiny_config(corpus_dir, teacher="stdlib-eagle", distill="fkl"),
                    tmp_path / "run")
  short = tmp_path / "short"
  checkpoint.save_model(short, init_model(TINY).config, init_model(TINY).params)
  with pytest.raises(ValueError, match="feeds the teacher 33 positions, more than"):
    train_lib.train(_tiny_config(corpus_dir, teacher=str(short), distill="fkl", seq_len=33),
                    tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_workdir_resumes_only_its_own_run(corpus_dir, tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  saved = _tiny_config(corpus_dir).to_json_best_effort(indent=2, sort_keys=True) + "\n"
  (run / "config.json").write_text(saved)
  with pytest.raises(ValueError, match=r"another run: config fields \['lr', 'model'\]"):
    train_lib.train(_tiny_config(corpus_dir, lr=5e-3, model=dict(
        train_configs.get_config("tiny").model, n_heads=1)), run)
  assert (run / "config.json").read_text() == saved  # the run it holds is still described
  # Its length, cadence and export may change (a longer run continues the schedule).
  workdir_lib.check_resume(run, _tiny_config(corpus_dir, steps=8, eval_every=4))


def test_an_export_over_another_kind_of_checkpoint_is_refused(corpus_dir, tmp_path):
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "elsewhere" / "head.json").write_text("{}")
  with pytest.raises(ValueError, match="another kind of checkpoint"):
    train_lib.train(_tiny_config(corpus_dir, export_dir=str(tmp_path / "elsewhere")),
                    tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_an_export_replaces_only_this_workdirs_own(corpus_dir, tmp_path, monkeypatch):
  """A shipped name is its folder (the teacher's own directory is refused however it is
  named), and a checkpoint another run exported is never written over."""
  shipped = tmp_path / "shipped"
  model = init_model(TINY)
  checkpoint.save_model(shipped / "stdlib-target", model.config, model.params)
  monkeypatch.setenv("SPECJAX_CHECKPOINTS", str(shipped))
  config = _tiny_config(corpus_dir, teacher="stdlib-target",
                        export_dir=str(shipped / "stdlib-target"))
  with pytest.raises(ValueError, match="the teacher's own directory"):
    workdir_lib.check_export_dir(config, tmp_path / "run")
  config = _tiny_config(corpus_dir, export_dir=str(shipped / "stdlib-target"))
  with pytest.raises(ValueError, match="this workdir did not export .no workdir recorded"):
    workdir_lib.check_export_dir(config, tmp_path / "run")
  mine = tmp_path / "mine"
  checkpoint.save_model(mine, model.config, model.params,
                        metadata={"workdir": str((tmp_path / "run").resolve())})
  config = _tiny_config(corpus_dir, export_dir=str(mine))
  assert workdir_lib.check_export_dir(config, tmp_path / "run") == mine.resolve()
  with pytest.raises(ValueError, match=f"did not export .from {tmp_path / 'run'}"):
    workdir_lib.check_export_dir(config, tmp_path / "other")
  # The run's default export (WORKDIR/model) is its own, recorded or not (older runs).
  checkpoint.save_model(tmp_path / "old" / "model", model.config, model.params)
  assert (workdir_lib.check_export_dir(_tiny_config(corpus_dir), tmp_path / "old")
          == (tmp_path / "old" / "model").resolve())


def test_a_workdir_is_not_a_model_and_keeps_no_stale_caches(corpus_dir, tmp_path):
  model_dir = tmp_path / "model"
  checkpoint.save_model(model_dir, init_model(TINY).config, init_model(TINY).params)
  with pytest.raises(ValueError, match="is a model directory"):
    workdir_lib.start_workdir(model_dir, _tiny_config(corpus_dir))
  assert not (model_dir / "config.json").exists()
  # A run that stopped before its first checkpoint, under another corpus: its tokenizer
  # and token caches are made again, not reused for this config.
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(_tiny_config("elsewhere").to_json_best_effort())
  for name in workdir_lib.DERIVED_FILES:
    (run / name).write_text("stale")
  workdir_lib.start_workdir(run, _tiny_config(corpus_dir))
  assert not any((run / name).exists() for name in workdir_lib.DERIVED_FILES)
  for name in workdir_lib.DERIVED_FILES:  # the same run again (longer): kept
    (run / name).write_text("kept")
  workdir_lib.start_workdir(run, _tiny_config(corpus_dir, steps=8))
  assert all((run / name).read_text() == "kept" for name in workdir_lib.DERIVED_FILES)


def test_a_corpus_too_short_for_a_window_is_not_cached(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  run = tmp_path / "run"
  with pytest.raises(ValueError, match=r"config.corpus: its \w+ split holds \d+ tokens, fewer "
                                       r"than one window of seq_len \+ 1 = 33"):
    train_lib.train(_tiny_config(tmp_path / "empty.txt", seq_len=32), run)
  # Neither its token caches nor the tokenizer trained on it (a resumed run keeps its
  # tokenizer): a fuller file at that path is read afresh.
  assert not list(run.glob("tokens_*.npy")) and not (run / "tokenizer.json").exists()


def test_metrics_cut_short_by_a_crash_are_dropped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
  workdir_lib.MetricsLog(path, resume_step=2)
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_tokenizer_larger_than_the_model_writes_nothing(corpus_dir, tmp_path):
  """The misfit is named before the tokenizer or token caches land in the workdir."""
  from specjax.models.tokenizer import Tokenizer
  config = _tiny_config(corpus_dir)
  texts = [f"def f{i}(x): return x * {i} + {i * i}\n" * 3 for i in range(200)]
  big = Tokenizer.train(texts, config.vocab_size + 40, min_frequency=1)
  assert big.vocab_size > config.vocab_size
  config.tokenizer = str(big.save(tmp_path / "big.json"))
  run = tmp_path / "run"
  with pytest.raises(ValueError, match=f"model vocab_size {config.vocab_size} < tokenizer's"):
    train_lib.train(config, run)
  assert not any((run / name).exists() for name in workdir_lib.DERIVED_FILES)


def test_a_short_heldout_split_writes_nothing(tmp_path):
  """Both splits pass their check before a cache (or a new tokenizer) is written."""
  path = tmp_path / "one.txt"
  path.write_text("".join(f"x = {i} * {i}\n" for i in range(400)))
  run = tmp_path / "run"
  with pytest.raises(ValueError, match="its heldout split holds"):
    train_lib.train(_tiny_config(path, seq_len=32, heldout_fraction=0.002), run)
  assert not any((run / name).exists() for name in workdir_lib.DERIVED_FILES)
