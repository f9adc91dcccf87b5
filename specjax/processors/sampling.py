"""Logits processing shared by every sampler: temperature, top-k, top-p, greedy.

`process_logits` returns the normalised distribution that is actually sampled from.
The draft and the target both go through it, so the p and q that verification compares
are exactly the distributions the tokens were drawn from. The parameters are traced
arrays (broadcast against the leading axes of the logits), so one compiled function
serves a whole temperature / top-p sweep. Temperature 0 is exact greedy: a one-hot at
the first argmax of the raw logits, not a small temperature.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import backends
from specjax.processors import history as processors


@dataclasses.dataclass(frozen=True)
class Paths:
  """What the host knows of a batch's settings, so the traced program holds only the path
  that runs: a conditional in a decode loop brings its predicate to the host every
  round on XLA:GPU. None: not known (a `lax.cond` decides, as for any traced values).

  greedy: every row at temperature 0 (True), none (False), or some of them (None).
  filters: some row has top-k > 0 or top-p < 1.
  deep_top_k: some row's top-k lies past the sorted head the filter looks in first.
  nucleus: some row has top-p < 1 (without, the top-p cut and its conditional go).
  A temperature sweep compiles one program per path: T = 0, T > 0, T > 0 with filters.
  """
  greedy: bool | None = None
  filters: bool | None = None
  deep_top_k: bool | None = None
  nucleus: bool | None = None

  @classmethod
  def of(cls, temperature, top_k, top_p, adjusts: bool = False) -> "Paths":
    """adjusts: history-dependent processors change the logits. Then only an all-greedy
    batch is claimed: with penalties up to 1e30 in the logits, the sampled path compiled
    without its conditionals gave NaN rows on XLA:CPU (its cause not found; the same
    logits processed alone do not), so it stays as traced as before."""
    t, k, p = (np.asarray(x) for x in (temperature, top_k, top_p))
    greedy = True if np.all(t <= 0) else (False if np.all(t > 0) else None)
    if greedy:  # a one-hot argmax: no filter runs
      return cls(greedy=True, filters=False, deep_top_k=False, nucleus=False)
    if adjusts:
      return cls()
    return cls(greedy=greedy, filters=bool(np.any(k > 0) or np.any(p < 1)),
               deep_top_k=bool(np.any(k > _HEAD)), nucleus=bool(np.any(p < 1)))


@flax.struct.dataclass
class Sampling:
  """Traced per-row sampling settings: one compile serves every value.

  Built by `Sampling.create` (or `specjax.generation.prepare`), the one place that fills
  the defaults. `procs`/`pcfg` are the history-dependent processors (`history.py`);
  `history` is attached by the engine each round: the committed prefix of every row.
  """
  temperature: jax.Array  # float32[B]; 0 = greedy
  top_k: jax.Array  # int32[B]; 0 = off
  top_p: jax.Array  # float32[B]; 1 = off
  max_new: jax.Array  # int32[B]
  stop_seqs: jax.Array  # int32[K, L] stop sequences, right-aligned; EOS ids are length 1
  stop_lens: jax.Array  # int32[K]; a length-0 row never matches
  procs: Any = None  # processors.ProcessorSettings, or None when none are on
  history: Any = None  # processors.History of the committed prefix, set each round
  pcfg: processors.ProcessorConfig = flax.struct.field(
      pytree_node=False, default=processors.ProcessorConfig())
  paths: Paths = flax.struct.field(pytree_node=False, default=Paths())

  @classmethod
  def create(cls, batch: int, temperature=1.0, top_k=0, top_p=1.0, max_new=0,
             stop_seqs=None, stop_lens=None, procs=None,
             pcfg: processors.ProcessorConfig | None = None, repeat: int = 1) -> "Sampling":
    """Scalars or [batch] values; no stop table means none (one length-0 row). repeat=n:
    each row n times over, adjacent (the rows of `n` samples a prompt)."""
    # Built in numpy and moved in one transfer: an eager jnp op per field costs a dispatch each.
    row = lambda x, dtype: np.broadcast_to(np.asarray(x, dtype), (batch,))
    if stop_seqs is None:
      stop_seqs, stop_lens = np.zeros((1, 1), np.int32), np.zeros((1,), np.int32)
    pcfg = pcfg or processors.ProcessorConfig()
    host = cls(
        temperature=row(temperature, np.float32), top_k=row(top_k, np.int32),
        top_p=row(top_p, np.float32), max_new=row(max_new, np.int32),
        stop_seqs=np.asarray(stop_seqs, np.int32), stop_lens=np.asarray(stop_lens, np.int32),
        procs=procs if pcfg.active else None, pcfg=pcfg,
        paths=Paths.of(temperature, top_k, top_p, pcfg.adjusts))
    if repeat > 1:
      host = map_rows(host, lambda x: np.repeat(np.asarray(x), repeat, 0))
    # Calls with the same settings share their device arrays (immutable): the transfer
    # was a large share of a `generate` call's host work.
    leaves, treedef = jax.tree_util.tree_flatten(host)
    leaves = [np.asarray(x) for x in leaves]
    key = (treedef, tuple((x.dtype.str, x.shape, x.tobytes()) for x in leaves))
    cached = _ON_DEVICE.pop(key, None)
    if cached is None:
      cached = jax.device_put(host)
    _ON_DEVICE[key] = cached  # the most recent last
    while len(_ON_DEVICE) > 8:
      _ON_DEVICE.pop(next(iter(_ON_DEVICE)))
    return cached

  @property
  def has_processors(self) -> bool:
    return self.pcfg.active

  def adjust(self, logits: jax.Array, history=None, banned=None) -> jax.Array:
    """Raw logits [B, V] -> logits after the history-dependent processors (`banned`:
    `processors.banned` of `history`, where the caller has it already)."""
    if history is None or not self.pcfg.active:
      return logits
    return processors.apply(self.pcfg, self.procs, logits, history, banned)

  def process(self, logits: jax.Array, history=None, banned=None) -> jax.Array:
    """logits [B, ..., V] -> the distributions sampled from (processors need [B, V])."""
    return process_logits(self.adjust(logits, history, banned), self.temperature,
                          self.top_k, self.top_p, self.paths)

  def advance(self, history, token):
    """The history after appending token int32[B] (None stays None)."""
    if history is None or not self.pcfg.active:
      return history
    return processors.advance(self.pcfg, self.procs, history, token)


_ON_DEVICE: dict = {}  # `Sampling.create`'s settings -> their Sampling on the device

# The per-row fields of a Sampling and of its processors' settings (the rest is shared).
SAMPLING_ROWS = ("temperature", "top_k", "top_p", "max_new")
PROCESSOR_ROWS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                  "no_repeat_ngram", "min_new", "logit_bias")


def map_rows(sampling: Sampling, fn) -> Sampling:
  """`sampling` with fn applied to every per-row field (the rest as it is)."""
  rows = lambda obj, fields: obj.replace(**{f: fn(getattr(obj, f)) for f in fields})
  out = rows(sampling, SAMPLING_ROWS)
  if sampling.procs is not None:
    out = out.replace(procs=rows(sampling.procs, PROCESSOR_ROWS))
  return out


def _param(x, lead_shape, dtype):
  x = jnp.asarray(x, dtype)
  return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(lead_shape) - x.ndim)), lead_shape)


def argmax(logits: jax.Array) -> jax.Array:
  """jnp.argmax(logits, axis=-1) (the first maximum; the first NaN if there is one), as
  the backend being traced computes it (`backends.current().argmax`: on a CPU one kernel
  call, or two reductions XLA:CPU vectorises)."""
  return backends.current().argmax(logits)


def process_logits(logits: jax.Array, temperature, top_k, top_p,
                   paths: Paths = Paths()) -> jax.Array:
  """logits [..., V] -> probabilities [..., V] (float32) after all processing.

  temperature/top_k/top_p are scalars or arrays whose shape is a prefix of the leading
  axes of `logits` (e.g. per-row [B] for logits [B, T, V]). top_k = 0 and top_p = 1
  disable the filters. `paths`: what is known of them on the host (`Paths`).
  """
  logits = logits.astype(jnp.float32)
  lead, vocab = logits.shape[:-1], logits.shape[-1]
  temperature = _param(temperature, lead, jnp.float32)[..., None]
  top_k = _param(top_k, lead, jnp.int32)[..., None]
  top_p = _param(top_p, lead, jnp.float32)[..., None]

  greedy = temperature <= 0.0
  one_hot = lambda: jax.nn.one_hot(argmax(logits), vocab, dtype=jnp.float32)
  if paths.greedy:  # an all-greedy batch (every T = 0 sweep point): no softmax or filters
    return one_hot()

  def filtered(scaled):
    if paths.filters is None:
      return jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1.0),
                          _filter_top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)
    return _filter_top_k_top_p(scaled, top_k, top_p, paths) if paths.filters else scaled

  def processed():
    # Shifting by the max first keeps tiny temperatures from overflowing to inf - inf.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    probs = jax.nn.softmax(filtered(shifted / jnp.where(greedy, 1.0, temperature)), axis=-1)
    return probs if paths.greedy is False else jnp.where(greedy, one_hot(), probs)

  if paths.greedy is None and paths.filters is None:  # nothing known: decided when run
    return jax.lax.cond(jnp.all(greedy), one_hot, processed)
  return processed()


def pick_by_paths(sampling: Sampling, greedy, sampled):
  """greedy() where the host knows every row is at temperature 0, else sampled(), which
  gives a greedy row the same token and q (a draw from a one-hot is its token): no
  conditional in the loop for a mixed batch."""
  return greedy() if sampling.paths.greedy else sampled()


def agreement(q_logits: jax.Array, p_logits: jax.Array) -> dict[str, jax.Array]:
  """Σ_x min(p(x), q(x)) per position of the processed q and p, at temperature 0
  ('alpha_t0') and 1 ('alpha_t1'): the acceptance probability of one draft token."""
  out = {}
  for name, temperature in (("alpha_t0", 0.0), ("alpha_t1", 1.0)):
    p = process_logits(p_logits, temperature, 0, 1.0)
    q = process_logits(q_logits, temperature, 0, 1.0)
    out[name] = jnp.minimum(p, q).sum(-1)
  return out


# Sorting the whole vocabulary is slow on XLA:CPU. The cut almost
# always lies among the largest few logits, so it is found there with `lax.top_k`; rows
# whose cut lies deeper fall back to an exact bisection over the float bit patterns.
_HEAD = 64


def _filter_top_k_top_p(scaled, top_k, top_p, paths: Paths = Paths()):
  """Sets logits outside the top-k / top-p support to -inf (ties at a cut are kept).

  top-k keeps logits >= the k-th largest; top-p then keeps the smallest head of the
  top-k distribution whose mass reaches p.
  """
  vocab = scaled.shape[-1]
  head = min(_HEAD, vocab)
  head_vals = jax.lax.top_k(scaled, head)[0]  # sorted descending

  k_in_head = (top_k <= head)
  kth = jnp.take_along_axis(head_vals, jnp.clip(top_k - 1, 0, head - 1), axis=-1)
  deep_k = lambda: jnp.where(
      k_in_head, kth, _largest_cut(scaled, jnp.ones_like(scaled), top_k.astype(jnp.float32)))
  if paths.deep_top_k is None:
    kth = jax.lax.cond(jnp.all(k_in_head | (top_k <= 0)), lambda: kth, deep_k)
  elif paths.deep_top_k:
    kth = deep_k()
  kth = jnp.where(top_k > 0, kth, -jnp.inf)
  if paths.nucleus is False:  # every top_p = 1: the cut is top-k's
    return jnp.where(scaled >= kth, scaled, -jnp.inf)
  # Where the top-p cut lies depends on the logits: it stays a conditional (a bisection
  # over the vocabulary is too dear to run every step), in programs with top-p only.

  kept = jnp.where(scaled >= kth, scaled, -jnp.inf)
  lse = jax.scipy.special.logsumexp(kept, axis=-1, keepdims=True)
  head_probs = jnp.where(head_vals >= kth, jnp.exp(head_vals - lse), 0.0)
  mass_before = jnp.cumsum(head_probs, axis=-1) - head_probs
  n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
  pth = jnp.take_along_axis(head_vals, n_keep - 1, axis=-1)
  p_in_head = jnp.sum(head_probs, axis=-1, keepdims=True) >= top_p
  pth = jax.lax.cond(jnp.all(p_in_head | (top_p >= 1.0)), lambda: pth, lambda: jnp.where(
      p_in_head, pth, _largest_cut(kept, jnp.exp(kept - lse), top_p)))
  cut = jnp.maximum(kth, jnp.where(top_p < 1.0, pth, -jnp.inf))
  return jnp.where(scaled >= cut, scaled, -jnp.inf)


def _ordered_bits(x):
  """float32 -> int32 with the same order (negative floats have their magnitude flipped)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _largest_cut(values, weights, target):
  """The largest value t with Σ_{values >= t} weights >= target, exactly.

  Bisection over the 2^32 ordered bit patterns: 32 masked sums instead of a sort.
  """
  keys = _ordered_bits(values)
  lo = jnp.min(keys, axis=-1, keepdims=True)
  hi = jnp.max(keys, axis=-1, keepdims=True) + 1  # never satisfies the target

  def body(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # overflow-free midpoint
    ok = jnp.sum(jnp.where(keys >= mid, weights, 0.0), axis=-1, keepdims=True) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
  # lo is the key of an actual value: return that value.
  return jnp.max(jnp.where(keys <= lo, values, -jnp.inf), axis=-1, keepdims=True)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one index per distribution along the last axis (zero-probability entries never).

  Gumbel-max with one noise value per token: exact to float32 rounding for every token.
  (An inverse CDF with one uniform is ~8x cheaper on XLA:CPU but quantises every
  probability to the uniform's 2^-23 grid: a total-variation error of ~1e-3 at a
  50k-token vocabulary, which would break the lossless guarantee.)
  """
  # jax.random.categorical's own construction, with `argmax` for its scalar-loop argmax.
  logits = jnp.log(probs)
  return argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits).astype(jnp.int32)
