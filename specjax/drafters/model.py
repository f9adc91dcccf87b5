"""A draft model: a small causal LM with its own KV cache, rolled back with the target's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.models.config import ModelConfig
from specjax.processors.sampling import argmax, pick_by_paths, sample


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
    def greedy():
      y = argmax(logits).astype(jnp.int32)
      return y, jax.nn.one_hot(y, logits.shape[-1], dtype=jnp.float32)

    def draw():
      q = sampling.process(logits)
      return sample(key, q), q

    if self.sample_mode == "greedy":
      return greedy()
    # At temperature 0 q is the one-hot argmax: skip the V random numbers a draw costs.
    return pick_by_paths(sampling, greedy, draw)

  def _catch_up(self, params, kv, tokens, n):
    """Feeds the draft up to the pending token: (its logits [B, V], kv of length n).

    After a fully accepted round the draft never saw y_γ, so its cache may be one behind
    the committed history. Feeding two tokens from its own length catches up in either
    case with one static shape; a surplus write lands past the new length.
    """
    start = kv.length
    chunk = jnp.take_along_axis(tokens, start[:, None] + jnp.arange(2)[None, :], axis=1,
                                mode="clip")
    last = (n - 1) - start  # 0 or 1: which of the two fed tokens is the newest
    # After a rejection every row's newest token is the first: the CPU kernels skip the
    # second (`forward_cached(live=)`), whose slot the rollback drops anyway.
    logits, kv = model_lib.forward_cached(self.graphdef, params, chunk, kv,
                                          live=jnp.max(last) + 1)
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

    def pick(i, logits, history, ys, qs, lengths, active):
      adjusted = sampling.adjust(logits, history)
      y, q = self._pick(keys[i], adjusted, sampling)
      top = jnp.max(jax.nn.softmax(adjusted.astype(jnp.float32), axis=-1), axis=-1)
      ys, qs = ys.at[:, i].set(y), qs.at[:, i].set(q)
      lengths = lengths + active
      active = active & (i + 1 < limit) & (top >= confidence)
      return y, sampling.advance(history, y), ys, qs, lengths, active

    def body(carry):
      # The forward of the token drawn last, at the start of the next step rather than
      # the end of its own: the loop's condition then skips it after the last token (as
      # in `propose`) and once every row has stopped, without a conditional.
      i, y, kv, history, ys, qs, lengths, active = carry
      out, kv = model_lib.forward_cached(self.graphdef, params, y[:, None], kv)
      y, history, ys, qs, lengths, active = pick(i, out[:, 0], history, ys, qs, lengths,
                                                 active)
      return i + 1, y, kv, history, ys, qs, lengths, active

    first = limit > 0
    drafts = jnp.any(first)  # no row drafts: nothing drawn, as with no step at all
    y, history, ys, qs, lengths, active = pick(
        0, logits, sampling.history, jnp.zeros((b, self.gamma), jnp.int32),
        jnp.zeros((b, self.gamma, vocab), jnp.float32), jnp.zeros((b,), jnp.int32), first)
    ys, qs = jnp.where(drafts, ys, 0), jnp.where(drafts, qs, 0.0)
    init = (jnp.ones((), jnp.int32), y, kv, history, ys, qs, lengths, active)
    steps, _, kv, _, ys, qs, lengths, _ = jax.lax.while_loop(
        lambda c: (c[0] < self.gamma) & jnp.any(c[-1]), body, init)
    steps = jnp.where(drafts, steps, 0)
    return ys, qs, kv, lengths, steps

  def rollback(self, kv, n, features=None, start=None):
    # Valid KV = the committed history (all but the pending token) ∩ what it computed.
    return kv.rollback(jnp.minimum(kv.length, n - 1))
