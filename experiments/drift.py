"""Total-variation drift of a verify rule's output law from the target's: the estimators.

Used by `experiments.audit` (the app) and the tests. A law here is the joint law of the
first L generated tokens after one prompt.

- `exact_law` / `continuation_probs`: the target's probabilities by teacher forcing, with
  the sampler's own logits processing;
- `tv_enumerated`: TV between an empirical law and an enumerated one (small vocabularies);
- `tv_observed`: the same TV when the target law can only be asked pointwise: it is
  Σ_x max(0, P̂(x) − P(x)) over the observed x;
- `multinomial_floor`: what either estimate reads for a sample of the target law itself.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import specjax
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.processors.sampling import process_logits


# ----------------------------------------------------------------------------
# Target laws by teacher forcing.


def continuation_probs(model, prompt, conts, temperature, top_k=0, top_p=1.0,
                       chunk: int = 512) -> np.ndarray:
  """float64 P(conts[j] | prompt) under the target's processed law, by teacher forcing.

  conts: int[M, L]. The prompt is fed once into a KV cache; each chunk of continuations
  then takes one cached pass over conts[:, :-1] from a copy of that cache (17x less work
  than re-reading a 32-token prompt per row). Every distribution goes through
  `process_logits` with the sampler's own settings. Chunks are padded to one shape. The
  tests check the result against an uncached teacher-forced oracle.
  """
  conts = np.asarray(conts, np.int32)
  m, length = conts.shape
  graphdef, params = model.graphdef, model.params
  kv = kv_cache.init_kv(model.config, 1, len(prompt) + length)
  logits, kv = model_lib.forward_cached_jit(graphdef, params,
                                            jnp.asarray([list(prompt)], jnp.int32), kv,
                                            empty=True)
  first = process_logits(logits[:, -1:], temperature, top_k, top_p)  # [1, 1, V]
  chunk = min(chunk, m)
  kv = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (chunk,) + x.shape[1:]), kv)
  out = np.empty((m,), np.float64)
  for lo in range(0, m, chunk):
    block = conts[lo:lo + chunk]
    n = len(block)
    if n < chunk:
      block = np.concatenate([block, np.repeat(block[:1], chunk - n, axis=0)])
    probs = jnp.broadcast_to(first, (chunk, 1, first.shape[-1]))
    if length > 1:
      rest, _ = model_lib.forward_cached_jit(graphdef, params, jnp.asarray(block[:, :-1]), kv)
      probs = jnp.concatenate([probs, process_logits(rest, temperature, top_k, top_p)], axis=1)
    picked = np.take_along_axis(np.asarray(probs, np.float64)[:n], block[:n, :, None],
                                axis=-1)[..., 0]
    out[lo:lo + n] = np.prod(picked, axis=1)
  return out


def exact_law(model, prompt, length: int, temperature: float):
  """Every continuation of `length` tokens (vocab^length rows) and its target probability."""
  vocab = model.config.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=length)), np.int32)
  return conts, continuation_probs(model, prompt, conts, temperature)


# ----------------------------------------------------------------------------
# Distances and their noise floor.


def tv_enumerated(samples, probs, vocab: int) -> float:
  """TV between the empirical law of samples int[N, L] and an enumerated law over V^L."""
  samples = np.asarray(samples)
  index = np.ravel_multi_index(samples.T, (vocab,) * samples.shape[1])
  freq = np.bincount(index, minlength=len(probs)) / len(samples)
  return float(0.5 * np.abs(freq - probs).sum())


def tv_observed(samples, prob_fn) -> float:
  """TV between the empirical law of samples and a law P known pointwise.

  TV = Σ_x max(0, P̂(x) − P(x)); only observed x have P̂(x) > 0, so `prob_fn` (int[M, L]
  -> float64[M]) is asked about the distinct samples only.
  """
  unique, counts = np.unique(np.asarray(samples), axis=0, return_counts=True)
  return float(np.sum(np.maximum(counts / len(samples) - prob_fn(unique), 0.0)))


def multinomial_floor(probs, samples: int, reps: int, seed: int = 0) -> np.ndarray:
  """TVs of `reps` empirical laws of `samples` draws from `probs` itself."""
  rng = np.random.default_rng(seed)
  probs = np.asarray(probs, np.float64)
  probs = probs / probs.sum()
  return np.array([0.5 * np.abs(rng.multinomial(samples, probs) / samples - probs).sum()
                   for _ in range(reps)])


def floor_summary(floors) -> dict:
  floors = np.asarray(floors, np.float64)
  return {"floor_mean": float(floors.mean()),
          "floor_sd": float(floors.std(ddof=1)) if len(floors) > 1 else float("nan"),
          "floor_q99": float(np.quantile(floors, 0.99))}


def with_excess(row: dict) -> dict:
  """Adds the excess over the floor and its z score; `at_floor` for z <= 4."""
  excess = row["tv"] - row["floor_mean"]
  z = excess / row["floor_sd"] if row["floor_sd"] > 0 else float("nan")
  return dict(row, excess=excess, z=z, at_floor=bool(z <= 4.0))


# ----------------------------------------------------------------------------
# Sampling the rules.


def sample_rows(target, draft, prompt, rows: int, length: int, temperature: float,
                gamma: int, rule: str | None, params, seed: int, chunk: int):
  """int[rows, length] first tokens from `rows` copies of `prompt`, in equal chunks.

  rule=None decodes target-only (a sample of the target law itself). Returns the samples
  and the generate stats merged over the chunks.
  """
  chunk = min(chunk, rows)
  kw = dict(max_new_tokens=length, temperature=temperature, eos_id=None)
  if rule is not None:
    kw.update(draft=draft, gamma=gamma, verify_rule=rule, rule_params=params)
  out, stats = [], []
  for i, lo in enumerate(range(0, rows, chunk)):
    res = specjax.generate(target, [list(prompt)] * chunk, seed=seed + i, **kw)
    out.extend(res.tokens[:rows - lo])
    stats.append(res.stats)
  return np.array(out, np.int32), common.merge_stats(stats)


def random_pair(vocab: int = 8, sharpness: float = 4.0):
  """A tiny random target (2 layers) and draft (1 layer) that disagree often.

  Scaling the embeddings makes the next-token laws peaked and context-dependent, as in
  the tests' `tiny_model`.
  """
  def build(d_model, n_layers, seed):
    model = specjax.init_model(specjax.ModelConfig(vocab_size=vocab, d_model=d_model,
                                                   n_layers=n_layers, n_heads=2, max_len=64),
                               seed=seed)
    params = jax.tree_util.tree_map(lambda x: x, model.params)
    params["embed"]["embedding"] = params["embed"]["embedding"] * sharpness
    return model.with_params(params)
  return build(32, 2, 0), build(16, 1, 1)
