"""Host-side argument checks: each failure is a ValueError that names the argument."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def int_at_least(name, value, low) -> int:
  if not is_int(value) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
  return int(value)


def host_array(x):
  """A jax.Array (or any other array that is not a sequence) as numpy; the rest as it is."""
  if hasattr(x, "__array__") and not isinstance(x, (str, bytes, Sequence)):
    return np.asarray(x)
  return x


def token_ids(name, ids, vocab) -> list[int]:
  """A flat sequence of ints in [0, vocab); bools, floats and nesting are refused."""
  ids = host_array(ids)
  if (isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray))
      or isinstance(ids, np.ndarray) and ids.ndim != 1):
    raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
  ids = list(ids)
  bad = [t for t in ids if not is_int(t)]
  if bad:
    raise ValueError(f"{name} must hold integer token ids, got {bad[:5]}")
  out_of_range = [int(t) for t in ids if not 0 <= t < vocab]
  if out_of_range:
    raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): "
                     f"{out_of_range[:5]}")
  return [int(t) for t in ids]


def per_row(name, value, batch, kind):
  """A scalar or one value per prompt, as a [batch] array; bools are refused."""
  try:
    arr = np.asarray(value)
  except ValueError:  # ragged nesting
    raise ValueError(f"{name} must be a scalar or one value per prompt ({batch}), "
                     f"got {value!r}") from None
  if arr.dtype.kind not in kind:
    raise ValueError(f"{name} must be {'an int' if kind == 'iu' else 'a number'} "
                     f"(or one per prompt), got {value!r}")
  if arr.ndim == 0:
    arr = np.full((batch,), arr)
  if arr.shape != (batch,):
    raise ValueError(f"{name} must be a scalar or one value per prompt ({batch}), "
                     f"got shape {arr.shape}")
  return arr


def utf8(name, text: str) -> bytes:
  """text's UTF-8 bytes; a lone surrogate (which has none) is refused by name."""
  try:
    return text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"{name} is not valid text: {e}") from None
