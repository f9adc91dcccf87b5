"""Drafters: what proposes γ tokens each round, behind one small interface.

A drafter is a frozen (hashable) dataclass, so it is a static argument of the jitted
decode loop, with four pure methods:

  init(batch, size)                          -> state (a pytree; may be empty)
  prefill(params, state, tokens, n, features) -> state, ready for the first round
  propose(params, state, tokens, n, key, sampling)
                                             -> (y int[B, γ], q [B, γ, V], state)
  rollback(state, n, features, start)        -> state consistent with the committed n

`tokens[B, S]` is the sequence buffer and `n[B]` the committed length of each row; the
last committed token (index n-1) has no KV yet on either side. q is the distribution
each y was drawn from (one-hot for token-only drafts).

A drafter whose `uses_features` is True (a head on the target's hidden states) gets
the target's last hidden states: of the prompt prefill in `prefill`, and of the verify
pass (inputs at positions start[b]..start[b]+γ) in `rollback`. Everything else gets None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax import model as model_lib
from specjax.config import ModelConfig
from specjax.sampling import sample


@dataclasses.dataclass(frozen=True)
class NoDrafter:
  """γ = 0: every round is one plain autoregressive target step."""

  vocab_size: int
  gamma: int = 0
  uses_features = False

  def init(self, batch, size):
    return ()

  def prefill(self, params, state, tokens, n, features=None):
    return state

  def propose(self, params, state, tokens, n, key, sampling):
    b = tokens.shape[0]
    return (jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, self.vocab_size), jnp.float32), state)

  def rollback(self, state, n, features=None, start=None):
    return state


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A small causal LM with its own KV cache proposes γ tokens inside the round.

  sample_mode 'probabilistic' draws y ~ q (q = the draft's processed distribution);
  'greedy' takes the draft's argmax and verifies against a one-hot q.
  """

  config: ModelConfig
  gamma: int
  sample_mode: str = "probabilistic"
  uses_features = False

  @property
  def graphdef(self):
    return model_lib.graphdef_for(self.config)

  def init(self, batch, size):
    return kv_cache.init_kv(self.config, batch, size)

  def prefill(self, params, kv, tokens, n, features=None):  # kv comes fresh from `init`
    dtype = model_lib.compute_dtype(params)  # the cache is kept in the draft's own dtype
    kv = kv.replace(k=tuple(k.astype(dtype) for k in kv.k), v=tuple(v.astype(dtype) for v in kv.v))
    _, kv = model_lib.forward_cached(self.graphdef, params, tokens, kv, empty=True)
    return kv.rollback(n - 1)

  def _draw(self, key, logits, sampling, history):
    return self._pick(key, sampling.adjust(logits, history), sampling)  # this prefix's

  def _pick(self, key, logits, sampling):
    def argmax():
      y = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return y, jax.nn.one_hot(y, logits.shape[-1], dtype=jnp.float32)

    def draw():
      q = sampling.process(logits)
      return sample(key, q), q

    if self.sample_mode == "greedy":
      return argmax()
    # At temperature 0 q is the one-hot argmax: skip the V random numbers a draw costs.
    return jax.lax.cond(jnp.all(sampling.temperature <= 0), argmax, draw)

  def _catch_up(self, params, kv, tokens, n):
    """Feeds the draft up to the pending token: (its logits [B, V], kv of length n).

    After a fully accepted round the draft never saw y_γ, so its cache may be one behind
    the committed history. Feeding two tokens from its own length catches up in either
    case with one static shape; a surplus write lands past the new length.
    """
    start = kv.length
    chunk = jnp.take_along_axis(tokens, start[:, None] + jnp.arange(2)[None, :], axis=1,
                                mode="clip")
    logits, kv = model_lib.forward_cached(self.graphdef, params, chunk, kv)
    last = (n - 1) - start  # 0 or 1: which of the two fed tokens is the newest
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return logits, kv.rollback(n)

  def propose(self, params, kv, tokens, n, key, sampling):
    logits, kv = self._catch_up(params, kv, tokens, n)

    # The processors' history follows the draft's own proposals, y_1..y_{i-1} at step i.
    def step(carry, step_key):
      logits, kv, history = carry
      y, q = self._draw(step_key, logits, sampling, history)
      logits, kv = model_lib.forward_cached(self.graphdef, params, y[:, None], kv)
      return (logits[:, 0], kv, sampling.advance(history, y)), (y, q)

    keys = jax.random.split(key, self.gamma)
    (logits, kv, history), (ys, qs) = jax.lax.scan(step, (logits, kv, sampling.history),
                                                   keys[:-1])
    y_last, q_last = self._draw(keys[-1], logits, sampling, history)
    ys = jnp.concatenate([ys, y_last[None]], axis=0).swapaxes(0, 1)  # [B, γ]
    qs = jnp.concatenate([qs, q_last[None]], axis=0).swapaxes(0, 1)  # [B, γ, V]
    return ys, qs, kv

  def propose_until(self, params, kv, tokens, n, key, sampling, limit, confidence):
    """`propose` for adaptive draft lengths (`specjax.policies`): row b drafts at most
    limit[b] tokens, stopping after one whose top probability is below `confidence`;
    the loop ends when every row has stopped. Returns (ys, qs, kv, lengths, steps); the
    draws at positions < lengths are those `propose` makes with the same key."""
    logits, kv = self._catch_up(params, kv, tokens, n)
    b, vocab = logits.shape
    keys = jax.random.split(key, self.gamma)

    def body(carry):
      i, logits, kv, history, ys, qs, lengths, active = carry
      adjusted = sampling.adjust(logits, history)
      y, q = self._pick(keys[i], adjusted, sampling)
      top = jnp.max(jax.nn.softmax(adjusted.astype(jnp.float32), axis=-1), axis=-1)
      ys, qs = ys.at[:, i].set(y), qs.at[:, i].set(q)
      lengths = lengths + active
      active = active & (i + 1 < limit) & (top >= confidence)

      def feed():
        out, new_kv = model_lib.forward_cached(self.graphdef, params, y[:, None], kv)
        return out[:, 0], new_kv

      # The last token drafted needs no forward (as in `propose`), nor does a stopped batch.
      logits, kv = jax.lax.cond((i + 1 < self.gamma) & jnp.any(active), feed,
                                lambda: (logits, kv))
      return i + 1, logits, kv, sampling.advance(history, y), ys, qs, lengths, active

    init = (jnp.zeros((), jnp.int32), logits, kv, sampling.history,
            jnp.zeros((b, self.gamma), jnp.int32), jnp.zeros((b, self.gamma, vocab), jnp.float32),
            jnp.zeros((b,), jnp.int32), limit > 0)
    steps, _, kv, _, ys, qs, lengths, _ = jax.lax.while_loop(
        lambda c: (c[0] < self.gamma) & jnp.any(c[-1]), body, init)
    return ys, qs, kv, lengths, steps

  def rollback(self, kv, n, features=None, start=None):
    # Valid KV = the committed history (all but the pending token) ∩ what it computed.
    return kv.rollback(jnp.minimum(kv.length, n - 1))


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup: continue the most recent earlier occurrence of the longest suffix.

  Finds the latest position whose preceding max_n..min_n tokens equal the sequence's
  last tokens and proposes what followed. Past the end of the sequence the match is
  periodic, so the proposal wraps (a repeated phrase keeps repeating). With no match it
  proposes the last token repeated: useless but harmless, since q is one-hot and the
  rule stays exact. Token-only, no state, fully jittable.
  """

  vocab_size: int
  gamma: int
  min_n: int = 1
  max_n: int = 4
  uses_features = False

  def init(self, batch, size):
    return ()

  def prefill(self, params, state, tokens, n, features=None):
    return state

  def _scores(self, tokens, n):
    """One row: int32[S], per continuation start i (the matched n-gram ends at i-1), the
    rank of its match — longest first, then the most recent — or -1 for no match."""
    size = tokens.shape[0]
    starts = jnp.arange(size)
    ks = jnp.arange(1, self.max_n + 1)[:, None]
    earlier = jnp.take(tokens, starts[None, :] - ks, mode="clip")
    suffix = jnp.take(tokens, n - ks, mode="clip")
    same = (earlier == suffix) & (starts[None, :] - ks >= 0) & (n - ks >= 0)
    match_len = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=0), axis=0)
    ok = (starts < n) & (match_len >= self.min_n)
    return jnp.where(ok, match_len * size + starts, -1)

  def _propose_row(self, tokens, n):
    score = self._scores(tokens, n)
    best = jnp.argmax(score)
    best = jnp.where(score[best] >= 0, best, n - 1)
    period = n - best
    return jnp.take(tokens, best + jnp.arange(self.gamma) % period, mode="clip")

  def propose(self, params, state, tokens, n, key, sampling):
    y = jax.vmap(self._propose_row)(tokens, n).astype(jnp.int32)
    return y, jax.nn.one_hot(y, self.vocab_size, dtype=jnp.float32), state

  def rollback(self, state, n, features=None, start=None):
    return state
