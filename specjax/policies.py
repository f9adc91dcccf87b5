"""Adaptive draft length: how many of its γ tokens each row drafts this round.

γ stays the static maximum (buffers, the verify pass's width), so one program serves
every length. A policy only changes how many tokens are proposed; the verify rule sees
a row's first L_b tokens, and when all L_b are accepted the next token is drawn from
the target's p at position L_b, exactly what a chain of length L_b would do. Every
policy is therefore as lossless as the rule it runs with.

  'fixed'       L = γ (the default).
  'heuristic'   Hugging Face assisted generation's schedule, per row: L + 2 after a
                round in which all L were accepted, L - 1 otherwise, within [1, γ].
  'confidence'  a row stops after the first token whose draft top probability (after
                the processors, at temperature 1) is below `confidence`
                (transformers' `assistant_confidence_threshold`).
  'ledger'      each row's running α̂ (its verified Σ min(p, q), shrunk toward a prior)
                picks L = argmax_L E(α̂, L) / (L·c + v): c and v are one draft token's
                and the verify pass's cost, `draft_cost` = c / v. Where the pass computes
                only the longest draft (a CPU, `decode._verify_pass`) and v(γ) is known
                (`verify_cost`, measured by `generate`), a round is priced
                L·c + 1 + L·(v(γ) - 1)/γ in 1-token steps instead: the line from v(0) = 1
                to v(γ) that `ledger.by_length` uses, so a row with a low α̂ drafts short.

Under 'fixed', a drafter that sizes its own drafts (`sizes_drafts`: the n-gram drafter,
which drafts nothing without a match) gives each row its own length all the same.

The draft loop of the model and EAGLE drafters is a `while_loop` that ends when every
row has stopped, so a short or unconfident batch really does less draft work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("fixed", "heuristic", "confidence", "ledger")


@dataclasses.dataclass(frozen=True)
class GammaPolicy:
  """A static (hashable) policy; `limits` and `update` are pure and jittable."""
  kind: str = "fixed"
  confidence: float = 0.0  # 'confidence': stop below this draft top probability
  draft_cost: float = 0.0  # 'ledger': c / v, one draft token relative to the verify pass
  verify_cost: float = 0.0  # 'ledger': v(γ) in 1-token target steps (0: not known)
  # 'ledger': α̂ = (Σ overlap + prior_alpha · prior_weight) / (verified + prior_weight)
  prior_alpha: float = 0.6
  prior_weight: float = 4.0

  def __post_init__(self):
    if self.kind not in POLICIES:
      raise ValueError(f"gamma_policy must be one of {POLICIES}, got {self.kind!r}")
    ok = 0.0 < self.confidence < 1.0 if self.kind == "confidence" else self.confidence == 0
    if not ok:
      raise ValueError(f"draft_confidence must be in (0, 1) with gamma_policy='confidence' "
                       f"(and unset otherwise), got {self.confidence!r}")
    if not (np.isfinite(self.draft_cost) and self.draft_cost >= 0.0):
      raise ValueError(f"draft_cost (c / v) must be a finite number >= 0, "
                       f"got {self.draft_cost!r}")
    if not (np.isfinite(self.verify_cost) and self.verify_cost >= 0.0):
      raise ValueError(f"verify_cost (v, the verify pass in target steps) must be a "
                       f"finite number >= 0 (0: not known), got {self.verify_cost!r}")
    if not 0.0 < self.prior_alpha < 1.0 or not self.prior_weight > 0:
      raise ValueError("prior_alpha must be in (0, 1) and prior_weight > 0")

  @property
  def adaptive(self) -> bool:
    return self.kind != "fixed"

  def first(self, batch: int, gamma: int) -> jax.Array:
    """The heuristic's starting length (the others ignore it)."""
    return jnp.full((batch,), gamma, jnp.int32)

  def limits(self, draft_len, stats, gamma: int, narrow: bool = False) -> jax.Array:
    """int32[B] in [1, γ]: the most each row may draft this round. narrow (static): the
    verify pass computes only the longest draft (`decode.narrows`)."""
    if self.kind == "heuristic":
      return jnp.clip(draft_len, 1, gamma)
    if self.kind == "ledger":
      alpha = ((stats.overlap_sum + self.prior_alpha * self.prior_weight)
               / (stats.overlap_count + self.prior_weight))
      if narrow and self.verify_cost > 0:  # in 1-token steps: c, and the pass's slope
        return ledger_length(alpha, gamma, self.draft_cost * self.verify_cost,
                             max(self.verify_cost - 1.0, 0.0) / gamma)
      return ledger_length(alpha, gamma, self.draft_cost)
    return jnp.full_like(draft_len, gamma)

  # The engine's four calls, made for every policy (`init_state` in `decode.prefill`;
  # `draft`, `settle`, `carry` in `decode.decode_round`): 'fixed' passes straight
  # through, so neither has a branch of its own for policies.

  def init_state(self, batch: int, gamma: int) -> dict:
    """The DecodeState fields an adaptive policy carries between rounds ({} for 'fixed')."""
    if not self.adaptive:
      return {}
    return dict(draft_len=self.first(batch, gamma), draft_steps=jnp.zeros((), jnp.int32))

  def draft(self, drafter, params, state, key, sampling, narrow: bool = False):
    """(ys, qs, draft_state, lengths, steps) for DecodeState `state`: every row drafts γ
    under 'fixed' (lengths and steps None), or its own length where the drafter sizes
    its drafts (`sizes_drafts`: the n-gram drafter drafts nothing without a match; a
    finished row, nothing); else up to its limit (`propose_upto`). narrow: as `limits`."""
    if not self.adaptive:
      if getattr(drafter, "sizes_drafts", False):
        ys, qs, draft_state, lengths = drafter.propose_sized(
            params, state.draft_state, state.tokens, state.n, key, sampling)
        return ys, qs, draft_state, jnp.where(state.done, 0, lengths), None
      ys, qs, draft_state = drafter.propose(params, state.draft_state, state.tokens, state.n,
                                            key, sampling)
      return ys, qs, draft_state, None, None
    limit = jnp.where(state.done, 0,
                      self.limits(state.draft_len, state.stats, drafter.gamma, narrow))
    return propose_upto(drafter, params, state.draft_state, state.tokens, state.n, key,
                        sampling, limit, self.confidence)

  def settle(self, n_accepted, next_token, ps, lengths, key, greedy=None, top=None):
    """The rule's outcome as if each row had drafted a chain of its own length (`cut`)."""
    if lengths is None:
      return n_accepted, next_token
    return cut(n_accepted, next_token, ps, lengths, jax.random.fold_in(key, 2 ** 31 - 1),
               greedy, top)

  def carry(self, state, lengths, n_accepted, steps, gamma: int) -> dict:
    """The fields of `init_state` after this round."""
    if not self.adaptive:
      return {}
    return dict(draft_len=self.update(state.draft_len, lengths, n_accepted, gamma),
                draft_steps=state.draft_steps + steps)

  def update(self, draft_len, lengths, n_accepted, gamma: int) -> jax.Array:
    """The heuristic's next length; unchanged for the other policies."""
    if self.kind != "heuristic":
      return draft_len
    all_in = n_accepted >= lengths
    grown = jnp.where(all_in, lengths + 2, lengths - 1)
    # A row that drafted nothing of its own accord (no n-gram match) keeps its length.
    grown = jnp.where(lengths == 0, draft_len, grown)
    return jnp.clip(grown, 1, gamma).astype(jnp.int32)


def ledger_length(alpha, gamma: int, draft_cost, pass_slope=0.0) -> jax.Array:
  """argmax over L in 1..γ of E(α, L) / (L·(draft_cost + pass_slope) + 1), per row: the
  round's cost relative to a verify pass of no draft, which grows by pass_slope a token."""
  a = jnp.clip(alpha, 0.0, 0.999)[:, None]
  lengths = jnp.arange(1, gamma + 1, dtype=jnp.float32)[None, :]
  expected = (1.0 - a ** (lengths + 1)) / (1.0 - a)  # accepted + the correction/bonus
  cost = lengths * (draft_cost + pass_slope) + 1.0
  return (jnp.argmax(expected / cost, axis=1) + 1).astype(jnp.int32)


def propose_upto(drafter, params, state, tokens, n, key, sampling, limit, confidence):
  """(ys [B, γ], qs, state, lengths int32[B], steps): the drafter's proposal, each row cut
  to its limit (and, with a confidence threshold, at its first unconfident token).

  Drafters that draft token by token (`propose_until`) stop their loop once every row
  has stopped; steps counts the draft steps the loop ran. The others propose γ tokens
  at once and are cut afterwards.
  """
  if hasattr(drafter, "propose_until"):
    return drafter.propose_until(params, state, tokens, n, key, sampling, limit, confidence)
  steps = jnp.asarray(drafter.gamma, jnp.int32)
  if getattr(drafter, "sizes_drafts", False):
    ys, qs, state, own = drafter.propose_sized(params, state, tokens, n, key, sampling)
    return ys, qs, state, jnp.minimum(limit, own), steps
  ys, qs, state = drafter.propose(params, state, tokens, n, key, sampling)
  return ys, qs, state, limit, steps


def cut(n_accepted, next_token, ps, lengths, key, greedy=None, top=None):
  """The rule's outcome for chains of `lengths` tokens instead of γ.

  Every rule but the block rule (which takes the lengths itself, `Chain.verify`) decides
  position i from position i's inputs alone, so a row whose first
  L tokens were all accepted would have drawn its bonus from p_{L+1} (index L) with a
  chain of L: that draw replaces the rule's next token; otherwise nothing changes.
  """
  from specjax.processors.sampling import argmax, sample
  full = n_accepted >= lengths
  if top is not None:  # every p a point mass on top [B, γ+1] (the rule's `top`)
    return jnp.minimum(n_accepted, lengths), jnp.where(
        full, jnp.take_along_axis(top, lengths[:, None], axis=1)[:, 0], next_token)
  p_next = jnp.take_along_axis(ps, lengths[:, None, None], axis=1)[:, 0]
  # A point mass's draw is its one token (temperature 0): no V random numbers per row.
  # Unknown (None): a draw, which gives a point mass its token, not a conditional.
  bonus = argmax(p_next).astype(jnp.int32) if greedy else sample(key, p_next)
  return jnp.minimum(n_accepted, lengths), jnp.where(full, bonus, next_token)
