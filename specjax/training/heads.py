"""Training EAGLE / Medusa heads on a frozen target's features, computed on the fly.

  python -m experiments.train --config=configs/train.py:eagle --workdir=/work/runs/eagle

Each step takes windows x_0..x_T of the training stream, runs the frozen target once
(logits l_t and last hidden states f_t, no gradient) and trains only the head:

- EAGLE, slot t = 0..T-1: input (f_t, x_{t+1}); loss = feature_weight * smooth-L1(f̂_{t+1},
  f_{t+1}) + distill_weight * CE(p_{t+1}, q_t), where p_{t+1} = softmax(l_{t+1}) is the
  target's T = 1 distribution for x_{t+2} (soft cross-entropy: the gradient of KL(p||q)).
- Medusa, head k: input f_t; loss = Σ_k decay^(k-1) * CE(p_{t+k}, q_{k,t}).
- EAGLE-3, training-time test: `ttt_steps` unrolled steps (`heads.eagle3_unroll`), step
  k on the head's own step k-1 predictions; loss = Σ_k ttt_decay^k * CE(p̃_{t+k+1},
  q_{k,t}), p̃ = the target's p renormalised on the draft vocabulary (its `ttt_steps`
  most frequent training tokens). No feature regression.

AdamW with warm-up + cosine decay (`train.make_optimizer`); orbax checkpoints with exact
resume (the batch and the feature noise of step s depend only on (seed, s)); held-out
eval logs α̂ = mean Σ_x min(p, q) of the head's next-token q (EAGLE's slot t, Medusa's
head k at t) against the target's p, at T = 0 (argmax agreement) and T = 1.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models import heads as heads_lib
from specjax.models import model as model_lib
from specjax.processors import sampling
from specjax.training import data as data_lib
from specjax.training import lm as train_lib
from specjax.training import workdir as workdir_lib


def smooth_l1(x: jax.Array) -> jax.Array:
  """Huber with beta = 1 (EAGLE's regression loss), elementwise."""
  a = jnp.abs(x)
  return jnp.where(a < 1.0, 0.5 * x * x, a - 0.5)


def soft_cross_entropy(q_logits, p_logits) -> jax.Array:
  """-Σ_x p(x) log q(x) per position, p = softmax(p_logits) at temperature 1."""
  p = jax.nn.softmax(p_logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(p * jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1), axis=-1)


def head_outputs(hc, params, feats, tokens, target_logits, steps: int = 1):
  """Teacher-forced head outputs paired with the target's logits for the same token.

  feats [B, T+1, d], tokens int[B, T+1], target_logits [B, T+1, V] of one target pass.
  Returns a list over next-token positions (EAGLE: one; Medusa: K heads) of
  (q_logits [B, T', V], p_logits [B, T', V]) and EAGLE's (pred, true) features or None.
  EAGLE-3: one pair per unrolled step (`steps`), on the first T + 1 - steps slots.
  """
  if hc.kind == "eagle":
    pred, logits, _ = heads_lib.eagle_apply(hc, params, feats[:, :-1], tokens[:, 1:],
                                            target_features=True)
    return [(logits, target_logits[:, 1:])], (pred, feats[:, 1:])
  if hc.kind == "eagle3":
    t = feats.shape[1] - steps  # slots whose every unrolled step has a target to match
    logits = heads_lib.eagle3_unroll(hc, params, feats[:, :t], tokens, steps)
    return [(logits[k], target_logits[:, k + 1: k + 1 + t]) for k in range(steps)], None
  logits = heads_lib.medusa_apply(hc, params, feats)  # [B, T+1, K, V]
  t1 = feats.shape[1]
  return [(logits[:, : t1 - k, k - 1], target_logits[:, k:])
          for k in range(1, hc.medusa_heads + 1)], None


def draft_vocabulary(stream: np.ndarray, hc) -> np.ndarray:
  """EAGLE-3's draft vocabulary: the target ids of the `hc.vocab_size` tokens most
  frequent in `stream`, in id order (ties to the lower id)."""
  counts = np.bincount(np.asarray(stream, np.int64), minlength=hc.target.vocab_size)
  order = np.lexsort((np.arange(counts.size), -counts))
  return np.sort(order[: hc.vocab_size]).astype(np.int32)


def on_draft_vocab(p_logits, vocab):
  """The target's logits with tokens outside the draft vocabulary at OFF_VOCAB: their
  softmax is p renormalised on the vocabulary, the best a head limited to it can match."""
  keep = jnp.zeros(p_logits.shape[-1], bool).at[vocab].set(True)
  return jnp.where(keep, p_logits, heads_lib.OFF_VOCAB)


def make_head_train_step(hc, target_graphdef, optimizer, feature_weight: float = 1.0,
                         distill_weight: float = 1.0, medusa_decay: float = 0.8,
                         feature_noise: float = 0.0, seed: int = 0, fixed=None,
                         ttt_steps: int = 1, ttt_decay: float = 0.8):
  """A jitted `step(params, opt_state, tokens[B, T+1], target_params, step)`.

  Only the head's own params are trained; the target's embedding / norm / LM head are
  read from `target_params` and get no gradient, as do `fixed` params (EAGLE-3's
  vocabulary map).
  """
  fixed = dict(fixed or {})
  decay = ttt_decay if hc.kind == "eagle3" else medusa_decay

  def loss_fn(params, shared, feats, tokens, target_logits, key):
    if feature_noise > 0:  # EAGLE's input augmentation: drafting feeds noisy features
      noise = jax.random.uniform(key, feats.shape, feats.dtype, -feature_noise, feature_noise)
      feats_in = feats + noise
    else:
      feats_in = feats
    pairs, regress = head_outputs(hc, {**params, **fixed, **shared}, feats_in, tokens,
                                  target_logits, ttt_steps)
    metrics, loss = {}, 0.0
    for k, (q_logits, p_logits) in enumerate(pairs):
      if hc.draft_vocab is not None:
        p_logits = on_draft_vocab(p_logits, fixed["vocab"])
      ce = jnp.mean(soft_cross_entropy(q_logits, p_logits))
      loss = loss + distill_weight * decay ** k * ce
      metrics["distill_ce" if k == 0 else f"distill_ce_{k + 1}"] = ce
    if regress is not None:
      pred, _ = regress  # regress onto the clean features, not the noisy inputs
      reg = jnp.mean(smooth_l1(pred - feats[:, 1:]))
      metrics["feature_l1"] = reg
      loss = loss + feature_weight * reg
    q_logits, p_logits = pairs[0]
    metrics["agree"] = jnp.mean(jnp.argmax(q_logits, -1) == jnp.argmax(p_logits, -1))
    metrics["loss"] = loss
    return loss, metrics

  @jax.jit
  def step(params, opt_state, tokens, target_params, step_index):
    target_logits, feats = jax.lax.stop_gradient(
        model_lib.forward(target_graphdef, target_params, tokens, hidden=hc.hidden))
    feats = feats.astype(jnp.float32)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step_index)
    grads, metrics = jax.grad(loss_fn, has_aux=True)(
        params, heads_lib.shared_params(target_params, hc.kind), feats, tokens, target_logits,
        key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = train_lib.tree_norm(grads)
    return params, opt_state, metrics

  return step


@functools.partial(jax.jit, static_argnums=(0, 1))
def _alpha_batch(hc, target_graphdef, target_params, params, tokens):
  target_logits, feats = model_lib.forward(target_graphdef, target_params, tokens,
                                           hidden=hc.hidden)
  pairs, _ = head_outputs(hc, {**params, **heads_lib.shared_params(target_params, hc.kind)},
                          feats.astype(jnp.float32), tokens, target_logits)
  return [{k: v.sum() for k, v in sampling.agreement(q, p).items()} | {"n": jnp.asarray(q.shape[0] * q.shape[1])}
          for q, p in pairs]


def acceptance_rate(hc, target, params, windows: np.ndarray, batch_size: int = 8) -> dict:
  """α̂ at T = 0 / T = 1 of the head's next-token q vs the target's p on `windows`.

  EAGLE: 'alpha_t0', 'alpha_t1' for x_{t+2} from slot t (input f_t, x_{t+1}). Medusa:
  the same names for head 1 (x_{t+2} from f_t) and 'alpha_t0_k' / 'alpha_t1_k' for
  head k. 'positions' counts the first pair's positions.
  """
  windows = np.asarray(windows, np.int32)
  totals = None
  for i in range(0, len(windows), batch_size):
    res = jax.device_get(_alpha_batch(hc, target.graphdef, target.params, params,
                                      jnp.asarray(windows[i: i + batch_size])))
    res = [{k: float(v) for k, v in r.items()} for r in res]
    totals = res if totals is None else [{k: a[k] + b[k] for k in a} for a, b in zip(totals, res)]
  out = {"positions": int(totals[0]["n"])}
  for k, tot in enumerate(totals, start=1):
    suffix = "" if k == 1 else f"_{k}"
    out[f"alpha_t0{suffix}"] = tot["alpha_t0"] / tot["n"]
    out[f"alpha_t1{suffix}"] = tot["alpha_t1"] / tot["n"]
  return out


def head_config_from(config, target) -> heads_lib.HeadConfig:
  eagle3 = config.head == "eagle3"
  layers = config.get("feature_layers") if eagle3 else None
  return heads_lib.HeadConfig(kind=config.head, target=target.config,
                              medusa_heads=int(config.get("medusa_heads", 4)),
                              feature_layers=tuple(layers) if layers else None,
                              draft_vocab=(config.get("draft_vocab") or None) if eagle3 else None)


def validate(config) -> None:
  """`lm.validate` and the head's own fields: ValueError naming the field."""
  train_lib.validate(config)
  if config.head not in heads_lib.KINDS:
    raise ValueError(f"config.head must be one of {heads_lib.KINDS}, got {config.head!r}")
  if not config.teacher:
    raise ValueError("config.teacher must name the target the head drafts for")
  heads = config.get("medusa_heads", 4)
  if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
    raise ValueError(f"config.medusa_heads must be an int >= 1, got {heads!r}")
  steps = config.get("ttt_steps", 1)
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise ValueError(f"config.ttt_steps must be an int >= 1, got {steps!r}")
  if steps >= config.seq_len:
    raise ValueError(f"config.ttt_steps ({steps}) must be below config.seq_len ({config.seq_len})")
  for field in ("feature_weight", "distill_weight", "medusa_decay", "feature_noise",
                "ttt_decay"):
    value = config.get(field, 0.0)
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
        or not math.isfinite(value) or value < 0):
      raise ValueError(f"config.{field} must be a finite number >= 0, got {value!r}")


def train(config, workdir: str | os.PathLike) -> heads_lib.Head:
  """Runs (or resumes) a head job: data from `config.corpus`, target `config.teacher`."""
  validate(config)
  target = train_lib.load_teacher(config.teacher, config.seq_len + 1)
  if target.tokenizer is None:
    raise ValueError(f"target {config.teacher!r} has no tokenizer")
  corpus = data_lib.load_corpus(config.corpus, config.heldout_fraction)
  workdir_lib.check_export_dir(config, workdir, "head", heads_lib.MANIFEST)
  workdir = workdir_lib.start_workdir(workdir, config)
  train_stream, heldout_stream = train_lib.token_streams(
      workdir, corpus, target.tokenizer, config.seq_len + 1, save_tokenizer=True)
  return run(config, workdir, target, train_stream, heldout_stream)


def run(config, workdir: Path, target, train_stream, heldout_stream) -> heads_lib.Head:
  """The training loop proper, on given token streams (tests call it directly)."""
  import orbax.checkpoint as ocp

  workdir = Path(workdir)
  hc = head_config_from(config, target)
  if config.seq_len + 1 > target.config.max_len:
    raise ValueError(f"seq_len + 1 = {config.seq_len + 1} exceeds the target's max_len")
  eval_windows = data_lib.eval_windows(heldout_stream, config.seq_len, config.eval_windows)
  params = heads_lib.init_params(hc, config.seed)
  fixed = {}
  if hc.kind == "eagle3":
    fixed["vocab"] = jnp.asarray(draft_vocabulary(train_stream, hc))
    params = heads_lib.trainable(params)
  optimizer = train_lib.make_optimizer(config.lr, config.warmup_steps, config.steps,
                                       config.weight_decay, config.grad_clip, config.b1,
                                       config.b2, config.end_lr_fraction)
  opt_state = optimizer.init(params)
  step_fn = make_head_train_step(
      hc, target.graphdef, optimizer, config.get("feature_weight", 1.0),
      config.get("distill_weight", 1.0), config.get("medusa_decay", 0.8),
      config.get("feature_noise", 0.0), config.seed, fixed, config.get("ttt_steps", 1),
      config.get("ttt_decay", 0.8))

  manager = ocp.CheckpointManager(workdir / "checkpoints",
                                  options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  state = {"params": params, "opt_state": opt_state, "elapsed_s": np.zeros((), np.float64)}
  start_step = 0
  if manager.latest_step() is not None:
    start_step = manager.latest_step()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(start_step, args=ocp.args.StandardRestore(abstract))
    workdir_lib.log_line(f"resumed from {workdir / 'checkpoints'} at step {start_step}")
  params, opt_state, elapsed = state["params"], state["opt_state"], float(state["elapsed_s"])
  metrics_log = workdir_lib.MetricsLog(workdir / "metrics.jsonl", start_step)
  tokens_per_step = config.batch_size * config.seq_len
  workdir_lib.log_line(f"{hc.kind} head, {model_lib.count_params(params):,} own params on "
                 f"target {config.teacher}; {len(train_stream):,} train tokens; "
                 f"{tokens_per_step} tokens/step, {config.steps} steps")

  def run_eval(step):
    rates = acceptance_rate(hc, target, {**params, **fixed}, eval_windows,
                            config.eval_batch_size)
    metrics_log.write({"step": step, "elapsed_s": elapsed,
                       **{f"eval/{k}": v for k, v in rates.items()}})
    workdir_lib.log_line(f"step {step:6d}  eval alpha T=0 {rates['alpha_t0']:.4f}  "
                   f"T=1 {rates['alpha_t1']:.4f}")
    return rates

  run_t0, elapsed0 = time.time(), elapsed
  window_t0, window_steps = time.time(), 0
  for step in range(start_step, config.steps):
    tokens = jnp.asarray(data_lib.batch_at(train_stream, step, config.batch_size,
                                           config.seq_len, config.seed))
    params, opt_state, metrics = step_fn(params, opt_state, tokens, target.params,
                                         jnp.asarray(step, jnp.int32))
    done, window_steps = step + 1, window_steps + 1
    elapsed = elapsed0 + time.time() - run_t0
    if done % config.log_every == 0 or done == config.steps:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      rate = window_steps * tokens_per_step / max(time.time() - window_t0, 1e-9)
      metrics_log.write({"step": done, "lr": train_lib.optimizer_lr(config, done),
                         "tokens_per_s": rate, "elapsed_s": elapsed,
                         **{f"train/{k}": v for k, v in metrics.items()}})
      extra = f"  feat {metrics['feature_l1']:.4f}" if "feature_l1" in metrics else ""
      workdir_lib.log_line(f"step {done:6d}/{config.steps}  loss {metrics['loss']:.4f}  ce "
                     f"{metrics['distill_ce']:.4f}{extra}  agree {metrics['agree']:.3f}  "
                     f"{rate:,.0f} tok/s  {elapsed / 60:.1f} min")
      window_t0, window_steps = time.time(), 0
    if done % config.eval_every == 0 or done == config.steps:
      final = run_eval(done)
      window_t0, window_steps = time.time(), 0
    if done % config.checkpoint_every == 0 or done == config.steps:
      elapsed = elapsed0 + time.time() - run_t0
      manager.save(done, args=ocp.args.StandardSave(
          {"params": params, "opt_state": opt_state, "elapsed_s": np.asarray(elapsed)}))
      window_t0, window_steps = time.time(), 0
  manager.wait_until_finished()
  manager.close()
  if start_step >= config.steps:
    final = run_eval(config.steps)

  meta = {"train_steps": config.steps, "train_tokens": config.steps * tokens_per_step,
          "train_wall_s": round(elapsed, 1), "target": config.teacher, "corpus": config.corpus,
          "heldout_alpha": {k: v for k, v in final.items()}, "workdir": str(workdir)}
  if fixed:
    meta["draft_vocab_mass"] = float(
        np.isin(train_stream, np.asarray(fixed["vocab"])).mean())
  head = heads_lib.Head(hc, {**params, **fixed},
                        heads_lib.target_fingerprint(target.config, target.params), meta)
  export_dir = Path(config.export_dir) if config.export_dir else workdir / "head"
  heads_lib.save_head(export_dir, head,
                      dtype=jnp.dtype(config.export_dtype) if config.export_dtype else None)
  workdir_lib.log_line(f"exported to {export_dir}: {json.dumps(meta)}")
  return head
