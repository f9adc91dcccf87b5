"""Verification rules for one sequence; the engine `vmap`s them over the batch.

The rule (Leviathan et al. 2023; Chen et al. 2023): draft token y_i ~ q_i is accepted
with probability min(1, p_i(y_i) / q_i(y_i)); at the first rejection a token is drawn
from the normalised residual [p_i - q_i]_+ and the round stops; if all γ pass, a bonus
token is drawn from p_{γ+1}. The accept path contributes min(p, q) and the reject path
[p - q]_+, which sum to p: the output follows the target exactly.

Greedy needs no separate code: at temperature 0 `process_logits` makes p the one-hot of
the target's argmax, so y is accepted iff it is that argmax, and the residual (and the
bonus) is that argmax. Token-only drafters pass q = one-hot(y), which gives acceptance
p(y) and the residual "p without y, renormalised".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import backends
from specjax.processors.sampling import argmax, sample


def acceptance_prob(p: jax.Array, q: jax.Array, y: jax.Array) -> jax.Array:
  """min(1, p(y) / q(y)) for the last axis; 1 where q(y) = 0 < p(y), 0 where p(y) = 0."""
  py = jnp.take_along_axis(p, y[..., None], axis=-1)[..., 0]
  qy = jnp.take_along_axis(q, y[..., None], axis=-1)[..., 0]
  return jnp.where(py >= qy, 1.0, py / jnp.where(qy > 0, qy, 1.0))


def accepted_prefix(accepted: jax.Array) -> jax.Array:
  """int32 [...]: how many leading entries of accepted bool [..., γ] are True (the index
  of the first False, or γ): one reduction (a cumulative product is a reduce-window
  thunk on XLA:CPU)."""
  gamma = accepted.shape[-1]
  return jnp.min(jnp.where(accepted, gamma, jnp.arange(gamma, dtype=jnp.int32)),
                 axis=-1, initial=gamma).astype(jnp.int32)  # γ = 0: 0


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
  """normalise([p - q]_+) along the last axis.

  Its mass is the rejection probability, so it is only sampled when that is positive;
  where rounding leaves no mass (p == q) it falls back to p, which is then the same law.
  """
  r = jnp.maximum(p - q, 0.0)
  mass = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p)


def verify(key: jax.Array, draft_tokens: jax.Array, q: jax.Array, p: jax.Array):
  """Speculative sampling for one sequence.

  Args:
    key: PRNG key for this row and round.
    draft_tokens: int[γ] proposed tokens y_1..y_γ.
    q: [γ, V] the distributions the draft tokens were drawn from.
    p: [γ+1, V] the target's distributions at the same positions, plus one.

  Returns:
    n_accepted: int32 in [0, γ], the accepted prefix length.
    next_token: int32, the correction (n_accepted < γ) or bonus token.
    overlap: [γ] Σ_x min(p_i, q_i), the acceptance probability at each position.
  """
  gamma, vocab = q.shape
  key_accept, key_next = jax.random.split(key)
  u = jax.random.uniform(key_accept, (gamma,))
  accepted = u < acceptance_prob(p[:gamma], q, draft_tokens)  # u < 1 always: a = 1 accepts
  n_accepted = accepted_prefix(accepted)
  # Row γ of the padded q is zero, so the "residual" there is p_{γ+1}: the bonus.
  q_pad = jnp.concatenate([q, jnp.zeros((1, vocab), q.dtype)], axis=0)
  next_dist = residual(p[n_accepted], q_pad[n_accepted])
  next_token = sample(key_next, next_dist)
  overlap = jnp.sum(jnp.minimum(p[:gamma], q), axis=-1)
  return n_accepted, next_token, overlap


verify_batch = jax.vmap(verify)


def verify_point_masses(keys, draft_tokens, q, p, top=None):
  """`verify_batch` where every p [B, γ+1, V] is a point mass, in O(γ) gathers per row;
  with top (int32[B, γ+1], each p's token, where the caller has it) p is not read.

  With all of p_i on a_i = argmax p_i: y_i is accepted with probability min(1, p(y)/q(y)),
  which is 1 for y_i = a_i (or q(y_i) = 0) and 0 otherwise, so no uniform is drawn; the
  residual [p - q]_+ (or p where it has no mass) is the point mass on a_i, so the
  correction or bonus is a_n; Σ_x min(p_i, q_i) = min(p_i(a_i), q_i(a_i)). The same
  tokens as `verify_batch` (tested), without its passes over the vocabulary (the
  overlap's alone cost a 20th of a prompt-lookup round on the shipped target on a CPU).
  `keys` is unused: nothing is random.
  """
  del keys
  gamma = draft_tokens.shape[1]
  at_top = lambda d: jnp.take_along_axis(d, top[:, :gamma, None], axis=-1)[..., 0]
  if top is None:
    top = argmax(p).astype(jnp.int32)  # [B, γ+1]
    accepted = acceptance_prob(p[:, :gamma], q, draft_tokens) > 0
    p_top = at_top(p[:, :gamma])
  else:  # p = one-hot(top), not read: p(y) = [y = top], p(top) = 1
    py = (draft_tokens == top[:, :gamma]).astype(q.dtype)
    qy = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    accepted = (py >= qy) | (py > 0)  # acceptance_prob > 0
    p_top = jnp.ones(top[:, :gamma].shape, q.dtype)
  n_accepted = accepted_prefix(accepted)
  next_token = jnp.take_along_axis(top, n_accepted[:, None], axis=1)[:, 0]
  return n_accepted, next_token, jnp.minimum(p_top, at_top(q))


def point_masses(ps: jax.Array) -> jax.Array:
  """Whether every distribution in ps [..., V] has one token of nonzero probability."""
  return backends.current().point_masses(ps)  # on a CPU one kernel call, not three thunks


@dataclasses.dataclass(frozen=True)
class ExactRule:
  """The lossless rule above. A verify rule is a frozen dataclass (a static argument of
  the engine) with `lossless` and `__call__(keys[B], ys[B, γ], qs[B, γ, V], ps[B, γ+1, V],
  greedy) -> (n_accepted int32[B], next_token int32[B], overlap float32[B, γ])`; any
  rule other than this one must set `lossless = False`; one with `reads_top` also takes
  `top=` (`ChainLayout.verify`). `greedy` (static,
  `sampling.Paths.greedy`): every row at temperature 0 (True), none (False), unknown
  (None).
  """
  lossless = True
  reads_top = True  # takes `top=` (each p's token where all are point masses)

  def __call__(self, keys, ys, qs, ps, greedy=None, top=None):
    # Every p a point mass (temperature 0 on every row, known on the host): the same
    # tokens from argmaxes and gathers, without V random numbers per row or passes over
    # the vocabulary. Not known: `verify_batch`, which gives a point mass the same tokens
    # and overlap; a conditional here would bring its predicate to the host each round.
    # top: each p's token where the host knows every p is a point mass (then p is not
    # read, and the program need not build it).
    if top is not None:
      return verify_point_masses(keys, ys, qs, ps, top)
    return (verify_point_masses if greedy else verify_batch)(keys, ys, qs, ps)
