"""Drafters for the learned heads of `specjax.models.heads`: EAGLE and Medusa.

Both follow the engine's drafter protocol with `uses_features = True`: the round hands
them the target's last hidden states (an EAGLE-3 head's `feature_layers`: the residual
streams of those layers, concatenated).

  init(batch, size)                            -> state
  prefill(params, state, tokens, n, features)  -> state   features [B, P, d] of tokens[:, :P]
  propose(params, state, tokens, n, key, sampling) -> (ys int32[B, γ], qs [B, γ, V], state)
  rollback(state, n, features, start)          -> state   features [B, γ+1, d] at positions
                                                          start[b] .. start[b] + γ

The committed history of row b is tokens[b, :n[b]]; the last of them (n-1) is pending:
the target has computed features only for positions 0..n-2. Features at positions
>= n-1 (rejected candidates, or the verify pass's output at the new pending token) are
zeroed on arrival and never read.

`params` is `Head.draft_params(target)`: the head's own arrays plus the target's frozen
embedding / final norm / LM head. q is the processed distribution each y was drawn from
(`process_logits` with the round's settings, or one-hot for sample_mode='greedy').
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models import heads as heads_lib
from specjax.models import kv_cache
from specjax.processors.sampling import argmax, pick_by_paths, process_logits, sample

SAMPLE_MODES = ("probabilistic", "greedy")


def _adjust(sampling, logits, history):
  """History-dependent processors (penalties...), where the sampling settings have them."""
  adjust = getattr(sampling, "adjust", None)
  return logits if adjust is None else adjust(logits, history)


def _advance(sampling, history, y):
  advance = getattr(sampling, "advance", None)
  return history if advance is None else advance(history, y)


def draw(sample_mode: str, key, logits, sampling, history=None):
  """(y, q): y ~ q = the processed distribution of `logits` [B, V]; argmax at T = 0.

  Like `ModelDrafter._draw`: processors see `history` (committed prefix + earlier drafts).
  """
  return _pick(sample_mode, key, _adjust(sampling, logits, history), sampling)


def _pick(sample_mode: str, key, logits, sampling):
  """`draw` on logits the history-dependent processors have already adjusted."""

  def greedy():
    y = argmax(logits).astype(jnp.int32)
    return y, jax.nn.one_hot(y, logits.shape[-1], dtype=jnp.float32)

  def drawn():
    q = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                       sampling.paths)
    return sample(key, q), q

  if sample_mode == "greedy":
    return greedy()
  # At temperature 0 q is the one-hot argmax: skip the random numbers a draw costs.
  return pick_by_paths(sampling, greedy, drawn)


def _known(features, positions, n):
  """features [B, T, d] at positions int[B, T], zeroed where the position is >= n - 1."""
  keep = positions <= (n - 2)[:, None]
  return jnp.where(keep[..., None], features, 0.0).astype(jnp.float32)


def _check(config: heads_lib.HeadConfig, kind: str, gamma: int, sample_mode: str):
  if config.kind not in kind.split("/"):
    raise ValueError(f"a {kind} drafter needs a {kind} HeadConfig, got {config.kind!r}")
  if not isinstance(gamma, int) or gamma < 1:
    raise ValueError(f"gamma must be a positive int, got {gamma!r}")
  if sample_mode not in SAMPLE_MODES:
    raise ValueError(f"sample_mode must be one of {SAMPLE_MODES}, got {sample_mode!r}")


@flax.struct.dataclass
class EagleState:
  kv: kv_cache.KVState  # the head's one-layer cache; length = slots fed with true features
  feats: jax.Array  # float32[B, γ+1, d]: true features at positions kv.length.., not yet fed


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
  """EAGLE: slot t reads (f_t, x_{t+1}) and predicts f_{t+1}, hence x_{t+2}. The same
  drafter runs an EAGLE-3 head: its f_t are the target's fused features
  (`feature_layers`, handed over by the target's passes), which the head's `fc` takes in
  (`target_features=True`), and its predicted features are its own hidden states.

  Invariant between rounds: the head's cache holds slots 0..L-1 (L = kv.length) built
  from the target's true features, and `feats` holds the true features of positions
  L..L+γ (zero where unknown). `propose` first feeds those γ+1 slots in one chunk (one
  static shape; slots past n-2 are masked garbage) and reads the output at slot n-2,
  which drafts y_1 = x_n; then γ-1 single-slot steps feed (predicted f, drafted y).
  `rollback` drops every slot built on a predicted feature (kv.length = start) and keeps
  the verify pass's true features of start..n-2 for the next chunk.
  """

  config: heads_lib.HeadConfig
  gamma: int
  sample_mode: str = "probabilistic"
  uses_features = True

  def __post_init__(self):
    _check(self.config, "eagle/eagle3", self.gamma, self.sample_mode)

  @property
  def feature_layers(self):
    """The target layers whose features this head reads (None: the last hidden state)."""
    return self.config.feature_layers

  def init(self, batch, size):
    kv = kv_cache.init_kv(self.config.layer_config, batch, size)
    feats = jnp.zeros((batch, self.gamma + 1, self.config.feature_dim), jnp.float32)
    return EagleState(kv=kv, feats=feats)

  def prefill(self, params, state, tokens, n, features):
    b, p = features.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    known = _known(features, pos, n)
    next_tokens = jnp.take_along_axis(tokens, pos + 1, axis=1, mode="clip")
    _, _, kv = heads_lib.eagle_apply(self.config, params, known, next_tokens, state.kv,
                                     empty=True, target_features=True)
    # Slots 0..n-3 stay; slot n-2 (the newest true feature) is fed by the first propose.
    start = jnp.maximum(n - 2, 0)
    idx = start[:, None] + jnp.arange(self.gamma + 1, dtype=jnp.int32)[None, :]
    feats = jnp.take_along_axis(known, jnp.minimum(idx, p - 1)[..., None], axis=1)
    feats = jnp.where((idx < p)[..., None], feats, 0.0)
    return EagleState(kv=kv.rollback(start), feats=feats)

  def _first(self, params, state, tokens, n):
    """Feeds the true-feature slots: (predicted f_{n-1} [B, 1, d], its logits, kv)."""
    kv, c = state.kv, self.gamma + 1
    start = kv.length
    pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    next_tokens = jnp.take_along_axis(tokens, pos + 1, axis=1, mode="clip")
    # Only slot n-2's output is read, and the slots past it are rolled back: the head's
    # LM head runs on one row, and its layer (fused, on a CPU) on slots up to there.
    last = jnp.clip(n - 2 - start, 0, c - 1)
    x, logits, kv = heads_lib.eagle_apply(self.config, params, state.feats, next_tokens, kv,
                                          at=last, target_features=True)
    return x, logits[:, 0], kv.rollback(jnp.maximum(n - 1, 0))  # true slots 0..n-2

  def propose(self, params, state, tokens, n, key, sampling):
    x, logits, kv = self._first(params, state, tokens, n)

    def step(carry, step_key):
      x, logits, kv, history = carry
      y, q = draw(self.sample_mode, step_key, logits, sampling, history)
      x, logits, kv = heads_lib.eagle_apply(self.config, params, x, y[:, None], kv)
      return (x, logits[:, 0], kv, _advance(sampling, history, y)), (y, q)

    keys = jax.random.split(key, self.gamma)
    history = getattr(sampling, "history", None)
    (x, logits, kv, history), (ys, qs) = jax.lax.scan(step, (x, logits, kv, history),
                                                      keys[:-1])
    y_last, q_last = draw(self.sample_mode, keys[-1], logits, sampling, history)
    ys = jnp.concatenate([ys, y_last[None]], axis=0).swapaxes(0, 1)  # [B, γ]
    qs = jnp.concatenate([qs, q_last[None]], axis=0).swapaxes(0, 1)  # [B, γ, V]
    return ys, qs, state.replace(kv=kv)

  def propose_until(self, params, state, tokens, n, key, sampling, limit, confidence):
    """`propose` with adaptive lengths (see `ModelDrafter.propose_until`)."""
    x, logits, kv = self._first(params, state, tokens, n)
    b, vocab = logits.shape
    keys = jax.random.split(key, self.gamma)

    def pick(i, logits, history, ys, qs, lengths, active):
      adjusted = _adjust(sampling, logits, history)
      y, q = _pick(self.sample_mode, keys[i], adjusted, sampling)
      top = jnp.max(jax.nn.softmax(adjusted.astype(jnp.float32), axis=-1), axis=-1)
      ys, qs = ys.at[:, i].set(y), qs.at[:, i].set(q)
      lengths = lengths + active
      active = active & (i + 1 < limit) & (top >= confidence)
      return y, _advance(sampling, history, y), ys, qs, lengths, active

    def body(carry):
      # The last token's forward at the start of the next step: the loop's condition
      # skips it, without a conditional (`ModelDrafter.propose_until`).
      i, y, x, kv, history, ys, qs, lengths, active = carry
      x, logits, kv = heads_lib.eagle_apply(self.config, params, x, y[:, None], kv)
      y, history, ys, qs, lengths, active = pick(i, logits[:, 0], history, ys, qs, lengths,
                                                 active)
      return i + 1, y, x, kv, history, ys, qs, lengths, active

    first = limit > 0
    drafts = jnp.any(first)  # no row drafts: nothing drawn, as with no step at all
    y, history, ys, qs, lengths, active = pick(
        0, logits, getattr(sampling, "history", None), jnp.zeros((b, self.gamma), jnp.int32),
        jnp.zeros((b, self.gamma, vocab), jnp.float32), jnp.zeros((b,), jnp.int32), first)
    ys, qs = jnp.where(drafts, ys, 0), jnp.where(drafts, qs, 0.0)
    init = (jnp.ones((), jnp.int32), y, x, kv, history, ys, qs, lengths, active)
    steps, _, _, kv, _, ys, qs, lengths, _ = jax.lax.while_loop(
        lambda c: (c[0] < self.gamma) & jnp.any(c[-1]), body, init)
    steps = jnp.where(drafts, steps, 0)
    return ys, qs, state.replace(kv=kv), lengths, steps

  def rollback(self, state, n, features, start):
    pos = start[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
    kv = state.kv.rollback(jnp.minimum(state.kv.length, start))
    return EagleState(kv=kv, feats=_known(features, pos, n))


@flax.struct.dataclass
class MedusaState:
  feature: jax.Array  # float32[B, d]: the target's feature at position n-2 (zero if n < 2)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
  """Medusa: y_k ~ q_k = processed head-k distribution on f_{n-2}, for k = 1..γ (γ <= K).

  f_{n-2} predicts x_{n-1} (the pending token) through the target's own LM head, so head
  k, trained to predict x_{t+k+1} from f_t, drafts x_{n-1+k} = y_k. Each q_k depends on
  the committed history only (see `specjax.models.heads` for why the rule stays exact).
  """

  config: heads_lib.HeadConfig
  gamma: int
  sample_mode: str = "probabilistic"
  uses_features = True

  def __post_init__(self):
    _check(self.config, "medusa", self.gamma, self.sample_mode)
    if self.gamma > self.config.medusa_heads:
      raise ValueError(f"Medusa with {self.config.medusa_heads} heads drafts at most that "
                       f"many tokens (a tree at most that deep); got gamma={self.gamma}")

  def init(self, batch, size):
    return MedusaState(feature=jnp.zeros((batch, self.config.target.d_model), jnp.float32))

  def _take(self, features, index):
    idx = jnp.clip(index, 0, features.shape[1] - 1)[:, None, None]
    return jnp.take_along_axis(features, idx, axis=1)[:, 0].astype(jnp.float32)

  def prefill(self, params, state, tokens, n, features):
    return MedusaState(feature=jnp.where((n >= 2)[:, None], self._take(features, n - 2), 0.0))

  def propose(self, params, state, tokens, n, key, sampling):
    logits = heads_lib.medusa_apply(self.config, params, state.feature)
    history = getattr(sampling, "history", None)
    ys, qs = [], []
    for k, k_key in enumerate(jax.random.split(key, self.gamma)):
      # Only history-dependent processors (if any) make q_k depend on y_1..y_{k-1}.
      y, q = draw(self.sample_mode, k_key, logits[:, k], sampling, history)
      history = _advance(sampling, history, y)
      ys.append(y)
      qs.append(q)
    return jnp.stack(ys, axis=1), jnp.stack(qs, axis=1), state

  def rollback(self, state, n, features, start):
    index = n - 2 - start  # >= 0 whenever the row committed a token this round
    new = self._take(features, index)
    return MedusaState(feature=jnp.where((index >= 0)[:, None], new, state.feature))


def for_head(config: heads_lib.HeadConfig, gamma: int, sample_mode: str = "probabilistic"):
  """The drafter of a head with this config: an EAGLE (-1 or -3) or a Medusa drafter of
  γ tokens."""
  cls = MedusaDrafter if config.kind == "medusa" else EagleDrafter
  return cls(config, gamma, sample_mode)
