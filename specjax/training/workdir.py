"""A training run's workdir: what makes it resumable, its derived files and its logs.

Shared by the language-model trainer (`training.lm`) and the head trainer
(`training.heads`): a workdir holds config.json, the derived token files, orbax
checkpoints and metrics.jsonl; a run resumes only where the fields that shape the
model and its data are unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specjax.models import checkpoint as checkpoint_lib

# Fields a resumed run may change: its length (the schedule is a function of the step and
# `steps`, as a longer run's is), how often it logs, evaluates and saves, and its export.
RESUMABLE_FIELDS = frozenset({"steps", "log_every", "eval_every", "eval_windows",
                              "eval_batch_size", "checkpoint_every", "export_dir",
                              "export_dtype"})


def _run_fields_differ(saved: dict, config) -> list[str]:
  """The fields, other than `RESUMABLE_FIELDS`, where `config` differs from a saved one."""
  new = json.loads(config.to_json_best_effort())
  return sorted(k for k in set(saved) | set(new)
                if k not in RESUMABLE_FIELDS and saved.get(k) != new.get(k))


def check_resume(workdir: Path, config) -> None:
  """A workdir with checkpoints resumes only the run it holds: ValueError naming the
  fields that differ (other than `RESUMABLE_FIELDS`), before anything is written."""
  saved = workdir / "config.json"
  if not (workdir / "checkpoints").is_dir() or not saved.is_file():
    return
  try:
    old = json.loads(saved.read_text())
  except (ValueError, OSError) as e:
    raise ValueError(f"{saved} is unreadable ({e}); it describes the checkpoints in "
                     f"{workdir / 'checkpoints'}: mend it or use a new workdir") from e
  differ = _run_fields_differ(old, config)
  if differ:
    raise ValueError(f"{workdir} holds checkpoints of another run: config fields "
                     f"{differ} differ from its config.json (a resume may change only "
                     f"{sorted(RESUMABLE_FIELDS)}); use a new workdir")


# What a run derives from its config and keeps beside it; without checkpoints they are
# made again, so a changed config (another corpus, tokenizer) never reuses them.
DERIVED_FILES = ("tokenizer.json", "tokens_train.npy", "tokens_heldout.npy")


def start_workdir(workdir, config) -> Path:
  """The resolved workdir, checked against `config` and holding its config.json."""
  if not str(workdir).strip():
    raise ValueError("workdir must be a directory path, got an empty string")
  workdir = Path(workdir).expanduser().resolve()
  for marker in (checkpoint_lib.MANIFEST, "head.json"):
    if (workdir / marker).is_file():
      raise ValueError(f"workdir {workdir} is a model directory ({marker}); a run writes "
                       "its config, caches and checkpoints there: use another workdir")
  check_resume(workdir, config)
  saved = workdir / "config.json"
  if saved.is_file() and not (workdir / "checkpoints").is_dir():
    try:
      same = not _run_fields_differ(json.loads(saved.read_text()), config)
    except (ValueError, OSError, AttributeError):
      same = False
    if not same:  # an earlier run of another config stopped before its first checkpoint
      for name in DERIVED_FILES:
        if (workdir / name).is_file():
          log_line(f"note: {workdir / name} was made for another config; making it again")
          (workdir / name).unlink()
  workdir.mkdir(parents=True, exist_ok=True)
  checkpoint_lib.atomic_write(
      workdir / "config.json",
      (config.to_json_best_effort(indent=2, sort_keys=True) + "\n").encode())
  return workdir


def check_export_dir(config, workdir, default: str = "model",
                     marker: str = checkpoint_lib.MANIFEST) -> Path:
  """Where the job exports (config.export_dir, else WORKDIR/`default`), refused before
  any work if it holds another kind of artifact or is the teacher's own directory."""
  path = (Path(config.export_dir) if config.export_dir
          else Path(workdir) / default).expanduser().resolve()
  for other in ("model.json", "head.json"):
    if other != marker and (path / other).is_file():
      raise ValueError(f"config.export_dir: {path} holds another kind of checkpoint "
                       f"({other}); export elsewhere")
  if config.teacher:
    from specjax.models import pretrained
    try:
      teacher = pretrained.locate(config.teacher)  # a shipped name is its folder
    except ValueError:
      teacher = None  # the teacher's own loader names the problem
    if isinstance(teacher, Path) and teacher.expanduser().resolve() == path:
      raise ValueError(f"config.export_dir: {path} is the teacher's own directory")
  own = (Path(workdir) / default).expanduser().resolve()  # where this run exports by default
  if (path / marker).is_file() and path != own:  # elsewhere: only this workdir's own export
    try:
      written_by = json.loads((path / marker).read_text()).get("metadata", {}).get("workdir")
    except (ValueError, OSError, AttributeError):
      written_by = None
    if written_by != str(Path(workdir).expanduser().resolve()):
      raise ValueError(f"config.export_dir: {path} holds a checkpoint this workdir did not "
                       f"export ({'from ' + written_by if written_by else 'no workdir recorded'}"
                       "); export elsewhere or remove it first")
  return path


class MetricsLog:
  """metrics.jsonl in the workdir; on resume, records past the restored step are dropped."""

  def __init__(self, path: Path, resume_step: int):
    self.path = path
    if path.is_file():
      kept = [l for l in path.read_text().splitlines()
              if (step := _record_step(l)) is not None and step <= resume_step]
      checkpoint_lib.atomic_write(path, "".join(l + "\n" for l in kept).encode())

  def write(self, record: dict[str, Any]):
    with self.path.open("a") as f:
      f.write(json.dumps(record, sort_keys=True) + "\n")


def _record_step(line: str):
  """A metrics line's step; None for a line cut short by a crash mid-write."""
  try:
    return json.loads(line).get("step", 0)
  except (ValueError, AttributeError):
    return None


def log_line(msg: str):
  print(msg, flush=True)
