"""Training: next-token loss (optionally distilled from a teacher), optax, orbax, eval.

`train(config, workdir)` runs a whole job from an ml_collections config (see
`configs/train.py`). The pieces are usable alone from a notebook:

  optimizer = make_optimizer(lr=1e-3, warmup_steps=100, total_steps=1000)
  step = make_train_step(graphdef, optimizer)
  params, opt_state, metrics = step(params, opt_state, tokens)  # tokens int[B, T+1]

Resume is exact: the optimizer state lives in the orbax checkpoint and the batch of
step s depends only on (seed, s), so 2 + 2 steps with a restart in between produce the
same parameters as 4 straight steps.

Distillation (DistillSpec) trains the draft on the teacher's full next-token
distribution at temperature 1 instead of (or mixed with) the one-hot data token. The
acceptance rate of speculative decoding is 1 - TVD(p, q), so matching p is exactly
what the draft is for: `distill='tvd'` minimises that distance itself, `'fkl'`
(forward KL, KL(p || q)) is its smooth upper bound and trains faster.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models import checkpoint as checkpoint_lib
from specjax.models import model as model_lib
from specjax.models.config import ModelConfig
from specjax.models.tokenizer import Tokenizer
from specjax.processors import sampling
from specjax.training import data as data_lib
from specjax.training.workdir import MetricsLog, check_export_dir, log_line, start_workdir

DISTILL_KINDS = ("fkl", "rkl", "tvd")
# optax renamed global_norm; take the new name where it exists.
tree_norm = getattr(optax.tree_utils, "tree_norm", None) or optax.global_norm


# ----------------------------------------------------------------------------------
# Losses.


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-position next-token loss in nats: float[B, T, V], int[B, T] -> float[B, T]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def distill_loss(student_logits: jax.Array, teacher_logits: jax.Array, kind: str) -> jax.Array:
  """Per-position divergence of the student q from the teacher p at temperature 1."""
  logq = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  logp = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
  p, q = jnp.exp(logp), jnp.exp(logq)
  if kind == "fkl":  # KL(p || q)
    return jnp.sum(p * (logp - logq), axis=-1)
  if kind == "rkl":  # KL(q || p)
    return jnp.sum(q * (logq - logp), axis=-1)
  if kind == "tvd":  # 1 - acceptance rate
    return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
  raise ValueError(f"distill kind must be one of {DISTILL_KINDS}, got {kind!r}")


# ----------------------------------------------------------------------------------
# Optimizer and step.


def make_optimizer(lr: float, warmup_steps: int, total_steps: int, weight_decay: float = 0.1,
                   grad_clip: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                   end_lr_fraction: float = 0.1) -> optax.GradientTransformation:
  """AdamW on a linear warm-up + cosine decay schedule, after global-norm clipping.

  Weight decay applies to matrices only, not to norm scales and biases.
  """
  if total_steps < 1 or not 0 <= warmup_steps < total_steps:
    raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup_steps, decay_steps=total_steps,
      end_value=lr * end_lr_fraction)
  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(grad_clip),
      optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))


def make_train_step(graphdef, optimizer: optax.GradientTransformation, teacher_graphdef=None,
                    distill: str | None = None, distill_weight: float = 1.0) -> Callable:
  """A jitted `step(params, opt_state, tokens[B, T+1], teacher_params=None)`.

  Returns (params, opt_state, metrics). With `distill`, the loss is
  (1 - distill_weight) * cross-entropy + distill_weight * divergence from the teacher,
  whose logits are computed in the same step (no stored soft labels).
  """
  if distill is not None and distill not in DISTILL_KINDS:
    raise ValueError(f"distill must be None or one of {DISTILL_KINDS}, got {distill!r}")
  if distill is not None and teacher_graphdef is None:
    raise ValueError("distillation needs a teacher_graphdef")
  if not 0.0 <= distill_weight <= 1.0:
    raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")

  def loss_fn(params, inputs, targets, teacher_logits):
    logits = model_lib.forward(graphdef, params, inputs)
    ce = jnp.mean(cross_entropy(logits, targets))
    metrics = {"loss": ce}
    if teacher_logits is None:
      return ce, metrics
    div = jnp.mean(distill_loss(logits, teacher_logits, distill))
    metrics["distill"] = div
    return (1.0 - distill_weight) * ce + distill_weight * div, metrics

  @jax.jit
  def step(params, opt_state, tokens, teacher_params=None):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    teacher_logits = None
    if distill is not None:
      teacher_logits = jax.lax.stop_gradient(
          model_lib.forward(teacher_graphdef, teacher_params, inputs))
    grads, metrics = jax.grad(loss_fn, has_aux=True)(params, inputs, targets, teacher_logits)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = tree_norm(grads)
    return params, opt_state, metrics

  return step


# ----------------------------------------------------------------------------------
# Evaluation.


@functools.partial(jax.jit, static_argnums=0)
def eval_batch(graphdef, params, tokens):
  logits = model_lib.forward(graphdef, params, tokens[:, :-1])
  return cross_entropy(logits, tokens[:, 1:])


def evaluate(graphdef, params, windows: np.ndarray, byte_lengths: np.ndarray | None = None,
             batch_size: int = 8) -> dict[str, float]:
  """Held-out loss (nats/token) and bits per byte over `windows` int[N, T+1].

  Bits per byte divides the total loss by the bytes the predicted tokens stand for, so
  it compares models with different tokenizers; end-of-text tokens count zero bytes.
  """
  windows = np.asarray(windows, np.int32)
  if windows.ndim != 2 or windows.shape[1] < 2:
    raise ValueError(f"windows must be int[N, T+1] with T >= 1, got shape {windows.shape}")
  total, count = 0.0, 0
  for i in range(0, len(windows), batch_size):
    chunk = windows[i: i + batch_size]
    nats = np.asarray(eval_batch(graphdef, params, jnp.asarray(chunk)), np.float64)
    total += nats.sum()
    count += nats.size
  out = {"loss": total / count, "tokens": count}
  if byte_lengths is not None:
    num_bytes = int(np.asarray(byte_lengths)[windows[:, 1:]].sum())
    out["bits_per_byte"] = total / math.log(2) / max(num_bytes, 1)
    out["bytes_per_token"] = num_bytes / count
  return out


@functools.partial(jax.jit, static_argnums=(0, 2))
def _agreement_batch(target_graphdef, target_params, draft_graphdef, draft_params, tokens):
  p_logits = model_lib.forward(target_graphdef, target_params, tokens)
  q_logits = model_lib.forward(draft_graphdef, draft_params, tokens)
  return sampling.agreement(q_logits, p_logits)


def acceptance_rate(target, draft, windows: np.ndarray, batch_size: int = 8) -> dict[str, float]:
  """α̂ = mean over positions of Σ_x min(p(x), q(x)) at temperature 0 and 1.

  `target`, `draft`: `Model`s; both are teacher-forced on the same windows int[N, T+1].
  At temperature 0, p and q are one-hot argmaxes and α̂ is the argmax agreement rate.
  """
  windows = np.asarray(windows, np.int32)
  sums, count = {"alpha_t0": 0.0, "alpha_t1": 0.0}, 0
  for i in range(0, len(windows), batch_size):
    chunk = jnp.asarray(windows[i: i + batch_size, :-1])
    res = jax.device_get(_agreement_batch(target.graphdef, target.params, draft.graphdef,
                                          draft.params, chunk))
    for k in sums:
      sums[k] += float(np.sum(res[k], dtype=np.float64))
    count += chunk.size
  return {**{k: v / count for k, v in sums.items()}, "positions": count}


# ----------------------------------------------------------------------------------
# The whole job.


def model_config_from(config) -> ModelConfig:
  """The ModelConfig described by `config.model` (a dict of ModelConfig fields + 'style')."""
  fields = dict(config.model)
  style = fields.pop("style", "gpt2")
  if style == "llama":
    return ModelConfig.llama(**fields)
  if style == "gpt2":
    return ModelConfig(**fields)
  raise ValueError(f"config.model.style must be 'gpt2' or 'llama', got {style!r}")




def validate(config) -> None:
  """ValueError naming the field for a config no run could take, before anything is read
  or written (a bad value found after a resume could cost its checkpoints)."""

  def need(ok, field, what):
    if not ok:
      raise ValueError(f"config.{field} {what}, got {config.get(field)!r}")

  def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)

  def is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

  for field in ("steps", "seq_len", "batch_size", "eval_windows", "eval_batch_size",
                "log_every", "eval_every", "checkpoint_every"):
    need(is_int(config.get(field)) and config[field] >= 1, field, "must be an int >= 1")
  need(is_int(config.warmup_steps) and 0 <= config.warmup_steps < config.steps,
       "warmup_steps", f"must be an int in [0, steps={config.steps})")
  need(is_int(config.seed) and config.seed >= 0, "seed", "must be an int >= 0")
  need(is_num(config.lr) and config.lr > 0, "lr", "must be a finite number > 0")
  need(is_num(config.weight_decay) and config.weight_decay >= 0, "weight_decay",
       "must be a finite number >= 0")
  need(is_num(config.grad_clip) and config.grad_clip > 0, "grad_clip",
       "must be a finite number > 0")
  for field in ("b1", "b2"):
    need(is_num(config[field]) and 0 <= config[field] < 1, field, "must be in [0, 1)")
  need(is_num(config.end_lr_fraction) and 0 <= config.end_lr_fraction <= 1, "end_lr_fraction",
       "must be in [0, 1]")
  if config.export_dtype:
    model_lib.float_dtype(config.export_dtype)  # ValueError naming it
  if config.get("tokenizer"):
    need(Path(config.tokenizer).expanduser().is_file(), "tokenizer", "names no file")
  if config.get("head"):
    return  # the head's own fields (its loss weights are not a mix): `heads.validate`
  need(is_num(config.distill_weight) and 0 <= config.distill_weight <= 1, "distill_weight",
       "must be in [0, 1]")
  need(config.distill in ("",) + DISTILL_KINDS, "distill",
       f"must be '' or one of {DISTILL_KINDS}")
  need(not config.distill or config.teacher, "distill", "needs config.teacher")
  try:
    cfg = model_config_from(config)  # ValueError naming the ModelConfig field
  except TypeError as e:  # an unknown field
    raise ValueError(f"config.model: {e}") from e
  need(config.seq_len <= cfg.max_len, "seq_len", f"must be <= the model's max_len {cfg.max_len}")
  if not config.tokenizer and not config.teacher:  # a tokenizer is trained: bytes + EOS
    need(is_int(config.vocab_size) and 258 <= config.vocab_size <= cfg.vocab_size,
         "vocab_size", f"must be an int in [258, model.vocab_size={cfg.vocab_size}] (256 "
         "bytes, end-of-text and merges)")


def load_teacher(spec: str, positions: int | None = None):
  """The teacher (or a head's target) as a Model; ValueError if `spec` names a head or
  its context is shorter than the `positions` a training window feeds it."""
  from specjax.models.pretrained import load_pretrained
  teacher = load_pretrained(spec)
  if not isinstance(teacher, model_lib.Model):
    raise ValueError(f"config.teacher {spec!r} is a {type(teacher).__name__}, not a model")
  if positions is not None and positions > teacher.config.max_len:
    raise ValueError(f"config.seq_len: a window feeds the teacher {positions} positions, "
                     f"more than {spec!r}'s max_len {teacher.config.max_len}")
  return teacher


def _prepare_tokenizer(config, workdir: Path, corpus, teacher) -> tuple[Tokenizer, bool]:
  """The run's tokenizer, and whether it is new (`token_streams` saves it once the
  corpus has passed its checks: a resumed run keeps the tokenizer it started with, so
  one made from a corpus that then failed must not be kept)."""
  path = workdir / "tokenizer.json"
  if path.is_file():
    return Tokenizer.from_file(path), False
  if config.tokenizer:
    tok = Tokenizer.from_file(config.tokenizer)
  elif teacher is not None:
    if teacher.tokenizer is None:
      raise ValueError(f"teacher {config.teacher!r} has no tokenizer; set config.tokenizer")
    tok = teacher.tokenizer
  else:
    tok = Tokenizer.train(corpus.read("train"), config.vocab_size)
  return tok, True


def token_streams(workdir: Path, corpus, tok: Tokenizer, min_tokens: int = 1,
                   save_tokenizer: bool = False):
  """Train and held-out streams, cached in the workdir so a resume skips tokenizing.
  Both splits are checked (at least `min_tokens`, one training window) before anything
  is written; `save_tokenizer` saves `tok` with them."""
  streams, fresh = {}, []
  for split in ("train", "heldout"):
    cache = workdir / f"tokens_{split}.npy"
    if cache.is_file():
      try:
        streams[split] = np.load(cache).astype(np.int32)
        continue
      except (ValueError, OSError, EOFError):  # a cache cut short: tokenize again
        log_line(f"note: {cache} is unreadable; tokenizing {split} again")
    stream = data_lib.token_stream(tok, corpus.read(split))
    if len(stream) < min_tokens:
      raise ValueError(f"config.corpus: its {split} split holds {len(stream)} tokens, fewer "
                       f"than one window of seq_len + 1 = {min_tokens}")
    streams[split] = stream
    fresh.append(split)
  if save_tokenizer:
    tok.save(workdir / "tokenizer.json")
  for split in fresh:
    cache = workdir / f"tokens_{split}.npy"
    tmp = cache.with_name(f"tokens_{split}.tmp.npy")
    np.save(tmp, streams[split].astype(np.uint16 if tok.vocab_size <= 65536 else np.int32))
    os.replace(tmp, cache)
  return streams["train"], streams["heldout"]


def train(config, workdir: str | os.PathLike) -> model_lib.Model:
  """Runs (or resumes) the job described by `config` in `workdir`; returns the model.

  The workdir ends up with config.json, tokenizer.json, metrics.jsonl, orbax
  checkpoints under checkpoints/, and the final model in our checkpoint format under
  `config.export_dir` (default WORKDIR/model).
  """
  import orbax.checkpoint as ocp

  validate(config)
  cfg = model_config_from(config)
  corpus = data_lib.load_corpus(config.corpus, config.heldout_fraction)
  teacher = load_teacher(config.teacher, config.seq_len) if config.teacher else None
  if teacher is not None and teacher.config.vocab_size != cfg.vocab_size:
    raise ValueError(f"teacher vocab {teacher.config.vocab_size} != student vocab {cfg.vocab_size}")
  export_dir = check_export_dir(config, workdir)
  workdir = start_workdir(workdir, config)
  tok, new_tokenizer = _prepare_tokenizer(config, workdir, corpus, teacher)
  if cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"model vocab_size {cfg.vocab_size} < tokenizer's {tok.vocab_size}")
  if new_tokenizer:  # token caches without their tokenizer were made by another one
    for split in ("train", "heldout"):
      (workdir / f"tokens_{split}.npy").unlink(missing_ok=True)
  train_stream, heldout_stream = token_streams(workdir, corpus, tok, config.seq_len + 1,
                                                save_tokenizer=new_tokenizer)
  byte_lengths = tok.token_byte_lengths()
  eval_windows = data_lib.eval_windows(heldout_stream, config.seq_len, config.eval_windows)
  model = model_lib.init_model(cfg, config.seed)
  graphdef, params = model.graphdef, model.params
  optimizer = make_optimizer(config.lr, config.warmup_steps, config.steps, config.weight_decay,
                             config.grad_clip, config.b1, config.b2, config.end_lr_fraction)
  opt_state = optimizer.init(params)
  distill = config.distill or None
  step_fn = make_train_step(graphdef, optimizer,
                            teacher.graphdef if teacher is not None else None,
                            distill if teacher is not None else None, config.distill_weight)
  if distill and teacher is None:
    raise ValueError("config.distill is set but config.teacher is empty")
  teacher_params = teacher.params if teacher is not None else None

  manager = ocp.CheckpointManager(
      workdir / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  state = {"params": params, "opt_state": opt_state,
           "elapsed_s": np.zeros((), np.float64)}
  start_step = 0
  if manager.latest_step() is not None:
    start_step = manager.latest_step()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(start_step, args=ocp.args.StandardRestore(abstract))
    log_line(f"resumed from {workdir / 'checkpoints'} at step {start_step}")
  params, opt_state = state["params"], state["opt_state"]
  elapsed = float(state["elapsed_s"])
  metrics_log = MetricsLog(workdir / "metrics.jsonl", start_step)

  n_params = model_lib.count_params(params)
  tokens_per_step = config.batch_size * config.seq_len
  log_line(f"model {n_params:,} params, {cfg}\n"
       f"corpus {config.corpus}: {len(train_stream):,} train / {len(heldout_stream):,} "
       f"held-out tokens; {tokens_per_step} tokens/step, {config.steps} steps")

  def save(step):
    manager.save(step, args=ocp.args.StandardSave(
        {"params": params, "opt_state": opt_state, "elapsed_s": np.asarray(elapsed)}))

  def run_eval(step):
    result = evaluate(graphdef, params, eval_windows, byte_lengths, config.eval_batch_size)
    record = {"step": step, "eval/loss": result["loss"],
              "eval/bits_per_byte": result["bits_per_byte"], "elapsed_s": elapsed,
              "train_tokens": step * tokens_per_step}
    agree = ""
    if teacher is not None:  # how often the student would be accepted as a draft
      rates = acceptance_rate(teacher, model_lib.Model(cfg, params), eval_windows,
                              config.eval_batch_size)
      record.update({f"eval/{k}": rates[k] for k in ("alpha_t0", "alpha_t1")})
      agree = f"  alpha T=0 {rates['alpha_t0']:.4f}  T=1 {rates['alpha_t1']:.4f}"
    metrics_log.write(record)
    log_line(f"step {step:6d}  eval loss {result['loss']:.4f}  bits/byte "
         f"{result['bits_per_byte']:.4f}{agree}")
    return result

  run_t0, elapsed0 = time.time(), elapsed
  window_t0, window_steps = time.time(), 0  # tokens/s over the steps since the last line
  for step in range(start_step, config.steps):
    tokens = jnp.asarray(data_lib.batch_at(train_stream, step, config.batch_size,
                                           config.seq_len, config.seed))
    params, opt_state, metrics = step_fn(params, opt_state, tokens, teacher_params)
    done, window_steps = step + 1, window_steps + 1
    elapsed = elapsed0 + time.time() - run_t0
    if done % config.log_every == 0 or done == config.steps:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      rate = window_steps * tokens_per_step / max(time.time() - window_t0, 1e-9)
      record = {"step": done, "lr": optimizer_lr(config, done), "tokens_per_s": rate,
                "elapsed_s": elapsed, **{f"train/{k}": v for k, v in metrics.items()}}
      metrics_log.write(record)
      extra = f"  distill {metrics['distill']:.4f}" if "distill" in metrics else ""
      log_line(f"step {done:6d}/{config.steps}  loss {metrics['loss']:.4f}{extra}  "
           f"grad {metrics['grad_norm']:.3f}  lr {record['lr']:.2e}  "
           f"{rate:,.0f} tok/s  {elapsed / 60:.1f} min")
      window_t0, window_steps = time.time(), 0
    if done % config.eval_every == 0 or done == config.steps:
      run_eval(done)
      window_t0, window_steps = time.time(), 0
    if done % config.checkpoint_every == 0 or done == config.steps:
      elapsed = elapsed0 + time.time() - run_t0
      save(done)
      window_t0, window_steps = time.time(), 0
  manager.wait_until_finished()
  manager.close()

  final = evaluate(graphdef, params, eval_windows, byte_lengths, config.eval_batch_size)
  meta = {"train_steps": config.steps, "train_tokens": config.steps * tokens_per_step,
          "train_wall_s": round(elapsed, 1), "heldout_loss": final["loss"],
          "heldout_bits_per_byte": final["bits_per_byte"], "corpus": config.corpus,
          "teacher": config.teacher or None, "distill": distill, "workdir": str(workdir)}
  checkpoint_lib.save_model(export_dir, cfg, params, tok,
                            dtype=jnp.dtype(config.export_dtype) if config.export_dtype else None,
                            metadata=meta)
  log_line(f"exported to {export_dir}: {json.dumps(meta)}")
  return model_lib.Model(cfg, params, tok)


def optimizer_lr(config, step: int) -> float:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.lr, config.warmup_steps, config.steps, config.lr * config.end_lr_fraction)
  return float(schedule(step))
