"""EAGLE / Medusa heads: target features, drafters against step-by-step references,
rollback after a partly accepted round, training, exact resume, target checks."""

import functools
import json
import shutil
import types

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specjax.drafters import heads as head_drafters
from specjax.drafters.heads import EagleDrafter, MedusaDrafter
from specjax.models import heads as heads_lib
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax.processors.sampling import Sampling, process_logits
from specjax.training import heads as train_heads
from specjax.training import lm as train_lib
from conftest import tiny_model

V, D, GAMMA = 16, 32, 3


def settings(b, temperature, top_k=0, top_p=1.0):
  return Sampling.create(b, temperature=temperature, top_k=top_k, top_p=top_p)


@pytest.fixture(scope="module")
def target():
  return head_target()


def head_target():
  model = tiny_model(vocab=V, d_model=D, n_layers=2, llama=True, seed=0, sharpness=3.0)
  # A larger final-norm scale sharpens the target (its entropy ~2.4 nats, not ln 16).
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  params["final_norm"]["scale"] = params["final_norm"]["scale"] * 8
  return model.with_params(params)


def random_head(target, kind, seed=1, scale=3.0):
  """A head with random (not freshly initialised) weights, so its outputs are peaked."""
  hc = heads_lib.HeadConfig(kind, target.config, medusa_heads=GAMMA + 1)
  own = heads_lib.init_params(hc, seed)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
  own = jax.tree_util.tree_map(
      lambda x: x + 0.3 * scale * jax.random.normal(next(keys), x.shape) / x.shape[0] ** 0.5
      if x.ndim == 2 else x, own)
  fp = heads_lib.target_fingerprint(target.config, target.params)
  return heads_lib.Head(hc, own, fp)


@functools.lru_cache(maxsize=None)
def jitted(drafter):
  """One compiled program per drafter (a hashable config) for the whole module."""
  return types.SimpleNamespace(prefill=jax.jit(drafter.prefill),
                               propose=jax.jit(drafter.propose),
                               rollback=jax.jit(drafter.rollback))


@functools.partial(jax.jit, static_argnums=0)
def _eagle_uncached(hc, params, feats, tokens):
  return heads_lib.eagle_apply(hc, params, feats, tokens)[:2]


def features_of(target, tokens):
  return model_lib.forward(target.graphdef, target.params, jnp.asarray(tokens), hidden=True)[1]


TOKENS = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4],
                   [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3]], np.int32)
N = np.array([7, 5], np.int32)  # ragged prompt lengths
P, SIZE = 8, 32  # prompt prefill width, cache slots


def test_hidden_states_cached_equal_uncached(target):
  for model in (target, tiny_model(vocab=V, d_model=D, n_layers=2, seed=3)):  # llama, gpt2
    toks = jnp.asarray(TOKENS[:, :12])
    logits, feats = model_lib.forward(model.graphdef, model.params, toks, hidden=True)
    chex.assert_shape(feats, (2, 12, D))
    np.testing.assert_array_equal(logits, model_lib.forward(model.graphdef, model.params, toks))
    kv = kv_cache.init_kv(model.config, 2, SIZE)
    l1, kv, f1 = model_lib.forward_cached(model.graphdef, model.params, toks[:, :7], kv,
                                          empty=True, hidden=True)
    l2, kv, f2 = model_lib.forward_cached_jit(model.graphdef, model.params, toks[:, 7:], kv,
                                              hidden=True)
    assert kv.length.tolist() == [12, 12]
    np.testing.assert_allclose(jnp.concatenate([f1, f2], 1), feats, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([l1, l2], 1), logits, atol=1e-4, rtol=1e-4)
    # The features are the pre-norm residual: the target's own readout gives its logits.
    hc = heads_lib.HeadConfig("medusa", model.config, 1)
    head = nnx.merge(heads_lib.graphdef_for(hc), {
        **heads_lib.init_params(hc), **heads_lib.shared_params(model.params)})
    np.testing.assert_allclose(head.readout(feats), logits, atol=1e-4, rtol=1e-4)


def eagle_reference(hc, params, tokens, feats, n, drafted):
  """Logits of each draft step of one row, by uncached passes over the whole history.

  Slot t takes (f_t, x_{t+1}) for t <= n-2, then (predicted f, drafted y) slots.
  """
  f_in = [feats[t] for t in range(n - 1)]
  x_in = [int(tokens[t + 1]) for t in range(n - 1)]
  out, width = [], 16  # causal: zero padding after the history changes nothing before it
  for y in drafted:  # logits for y_i come from the history holding y_1..y_{i-1}
    pad = width - len(f_in)
    f = jnp.concatenate([jnp.stack(f_in), jnp.zeros((pad, feats.shape[-1]))])[None]
    pred, logits = _eagle_uncached(hc, params, f, jnp.asarray(x_in + [0] * pad)[None])
    out.append(logits[0, len(f_in) - 1])
    f_in.append(pred[0, len(f_in) - 1])
    x_in.append(int(y))
  return jnp.stack(out)


def drafter_setup(target, head, temperature=0.0):
  drafter = head_drafters.for_head(head.config, GAMMA)
  assert isinstance(drafter, EagleDrafter if head.kind == "eagle" else MedusaDrafter)
  assert drafter.uses_features and hash(drafter) == hash(head_drafters.for_head(head.config, GAMMA))
  params = head.draft_params(target)
  feats = features_of(target, TOKENS[:, :P])
  state = jitted(drafter).prefill(params, drafter.init(2, SIZE), jnp.asarray(TOKENS),
                                   jnp.asarray(N), feats)
  return drafter, params, state


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (0.8, 5)])
def test_eagle_proposal_matches_step_by_step_reference(target, temperature, top_k):
  head = random_head(target, "eagle")
  drafter, params, state = drafter_setup(target, head)
  sampling = settings(2, temperature, top_k)
  ys, qs, _ = jitted(drafter).propose(params, state, jnp.asarray(TOKENS), jnp.asarray(N),
                                       jax.random.PRNGKey(5), sampling)
  chex.assert_shape((ys, qs), ((2, GAMMA), (2, GAMMA, V)))
  full = features_of(target, TOKENS)
  for b in range(2):
    logits = eagle_reference(head.config, params, TOKENS[b], full[b], int(N[b]), ys[b].tolist())
    q_ref = process_logits(logits, temperature, top_k, 1.0)
    np.testing.assert_allclose(qs[b], q_ref, atol=2e-5)
    assert all(q_ref[i, ys[b, i]] > 0 for i in range(GAMMA))
    if temperature == 0:
      assert ys[b].tolist() == jnp.argmax(logits, -1).tolist()


def verify_features(target, committed_tokens, n, ys):
  """The target's verify pass: [x_{n-1}, y_1..y_γ] at each row's length n-1, hidden out."""
  kv = kv_cache.init_kv(target.config, 2, SIZE)
  _, kv = model_lib.forward_cached(target.graphdef, target.params,
                                   jnp.asarray(committed_tokens[:, :P]), kv, empty=True)
  kv = kv.rollback(jnp.asarray(n - 1))
  inputs = jnp.concatenate([jnp.asarray(committed_tokens)[jnp.arange(2), n - 1][:, None], ys], 1)
  _, _, feats = model_lib.forward_cached(target.graphdef, target.params, inputs, kv, hidden=True)
  return feats


def partly_accepted_round(target, head, accepted):
  """prefill, propose, verify, commit `accepted[b]` drafts + one token, rollback."""
  drafter, params, state = drafter_setup(target, head)
  tokens, n = jnp.asarray(TOKENS), jnp.asarray(N)
  ys, _, state = jitted(drafter).propose(params, state, tokens, n, jax.random.PRNGKey(1),
                                          settings(2, 0.0))
  feats = verify_features(target, TOKENS, N, ys)
  committed = TOKENS.copy()
  for b, a in enumerate(accepted):
    committed[b, N[b]: N[b] + a] = np.asarray(ys[b, :a])
    committed[b, N[b] + a] = (int(ys[b, a]) + 1) % V if a < GAMMA else 11  # correction/bonus
  new_n = N + np.asarray(accepted) + 1
  state = jitted(drafter).rollback(state, jnp.asarray(new_n), feats, jnp.asarray(N - 1))
  return drafter, params, state, committed, new_n


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_rollback_keeps_exactly_the_committed_features(target, kind):
  head = random_head(target, kind)
  accepted = [1, GAMMA]  # one row partly accepted, one fully
  drafter, params, state, committed, new_n = partly_accepted_round(target, head, accepted)
  fresh = features_of(target, committed)
  if kind == "eagle":
    # What the next chunk will feed: true features of start..n-2, zeros past them.
    for b in range(2):
      start = N[b] - 1
      assert int(state.kv.length[b]) == start
      k = new_n[b] - 1 - start
      np.testing.assert_allclose(state.feats[b, :k], fresh[b, start: new_n[b] - 1], atol=1e-5)
      assert not np.any(np.asarray(state.feats[b, k:]))
  else:
    for b in range(2):
      np.testing.assert_allclose(state.feature[b], fresh[b, new_n[b] - 2], atol=1e-5)
  # And the next proposal equals a drafter prefilled from scratch on the committed rows.
  sampling, key = settings(2, 1.0), jax.random.PRNGKey(9)
  tokens, n = jnp.asarray(committed), jnp.asarray(new_n)
  propose = jitted(drafter).propose
  ys, qs, _ = propose(params, state, tokens, n, key, sampling)
  scratch = jitted(drafter).prefill(params, drafter.init(2, SIZE), tokens, n, fresh[:, :P])
  ys2, qs2, _ = propose(params, scratch, tokens, n, key, sampling)
  np.testing.assert_allclose(qs, qs2, atol=1e-5)
  np.testing.assert_array_equal(ys, ys2)


def test_medusa_proposal_reads_the_last_committed_feature(target):
  head = random_head(target, "medusa")
  drafter, params, state = drafter_setup(target, head)
  for temperature in (0.0, 1.0):
    ys, qs, _ = jitted(drafter).propose(params, state, jnp.asarray(TOKENS), jnp.asarray(N),
                                         jax.random.PRNGKey(2), settings(2, temperature))
    full = features_of(target, TOKENS)
    f = full[jnp.arange(2), N - 2]  # f_{n-2}: the newest feature the target has computed
    logits = heads_lib.medusa_apply(head.config, params, f)[:, :GAMMA]
    np.testing.assert_allclose(qs, process_logits(logits, temperature, 0, 1.0), atol=1e-5)
    assert np.all(np.take_along_axis(np.asarray(qs), np.asarray(ys)[..., None], -1) > 0)
  with pytest.raises(ValueError, match="at most"):
    head_drafters.for_head(head.config, GAMMA + 2)


def _stream(n=3000):
  rng = np.random.default_rng(0)
  base = rng.integers(0, V, 23)
  return np.concatenate([base] * (n // 23)).astype(np.int32)  # periodic: learnable


def _config(kind, steps, **kw):
  c = ml_collections.ConfigDict(dict(
      head=kind, teacher="tiny", medusa_heads=2, feature_weight=1.0, distill_weight=1.0,
      medusa_decay=0.8, feature_noise=0.05, seq_len=16, batch_size=4, seed=0, steps=steps,
      lr=1e-2, warmup_steps=1, end_lr_fraction=0.1, weight_decay=0.0, grad_clip=1.0, b1=0.9,
      b2=0.95, log_every=1, eval_every=2, eval_windows=2, eval_batch_size=2,
      checkpoint_every=2, export_dir="", export_dtype="", corpus="synthetic"))
  c.update(kw)
  return c


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_training_lowers_the_loss(target, kind):
  hc = heads_lib.HeadConfig(kind, target.config, 2)
  optimizer = train_lib.make_optimizer(1e-2, 1, 30)
  step = train_heads.make_head_train_step(hc, target.graphdef, optimizer)
  params = heads_lib.init_params(hc)
  opt_state = optimizer.init(params)
  windows = jnp.asarray(np.stack([_stream()[i: i + 17] for i in range(0, 40, 5)]))
  before = train_heads.acceptance_rate(hc, target, params, windows)
  losses = []
  for i in range(30):
    params, opt_state, m = step(params, opt_state, windows, target.params, jnp.int32(i))
    losses.append(float(m["loss"]))
  after = train_heads.acceptance_rate(hc, target, params, windows)
  assert losses[-1] < losses[0] - 0.4, losses
  assert after["alpha_t1"] > before["alpha_t1"] + 0.1
  assert after["alpha_t0"] > before["alpha_t0"] + 0.2


def test_resume_is_bit_exact(target, tmp_path, capsys):
  stream = _stream()
  straight = tmp_path / "straight"
  head = train_heads.run(_config("eagle", 4), straight, target, stream, stream[:500])
  resumed = tmp_path / "resumed"
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / "checkpoints" / "4")
  shutil.rmtree(resumed / "head")
  capsys.readouterr()
  again = train_heads.run(_config("eagle", 4), resumed, target, stream, stream[:500])
  assert "at step 2" in capsys.readouterr().out
  jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, head.params)
  loaded = heads_lib.load_head(resumed / "head")
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, head.params)
  assert loaded.target_fingerprint == head.target_fingerprint and loaded.kind == "eagle"


def test_head_for_another_target_is_refused(target):
  head = random_head(target, "eagle")
  head.check_target(target)
  # bfloat16-rounded weights of the same target keep the fingerprint.
  rounded = target.with_params(jax.tree_util.tree_map(
      lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), target.params))
  head.check_target(rounded)
  cases = [(tiny_model(vocab=V, d_model=48, n_layers=2, llama=True), "d_model"),
           (tiny_model(vocab=V + 4, d_model=D, n_layers=2, llama=True), "vocab_size"),
           (tiny_model(vocab=V, d_model=D, n_layers=3, llama=True), "n_layers"),
           (tiny_model(vocab=V, d_model=D, n_layers=2, llama=True, seed=7), "fingerprint")]
  for other, what in cases:
    with pytest.raises(ValueError, match=what):
      head.check_target(other)
    with pytest.raises(ValueError, match=what):
      head.draft_params(other)
  # Fingerprints are remembered per jax array; numpy weights are hashed every time, so
  # one changed in place after a passing check is still refused.
  head.check_target(target)
  host = target.with_params(jax.tree_util.tree_map(np.array, target.params))
  head.check_target(host)
  host.params["embed"]["embedding"][0, 0] += 1.0
  with pytest.raises(ValueError, match="fingerprint"):
    head.check_target(host)


def test_fingerprint_memory_keeps_no_target_alive():
  import gc
  import weakref
  other = tiny_model(vocab=V, d_model=D, n_layers=2, llama=True, seed=11)
  first = heads_lib.target_fingerprint(other.config, other.params)
  assert heads_lib.target_fingerprint(other.config, other.params) == first
  embedding = weakref.ref(other.params["embed"]["embedding"])
  del other
  gc.collect()
  assert embedding() is None


def run_with_head(target, head, prompts, gamma, temperature, max_new=12, seed=0):
  """The engine's own decode loop with the head as the draft (`draft=head`)."""
  from specjax import generation
  args = generation.prepare(target, prompts, max_new_tokens=max_new, temperature=temperature,
                            top_k=0, top_p=1.0, eos_id=None, gamma=gamma, draft=head)
  assert type(args.engine.drafter) is type(head_drafters.for_head(head.config, gamma))
  state = args.run(jax.random.PRNGKey(seed))
  tokens, n, plen = jax.device_get((state.tokens, state.n, state.prompt_len))
  return [tokens[i, plen[i]:n[i]].tolist() for i in range(len(prompts))], state


def test_generate_takes_a_head_and_refuses_a_wrong_one(target):
  import specjax
  eagle, medusa = random_head(target, "eagle"), random_head(target, "medusa")
  prompts = [TOKENS[0, :5].tolist()]
  expected = specjax.generate(target, prompts, max_new_tokens=6).tokens
  out = specjax.generate(target, prompts, max_new_tokens=6, draft=eagle, drafter="eagle",
                         gamma=2)
  assert out.tokens == expected and out.stats["lossless"]
  other = tiny_model(vocab=V, d_model=D, n_layers=2, llama=True, seed=7)
  cases = [(dict(drafter="eagle"), "needs draft=<a eagle head>"),
           (dict(draft=medusa, drafter="eagle"), "got a medusa head"),
           (dict(draft=eagle, draft_sample="top"), "draft_sample"),
           (dict(draft=eagle, gamma=0), "gamma"),
           (dict(draft=eagle, drafter="model"), "needs draft=<a draft Model>, got the eagle"),
           (dict(draft="stdlib-eagle"), "draft must be")]
  for kwargs, what in cases:
    with pytest.raises(ValueError, match=what):
      specjax.generate(target, prompts, max_new_tokens=6, **kwargs)
  with pytest.raises(ValueError, match="fingerprint") as wrong:
    specjax.generate(other, prompts, max_new_tokens=6, draft=eagle)
  assert "quantized" not in str(wrong.value)
  # The head's own target, quantised: refused, and the message says why.
  with pytest.raises(ValueError, match="fingerprint.*int8-quantized"):
    specjax.generate(specjax.quantize(target), prompts, max_new_tokens=6, draft=eagle)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_speculation_with_a_head_equals_target_greedy(target, kind):
  import specjax
  head = random_head(target, kind)
  prompts = [TOKENS[0, :7].tolist(), TOKENS[1, :3].tolist()]
  out, state = run_with_head(target, head, prompts, GAMMA, 0.0)
  expected = specjax.generate(target, prompts, max_new_tokens=12, temperature=0.0).tokens
  assert out == expected
  assert int(state.target_calls) <= 12 and np.all(np.asarray(state.stats.committed) == 12)


def test_ledger_measures_a_head_at_a_prompt_shorter_than_a_pass(target):
  # The ledger times the head's proposals at the prompt's length; a pass's γ + 1
  # features must not be cut to it (a 1-token prompt, γ = 4).
  import specjax
  head, prompts = random_head(target, "eagle"), [[int(TOKENS[0, 0])]]
  expected = specjax.generate(target, prompts, max_new_tokens=6).tokens
  out = specjax.generate(target, prompts, max_new_tokens=6, draft=head, gamma=4,
                         gamma_policy="ledger")
  assert out.tokens == expected


@pytest.mark.parametrize("name", ["stdlib-eagle", "stdlib-eagle3", "stdlib-medusa"])
def test_shipped_head_reproduces_its_card(name):
  import sys
  from experiments.common import heldout_windows
  from specjax.models import pretrained
  if not (pretrained.checkpoints_dir() / name).exists():
    pytest.skip(f"{name} is not in {pretrained.checkpoints_dir()}")
  head = pretrained.load_pretrained(name)
  target = pretrained.load_pretrained("stdlib-target")
  assert isinstance(head, heads_lib.Head) and head.kind == name.split("-")[1]
  head.check_target(target)
  card = head.metadata["card"]
  windows = heldout_windows(target.tokenizer, 256, 64)[: card["test_slice_windows"]]
  rates = train_heads.acceptance_rate(head.config, target, head.params, windows)
  # The slice is cut from this interpreter's stdlib; other Python versions shift it a bit.
  tol = 0.005 if sys.version.split()[0] == "3.11.7" else 0.05
  assert abs(rates["alpha_t0"] - card["test_slice_alpha_t0"]) < tol
  assert abs(rates["alpha_t1"] - card["test_slice_alpha_t1"]) < tol


# Medusa trees: head d drafts every node at depth d.

def test_medusa_tree_equals_target_greedy(target):
  # Sampled children at T = 0 are each head's top-k (q's support is one token); the
  # greedy draft mode takes the same top-k directly.
  import specjax
  head = random_head(target, "medusa")
  prompts = [TOKENS[0, :7].tolist(), TOKENS[1, :3].tolist()]
  res = specjax.generate(target, prompts, max_new_tokens=12, draft=head, tree=(3, 2, 1))
  assert res.tokens == specjax.generate(target, prompts, max_new_tokens=12).tokens
  assert res.stats["tokens_per_target_call"] > 1.0  # the tree's drafts were accepted
  with pytest.raises(ValueError, match="at most that deep"):
    specjax.generate(target, prompts, max_new_tokens=4, draft=head, tree=(1,) * (GAMMA + 2))


def tree_rounds(target, head, tree, rounds=4):
  """Real tree rounds of two rows at T = 1: yields (state, n, the target's features of
  the committed tokens) after each; at the end, asserts some row accepted no node in a
  round and some accepted nodes."""
  from specjax import decode as decode_lib
  from specjax import generation
  prompts = [TOKENS[0, :7].tolist(), TOKENS[1, :5].tolist()]
  args = generation.prepare(target, prompts, max_new_tokens=16, temperature=1.0, top_k=0,
                            top_p=1.0, eos_id=None, draft=head, tree=tree)
  step = jax.jit(lambda s: decode_lib.decode_round(args.engine, args.weights, s, args.sampling))
  state = args.prefill(jax.random.PRNGKey(3))
  seen = set()
  for _ in range(rounds):
    before = np.asarray(state.n)
    state = step(state)
    n = np.asarray(state.n)
    seen |= set((n - before - 1).tolist())  # nodes accepted per row this round
    yield state, n, features_of(target, np.asarray(state.tokens))
  assert 0 in seen and len(seen) > 1  # rounds with none and with some nodes accepted


def test_medusa_tree_keeps_the_feature_of_the_last_accepted_node(target):
  """After real tree rounds the head holds f_{n-2} of the committed text, as a head
  prefilled from scratch on it would (the last accepted node's feature, or the root's)."""
  for state, n, fresh in tree_rounds(target, random_head(target, "medusa"), (3, 2, 1)):
    for b in range(2):
      np.testing.assert_allclose(state.draft_state.feature[b], fresh[b, n[b] - 2], atol=1e-4)


def test_medusa_tree_three_token_law():
  """Whole continuations of a Medusa tree follow the target's law, its children drawn
  without replacement from each head's q (the walk's rules are tested in test_trees)."""
  import specjax
  from conftest import LAW_ROWS, exact_continuations, target_and_draft, within_law
  small, _ = target_and_draft()  # vocabulary 8: 512 continuations of 3 tokens
  head = random_head(small, "medusa")
  prompt, length, rows = [3, 1, 3], 3, LAW_ROWS
  res = specjax.generate(small, [prompt] * rows, max_new_tokens=length, draft=head,
                         tree=(2, 2), temperature=1.0, seed=4)
  _, probs = exact_continuations(small, prompt, length)
  ok, worst = within_law(res.tokens, probs)
  assert ok, f"worst z={worst}"
  assert 0.05 < res.stats["acceptance_rate"] < 0.95  # drafts both accepted and rejected


def test_a_broken_head_file_names_what_is_wrong(target, tmp_path):
  from specjax.models import checkpoint
  path = heads_lib.save_head(tmp_path / "head", random_head(target, "eagle"))
  manifest = (path / heads_lib.MANIFEST).read_text()
  with pytest.raises(ValueError, match="dtype must be a floating dtype"):
    heads_lib.load_head(path, dtype="int8")
  for edit, message in [(lambda m: m.pop("target_fingerprint"), "no 'target_fingerprint'"),
                        (lambda m: m["config"].update(kind="tree"), "config is invalid"),
                        (lambda m: m.update(params={}), "does not match its config"),
                        (lambda m: next(iter(m["params"].values())).pop("dtype"),
                         "no valid dtype")]:
    m = json.loads(manifest)
    edit(m)
    (path / heads_lib.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(checkpoint.CheckpointError, match=message):
      heads_lib.load_head(path)


@pytest.mark.parametrize("edit, message", [
    # A head count that is not the stored one would load a subset of the heads (or fail
    # as a KeyError); 2.7 heads is no count at all.
    (dict(medusa_heads=2), r"head .*medusa does not match its config: missing \[\], "
                           r"unexpected \['heads/2/bias'"),
    (dict(medusa_heads=6), r"does not match its config: missing \['heads/4/bias'"),
    (dict(medusa_heads=2.7), r"head.json: its config is invalid: .*medusa_heads must be a "
                             r"positive int, got 2.7"),
    (dict(medusa_heads=True), "medusa_heads must be a positive int"),
    (dict(kind=None), r"head.json: its config is invalid: no HeadConfig field 'kind'"),
    (dict(target=None), "no HeadConfig field 'target'"),
    (dict(medusa_head=2), r"unknown HeadConfig fields: \['medusa_head'\]"),
])
def test_a_hand_edited_head_config_is_refused(target, tmp_path, edit, message):
  from specjax.models import checkpoint
  path = heads_lib.save_head(tmp_path / "medusa", random_head(target, "medusa"))
  manifest = json.loads((path / heads_lib.MANIFEST).read_text())
  for k, v in edit.items():  # None: the field removed
    manifest["config"].pop(k) if v is None else manifest["config"].update({k: v})
  (path / heads_lib.MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(checkpoint.CheckpointError, match=message):
    heads_lib.load_head(path)


@pytest.mark.parametrize("overrides, message", [
    (dict(head="tree"), "config.head"), (dict(medusa_heads=0), "config.medusa_heads"),
    (dict(feature_noise=float("nan")), "config.feature_noise"), (dict(lr=-1.0), "config.lr"),
    (dict(teacher=""), "config.teacher"), (dict(teacher="stdlib-medusa"), "not a model")])
def test_a_bad_head_config_fails_before_anything_is_written(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    train_heads.train(_config("eagle", 4, **overrides), tmp_path / "run")
  assert not (tmp_path / "run").exists()
