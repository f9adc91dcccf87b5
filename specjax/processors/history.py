"""History-dependent logits processors, evaluated per candidate prefix.

Penalties, n-gram bans, a minimum length, a logit bias and a token automaton act on the
raw logits before temperature / top-k / top-p, in this order: repetition penalty,
presence/frequency penalties, logit bias, then the bans (n-grams, min length, automaton). Each depends on the text so far, so in a
round the target's distribution at position i is processed with the history
prompt + committed + y_1..y_{i-1}, and the draft processes its own proposals the same
way as it drafts. Nothing survives a rejection: the committed `History` is advanced
over the committed tokens only.

Stop strings matched on the text (`stops.py`) ride along: they change no logits, but
their automaton state is history too, so the round can tell which candidate ends a row.

Three pieces:
  `ProcessorConfig` (static, in the engine): which processors run — one compile per
    combination, and none of this costs anything when all are off;
  `ProcessorSettings` (traced, in `Sampling`): their per-row values;
  `History` (traced, per prefix): what they need of the text so far — its length, token
    counts (prompt + generated, and generated only), the automata's states and, for
    n-gram bans, the token sequence itself.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import checks
from specjax.processors.constraints import DEAD, TokenAutomaton


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
  repetition: bool = False  # repetition_penalty != 1 on some row
  presence: bool = False  # presence or frequency penalty != 0 on some row
  ngram: int = 0  # the largest no_repeat_ngram_size (0: off)
  min_new: bool = False
  bias: bool = False
  constraint: bool = False
  stop_text: bool = False  # stop strings matched on the text (they track, never mask)

  @property
  def adjusts(self) -> bool:
    """Whether some processor changes the logits."""
    return bool(self.repetition or self.presence or self.ngram or self.min_new or self.bias
                or self.constraint)

  @property
  def bans(self) -> bool:
    """Whether some processor can rule tokens out (then possibly all of them)."""
    return bool(self.ngram or self.min_new or self.constraint)

  @property
  def active(self) -> bool:
    """Whether the engine keeps a `History` per prefix."""
    return self.adjusts or self.stop_text


@flax.struct.dataclass
class ProcessorSettings:
  repetition_penalty: jax.Array  # float32[B]
  presence_penalty: jax.Array  # float32[B]
  frequency_penalty: jax.Array  # float32[B]
  no_repeat_ngram: jax.Array  # int32[B]
  min_new: jax.Array  # int32[B]
  logit_bias: jax.Array  # float32[B, V] (or [B, 0] when off)
  banned_early: jax.Array  # bool[V]: EOS ids and one-token stops, banned before min_new
  fsm_next: jax.Array  # int32[Q, V] next state (DEAD: leaves the language)
  fsm_accept: jax.Array  # bool[Q]
  fsm_start: jax.Array  # int32 scalar
  eos: jax.Array  # bool[V]: EOS ids, allowed only in accepting states
  stop_next: jax.Array  # int32[S, V] stop-string automaton state after a token (stops.py)
  stop_hit: jax.Array  # bool[S, V]: the token completes a stop string from that state


@flax.struct.dataclass
class History:
  """What the processors need of one prefix of every row."""
  length: jax.Array  # int32[B] prefix length, prompt included
  prompt_len: jax.Array  # int32[B]
  counts: jax.Array | None  # int32[B, V] in prompt + generated (repetition penalty)
  gen_counts: jax.Array | None  # int32[B, V] in generated tokens (presence/frequency)
  fsm: jax.Array | None  # int32[B] automaton state after the generated tokens
  seq: jax.Array | None  # int32[B, S] the tokens themselves (n-gram bans; past `length`: unused)
  stop: jax.Array | None = None  # int32[B] stop-string automaton state after the new tokens


def _count(tokens, mask, vocab):
  rows = jnp.arange(tokens.shape[0])[:, None]
  return jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[rows, tokens].add(
      mask.astype(jnp.int32))


def init_history(cfg: ProcessorConfig, settings: ProcessorSettings, tokens, n, prompt_len,
                 vocab) -> History:
  """The history of the committed prefix tokens[:, :n] (a prefill: nothing generated yet
  beyond n - prompt_len, which the counts include)."""
  slot = jnp.arange(tokens.shape[1])[None, :]
  counts = _count(tokens, slot < n[:, None], vocab) if cfg.repetition else None
  gen = (_count(tokens, (slot < n[:, None]) & (slot >= prompt_len[:, None]), vocab)
         if cfg.presence else None)
  fsm = jnp.broadcast_to(settings.fsm_start, n.shape) if cfg.constraint else None
  # Stop strings match new text only: the automaton starts empty after the prompt.
  stop = jnp.zeros(n.shape, jnp.int32) if cfg.stop_text else None
  return History(length=n, prompt_len=prompt_len, counts=counts, gen_counts=gen, fsm=fsm,
                 seq=tokens if cfg.ngram else None, stop=stop)


def advance(cfg: ProcessorConfig, settings: ProcessorSettings, h: History, token) -> History:
  """The history after appending token int32[B] to every row."""
  rows = jnp.arange(token.shape[0])
  return h.replace(
      length=h.length + 1,
      counts=None if h.counts is None else h.counts.at[rows, token].add(1),
      gen_counts=None if h.gen_counts is None else h.gen_counts.at[rows, token].add(1),
      fsm=None if h.fsm is None else fsm_after(settings, h.fsm, token),
      seq=None if h.seq is None else h.seq.at[rows, h.length].set(token, mode="drop"),
      stop=None if h.stop is None else settings.stop_next[h.stop, token])


def prefix_histories(cfg, settings, h: History, ys) -> History:
  """Histories of the prefixes h + ys[:, :i] for i = 0..T, stacked on axis 1: [B, T+1, ...].

  Unrolled over the static T rather than a scan of T `advance`s, whose stacked [T, B, V]
  counts XLA:CPU zeroed, copied and transposed every round: the counts add a one-hot per
  token, the automata take a gather per token, and the prefixes share one token sequence
  holding all of ys (a history reads `seq` below its length only).
  """
  batch, t = ys.shape

  def walk(state, step):
    out = [state]
    for j in range(t):
      out.append(step(out[-1], ys[:, j]))
    return jnp.stack(out, axis=1)

  def counts(base):  # a one-hot add per token: XLA fuses the walk into one loop
    return walk(base, lambda c, y: c + (y[:, None] == jnp.arange(c.shape[-1])[None, :]))

  def seq(s):
    rows = jnp.arange(batch)[:, None]
    full = s.at[rows, h.length[:, None] + jnp.arange(t)[None, :]].set(ys, mode="drop")
    return jnp.broadcast_to(full[:, None], (batch, t + 1) + s.shape[1:])

  return History(
      length=h.length[:, None] + jnp.arange(t + 1)[None, :],
      prompt_len=jnp.broadcast_to(h.prompt_len[:, None], (batch, t + 1)),
      counts=None if h.counts is None else counts(h.counts),
      gen_counts=None if h.gen_counts is None else counts(h.gen_counts),
      fsm=None if h.fsm is None else walk(h.fsm, lambda f, y: fsm_after(settings, f, y)),
      seq=None if h.seq is None else seq(h.seq),
      stop=None if h.stop is None else walk(h.stop, lambda s, y: settings.stop_next[s, y]))


def advance_each(cfg, settings, h: History, tokens) -> History:
  """Histories stacked on axis 1 ([B, F, ...]) each advanced by tokens[:, f] ([B, F])."""
  return jax.vmap(lambda hh, t: advance(cfg, settings, hh, t), in_axes=(1, 1),
                  out_axes=1)(h, tokens)


def tree_histories(cfg, settings, h: History, tokens, parents) -> History:
  """Histories of a token tree's nodes, [B, N+1, ...]: index 0 is h (the root: the
  committed prefix), index i+1 is h advanced along node i's root-to-node path.

  `parents` (static, -1 = the root) lists the nodes depth by depth with parents first, so
  each depth is one `advance_each` of its parents' histories by its own tokens
  (`dynamic_tree_histories` with the same parents in every row). A chain
  (parents = (-1, 0, 1, ...)) gives `prefix_histories` (up to `seq` past each length).
  """
  depths = []
  for p in parents:
    depths.append(1 if p < 0 else depths[p] + 1)
  levels = [(depths.index(d), depths.count(d)) for d in range(1, max(depths) + 1)]
  rows = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens.shape)
  return dynamic_tree_histories(cfg, settings, h, tokens, levels, rows)


def dynamic_tree_histories(cfg, settings, h: History, tokens, levels, parents) -> History:
  """`tree_histories` of one tree per row: `levels` ((first, count) per depth, static)
  and parents int32[B, N] (-1 = the root), each depth one `advance_each` of its nodes'
  parents' histories, picked per row."""
  out = jax.tree_util.tree_map(lambda x: x[:, None], h)
  for first, count in levels:
    above = at(out, parents[:, first:first + count] + 1)
    level = advance_each(cfg, settings, above, tokens[:, first:first + count])
    out = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b], axis=1), out, level)
  return out


def fsm_after(settings: ProcessorSettings, fsm, token):
  """The automaton's state after `token` (any shape, like `fsm`); DEAD stays DEAD."""
  return jnp.where(fsm == DEAD, DEAD, settings.fsm_next[jnp.maximum(fsm, 0), token])


def at(h: History, index, counts=True) -> History:
  """Entries of stacked histories ([B, P, ...]): h[b, index[b]] for index int32[B], or
  [B, W] for several each. counts=False leaves out the [V]- and [S]-sized fields (counts,
  seq), which the commit's stop checks do not read."""
  rows = jnp.arange(index.shape[0]).reshape((-1,) + (1,) * (index.ndim - 1))
  pick = lambda x: None if x is None else x[rows, index]
  big = pick if counts else (lambda x: None)
  return History(length=pick(h.length), prompt_len=pick(h.prompt_len), counts=big(h.counts),
                 gen_counts=big(h.gen_counts), fsm=pick(h.fsm), seq=big(h.seq),
                 stop=pick(h.stop))


def committed(cfg, settings, prefixes: History, before, tokens, count) -> History:
  """The history after the first count[b] of tokens[b] ([B, W]). `prefixes` are the
  round's per-prefix histories ([B, P, ...], index 0 the committed prefix) and
  before[b, j] the one before tokens[b, j] (None: j, a chain's). One `advance`, not W."""
  rows = jnp.arange(count.shape[0])
  last = jnp.maximum(count - 1, 0)
  node = last if before is None else before[rows, last]
  after = advance(cfg, settings, at(prefixes, node), tokens[rows, last])
  start = at(prefixes, jnp.zeros_like(count))
  same = lambda a, b: jnp.where((count > 0).reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  return jax.tree_util.tree_map(same, after, start)


def terminal(settings: ProcessorSettings, fsm):
  """bool: the state accepts and no token continues it (the row has finished)."""
  safe = jnp.maximum(fsm, 0)
  return (fsm != DEAD) & settings.fsm_accept[safe] & jnp.all(
      settings.fsm_next[safe] == DEAD, axis=-1)


def past_min_new(settings: ProcessorSettings, before: History):
  """bool[B, T]: token j, appended to the prefix before[:, j], is past the first
  `min_new_tokens` new tokens, where a stop string or a longer stop sequence it
  completes counts (EOS and one-token stops are banned before: `banned_early`)."""
  return before.length - before.prompt_len >= settings.min_new[:, None]


def stop_string_hits(settings: ProcessorSettings, before: History, tokens):
  """bool[B, T]: token j, appended to the prefix before[:, j], completes a stop string
  (one completed within the first `min_new_tokens` new tokens does not count)."""
  return settings.stop_hit[before.stop, tokens] & past_min_new(settings, before)


def _ngram_banned(seq, length, n_row, max_n):
  """bool[B, V]-ready mask: tokens that would complete an n-gram already in seq[:length].

  For every earlier j with seq[j-k] == seq[length-k] for k = 1..n-1, seq[j] is banned
  (n = 1 bans every token present). Rows with n = 0, or shorter than n - 1, ban nothing.
  """
  size = seq.shape[1]
  j = jnp.arange(size)[None, :]
  match = (j < length[:, None]) & (j >= n_row[:, None] - 1) & (n_row[:, None] > 0)
  for k in range(1, max_n):
    earlier = jnp.take_along_axis(seq, jnp.maximum(j - k, 0), axis=1)
    last = jnp.take_along_axis(seq, jnp.maximum(length - k, 0)[:, None], axis=1)
    match &= (earlier == last) | (k >= n_row[:, None])
  return match & (length[:, None] >= n_row[:, None] - 1)


def apply(cfg: ProcessorConfig, settings: ProcessorSettings, logits, h: History,
          ruled_out=None):
  """Processed raw logits [B, V] for the prefix `h` of each row (`ruled_out`: its
  `banned`, where the caller has it already)."""
  if not cfg.adjusts:
    return logits
  logits = logits.astype(jnp.float32)
  if cfg.repetition:
    penalty = settings.repetition_penalty[:, None]
    hit = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = jnp.where(h.counts > 0, hit, logits)
  if cfg.presence:
    logits = logits - (settings.presence_penalty[:, None] * (h.gen_counts > 0)
                       + settings.frequency_penalty[:, None] * h.gen_counts)
  if cfg.bias:
    logits = logits + settings.logit_bias
  banned = ruled_out if ruled_out is not None else _banned(cfg, settings, h, logits.shape)
  out = jnp.where(banned, -jnp.inf, logits)
  # A prefix with nothing allowed (past a rejected draft, or where the round ends the row
  # because of it) is never committed from: keep its logits finite rather than make NaNs.
  return jnp.where(jnp.all(banned, axis=-1, keepdims=True), logits, out)


def _banned(cfg: ProcessorConfig, settings: ProcessorSettings, h: History, shape):
  """bool[B, V]: the tokens the bans (n-grams, min length, automaton) rule out."""
  banned = jnp.zeros(shape, bool)
  if cfg.ngram:
    rows = jnp.arange(shape[0])[:, None]
    hits = _ngram_banned(h.seq, h.length, settings.no_repeat_ngram, cfg.ngram)
    # True set where a position hits, the rest dropped (index V): a processed round took
    # 0.95-0.97x the time of one with an int32 max over every position (XLA:CPU).
    banned = jnp.zeros(shape, bool).at[rows, jnp.where(hits, h.seq, shape[1])].set(
        True, mode="drop")
  if cfg.min_new:
    early = (h.length - h.prompt_len) < settings.min_new
    banned |= early[:, None] & settings.banned_early[None, :]
  if cfg.constraint:
    safe = jnp.maximum(h.fsm, 0)
    allowed = settings.fsm_next[safe] != DEAD
    allowed |= settings.eos[None, :] & settings.fsm_accept[safe][:, None]
    banned |= ~allowed
  return banned


def banned(cfg: ProcessorConfig, settings: ProcessorSettings, h: History):
  """bool[B, V]: the tokens the bans rule out after the prefix `h`. Where they rule out
  every one (no_repeat_ngram_size=1 once every token is in the text) no token follows
  the processed distribution, and the round ends the row there."""
  return _banned(cfg, settings, h, (h.length.shape[0], settings.eos.shape[0]))


# ----------------------------------------------------------------------------
# Host side: `generate`'s keyword arguments -> (ProcessorConfig, ProcessorSettings).


# The largest processor magnitude taken. Past ~1e30 a penalty or bias changes nothing more
# (it already bans or forces a token), and below it the processed logits stay finite in
# float32 however they add up (a frequency penalty times a count, at most a context's
# length, far below 1e8; a bias; a logit scaled by the repetition penalty), where a
# larger value made inf - inf: NaNs (1e38 does, checked).
PROCESSOR_LIMIT = 1e30


def settings_from_args(batch, vocab, max_new_tokens, stop_seqs, stop_lens, eos_ids, *,
                       repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                       no_repeat_ngram_size=0, min_new_tokens=0, logit_bias=None,
                       constraint=None, stop_table=None):
  """Checks every processor argument (ValueError naming it) and builds both halves.

  A processor whose value is neutral on every row (penalty 1, size 0, ...) is off: it
  costs nothing, and switching it on compiles once more.
  `stop_table` is `stops.token_table(...)` for stop strings matched on the text, or None.
  """
  rep = checks.per_row("repetition_penalty", repetition_penalty, batch, "iuf").astype(np.float64)
  if not np.all((rep >= 1 / PROCESSOR_LIMIT) & (rep <= PROCESSOR_LIMIT)):
    raise ValueError(f"repetition_penalty must be a number in [1e-30, 1e30] (1 = off), "
                     f"got {rep.tolist()}")
  pres, freq = (checks.per_row(name, value, batch, "iuf").astype(np.float64) for name, value in
                (("presence_penalty", presence_penalty),
                 ("frequency_penalty", frequency_penalty)))
  for name, arr in (("presence_penalty", pres), ("frequency_penalty", freq)):
    if not np.all(np.abs(arr) <= PROCESSOR_LIMIT):  # NaN fails too
      raise ValueError(f"{name} must be finite, at most 1e30 in size, got {arr.tolist()}")
  ngram = checks.per_row("no_repeat_ngram_size", no_repeat_ngram_size, batch, "iu")
  if np.any(ngram < 0):
    raise ValueError(f"no_repeat_ngram_size must be >= 0 (0 = off), got {ngram.tolist()}")
  min_new = checks.per_row("min_new_tokens", min_new_tokens, batch, "iu")
  if np.any(min_new < 0) or np.any(min_new > max_new_tokens):
    raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], "
                     f"got {min_new.tolist()}")
  bias = _bias_table(logit_bias, batch, vocab)
  if constraint is not None:
    if not isinstance(constraint, TokenAutomaton):
      raise ValueError(f"constraint must be a specjax.constraints.TokenAutomaton (e.g. "
                       f"constraints.regex(pattern, tokenizer)), got {type(constraint).__name__}")
    if constraint.vocab_size != vocab:
      raise ValueError(f"constraint was built for a vocabulary of {constraint.vocab_size} "
                       f"tokens, the target has {vocab}")
  # Static: which processors run. n-gram sizes share a compile up to a multiple of 4.
  cfg = ProcessorConfig(
      repetition=bool(np.any(rep != 1)), presence=bool(np.any((pres != 0) | (freq != 0))),
      ngram=checks.round_up(int(ngram.max()), 4) if np.any(ngram > 0) else 0,
      min_new=bool(np.any(min_new > 0)), bias=bias is not None,
      constraint=constraint is not None, stop_text=stop_table is not None)
  early = np.zeros(vocab, bool)
  stop_seqs, stop_lens = np.asarray(stop_seqs), np.asarray(stop_lens)
  for k, length in enumerate(stop_lens):
    if length == 1:  # EOS and one-token stops (vLLM's stop_token_ids); longer sequences
      early[stop_seqs[k, -1]] = True  # completed before min_new just do not count
  eos = np.zeros(vocab, bool)
  eos[list(eos_ids)] = True
  table = constraint
  settings = ProcessorSettings(
      repetition_penalty=np.asarray(rep, np.float32),
      presence_penalty=np.asarray(pres, np.float32),
      frequency_penalty=np.asarray(freq, np.float32),
      no_repeat_ngram=np.asarray(ngram, np.int32), min_new=np.asarray(min_new, np.int32),
      logit_bias=np.asarray(bias if bias is not None else np.zeros((batch, 0)), np.float32),
      banned_early=np.asarray(early),
      fsm_next=np.asarray(table.next if table else np.zeros((1, 1), np.int32)),
      fsm_accept=np.asarray(table.accept if table else np.zeros((1,), bool)),
      fsm_start=np.asarray(table.start if table else 0, np.int32), eos=np.asarray(eos),
      stop_next=stop_table[0] if stop_table else np.zeros((1, 1), np.int32),
      stop_hit=stop_table[1] if stop_table else np.zeros((1, 1), bool))
  return cfg, settings


def _bias_table(logit_bias, batch, vocab):
  """{token_id: bias} for every row, or one dict per row -> float[B, V]; None stays None."""
  if logit_bias is None:
    return None
  if not isinstance(logit_bias, (dict, list, tuple)):
    raise ValueError(f"logit_bias must be a dict {{token_id: bias}} or one dict per prompt, "
                     f"got {logit_bias!r}")
  per_row = [logit_bias] * batch if isinstance(logit_bias, dict) else list(logit_bias)
  if len(per_row) != batch or not all(isinstance(d, dict) for d in per_row):
    raise ValueError(f"logit_bias must be a dict {{token_id: bias}} or one dict per prompt "
                     f"({batch}), got {logit_bias!r}")
  table = np.zeros((batch, vocab), np.float64)
  for b, d in enumerate(per_row):
    for token, value in d.items():
      if not checks.is_int(token):  # OpenAI's JSON has string keys: say it is the type
        raise ValueError(f"logit_bias keys must be integer token ids, got {token!r} "
                         f"({type(token).__name__})")
      if not 0 <= token < vocab:
        raise ValueError(f"logit_bias token id {token!r} is outside the vocabulary [0, {vocab})")
      if (not isinstance(value, (int, float, np.number)) or isinstance(value, bool)
          or not abs(value) <= PROCESSOR_LIMIT):  # NaN fails too
        raise ValueError(f"logit_bias for token {token} must be a finite number, at most "
                         f"1e30 in size, got {value!r}")
      table[b, token] = value
  return table
