"""Stop strings matched on the text: an Aho-Corasick automaton over bytes, lifted to tokens.

`generate(stop_sequences=["\\n\\n"])` ends a row at the first new token whose text
completes an occurrence of a stop string, however the text was split into tokens: `")"`
stops a row that emits `")["` (what Hugging Face's `stop_strings` do), where matching the
string's own encoding would not.

The byte automaton's state is the longest suffix of the text so far that is a prefix of
some stop string; state 0 (nothing matched) is where the new text starts, so a match lies
wholly in the new text. Lifting walks every token's bytes from every state once, on the
host: `next[q, t]` is the state after token t from state q, `hit[q, t]` whether a stop
string ended inside its bytes. In a round the state is one more field of the processors'
`History`, advanced per candidate prefix like the constraint automaton's.
"""

from __future__ import annotations

import collections

import numpy as np

from specjax import checks
from specjax.models.tokenizer import BYTE_PIECE
from specjax.models import tokenizer as tokenizer_lib



def byte_automaton(strings: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
  """(delta int32[Q, 256], out bool[Q]): Aho-Corasick over the stop strings' bytes;
  out[q] is set where some stop string ends (q's string has one as a suffix)."""
  goto, out = [{}], [False]
  for s in strings:
    node = 0
    for b in s:
      if b not in goto[node]:
        goto[node][b] = len(goto)
        goto.append({})
        out.append(False)
      node = goto[node][b]
    out[node] = True
  delta = np.zeros((len(goto), 256), np.int32)
  fail = [0] * len(goto)
  queue = collections.deque([0])
  while queue:  # breadth first: a node's failure state is shallower, so already done
    node = queue.popleft()
    row = delta[fail[node]].copy() if node else np.zeros(256, np.int32)
    out[node] = out[node] or out[fail[node]]
    for b, child in goto[node].items():
      fail[child] = int(row[b]) if node else 0
      row[b] = child
      queue.append(child)
    delta[node] = row
  return delta, np.asarray(out)


def token_table(strings: list[bytes], token_bytes: list[bytes], bucket: int = 16):
  """(next int32[Q', V], hit bool[Q', V]): the byte automaton lifted to tokens, the state
  count rounded up to `bucket` (padding states are never reached) so nearby sets of stop
  strings share a compiled engine."""
  delta, out = byte_automaton(strings)
  q, v = delta.shape[0], len(token_bytes)
  lengths = np.fromiter((len(b) for b in token_bytes), np.int64, v)
  order = np.argsort(-lengths, kind="stable")  # longest first: step p walks a prefix
  longest = int(lengths.max()) if v else 0
  data = np.zeros((v, max(longest, 1)), np.uint8)
  for t, b in enumerate(token_bytes):
    data[t, :len(b)] = np.frombuffer(b, np.uint8)
  state = np.repeat(np.arange(q, dtype=np.int32)[:, None], v, axis=1)
  hit = np.zeros((q, v), bool)
  for p in range(longest):
    cols = order[:int(np.sum(lengths > p))]
    s = delta[state[:, cols], data[cols, p][None, :]]
    state[:, cols] = s
    hit[:, cols] |= out[s]
  size = checks.round_up(q, bucket)
  nxt = np.zeros((size, v), np.int32)
  nxt[:q] = state
  hits = np.zeros((size, v), bool)
  hits[:q] = hit
  return nxt, hits


def tokenizer_table(tokenizer, strings: list[bytes], vocab: int):
  """`token_table` for the model's `vocab` ids: tokens past the tokenizer's (a model's
  embedding padded beyond its tokenizer, as Qwen2's is) add no text. The last 8 tables
  are kept on the tokenizer (a 150k vocabulary's takes most of a second to build)."""
  cache = _cache_on(tokenizer, "_specjax_stop_tables", collections.OrderedDict)
  key = (tuple(strings), vocab)
  if cache is None or key not in cache:
    pieces = (list(token_bytes(tokenizer)) + [b""] * vocab)[:vocab]
    table = token_table(list(strings), pieces)
    if cache is None:
      return table
    cache[key] = table
    while len(cache) > 8:
      cache.popitem(last=False)
  cache.move_to_end(key)
  return cache[key]


def _cache_on(obj, name, make):
  """obj.name, set to make() the first time; None where obj takes no new attributes."""
  value = getattr(obj, name, None)
  if value is None:
    try:
      setattr(obj, name, make())
    except AttributeError:
      return None
    value = getattr(obj, name)
  return value


def token_bytes(tokenizer) -> list[bytes]:
  """The bytes each token adds to the text, cached on the tokenizer.

  From `Tokenizer.token_bytes` (exact for byte-level BPE). A tokenizer with only `decode`
  falls back to each token's text decoded on its own, a SentencePiece byte token
  (`<0x0A>`) read as its byte.
  """
  cache = _cache_on(tokenizer, "_specjax_token_bytes", dict)
  if cache is not None and "bytes" in cache:
    return cache["bytes"]
  if hasattr(tokenizer, "token_bytes"):
    out = tokenizer.token_bytes()
  else:
    out = []
    for t in range(tokenizer.vocab_size):
      text = tokenizer_lib.output_text(tokenizer)([t])
      byte = BYTE_PIECE.fullmatch(text)
      out.append(bytes([int(byte.group(1), 16)]) if byte else text.encode("utf-8"))
  if cache is not None:
    cache["bytes"] = out
  return out
