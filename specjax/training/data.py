"""Training text: a corpus of documents split by file, and batches from its token stream.

The default corpus is the Python standard library of the running interpreter (every
machine has it, ~1.8k `.py` files, ~31 MB of UTF-8 on CPython 3.11). Each file goes to train or
held-out by a hash of its path relative to the corpus root, so the split never depends
on the order files are listed or on which other files exist. Any text file or directory
can be used instead. Documents are tokenized once into one stream with an end-of-text
token after each; batches are windows of that stream at offsets drawn from
`(seed, step)`, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

STDLIB = "stdlib"
# Third-party code installed into the interpreter is not the standard library.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# pydoc_data/topics.py is the language reference as one generated 750 kB string: prose,
# not source, and on its own 40% of the held-out split if it were kept.
_STDLIB_SKIP_DIRS = {"pydoc_data"}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Documents of one source, already split. Paths are relative to `root`."""
  root: Path
  train: tuple[str, ...]
  heldout: tuple[str, ...]
  heldout_fraction: float

  def read(self, split: str) -> list[str]:
    """The texts of one split ('train' or 'heldout'), in path order."""
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if self.root.is_file():  # a single file: split by position, see `load_corpus`
      return [_single_file_part(self.root, split, self.heldout_fraction)]
    return [_read_text(self.root / p) for p in getattr(self, split)]


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def heldout_bucket(relpath: str) -> float:
  """A number in [0, 1) fixed by the path alone; below the fraction means held-out."""
  digest = hashlib.sha256(relpath.replace(os.sep, "/").encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def list_files(root: Path, suffixes: tuple[str, ...] | None,
               skip_dirs: frozenset[str] = frozenset()) -> list[str]:
  """Relative paths (sorted) of the UTF-8 text files under `root` with those suffixes."""
  out = []
  skip = _SKIP_DIRS | set(skip_dirs)
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
    for name in filenames:
      if suffixes is not None and not name.endswith(suffixes):
        continue
      path = Path(dirpath) / name
      if _is_utf8(path):
        out.append(path.relative_to(root).as_posix())
  return sorted(out)


def load_corpus(source: str = STDLIB, heldout_fraction: float = 0.05,
                suffixes: tuple[str, ...] | None = None) -> Corpus:
  """A corpus from 'stdlib', a directory, or a single text file.

  Directory: every UTF-8 file (or those ending in `suffixes`), split by path hash.
  Single file: its last `heldout_fraction` of lines is held out.
  """
  if not 0.0 < heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
  skip_dirs = frozenset()
  if not isinstance(source, (str, os.PathLike)) or not str(source).strip():  # '': the cwd
    raise ValueError(f"corpus source must be {STDLIB!r}, a directory or a text file, "
                     f"got {source!r}")
  if source == STDLIB:
    root, suffixes, skip_dirs = stdlib_root(), suffixes or (".py",), _STDLIB_SKIP_DIRS
  else:
    root = Path(source).expanduser()
  if not root.exists():
    raise ValueError(f"corpus source {source!r} does not exist")
  if root.is_file():
    if not _is_utf8(root):
      raise ValueError(f"corpus file {root} is not UTF-8 text")
    return Corpus(root, (root.name,), (root.name,), heldout_fraction)
  files = list_files(root, None if suffixes is None else tuple(suffixes), skip_dirs)
  if not files:
    raise ValueError(f"corpus directory {root} has no UTF-8 text files"
                     + (f" ending in {suffixes}" if suffixes else ""))
  train = tuple(f for f in files if heldout_bucket(f) >= heldout_fraction)
  heldout = tuple(f for f in files if heldout_bucket(f) < heldout_fraction)
  if not train or not heldout:
    raise ValueError(f"corpus {root} has too few files ({len(files)}) for a train/held-out "
                     f"split at heldout_fraction={heldout_fraction}")
  return Corpus(root, train, heldout, heldout_fraction)


def _is_utf8(path: Path) -> bool:
  try:
    path.read_bytes().decode("utf-8")
    return True
  except (UnicodeDecodeError, OSError):
    return False


def _read_text(path: Path) -> str:
  return path.read_bytes().decode("utf-8")


def _single_file_part(path: Path, split: str, fraction: float) -> str:
  lines = _read_text(path).splitlines(keepends=True)
  cut = max(1, min(len(lines) - 1, round(len(lines) * (1 - fraction))))
  return "".join(lines[:cut] if split == "train" else lines[cut:])


# ----------------------------------------------------------------------------------
# Token streams and batches.


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
  """All texts as one int32 stream, each followed by the end-of-text token."""
  if tokenizer.eos_id is None:
    raise ValueError("the tokenizer has no end-of-text token to separate documents")
  pieces = []
  for ids in tokenizer.encode_batch(texts):
    pieces.append(np.asarray(ids, np.int32))
    pieces.append(np.asarray([tokenizer.eos_id], np.int32))
  return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def _check_stream(stream: np.ndarray, seq_len: int):
  if stream.ndim != 1:
    raise ValueError(f"token stream must be 1-D, got shape {stream.shape}")
  if len(stream) < seq_len + 1:
    raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window "
                     f"of seq_len + 1 = {seq_len + 1}")


def batch_at(stream: np.ndarray, step: int, batch_size: int, seq_len: int,
             seed: int = 0) -> np.ndarray:
  """int32[batch_size, seq_len + 1] windows at random offsets fixed by (seed, step)."""
  _check_stream(stream, seq_len)
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
  return np.stack([stream[s: s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(stream: np.ndarray, seq_len: int, num_windows: int) -> np.ndarray:
  """int32[n, seq_len + 1]: fixed windows spread evenly over the stream (n may shrink)."""
  _check_stream(stream, seq_len)
  num_windows = max(1, min(num_windows, len(stream) // (seq_len + 1)))
  starts = np.linspace(0, len(stream) - seq_len - 1, num_windows).astype(np.int64)
  return np.stack([stream[s: s + seq_len + 1] for s in starts]).astype(np.int32)
