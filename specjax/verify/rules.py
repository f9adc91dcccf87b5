"""Research verification rules beside the lossless ones (`verify.exact`, `verify.block`,
`verify.traversal`), and `make_rule`, which makes any of them by name.
None of them is lossless.

Each is a frozen dataclass with `lossless = False` and the call signature of
`specjax.verify.ExactRule`: `(keys[B], ys[B, γ], qs[B, γ, V], ps[B, γ+1, V]) ->
(n_accepted int32[B], next_token int32[B], overlap float32[B, γ])`, written for one row
and `vmap`ped. All three stop at the first rejected position and draw the token there
from the target's p_i itself (not the residual [p − q]₊, which is what makes the exact
rule exact); if all γ pass, the bonus comes from p_{γ+1}. `overlap` is still
Σ_x min(p_i, q_i), so α̂ keeps its meaning (the exact rule's acceptance rate) under any
rule. How far each rule's output drifts from the target is measured by
`python -m experiments.audit` (docs/BENCHMARKS.md), not assumed.

- `TypicalRule` (Medusa, Cai et al. 2024): accept y_i iff p_i(y_i) > min(ε, δ·exp(−H(p_i))).
  Deterministic given the tokens. At temperature 0 p is one-hot (H = 0), so y_i passes
  iff it is the target's argmax and the correction is that argmax: greedy stays exact.
- `ThresholdRule`: accept y_i iff p_i(y_i) > 0 and (p_i(y_i) ≥ ratio·q_i(y_i) or
  p_i(y_i) ≥ floor). ratio = 1 is a deterministic rounding of min(1, p/q); a smaller
  ratio is more lenient. Also exact at temperature 0, for any ratio and floor.
- `SyntheticRule` (vLLM's synthetic acceptance mode): position i is accepted with the
  configured unconditional probability rates[i], whatever the tokens (one uniform u per
  round; the accepted prefix is {i : u < rates[i]}). For measuring engine speed at a
  chosen acceptance with random-weight models; its text is meaningless at any temperature.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp

from specjax.processors.sampling import sample
from specjax.verify.block import BlockRule
from specjax.verify.exact import ExactRule, accepted_prefix
from specjax.verify.traversal import TraversalRule

RULES = ("exact", "block", "traversal", "typical", "threshold", "synthetic")


def _stop_and_draw(key, accepted, q, p):
  """Shared tail of the lossy rules: prefix length, next token ~ p at the stop, overlap."""
  n_accepted = accepted_prefix(accepted)
  next_token = sample(key, p[n_accepted])  # the first failure, or p_{γ+1} as the bonus
  overlap = jnp.sum(jnp.minimum(p[:q.shape[0]], q), axis=-1)
  return n_accepted, next_token, overlap


def _probs_of(dist, tokens):
  return jnp.take_along_axis(dist, tokens[:, None], axis=-1)[:, 0]


def typical_accepts(ys, p, epsilon, delta):
  """bool[γ]: p_i(y_i) > min(ε, δ·exp(−H(p_i))), for one row (p: [γ(+1), V])."""
  p = p[:ys.shape[0]]
  entropy = jnp.sum(jax.scipy.special.entr(p), axis=-1)  # 0·log 0 = 0
  return _probs_of(p, ys) > jnp.minimum(epsilon, delta * jnp.exp(-entropy))


def threshold_accepts(ys, q, p, ratio, floor):
  """bool[γ]: p(y) > 0 and (p(y) ≥ ratio·q(y) or p(y) ≥ floor), for one row."""
  py, qy = _probs_of(p[:ys.shape[0]], ys), _probs_of(q, ys)
  return (py > 0) & ((py >= ratio * qy) | (py >= floor))


def _typical_row(key, ys, q, p, epsilon, delta):
  return _stop_and_draw(key, typical_accepts(ys, p, epsilon, delta), q, p)


def _threshold_row(key, ys, q, p, ratio, floor):
  return _stop_and_draw(key, threshold_accepts(ys, q, p, ratio, floor), q, p)


def _synthetic_row(key, ys, q, p, rates):
  key_accept, key_next = jax.random.split(key)
  u = jax.random.uniform(key_accept, ())
  # rates are non-increasing, so {i : u < rates[i]} is a prefix: P(n_accepted > i) = rates[i].
  return _stop_and_draw(key_next, u < jnp.asarray(rates, jnp.float32), q, p)


def _real(name, value) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  return float(value)


@dataclasses.dataclass(frozen=True)
class TypicalRule:
  """Medusa's typical acceptance: accept y_i iff p_i(y_i) > min(ε, δ·exp(−H(p_i)))."""
  epsilon: float = 0.09
  delta: float = 0.3
  lossless = False

  def __post_init__(self):
    for name in ("epsilon", "delta"):
      value = _real(f"typical rule {name}", getattr(self, name))
      if not 0 < value <= 1:
        raise ValueError(f"typical rule {name} must be in (0, 1], got {value}")
      object.__setattr__(self, name, value)

  def __call__(self, keys, ys, qs, ps, greedy=None):
    row = functools.partial(_typical_row, epsilon=self.epsilon, delta=self.delta)
    return jax.vmap(row)(keys, ys, qs, ps)


@dataclasses.dataclass(frozen=True)
class ThresholdRule:
  """Accept y_i iff p(y) > 0 and (p(y)/q(y) ≥ ratio or p(y) ≥ floor); redraw from p."""
  ratio: float = 0.5
  floor: float = 0.3
  lossless = False

  def __post_init__(self):
    ratio = _real("threshold rule ratio", self.ratio)
    floor = _real("threshold rule floor", self.floor)
    if ratio <= 0:
      raise ValueError(f"threshold rule ratio must be > 0, got {ratio}")
    if not 0 <= floor <= 1:
      raise ValueError(f"threshold rule floor must be in [0, 1], got {floor}")
    object.__setattr__(self, "ratio", ratio)
    object.__setattr__(self, "floor", floor)

  def __call__(self, keys, ys, qs, ps, greedy=None):
    row = functools.partial(_threshold_row, ratio=self.ratio, floor=self.floor)
    return jax.vmap(row)(keys, ys, qs, ps)


@dataclasses.dataclass(frozen=True)
class SyntheticRule:
  """Accepts position i with unconditional probability rates[i], whatever the tokens.

  rates must be non-increasing (position i+1 can only be accepted after position i),
  one per draft position. A constant per-position acceptance α is rates[i] = α^(i+1).
  """
  rates: tuple[float, ...] = ()
  lossless = False

  def __post_init__(self):
    rates = self.rates
    if isinstance(rates, (str, bytes)) or not hasattr(rates, "__len__"):
      raise ValueError(f"synthetic rule rates must be a sequence of numbers, got {rates!r}")
    rates = tuple(_real("synthetic rule rate", r) for r in rates)
    if any(not 0 <= r <= 1 for r in rates):
      raise ValueError(f"synthetic rule rates must be in [0, 1], got {list(rates)}")
    if any(b > a for a, b in zip(rates, rates[1:])):
      raise ValueError(f"synthetic rule rates must not increase with position (they are "
                       f"unconditional: P(position i accepted)), got {list(rates)}")
    object.__setattr__(self, "rates", rates)

  def __call__(self, keys, ys, qs, ps, greedy=None):
    if len(self.rates) != ys.shape[1]:
      raise ValueError(f"synthetic rule has {len(self.rates)} rates for γ = {ys.shape[1]}")
    row = functools.partial(_synthetic_row, rates=self.rates)
    return jax.vmap(row)(keys, ys, qs, ps)


_CLASSES = {"exact": ExactRule, "block": BlockRule, "traversal": TraversalRule, "typical": TypicalRule, "threshold": ThresholdRule,
            "synthetic": SyntheticRule}


def make_rule(name: str, params: dict | None, gamma: int):
  """The rule called `name` with keyword `params`; ValueError for anything invalid.

  `gamma` is the draft length: non-exact rules need one (γ ≥ 1), and a synthetic rule
  needs exactly γ rates.
  """
  if name not in _CLASSES:
    raise ValueError(f"verify_rule must be one of {RULES}, got {name!r}")
  if params is None:
    params = {}
  if not isinstance(params, dict):
    raise ValueError(f"rule_params must be a dict (or None), got {params!r}")
  cls = _CLASSES[name]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(params) - known)
  if unknown:
    raise ValueError(f"verify_rule={name!r} takes rule_params {sorted(known) or 'none'}, "
                     f"got unknown {unknown}")
  if name != "exact" and gamma < 1:
    raise ValueError(f"verify_rule={name!r} needs speculative decoding: pass a draft "
                     f"model or drafter='ngram'")
  if name == "synthetic":
    if "rates" not in params:
      raise ValueError("verify_rule='synthetic' needs rule_params={'rates': (...)}, the "
                       f"acceptance probability of each of the γ = {gamma} positions")
    if isinstance(params["rates"], (str, bytes)) or not hasattr(params["rates"], "__len__"):
      raise ValueError(f"synthetic rule rates must be a sequence of numbers, "
                       f"got {params['rates']!r}")
    if len(params["rates"]) != gamma:
      raise ValueError(f"synthetic rule rates must have one value per draft position "
                       f"(γ = {gamma}), got {len(params['rates'])}")
  return cls(**params)
