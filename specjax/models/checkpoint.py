"""A model on disk: config + parameters (+ tokenizer), in one plain directory.

    DIR/model.json      format tag, ModelConfig, every parameter's shape and stored
                        dtype, the SHA-256 of params.npz, free-form metadata
    DIR/params.npz      one array per parameter, keyed 'blocks/0/attn/qkv/kernel'
    DIR/tokenizer.json  optional, loads with `specjax.models.tokenizer.Tokenizer.from_file`

Plain numpy so a checkpoint is readable without orbax or a matching jax; orbax is kept
for the training state (`specjax.training.lm`). bfloat16 arrays are stored as their uint16
bit patterns (npz has no bfloat16), so any dtype round-trips bit for bit. The hash
catches truncated or corrupted files before any array is trusted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import model as model_lib
from specjax.models.config import ModelConfig

FORMAT = "specjax-model"
VERSION = 1
MANIFEST = "model.json"
PARAMS = "params.npz"
TOKENIZER = "tokenizer.json"


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete or corrupt; the message names the path."""


def is_checkpoint(path: str | os.PathLike) -> bool:
  """True if `path` is a directory in this format (judged by its manifest alone)."""
  manifest = Path(path) / MANIFEST
  if not manifest.is_file():
    return False
  try:
    return json.loads(manifest.read_text()).get("format") == FORMAT
  except (ValueError, OSError):
    return False


def param_key(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _reference_leaves(cfg: ModelConfig):
  """[(key, ShapeDtypeStruct)] of a config's parameters and the treedef to rebuild them."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(model_lib.abstract_params(cfg))
  return [(param_key(p), leaf) for p, leaf in leaves], treedef


def save_model(path: str | os.PathLike, config: ModelConfig, params, tokenizer=None,
               dtype=None, metadata: dict[str, Any] | None = None) -> Path:
  """Writes a model directory; `dtype` (e.g. jnp.bfloat16) casts floating parameters.

  `tokenizer` is a `specjax.models.tokenizer.Tokenizer` or a path to a tokenizer.json.
  Files are written under temporary names and renamed, so a crash leaves no
  half-written checkpoint that looks complete.
  """
  path = Path(path)
  if (path / "head.json").is_file():
    raise CheckpointError(f"{path} holds a draft head (head.json); save the model elsewhere")
  path.mkdir(parents=True, exist_ok=True)
  leaves, _ = jax.tree_util.tree_flatten_with_path(params)
  arrays, specs = {}, {}
  for p, leaf in leaves:
    arr = np.asarray(jax.device_get(leaf))
    if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
      arr = arr.astype(jnp.dtype(dtype))
    key = param_key(p)
    specs[key] = {"shape": list(arr.shape), "dtype": str(arr.dtype)}
    # npz cannot describe bfloat16 and friends: keep their bits as unsigned ints.
    arrays[key] = arr.view(f"u{arr.itemsize}") if arr.dtype.kind == "V" else arr
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  blob = buffer.getvalue()
  atomic_write(path / PARAMS, blob)
  if tokenizer is not None:
    if isinstance(tokenizer, (str, os.PathLike)):
      shutil.copyfile(tokenizer, path / (TOKENIZER + ".tmp"))
      os.replace(path / (TOKENIZER + ".tmp"), path / TOKENIZER)
    else:
      tokenizer.save(path / (TOKENIZER + ".tmp"))
      os.replace(path / (TOKENIZER + ".tmp"), path / TOKENIZER)
  manifest = {
      "format": FORMAT, "version": VERSION, "config": config.to_dict(),
      "params": specs, "params_sha256": hashlib.sha256(blob).hexdigest(),
      "num_params": int(sum(np.prod(s["shape"], dtype=np.int64) for s in specs.values())),
      "has_tokenizer": tokenizer is not None, "metadata": metadata or {},
  }
  # The manifest goes last: its presence marks the checkpoint complete.
  atomic_write(path / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
  return path


def atomic_write(path: Path, data: bytes):
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"checkpoint not found: {path}")
  if not path.is_dir():
    raise CheckpointError(f"checkpoint {path} is not a directory")
  manifest_path = path / MANIFEST
  if not manifest_path.is_file():
    raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (missing or incomplete save)")
  try:
    manifest = json.loads(manifest_path.read_text())
  except (ValueError, OSError) as e:
    raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable: {e}") from e
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise CheckpointError(f"{manifest_path} is not a {FORMAT} manifest")
  if manifest.get("version") != VERSION:
    raise CheckpointError(f"{manifest_path} has version {manifest.get('version')}, "
                          f"this code reads version {VERSION}")
  check_manifest(manifest, manifest_path, ("config", "params", "params_sha256"))
  return manifest


def check_manifest(manifest, where, keys):
  """CheckpointError naming `where` unless `manifest` has each of `keys`, with a dict
  under 'config' and 'params' (a hand-edited manifest would fail later as a KeyError)."""
  missing = [k for k in keys if k not in manifest]
  if missing:
    raise CheckpointError(f"{where} has no {', '.join(map(repr, missing))} entry")
  for k in ("config", "params"):
    if k in keys and not isinstance(manifest[k], dict):
      raise CheckpointError(f"{where}: {k!r} must be an object, got "
                            f"{type(manifest[k]).__name__}")


def config_from_manifest(manifest, where, from_dict):
  """`from_dict(manifest['config'])`, a CheckpointError naming `where` if it is unfit."""
  try:
    return from_dict(manifest["config"])
  except (TypeError, ValueError, KeyError, ArithmeticError) as e:
    raise CheckpointError(f"{where}: its config is invalid: {e}") from e


def load_params(path: str | os.PathLike, dtype=None, host: bool = False):
  """(config, params) with params exactly as stored, or cast to `dtype` if given.

  host=True keeps them as numpy arrays (for `specjax.shard` to place slice by slice)
  instead of putting each on the default device.
  """
  path = Path(path)
  dtype = None if dtype is None else model_lib.float_dtype(dtype)
  manifest = read_manifest(path)
  cfg = config_from_manifest(manifest, path / MANIFEST, ModelConfig.from_dict)
  params_path = path / PARAMS
  if not params_path.is_file():
    raise CheckpointError(f"checkpoint {path} is missing {PARAMS}")
  blob = params_path.read_bytes()
  if hashlib.sha256(blob).hexdigest() != manifest["params_sha256"]:
    raise CheckpointError(f"checkpoint file {params_path} is truncated or corrupt "
                          f"({len(blob)} bytes; SHA-256 does not match {MANIFEST})")
  try:
    stored = np.load(io.BytesIO(blob), allow_pickle=False)
  except (zipfile.BadZipFile, ValueError, OSError) as e:
    raise CheckpointError(f"checkpoint file {params_path} is unreadable: {e}") from e
  reference, treedef = _reference_leaves(cfg)
  specs = manifest["params"]
  check_param_names([k for k, _ in reference], specs, stored.files, f"checkpoint {path}")
  leaves = []
  for key, ref in reference:
    arr = stored[key]
    arr = as_stored(arr, stored_dtype(specs, key, path / MANIFEST), key, path)
    if list(arr.shape) != list(ref.shape):
      raise CheckpointError(f"checkpoint {path}: parameter {key} has shape {arr.shape}, "
                            f"config needs {tuple(ref.shape)}")
    if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
      arr = arr.astype(jnp.dtype(dtype))
    leaves.append(arr if host else jnp.asarray(arr))
  return cfg, jax.tree_util.tree_unflatten(treedef, leaves)


def check_param_names(want, specs, stored, where):
  """CheckpointError naming `where` unless the manifest's `specs` and the file's `stored`
  names hold exactly the config's parameters `want`: a hand-edited config (fewer layers or
  heads) would otherwise load a subset of the weights without a word."""
  missing = [k for k in want if k not in specs or k not in stored]
  extra = sorted((set(specs) | set(stored)) - set(want))
  if missing or extra:
    raise CheckpointError(f"{where} does not match its config: missing "
                          f"{missing[:5]}, unexpected {extra[:5]}")


def stored_dtype(specs, key, where):
  """The dtype the manifest records for parameter `key`; CheckpointError if it does not."""
  try:
    name = specs[key]["dtype"]
    if not isinstance(name, str):  # np.dtype(None) would be float64
      raise TypeError(name)
    return np.dtype(jnp.dtype(name))
  except (TypeError, KeyError) as e:
    raise CheckpointError(f"{where}: the manifest records no valid dtype for {key}") from e


def as_stored(arr, dtype, key, where):
  """`arr`'s bytes read as the manifest's `dtype` (bfloat16 is stored as uint16)."""
  if arr.dtype == dtype:
    return arr
  # Only a bit pattern the saver wrote (a uint of the width of a type numpy's files cannot
  # name) is reinterpreted; anything else is a manifest that does not describe the file.
  if arr.dtype.kind == "u" and dtype.kind == "V" and arr.dtype.itemsize == dtype.itemsize:
    return arr.view(dtype)
  raise CheckpointError(f"{where}: parameter {key} is stored as {arr.dtype}, which cannot "
                        f"be read as the manifest's {dtype}")


def load_model(path: str | os.PathLike, dtype=jnp.float32, mesh=None) -> model_lib.Model:
  """A `Model` with its tokenizer (if the checkpoint has one); floats cast to `dtype`.

  With a `mesh` the weights go from the file (through host memory) straight into their
  shards (`specjax.shard`): no device ever holds the whole model.
  """
  path = Path(path)
  cfg, params = load_params(path, dtype, host=mesh is not None)
  tokenizer = None
  if read_manifest(path).get("has_tokenizer"):
    from specjax.models.tokenizer import Tokenizer
    tok_path = path / TOKENIZER
    if not tok_path.is_file():
      raise CheckpointError(f"checkpoint {path} is missing {TOKENIZER}")
    try:
      tokenizer = Tokenizer.from_file(tok_path)
    except ValueError as e:
      raise CheckpointError(f"checkpoint tokenizer {tok_path} is corrupt: {e}") from e
    if tokenizer.vocab_size > cfg.vocab_size:
      raise CheckpointError(f"checkpoint {path}: tokenizer has {tokenizer.vocab_size} tokens, "
                            f"model only {cfg.vocab_size}")
  model = model_lib.Model(cfg, params, tokenizer)
  if mesh is not None:
    from specjax.models import sharding
    model = sharding.shard(model, mesh)
  return model
