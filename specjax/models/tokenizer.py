"""Byte-level BPE tokenizer: a thin wrapper over Hugging Face `tokenizers`.

Byte-level BPE maps every byte to a symbol before merging, so any string (source code,
non-ASCII, control characters) encodes and decodes back exactly. Our own tokenizers
reserve id 0 for the end-of-text token `<|endoftext|>` (GPT-2's name for it), which
separates documents in the training stream and ends generation. The same class loads
any Hugging Face `tokenizer.json`; there `eos_id` is found by the usual names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
# Names end-of-text tokens go by in Hugging Face tokenizer files, in order of preference.
_EOS_NAMES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")


class Tokenizer:
  """str <-> list[int], with `vocab_size`, `eos_id` and `eos_ids`.

  `eos_ids` is every id that ends generation (`generate`'s default eos_id='auto'):
  `eos_id` first, then `more_eos_ids` (a chat model's end-of-turn token, say).
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token: str | None = None,
               more_eos_ids: Iterable[int] = ()):
    self._tok = tokenizer
    if eos_token is None:
      eos_token = next((n for n in _EOS_NAMES if tokenizer.token_to_id(n) is not None), None)
    self.eos_token = eos_token
    self.eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
    if eos_token is not None and self.eos_id is None:
      raise ValueError(f"end-of-text token {eos_token!r} is not in the vocabulary")
    more = [int(i) for i in more_eos_ids]
    unknown = [i for i in more if tokenizer.id_to_token(i) is None]
    if unknown:
      raise ValueError(f"end-of-text ids {unknown} are not in the vocabulary")
    first = [] if self.eos_id is None else [self.eos_id]
    self.eos_ids = tuple(dict.fromkeys(first + more))

  # -- construction ---------------------------------------------------------------

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> "Tokenizer":
    """Trains a byte-level BPE on `texts`; id 0 is `<|endoftext|>`."""
    if vocab_size < 257 + 1:
      raise ValueError(f"vocab_size must be at least 258 (256 bytes + end-of-text), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    # No prefix space: it would add a byte the text does not have and break round trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return cls(tok, EOS_TOKEN)

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
    """Loads a `tokenizer.json` (ours or any Hugging Face one), or a directory holding one."""
    path = Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    if not path.is_file():
      raise FileNotFoundError(f"no tokenizer file at {path}")
    try:
      tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception
      raise ValueError(f"cannot read tokenizer file {path}: {e}") from e
    return cls(tok)

  def save(self, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(path))
    return path

  # -- use --------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """The text's ids alone: a piece of text (a stop string, a training document)."""
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_prompt(self, text: str) -> list[int]:
    """A prompt's ids, with what the file's post-processor adds around a text (Llama's and
    Mistral's BOS), as transformers' `tokenizer(text)` and vLLM give them."""
    return self.encode(text, add_special_tokens=True)

  def id_to_token(self, token_id: int) -> str | None:
    """The vocabulary entry of an id (special tokens by name), None past the table."""
    return self._tok.id_to_token(int(token_id))

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Like `encode` for many texts at once (parallel on the Rust side)."""
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in np.asarray(list(ids)).reshape(-1)]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
    return self._tok.decode(ids, skip_special_tokens=False)

  def decode_text(self, ids: Iterable[int]) -> str:
    """Generated ids as output text, as vLLM writes it: special tokens (end-of-text) left
    out, and ids past the tokenizer's table (a model's embedding padded beyond it, as
    Qwen's is) too, as transformers' decode drops them."""
    ids = [int(i) for i in np.asarray(list(ids)).reshape(-1)]
    return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size],
                            skip_special_tokens=True)

  def token_byte_lengths(self) -> np.ndarray:
    """int32[V]: bytes each token stands for (0 for special tokens), for bits per byte.

    Exact for byte-level BPE, where a text's byte length is the sum over its tokens.
    """
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    special = {t.content for t in self._tok.get_added_tokens_decoder().values()
               if t.special}
    lengths = np.zeros(self.vocab_size, np.int32)
    for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
      if token in special:
        continue
      if all(c in byte_of for c in token):
        lengths[idx] = len(token)  # one symbol per byte
      else:  # not a byte-level vocabulary: fall back to the UTF-8 length of its text
        lengths[idx] = len(self._tok.decode([idx]).encode("utf-8"))
    return lengths

  def token_bytes(self) -> list[bytes]:
    """The bytes each token adds to a decoded text (stop strings match on these).

    Exact for byte-level BPE. Special tokens add nothing, as `decode_text` leaves them
    out; other added tokens their own text; SentencePiece byte tokens (`<0x0A>`) their
    byte and its word marker a space.
    """
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    added = {t.content: t.special for t in self._tok.get_added_tokens_decoder().values()}
    vocab = self._tok.get_vocab(with_added_tokens=True)
    # A byte-level vocabulary holds all 256 byte symbols (its initial alphabet); in any
    # other, a character like "é" is itself, not the byte 0xE9.
    byte_level = all(c in vocab for c in byte_of)
    out = [b""] * self.vocab_size
    for token, idx in vocab.items():
      piece = BYTE_PIECE.fullmatch(token)
      if token in added:
        out[idx] = b"" if added[token] else token.encode("utf-8")
      elif byte_level and all(c in byte_of for c in token):
        out[idx] = bytes(byte_of[c] for c in token)
      elif piece:
        out[idx] = bytes([int(piece.group(1), 16)])
      else:
        out[idx] = token.replace("\u2581", " ").encode("utf-8")
    return out

  def __repr__(self):
    return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def encode_prompt(tokenizer, text: str) -> list[int]:
  """A string prompt's ids: `Tokenizer.encode_prompt` (with the BOS a Llama tokenizer
  adds), or `encode` for a tokenizer object that has only that."""
  return getattr(tokenizer, "encode_prompt", tokenizer.encode)(text)


def prompt_prefix(tokenizer) -> list[int]:
  """The ids a tokenizer's post-processor puts before a prompt's text (Llama's and
  Mistral's BOS; none for GPT-2's): what a prompt cut from inside a document needs to
  start as the model's training text did."""
  probe = "a"
  full = [int(i) for i in encode_prompt(tokenizer, probe)]
  plain = [int(i) for i in tokenizer.encode(probe)]
  for k in range(len(full) - len(plain) + 1):
    if full[k:k + len(plain)] == plain:
      return list(full[:k])
  return []


def output_text(tokenizer):
  """ids -> output text: `Tokenizer.decode_text` (no special tokens, as vLLM's text), or
  `decode` for a tokenizer object that has only that."""
  return getattr(tokenizer, "decode_text", tokenizer.decode)


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table, the alphabet of byte-level BPE."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))

