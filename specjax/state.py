"""The state a round reads and writes, and the arithmetic of a commit.

`Weights` (traced: both parameter sets) and `DecodeState` (tokens, lengths, both caches,
the counters) are the pytrees the jitted engine (`specjax.decode`) carries; `room_left`,
`stop_hits` and `commit_count` cut a round's accepted tokens by the budget, the context
and the stops; `update_stats` adds a round to the per-row counters.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models import kv_cache


@flax.struct.dataclass
class Weights:
  """The traced half: both parameter sets."""
  target: Any
  draft: Any = None  # None for token-only drafters


@flax.struct.dataclass
class Stats:
  """Per-row counters, summed on the host."""
  rounds: jax.Array  # int32[B] rounds in which the row was still running
  drafted: jax.Array  # int32[B]
  accepted: jax.Array  # int32[B] draft tokens accepted by verification
  committed: jax.Array  # int32[B] tokens committed (after stop truncation)
  accepted_at: jax.Array  # int32[B, γ] times position i was accepted
  verified_at: jax.Array  # int32[B, γ] times position i was drafted and checked
  committed_hist: jax.Array  # int32[B, γ+2] histogram of tokens committed per round
  length_hist: jax.Array  # int32[B, γ+1] rounds by the row's draft length (0..γ)
  # int32[B, γ+1] rounds by the draft tokens the batch's verify pass computed (0..γ): the
  # longest draft of the batch on a CPU (`_verify_pass`), else γ.
  pass_hist: jax.Array
  overlap_sum: jax.Array  # float32[B] Σ over verified positions of Σ_x min(p, q)
  overlap_count: jax.Array  # int32[B] verified positions
  # Per sibling rank r (a chain is a tree with one child per node: K = 1): times a child
  # of rank r was tried by the verify rule, accepted, and Σ of its acceptance probability.
  sibling_tried: jax.Array  # int32[B, K]
  sibling_accepted: jax.Array  # int32[B, K]
  sibling_chance: jax.Array  # float32[B, K]

  @classmethod
  def zeros(cls, batch: int, gamma: int, siblings: int = 1) -> "Stats":
    zi = lambda *s: jnp.zeros((batch,) + s, jnp.int32)
    return cls(rounds=zi(), drafted=zi(), accepted=zi(), committed=zi(),
               accepted_at=zi(gamma), verified_at=zi(gamma), committed_hist=zi(gamma + 2),
               length_hist=zi(gamma + 1), pass_hist=zi(gamma + 1),
               overlap_sum=jnp.zeros((batch,), jnp.float32), overlap_count=zi(),
               sibling_tried=zi(siblings), sibling_accepted=zi(siblings),
               sibling_chance=jnp.zeros((batch, siblings), jnp.float32))


@flax.struct.dataclass
class DecodeState:
  tokens: jax.Array  # int32[B, S] prompt + committed tokens
  n: jax.Array  # int32[B] committed length (prompt included)
  prompt_len: jax.Array  # int32[B]
  done: jax.Array  # bool[B]
  target_kv: kv_cache.KVState
  draft_state: Any
  key: jax.Array
  target_calls: jax.Array  # int32: batched target passes in the loop
  stats: Stats
  history: Any = None  # processors.History of the committed prefix (None: no processors)
  draft_len: Any = None  # int32[B]: the heuristic γ policy's next length (None: fixed γ)
  draft_steps: Any = None  # int32: draft steps the adaptive draft loop ran, all rounds
  logprobs: Any = None  # `Logprobs`; None unless `engine.logprobs`
  # bool[B]: the row ended at a stop (EOS, a stop sequence or string, a finished
  # constraint, a prefix where every token is banned), not at its budget.
  stopped: Any = None


@flax.struct.dataclass
class Logprobs:
  """The target's log-probabilities at each slot i of `DecodeState.tokens`, given
  tokens[:i] (raw, or processed: `Engine.logprobs_mode`): written for each committed
  token, and for the prompt's tokens 1.. (raw) where `engine.prompt_logprobs` (0
  elsewhere)."""
  chosen: jax.Array  # float32[B, S]: log p(tokens[b, i] | tokens[b, :i])
  top_values: Any = None  # float32[B, S, n]: the n largest at slot i, descending (n > 0)
  top_ids: Any = None  # int32[B, S, n]: their tokens

  @classmethod
  def zeros(cls, shape, top: int) -> "Logprobs":
    if not top:
      return cls(chosen=jnp.zeros(shape, jnp.float32))
    return cls(chosen=jnp.zeros(shape, jnp.float32),
               top_values=jnp.zeros((*shape, top), jnp.float32),
               top_ids=jnp.zeros((*shape, top), jnp.int32))

  def write(self, new: "Logprobs", start, count) -> "Logprobs":
    return jax.tree_util.tree_map(lambda buf, x: kv_cache.write(buf, x, start, count),
                                  self, new)


# ----------------------------------------------------------------------------
# Commit (step 4), in three small pure pieces that the tests drive with literal tables.


def room_left(n, prompt_len, max_new, max_len, buffer_size, width):
  """How many more tokens each row may commit: budget, context and buffer limits.

  The next round writes up to index n + width - 1 of the buffers, so a row stops before
  they would overflow.
  """
  generated = n - prompt_len
  return jnp.minimum(jnp.minimum(max_new - generated, max_len - n), buffer_size - width - n)


def stop_hits(tokens, n, prompt_len, new, stop_seqs, stop_lens):
  """bool[B, width]: candidate j completes a stop sequence lying wholly in new tokens.

  EOS is a stop sequence of length 1. A match may start in an earlier round: the last
  span-1 committed tokens are prepended to the candidates.
  """
  width = new.shape[1]
  span = stop_seqs.shape[1]
  history = jnp.take_along_axis(tokens, n[:, None] - (span - 1)
                                + jnp.arange(span - 1)[None, :], axis=1, mode="clip")
  seq = jnp.concatenate([history, new], axis=1)  # [B, span-1+width]
  windows = jnp.stack([seq[:, j:j + span] for j in range(width)], axis=1)  # [B, width, span]
  in_seq = jnp.arange(span)[None, :] >= span - stop_lens[:, None]  # [K, span]
  same = (windows[:, :, None, :] == stop_seqs[None, None]) | ~in_seq[None, None]
  starts = n[:, None] + jnp.arange(width)[None, :]  # absolute index of each candidate
  inside = starts[:, :, None] - stop_lens[None, None, :] + 1 >= prompt_len[:, None, None]
  return jnp.any(jnp.all(same, axis=-1) & inside & (stop_lens > 0), axis=-1)


def commit_count(n_accepted, room, hits, done):
  """(count, stops, at_hit): tokens to commit per row, whether the row is finished, and
  whether at a stop hit.

  The commit is the accepted prefix plus one token, cut at the room left and just after
  the first stop hit (stop tokens are emitted); finished rows commit nothing.
  """
  count = jnp.minimum(n_accepted + 1, room)
  hits = hits & (jnp.arange(hits.shape[1])[None, :] < count[:, None]) & ~done[:, None]
  stopped = jnp.any(hits, axis=1)
  count = jnp.where(stopped, jnp.argmax(hits, axis=1) + 1, count)
  count = jnp.where(done, 0, count)
  return count, stopped | (count >= room), stopped


def update_stats(s: Stats, live, n_accepted, count, overlap, lengths=None,
                 siblings=None, verified_width=None) -> Stats:
  """Adds one round. lengths: int32[B] tokens each row drafted (None: γ, a fixed chain);
  positions past a row's length were neither drafted nor verified. siblings: a tree
  round's (tried, accepted, chance) [B, K] by sibling rank (`verify.tree.walk`); None for a
  chain, whose one child per node was tried at every verified position. verified_width
  (int32): the draft tokens the batch's pass computed this round (None: γ)."""
  gamma = s.accepted_at.shape[1]
  li = live.astype(jnp.int32)
  lengths = jnp.full_like(n_accepted, gamma) if lengths is None else lengths
  verified = jnp.minimum(n_accepted + 1, lengths)  # positions whose draft token was checked
  pos = jnp.arange(gamma)[None, :]
  seen = jnp.where(pos < verified[:, None], overlap, 0.0)
  if siblings is None:
    siblings = verified[:, None], n_accepted[:, None], jnp.sum(seen, axis=1, keepdims=True)
  tried, took, chance = siblings
  return Stats(
      rounds=s.rounds + li,
      drafted=s.drafted + lengths * li,
      accepted=s.accepted + n_accepted * li,
      committed=s.committed + count,
      accepted_at=s.accepted_at + (pos < n_accepted[:, None]) * li[:, None],
      verified_at=s.verified_at + (pos < verified[:, None]) * li[:, None],
      committed_hist=s.committed_hist
      + jax.nn.one_hot(count, gamma + 2, dtype=jnp.int32) * li[:, None],
      length_hist=s.length_hist + jax.nn.one_hot(lengths, gamma + 1, dtype=jnp.int32)
      * li[:, None],
      pass_hist=s.pass_hist + jax.nn.one_hot(
          jnp.full_like(n_accepted, gamma) if verified_width is None else
          jnp.broadcast_to(verified_width, n_accepted.shape), gamma + 1,
          dtype=jnp.int32) * li[:, None],
      overlap_sum=s.overlap_sum + li * jnp.sum(seen, axis=1),
      overlap_count=s.overlap_count + verified * li,
      sibling_tried=s.sibling_tried + tried * li[:, None],
      sibling_accepted=s.sibling_accepted + took * li[:, None],
      sibling_chance=s.sibling_chance + chance * li[:, None],
  )


# ----------------------------------------------------------------------------
# The round.
