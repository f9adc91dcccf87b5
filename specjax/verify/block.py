"""Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative
Decoding", arXiv 2403.10444, Algorithm 2): a chain of γ drafts verified jointly.

In the engine's indexing (p_i: the target after the prefix y_1..y_i, i = 0..γ; q_i the
draft's, i = 0..γ−1; y_{i+1} ~ q_i):

  w_0 = 1,  w_i = min(1, w_{i−1} · p_{i−1}(y_i) / q_{i−1}(y_i))          i = 1..γ
  r_i = Σ_x [w_i · p_i(x) − q_i(x)]_+,  h_i = r_i / (r_i + 1 − w_i)        i < γ
  h_γ = w_γ;  η_1..η_γ ~ U(0, 1);  τ = the largest i with η_i < h_i (0 if none)

then y_1..y_τ are accepted and the next token is drawn from p_γ (the bonus) if τ = γ,
else from normalise([w_τ · p_τ − q_τ]_+). With q_γ taken as 0, h_γ = w_γ and the bonus
are the same formulas at i = γ (r_γ = w_γ), so one expression serves every position.

Unlike the token-level rule, τ is not the first failure: a later position can pass
after an earlier one fails, and the residual is weighted by w_τ. The law of the
committed tokens is the target's (tests/test_block.py sums it over every draft in
float64), and for one draft chain no valid verifier accepts more in expectation; it
never accepts fewer than the token-level rule.

Where r_i + 1 − w_i = 0 (w_i = 1 and p_i = q_i), h_i is set to 0: then w_{i+1} = 1 too,
so some later position passes with probability 1 and τ > i whatever h_i is.
At temperature 0 (p one-hot) h_i is 1 on the matched prefix and 0 after it, so the rule
is the greedy comparison: the engine runs `exact.verify_point_masses` there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.processors.sampling import argmax, sample
from specjax.verify.exact import verify_point_masses


def weights(ys, q, p, length=None):
  """(w [γ+1], h [γ], q_pad [γ+1, V]) for one row: the block weights w_0..w_γ, each
  position's stopping probability h_1..h_γ, and q with the rows past the row's draft
  length (`length`, default γ) and row γ zeroed. Positions past `length` get h = 0:
  they were not drafted, and h_length = w_length (the chain of `length` tokens)."""
  gamma, vocab = q.shape
  if length is None:
    length = gamma
  drafted = jnp.arange(gamma) < length
  q_pad = jnp.concatenate([jnp.where(drafted[:, None], q, 0.0),
                           jnp.zeros((1, vocab), q.dtype)], axis=0)
  py = jnp.take_along_axis(p[:gamma], ys[:, None], axis=-1)[:, 0]
  qy = jnp.take_along_axis(q, ys[:, None], axis=-1)[:, 0]
  w = [jnp.ones((), p.dtype)]
  for i in range(gamma):  # γ is static and small: scalar arithmetic, unrolled
    num = w[-1] * py[i]
    w.append(jnp.where(num >= qy[i], 1.0, num / jnp.where(qy[i] > 0, qy[i], 1.0)))
  w = jnp.stack(w)
  r = jnp.sum(jnp.maximum(w[:, None] * p - q_pad, 0.0), axis=-1)  # [γ+1]; r_γ = w_γ
  denom = r + 1.0 - w
  h = jnp.where(denom > 0, r / jnp.where(denom > 0, denom, 1.0), 0.0)[1:]
  h = jnp.where(jnp.arange(1, gamma + 1) <= length, h, 0.0)
  return w, h, q_pad


def weighted_residual(w, p, q):
  """normalise([w · p − q]_+) over the last axis; p where it has no mass (then τ is
  never this position, bar rounding)."""
  r = jnp.maximum(w * p - q, 0.0)
  mass = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p)


def verify(key, ys, q, p, length=None):
  """Block verification of one row: (n_accepted = τ, next_token, overlap [γ]).

  ys int[γ], q [γ, V], p [γ+1, V] as `exact.verify`; length: the row's own draft length
  (≤ γ), positions past it not drafted. overlap stays Σ_x min(p_i, q_i), so α̂ keeps
  its meaning (the token-level rule's acceptance rate)."""
  gamma = q.shape[0]
  key_accept, key_next = jax.random.split(key)
  w, h, q_pad = weights(ys, q, p, length)
  eta = jax.random.uniform(key_accept, (gamma,))
  passed = eta < h
  tau = jnp.max(jnp.where(passed, jnp.arange(1, gamma + 1, dtype=jnp.int32), 0),
                initial=0).astype(jnp.int32)
  next_token = sample(key_next, weighted_residual(w[tau], p[tau], q_pad[tau]))
  overlap = jnp.sum(jnp.minimum(p[:gamma], q), axis=-1)
  return tau, next_token, overlap


verify_batch = jax.vmap(verify)


@dataclasses.dataclass(frozen=True)
class BlockRule:
  """`verify_rule="block"`: the rule above, with `ExactRule`'s call signature, plus
  `lengths=` (int32[B], each row's draft length under a γ policy): τ depends on the
  whole chain, so the rule, not `policies.cut`, applies a row's own length."""
  lossless = True
  reads_top = True
  reads_lengths = True

  def __call__(self, keys, ys, qs, ps, greedy=None, top=None, lengths=None):
    if top is not None or greedy:
      # Every p a point mass: block verification is the greedy comparison (module
      # docstring), so the exact rule's gathers give its tokens; a row's length cuts
      # the prefix, and the next token is that p's argmax.
      n, next_token, overlap = verify_point_masses(keys, ys, qs, ps, top)
      if lengths is not None:
        n = jnp.minimum(n, lengths)
        tops = top if top is not None else argmax(ps).astype(jnp.int32)
        next_token = jnp.take_along_axis(tops, n[:, None], axis=1)[:, 0]
      return n, next_token, overlap
    if lengths is None:
      return verify_batch(keys, ys, qs, ps)
    return verify_batch(keys, ys, qs, ps, lengths)
