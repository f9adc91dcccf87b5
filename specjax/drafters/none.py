"""The target-only baseline as a drafter: γ = 0, so each round is one target step."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


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
