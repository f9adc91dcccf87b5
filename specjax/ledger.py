"""The cost/acceptance ledger: what speedup a (draft, γ) should give, and why.

With per-position acceptance α (i.i.d. across positions), one round commits on average
  E(α, γ) = (1 - α^(γ+1)) / (1 - α)
tokens (Leviathan et al. 2023, eq. 1). A round costs γ draft steps plus one (γ+1)-token
target pass, against E target steps for plain decoding. In units of one 1-token target
step, with c = draft step / target step and v(γ) = (γ+1)-token pass / 1-token pass,
  speedup(α, γ) = E(α, γ) / (γ c + v(γ)).
On accelerators v ≈ 1 (decode is memory bound); on a CPU v grows with γ.

Rounds need not all draft γ: the n-gram drafter drafts nothing without a match, an
adaptive policy anything up to γ, and on a CPU the verify pass is only as long as the
draft (`decode._verify_pass`). With P(L) the measured law of draft lengths
(`length_hist`), a round commits Σ_L P(L) E(α, L) tokens and its pass costs
Σ_L P(L) v(L) (`by_length`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def expected_tokens(alpha, gamma):
  """E(α, γ): mean tokens committed per round (γ+1 at α = 1)."""
  alpha = np.asarray(alpha, np.float64)
  gamma = np.asarray(gamma, np.float64)
  safe = np.where(alpha < 1.0, alpha, 0.5)
  out = (1.0 - safe ** (gamma + 1)) / (1.0 - safe)
  return np.where(alpha < 1.0, out, gamma + 1.0)


def predicted_speedup(alpha, gamma, c, v: float | Callable[[int], float] = 1.0):
  """E(α, γ) / (γ c + v(γ)); v is a number or a function of γ."""
  v_gamma = v(gamma) if callable(v) else v
  return expected_tokens(alpha, gamma) / (np.asarray(gamma) * c + v_gamma)


def optimal_gamma(alpha, c, v: float | Callable[[int], float] = 1.0, max_gamma: int = 32):
  """The γ in [1, max_gamma] with the highest predicted speedup, and that speedup."""
  gammas = np.arange(1, max_gamma + 1)
  speedups = np.array([predicted_speedup(alpha, g, c, v) for g in gammas], np.float64)
  best = int(np.argmax(speedups))
  return int(gammas[best]), float(speedups[best])


def alpha_from_positions(accepted_at: Sequence[int], rounds: int,
                         verified_at: Sequence[int] | None = None) -> float:
  """Per-position α from how often position i was accepted.

  Position i+1 is only reached when position i was accepted, so the conditional rates
  accepted_at[i+1] / accepted_at[i] all estimate α; pooling them is the maximum
  likelihood estimate for a geometric run: Σ accepted_at / (rounds + Σ accepted_at[:-1]).
  With adaptive draft lengths a row may stop drafting before position i: pass
  verified_at (times position i was drafted and checked), and the denominator is its sum.
  """
  accepted_at = np.asarray(accepted_at, np.float64)
  if rounds <= 0 or accepted_at.size == 0:
    return float("nan")
  reached = (rounds + accepted_at[:-1].sum() if verified_at is None
             else float(np.sum(verified_at)))
  return float(accepted_at.sum() / reached)


def length_law(length_hist: Sequence[int]) -> np.ndarray:
  """P(L), L = 0..γ, from the rounds counted at each draft length."""
  hist = np.asarray(length_hist, np.float64)
  return hist / hist.sum() if hist.sum() > 0 else hist


def by_length(alpha, length_hist: Sequence[int], v_gamma: float,
              pass_hist: Sequence[int] | None = None):
  """(tokens per round, verify cost per round) for draft lengths with the law of
  `length_hist` (rounds at L = 0..γ): Σ P(L) E(α, L) and Σ P(W) v(W) over the passes'
  widths `pass_hist` (rounds by the draft tokens the pass computed; None: as
  length_hist, one row per batch), with v(W) on the line from v(0) = 1 (the 1-token
  step) to v(γ) = v_gamma. All rounds at γ: E(α, γ), v(γ)."""
  law = length_law(length_hist)
  lengths = np.arange(law.size)
  gamma = max(law.size - 1, 1)
  expected = float(law @ expected_tokens(alpha, lengths))
  widths = law if pass_hist is None else length_law(pass_hist)
  return expected, float(widths @ (1.0 + (v_gamma - 1.0) * lengths / gamma))


def fit_verify_cost(gammas: Sequence[int], costs: Sequence[float]) -> Callable[[int], float]:
  """v(γ) by linear interpolation between measured (γ, cost ratio) points.

  Several points at one γ (other temperatures, repeated runs) are averaged. Beyond the
  measured range the line through the first and last points continues, but never below
  1: a (γ+1)-token pass costs at least the 1-token step it is measured against.
  """
  gammas, inverse = np.unique(np.asarray(gammas, np.float64), return_inverse=True)
  costs = np.bincount(inverse, weights=np.asarray(costs, np.float64)) / np.bincount(inverse)

  def v(gamma):
    g = np.asarray(gamma, np.float64)
    slope = (costs[-1] - costs[0]) / max(gammas[-1] - gammas[0], 1.0)
    inside = np.interp(g, gammas, costs)
    beyond = costs[-1] + slope * (g - gammas[-1])
    below = costs[0] + slope * (g - gammas[0])
    return np.maximum(np.where(g > gammas[-1], beyond, np.where(g < gammas[0], below, inside)),
                      1.0)

  return v


def tree_expected_tokens(parents, alpha):
  """Mean tokens per target call for a token tree (parents listed breadth-first, -1 = root).

  alpha: the probability that a try of a child is accepted, given that every earlier
  sibling was rejected — one number for every rank, or a sequence by sibling rank (the
  measured `alpha_by_sibling` of a tree run; ranks past its end take its last value, a
  rank never tried (NaN) counts as 0). A node's value is Σ_r Π_{s<r} (1 - α_s) · α_r ·
  (1 + value(child r)), and a call commits 1 + value(root) tokens. A chain gives E(α, γ).
  With one α for every rank this is generous: a later sibling is tried against what p
  has left after the earlier ones, which it matches less often.
  """
  rates = np.nan_to_num(np.atleast_1d(np.asarray(alpha, np.float64)), nan=0.0)
  children = {}
  for i, p in enumerate(parents):
    children.setdefault(p, []).append(i)

  def value(node):
    out, reach = 0.0, 1.0
    for r, c in enumerate(children.get(node, [])):
      a = rates[min(r, len(rates) - 1)]
      out += reach * a * (1 + value(c))
      reach *= 1 - a
    return out

  return 1.0 + value(-1)


def predicted_call_speedup(expected, new_tokens, round_ratio, fixed_method, fixed_baseline,
                           rounds=None):
  """Whole-call speedup: (F_b + N) / (F_m + R ρ), all in target-only rounds.

  A target-only call is its fixed part F_b (host work and prefill) plus N rounds of one
  token; a speculative call is F_m plus R rounds that each cost ρ target-only rounds
  (`costs.call_costs` measures ρ, F_m and F_b). R is `rounds` (say `rounds_to_commit`)
  or N / E. With F = 0, R = N / E and ρ = γc + v(γ) this is the ledger's
  E / (γc + v(γ)); the fixed parts pull a short call's speedup towards 1.
  """
  rounds = new_tokens / np.asarray(expected, np.float64) if rounds is None else rounds
  return (fixed_baseline + new_tokens) / (fixed_method + rounds * round_ratio)


def ceiling_call_speedup(tokens_per_round: int, new_tokens: int, round_ratio, fixed_method,
                         fixed_baseline, cut_last: bool = True) -> float:
  """The whole call's speedup were every draft accepted: `predicted_call_speedup` with
  every round committing `tokens_per_round` (γ + 1; a tree's depth + 1), ceil(N / (γ + 1))
  rounds (cut_last=False: N / (γ + 1), as a prediction from N / E counts them), at the
  measured round cost ρ and fixed parts.

  What better acceptance alone could buy on this machine at these call shapes. An upper
  bound, since a round that accepts more costs no less: its verify pass is as wide or
  wider (a narrowed pass, `decode._verify_pass`) and its draft catches up as many tokens
  or more. Where ρ was measured with rounds that drafted nothing (prompt lookup without
  a match), the bound is looser still.
  """
  commits = np.zeros(int(tokens_per_round))
  commits[-1] = 1.0
  rounds = rounds_to_commit(commits, new_tokens) if cut_last else None
  return float(predicted_call_speedup(tokens_per_round, new_tokens, round_ratio,
                                      fixed_method, fixed_baseline, rounds))


def commits_by_position(rates, gamma: int) -> np.ndarray:
  """P(a round commits k + 1 tokens), k = 0..γ, from P(accept i | position i reached).

  rates: the measured `acceptance_by_position` (a position never reached, NaN, counts
  as 0; positions past its end take its last value). One rate α for every position
  gives the ledger's i.i.d. law, whose mean is E(α, γ).
  """
  rates = np.nan_to_num(np.atleast_1d(np.asarray(rates, np.float64)), nan=0.0)
  rates = rates[np.minimum(np.arange(gamma), rates.size - 1)]
  reach = np.concatenate([[1.0], np.cumprod(rates)])  # P(position k reached), k = 0..γ
  return reach * np.append(1.0 - rates, 1.0)


def commits_by_length(rates, length_hist: Sequence[int]) -> np.ndarray:
  """P(a round commits k + 1 tokens), k = 0..γ, for rounds drafting L = 0..γ tokens with
  the law of `length_hist`: the mixture of `commits_by_position(rates, L)`."""
  law = length_law(length_hist)
  out = np.zeros(law.size)
  for length, p in enumerate(law):
    out[:length + 1] += p * commits_by_position(rates, length)
  return out


def rounds_to_commit(commits, new_tokens: int) -> float:
  """Expected rounds until a row has committed `new_tokens` (its last round cut short).

  commits: P(a round commits k + 1 tokens), k = 0.. (`commits_by_position`). N / E
  undercounts: the round that crosses the budget counts whole but commits only what is
  left, worth up to half a round over a short call. Per row: a batch decodes until its
  slowest row is done, so at batch > 1 the call takes more rounds than this.
  """
  commits = np.asarray(commits, np.float64)
  r = np.zeros(new_tokens + 1)
  for n in range(1, new_tokens + 1):
    left = np.maximum(n - np.arange(1, commits.size + 1), 0)
    r[n] = 1.0 + commits @ r[left]
  return float(r[new_tokens])
