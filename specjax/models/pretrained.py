"""`load_pretrained(name_or_path)`: the shipped pair by name, our checkpoints, HF models.

Names resolve to directories under the checkpoints folder: `checkpoints/` at the root
of the repository (an editable install keeps the package inside it), or the folder in
the SPECJAX_CHECKPOINTS environment variable when set. A Hugging Face model directory
(a config.json with a `model_type`) or a hub id goes to `specjax.hf`, imported only then
so the hub dependencies stay optional.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp

from specjax.models import checkpoint as checkpoint_lib

KNOWN = ("stdlib-target", "stdlib-draft", "stdlib-eagle", "stdlib-eagle3", "stdlib-medusa")
ENV_VAR = "SPECJAX_CHECKPOINTS"


def checkpoints_dir() -> Path:
  override = os.environ.get(ENV_VAR)
  if override:
    return Path(override).expanduser()
  return Path(__file__).resolve().parents[2] / "checkpoints"  # the repository's


def _is_hf_dir(path: Path) -> bool:
  config = path / "config.json"
  if not config.is_file():
    return False
  try:
    return "model_type" in json.loads(config.read_text())
  except (ValueError, OSError):
    return True  # the Hugging Face loader says what is wrong with it


def _is_head_dir(path: Path) -> bool:
  from specjax.models import heads
  return heads.is_head(path)


def _load_dir(path: Path, dtype, mesh=None):
  if _is_head_dir(path):
    if mesh is not None:
      raise ValueError(f"{path} is a draft head; mesh= places models (load the head without it)")
    from specjax.models import heads
    return heads.load_head(path, dtype)
  return checkpoint_lib.load_model(path, dtype, mesh)


def load_pretrained(name_or_path: str | os.PathLike, dtype=jnp.float32, mesh=None,
                    target=None):
  """A `Model` with `.tokenizer` set, from a shipped name, a directory or a hub id.

  dtype: the parameters' floating dtype, which the forward and the KV cache run in
  (logits and sampling stay float32). mesh: a jax Mesh ('data', 'model'); the weights
  are read into host memory and placed slice by slice (`specjax.shard`), so no device
  ever holds the whole model.

  A draft-head directory (e.g. 'stdlib-eagle', 'stdlib-medusa') gives a
  `specjax.models.heads.Head` instead. So does a published EAGLE-3, EAGLE-1/2 or
  Medusa-1 head (its authors' layout, `specjax.hf.heads`), which needs `target=` (the
  loaded `Model` it drafts for): its files name no target, and every shape is checked
  against it.
  """
  where = locate(name_or_path)
  kind = _published(where) if isinstance(where, Path) else None
  if kind is not None:
    from specjax.hf import heads as hf_heads
    if target is None:
      raise ValueError(f"{where} is a published {kind} head: pass target=<the loaded target "
                       "Model> to load_pretrained, so its shapes can be checked against it")
    if mesh is not None:
      raise ValueError(f"{where} is a draft head; mesh= places models (load the head without it)")
    return hf_heads.load_published(where, target, dtype)
  if target is not None:
    raise ValueError("target= is for published draft heads (EAGLE-3, EAGLE or Medusa "
                     f"directories); {name_or_path} is not one")
  if not isinstance(where, Path) or _is_hf(where):
    from specjax import hf
    return hf.load_hf_model(os.fspath(where), dtype=dtype, mesh=mesh)
  return _load_dir(where, dtype, mesh)


def _published(path: Path) -> str | None:
  """'eagle3', 'eagle' or 'medusa' for a published head directory (`specjax.hf.heads`)."""
  if not (path / "config.json").is_file() or (path / checkpoint_lib.MANIFEST).exists():
    return None
  try:  # a look at config.json first: a model directory never imports the hf package
    config = json.loads((path / "config.json").read_text())
  except (ValueError, OSError):
    return None
  if not isinstance(config, dict) or not (
      config.get("num_hidden_layers") == 1 or "medusa_num_heads" in config
      or "draft_vocab_size" in config or any(path.glob("medusa_lm_head.*"))
      or any("eagle" in str(a).lower() for a in config.get("architectures") or [])):
    return None
  from specjax.hf import heads as hf_heads
  return hf_heads.published_kind(path)


def _is_hf(path: Path) -> bool:
  """A Hugging Face directory rather than ours (a shipped name's folder that is neither
  goes to our loader, which says what it lacks)."""
  return (not (path / checkpoint_lib.MANIFEST).exists() and not _is_head_dir(path)
          and _is_hf_dir(path))


def locate(name_or_path) -> Path | str:
  """The model directory a name means (a shipped name: its folder), or the name itself
  for a hub id; raises for a name that names nothing loadable."""
  if not isinstance(name_or_path, (str, os.PathLike)) or not os.fspath(name_or_path).strip():
    raise ValueError(f"expected a model name, directory or hub id, got {name_or_path!r}")
  name = os.fspath(name_or_path)
  if name in KNOWN:
    path = checkpoints_dir() / name
    if not path.exists():
      raise checkpoint_lib.CheckpointError(
          f"shipped checkpoint {name!r} not found at {path} (set {ENV_VAR} to the folder "
          "that holds it)")
    return path
  path = Path(name).expanduser()
  if path.is_dir():
    if ((path / checkpoint_lib.MANIFEST).exists() or _is_head_dir(path)
        or _is_hf_dir(path) or _published(path)):
      return path
    raise ValueError(f"{path} is neither a specjax checkpoint ({checkpoint_lib.MANIFEST}) "
                     "nor a Hugging Face model directory (config.json with model_type)")
  if path.exists():
    raise ValueError(f"{path} is a file; load_pretrained needs a model directory or a name")
  from specjax.hf.files import looks_like_hub_id
  if looks_like_hub_id(name):
    return name
  raise ValueError(f"unknown model {name!r}: there is no directory {path.resolve()}, and it "
                   f"is not a hub id; known names: {', '.join(KNOWN)}")


def read_config(name_or_path: str | os.PathLike):
  """The config of what `load_pretrained(name_or_path)` loads, read without the weights.

  A `ModelConfig`, a `HeadConfig` for a draft-head directory, or None for a hub id (a look
  at it would fetch the files). Raises what `load_pretrained` raises for a name that
  names nothing and for an unreadable manifest or config.json, so a caller can check a
  pair before it reads gigabytes of weights.
  """
  where = locate(name_or_path)
  if not isinstance(where, Path):
    return None
  if _published(where):
    raise ValueError(f"{where} is a published draft head; its config depends on the target "
                     "(load it with load_pretrained(path, target=...))")
  if _is_hf(where):
    from specjax.hf import config as hf_config, files
    return hf_config.config_from_hf(files.read_config(where / "config.json"))
  if _is_head_dir(where):
    from specjax.models import heads
    return heads.read_head_config(where)
  from specjax.models.config import ModelConfig
  return checkpoint_lib.config_from_manifest(checkpoint_lib.read_manifest(where),
                                where / checkpoint_lib.MANIFEST, ModelConfig.from_dict)
