"""What a call hands back: a `GenerateResult` from the final state, and a `Stream`'s chunks.

The host reads the state once (`fetch`), cuts each row's new tokens out of the buffer,
decodes their text, names why each row ended, and sums the counters into the stats.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from specjax import decode as decode_lib
from specjax.models import tokenizer as tokenizer_lib
from specjax.models.model import Model
from specjax.processors import stops as stops_lib

@dataclasses.dataclass
class GenerateResult:
  tokens: list[list[int]]  # the new tokens of each prompt
  stats: dict[str, Any]
  # The new tokens as text, when the target has a tokenizer: special tokens (EOS) and
  # ids past the tokenizer's table left out, as vLLM's text (`Tokenizer.decode_text`).
  texts: list[str] | None = None
  # Why each row ended: 'stop' (EOS, a stop sequence or string, a finished constraint,
  # a prefix where the processors ban every token) or 'length' (max_new_tokens).
  finish_reasons: list[str] | None = None
  # Which stop ended each row (vLLM's stop_reason): the EOS id (an int), the stop string
  # or token-id list as given in stop_sequences; None for any other end.
  stop_reasons: list[int | str | bytes | list[int] | None] | None = None
  prompt_tokens: list[list[int]] | None = None  # each row's prompt ids (strings encoded)
  # logprobs=True: log p(token | all before it) under the target's raw logits (no
  # temperature, top-k/p or processors; with logprobs_mode='processed', after them).
  logprobs: list[list[float]] | None = None
  # top_logprobs=n: at each new token's position, the n most likely (token, logprob)
  # pairs under the same distribution, most likely first.
  top_logprobs: list[list[list[tuple[int, float]]]] | None = None
  # prompt_logprobs=True: the same for each prompt's tokens (None for the first, which
  # nothing comes before), and their top n where top_logprobs=n.
  prompt_logprobs: list[list[float | None]] | None = None
  prompt_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None

  def __eq__(self, other):
    # A rate with nothing to count is NaN (`_summary`): equal results compare equal.
    if not isinstance(other, GenerateResult):
      return NotImplemented
    return all(_same(getattr(self, f.name), getattr(other, f.name))
               for f in dataclasses.fields(self))


def _same(a, b) -> bool:
  """a == b, where NaN equals NaN, through dicts, lists and tuples."""
  if isinstance(a, float) and isinstance(b, float):
    return a == b or (math.isnan(a) and math.isnan(b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
  return a == b


COUNTERS = ("rows", "rounds", "target_calls", "drafted", "accepted", "committed",
            "overlap_sum", "overlap_count", "accepted_at", "verified_at", "committed_hist",
            "length_hist", "pass_hist",
            "draft_steps", "sibling_tried", "sibling_accepted", "sibling_chance")


def with_rates(counts: dict[str, Any]) -> dict[str, Any]:
  """The counters plus every rate derived from them (also used to pool several runs)."""
  rounds, drafted, committed = counts["rounds"], counts["drafted"], counts["committed"]
  accepted_at = counts["accepted_at"]
  # Rows written before verified_at existed drafted fixed chains: reached i = accepted i-1.
  verified_at = counts.get("verified_at") or [rounds] + list(accepted_at[:-1])
  nan = float("nan")
  return dict(
      counts,
      acceptance_rate=counts["accepted"] / drafted if drafted else nan,
      alpha_hat=counts["overlap_sum"] / counts["overlap_count"] if counts["overlap_count"]
      else nan,
      # Per sequence: every round is one target call for each live row.
      tokens_per_target_call=committed / rounds if rounds else nan,
      # P(position i accepted | the round reached it)
      acceptance_by_position=[a / r if r else nan for a, r in zip(accepted_at, verified_at)],
      # Per sibling rank r (tried only once every earlier sibling was rejected): how
      # often a try was accepted, and α̂ (its mean acceptance probability). A chain: K = 1.
      acceptance_by_sibling=[a / t if t else nan for a, t in zip(
          counts.get("sibling_accepted", ()), counts.get("sibling_tried", ()))],
      alpha_by_sibling=[c / t if t else nan for c, t in zip(
          counts.get("sibling_chance", ()), counts.get("sibling_tried", ()))],
  )


def on_host(tree):
  """`jax.device_get(tree)`, without its copies on a CPU.

  On a CPU `np.asarray` reads a result's buffer where it lies, where `device_get` first
  starts a copy of every leaf, about ten times as long over a call's ~20 leaves. Off a
  CPU, those copies overlap: kept.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if all(d.platform == "cpu" for x in leaves if isinstance(x, jax.Array) for d in x.devices()):
    return jax.tree_util.tree_map(np.asarray, tree)
  return jax.device_get(tree)


def fetch(state: decode_lib.DecodeState, gamma: int):
  """(tokens, n, prompt_len, stats, logprobs, stopped) on the host, fetched together
  (each separate fetch waits on its own); stats: the run's counters summed over rows,
  and every rate (`with_rates`); logprobs: a `decode.Logprobs`, None unless the engine
  kept them; stopped: bool[B], the row ended at a stop (`DecodeState.stopped`)."""
  tokens, n, prompt_len, logprobs, stopped, *counters = on_host(
      (state.tokens, state.n, state.prompt_len, state.logprobs, state.stopped, state.stats,
       state.target_calls, state.draft_steps))
  return tokens, n, prompt_len, _summary(*counters, gamma), logprobs, stopped


def _summary(s, target_calls, draft_steps, gamma: int) -> dict[str, Any]:
  """`fetch`'s stats from the counters it got on the host."""
  counts = {key: int(np.sum(getattr(s, key))) for key in
            ("rounds", "drafted", "accepted", "committed", "overlap_count")}
  counts.update(rows=int(s.rounds.shape[0]), target_calls=int(target_calls),
                overlap_sum=float(np.sum(s.overlap_sum)),
                accepted_at=[int(x) for x in np.sum(s.accepted_at, axis=0)],
                verified_at=[int(x) for x in np.sum(s.verified_at, axis=0)],
                sibling_tried=[int(x) for x in np.sum(s.sibling_tried, axis=0)],
                sibling_accepted=[int(x) for x in np.sum(s.sibling_accepted, axis=0)],
                sibling_chance=[float(x) for x in np.sum(s.sibling_chance, axis=0)],
                # Draft steps run (an adaptive loop may stop early); fixed: γ per round.
                draft_steps=int(draft_steps) if draft_steps is not None
                else gamma * int(target_calls),
                committed_hist=[int(x) for x in np.sum(s.committed_hist, axis=0)],
                # Rounds by draft length 0..γ (fixed chains: all at γ; the n-gram drafter
                # drafts 0 without a match; adaptive policies anything up to γ).
                length_hist=[int(x) for x in np.sum(s.length_hist, axis=0)],
                # Rounds by the draft tokens the batch's verify pass computed (on a CPU
                # the longest draft of the batch, else γ): what the pass cost.
                pass_hist=[int(x) for x in np.sum(s.pass_hist, axis=0)])
  return dict(gamma=gamma, **with_rates(counts))


def _spans(x, start, end):
  """Row i's x[i, start[i]:end[i]] as a list, for each row (None stays None)."""
  return None if x is None else [x[i, start[i]:end[i]].tolist() for i in range(len(end))]


def _top_spans(lp, start, end):
  """`_spans` of a `decode.Logprobs`' top n as (token, logprob) pairs per position."""
  if lp is None or lp.top_ids is None:
    return None
  return [[list(zip(i, v)) for i, v in zip(ids, values)]
          for ids, values in zip(_spans(lp.top_ids, start, end),
                                 _spans(lp.top_values, start, end))]


def _reasons(done, stopped):
  """Each row's finish reason: 'stop', 'length', or None while it runs."""
  return [("stop" if s else "length") if d else None for d, s in zip(done, stopped)]


def _stop_reasons(target: Model, stops, new, at_stop, rows=None):
  """`StopList.reason` of each row in `new` that ended at a stop, else None (rows: their
  indices in the batch, where `new` is not all of it)."""
  if stops is None:
    return None
  token_bytes = None
  if target.tokenizer is not None and any(isinstance(g, (str, bytes)) for g in stops.given):
    token_bytes = stops_lib.token_bytes(target.tokenizer)
  rows = range(len(new)) if rows is None else rows
  return [stops.reason(i, row, token_bytes) if s else None
          for i, row, s in zip(rows, new, at_stop)]


def build_result(target: Model, engine: decode_lib.Engine, state,
                 stops=None) -> GenerateResult:
  """The `GenerateResult` of a final state (the caller's rows, `Prepared.finish`)."""
  tokens, n, prompt_len, stats, lp, stopped = fetch(state, engine.gamma)
  new = _spans(tokens, prompt_len, n)
  texts = None
  if target.tokenizer is not None:
    text_of = tokenizer_lib.output_text(target.tokenizer)
    texts = [text_of(t) for t in new]
  stats = dict(stats, lossless=engine.rule.lossless, gamma_policy=engine.policy.kind)
  done = [True] * len(new)
  out = GenerateResult(tokens=new, stats=stats, texts=texts,
                       finish_reasons=_reasons(done, stopped),
                       stop_reasons=_stop_reasons(target, stops, new, stopped),
                       prompt_tokens=_spans(tokens, np.zeros_like(prompt_len), prompt_len))
  if lp is None:
    return out
  out.logprobs = _spans(lp.chosen, prompt_len, n)
  out.top_logprobs = _top_spans(lp, prompt_len, n)
  if engine.prompt_logprobs:
    out.prompt_logprobs, out.prompt_top_logprobs = _prompt_logprobs(lp, prompt_len)
  return out


def _prompt_logprobs(lp, prompt_len):
  """`GenerateResult`'s prompt_logprobs and prompt_top_logprobs (None without a top n),
  read off the prefill's slots; slot 0 has nothing before it."""
  ones = np.ones_like(prompt_len)
  top = _top_spans(lp, ones, prompt_len)
  return ([[None] + x for x in _spans(lp.chosen, ones, prompt_len)],
          None if top is None else [[None] + x for x in top])


@dataclasses.dataclass
class Chunk:
  """What a stream's step added to each row."""
  tokens: list[list[int]]  # the row's tokens committed since the previous chunk
  # Their text, when the target has a tokenizer. A character whose bytes are split over
  # tokens waits for its last byte, so the texts of all chunks add up to the row's text
  # (where decoding more tokens never rewrites the text of earlier ones).
  texts: list[str] | None
  done: list[bool]  # the row has finished: nothing more will come
  finish_reasons: list[str | None] | None = None  # as GenerateResult's; None: running
  stop_reasons: list | None = None  # as GenerateResult's (None while running)
  logprobs: list[list[float]] | None = None  # as GenerateResult.logprobs, for these tokens
  top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # and top_logprobs
  # With prompt_logprobs, the first chunk carries GenerateResult's two prompt fields (as
  # vLLM's first output does); later chunks have None.
  prompt_logprobs: list[list[float | None]] | None = None
  prompt_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None


class Stream:
  """`stream`'s chunks, in order, as rounds finish; then `result`, what `generate` with
  the same arguments returns."""

  def __init__(self, target: Model, prepared, key, rounds: int):
    self._chunks = self._run(target, prepared, key, rounds)
    self._result = None

  def __iter__(self):
    return self._chunks

  @property
  def result(self) -> GenerateResult:
    if self._result is None:
      raise RuntimeError("the stream has chunks left: read them all before its result")
    return self._result

  def _run(self, target: Model, prepared, key, rounds: int):
    engine = prepared.engine
    prompt_len = prepared.caller_prompt_len()
    batch = len(prompt_len)  # the caller's rows (a mesh pads the batch)
    sent = np.asarray(prompt_len, np.int64)  # tokens handed out, per row
    detok = None
    if target.tokenizer is not None:
      detok = [TextStream(target.tokenizer) for _ in range(batch)]
    state = prepared.start(key)
    limit = 0
    reasons, named = [None] * batch, np.zeros(batch, bool)
    while True:
      limit += rounds
      state = prepared.resume(state, limit)
      tokens, n, done, stopped, lp = jax.tree_util.tree_map(lambda x: x[:batch],
                                                            prepared.progress(state))
      chunk = _spans(tokens, sent, n)
      logprobs = None if lp is None else _spans(lp.chosen, sent, n)
      top = _top_spans(lp, sent, n)
      sent = np.asarray(n, np.int64)
      finished = bool(np.all(done)) or limit >= decode_lib.NO_ROUND_LIMIT - rounds
      texts = None if detok is None else [
          t.add(c, bool(d)) for t, c, d in zip(detok, chunk, done)]
      ended = np.flatnonzero(done & stopped & ~named)  # each row's once, as it ends
      if ended.size and prepared.stops is not None:
        new = _spans(tokens[ended], np.asarray(prompt_len)[ended], n[ended])
        for i, reason in zip(ended, _stop_reasons(target, prepared.stops, new,
                                                  [True] * len(new), ended)):
          reasons[i] = reason
      named |= done & stopped
      first = limit == rounds
      prompt_lp, prompt_top = (_prompt_logprobs(lp, np.asarray(prompt_len))
                               if first and engine.prompt_logprobs else (None, None))
      yield Chunk(tokens=chunk, texts=texts, done=[bool(d) for d in done],
                  finish_reasons=_reasons(done, stopped), stop_reasons=list(reasons),
                  logprobs=logprobs, top_logprobs=top, prompt_logprobs=prompt_lp,
                  prompt_top_logprobs=prompt_top)
      if finished:
        break
    self._result = build_result(target, engine, prepared.finish(state), prepared.stops)


class TextStream:
  """A row's text as its tokens come, decoding a window of the last chunks' tokens
  rather than the whole row each time (which made a long stream quadratic), as vLLM's
  incremental detokenizer does.

  The window opens on the last chunk whose text was handed out whole (or earlier, while
  the tokens since render nothing: a skipped special token), so a decoder that treats
  a text's first token apart (SentencePiece drops its space, WordPiece keeps a '##')
  decodes the new tokens as it would inside the row: what is handed out is
  `decode(window)` past what was sent of it. A text ending in U+FFFD (a character whose
  last byte has not come) is held back from there until it ends cleanly or the row is
  done.
  """

  def __init__(self, tokenizer):
    self._decode = tokenizer_lib.output_text(tokenizer)
    self._ids: list[int] = []
    self._start = 0  # the window: tokens before it are sent and never decoded again
    self._clean = 0  # tokens up to here are sent and end on a whole character
    self._sent = 0  # characters of decode(ids[start:]) handed out

  def add(self, ids: list[int], done: bool) -> str:
    if not ids and not done:
      return ""  # keep the window: the next tokens decode after it
    self._ids += ids
    text = self._decode(self._ids[self._start:])
    final = done or not text.endswith("\ufffd")
    # Past what was sent (a tokenizer that rewrites earlier text on a longer decode,
    # say a cleanup of spaces before punctuation, cannot take it back).
    delta = (text if final else text.rstrip("\ufffd"))[self._sent:]
    self._sent += len(delta)
    if final:
      self._advance(len(self._ids), len(text))
      return delta
    # A character cut at the end began at most 3 bytes back (UTF-8 takes 4 at most), so
    # in the last 3 tokens: move the window to the latest boundary among them whose text
    # ends on a whole character and was sent, where there is one (else a row whose
    # chunks end mid-character decodes from its last clean chunk every time).
    for end in range(len(self._ids) - 1, max(self._clean, len(self._ids) - 4), -1):
      head = self._decode(self._ids[self._start:end])
      if head and not head.endswith("\ufffd") and len(head) <= self._sent:
        self._advance(end, len(head))
        break
    return delta

  def _advance(self, end: int, width: int):
    """Tokens up to `end` are sent; `width`: their characters in the window's text."""
    tail = self._decode(self._ids[self._clean:end])
    if tail:  # the next window opens on the tokens since the last clean point
      self._start, self._sent = self._clean, self._sent - width + len(tail)
    # (else they render nothing, a skipped special token: keep the older tokens before)
    self._clean = end
