"""Published EAGLE-3 heads (the EAGLE authors' layout): loading, a forward checked against
an independent torch reference written here, greedy equality, and the refusals."""

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

import specjax  # noqa: E402
from specjax.models import heads as heads_lib  # noqa: E402
from specjax.models import kv_cache  # noqa: E402
from specjax.models import model as model_lib  # noqa: E402

VOCAB, D, LAYERS, HEADS, KV, HD, FF = 64, 32, 8, 4, 2, 8, 40
DRAFT = 40
IDS = (2, 4, 5)  # vLLM's default (2, L // 2, L - 3) for L = 8
HEAD_THETA = 1000.0  # not the target's: the layer's RoPE comes from the head's config


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=LAYERS,
      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
      max_position_embeddings=64, rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0},
      bos_token_id=None, eos_token_id=None)
  ref = transformers.AutoModelForCausalLM.from_config(config)
  torch.manual_seed(0)
  with torch.no_grad():
    for p in ref.parameters():
      p.add_(0.1 * torch.randn_like(p))
    ref.model.embed_tokens.weight.mul_(4.0)  # peaked next-token distributions
  directory = tmp_path_factory.mktemp("target")
  ref.eval().save_pretrained(directory)
  return directory, ref


@pytest.fixture(scope="module")
def target(target_dir):
  return specjax.load_pretrained(target_dir[0])


def head_tensors(seed=1):
  g = torch.Generator().manual_seed(seed)

  def w(*shape, scale=None):
    return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)

  def norm():
    return 1.0 + 0.2 * torch.randn(D, generator=g)

  draft_ids = np.sort(np.random.RandomState(seed).choice(VOCAB, DRAFT, replace=False))
  t2d = torch.zeros(VOCAB, dtype=torch.bool)
  t2d[draft_ids] = True
  return {
      "fc.weight": w(D, 3 * D),
      "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * D),
      "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * D),
      "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * D),
      "midlayer.self_attn.o_proj.weight": w(D, HEADS * HD),
      "midlayer.mlp.gate_proj.weight": w(FF, D),
      "midlayer.mlp.up_proj.weight": w(FF, D),
      "midlayer.mlp.down_proj.weight": w(D, FF),
      "midlayer.input_layernorm.weight": norm(),
      "midlayer.hidden_norm.weight": norm(),
      "midlayer.post_attention_layernorm.weight": norm(),
      "norm.weight": norm(),
      "lm_head.weight": w(DRAFT, D, scale=0.5),
      "d2t": torch.as_tensor(draft_ids - np.arange(DRAFT), dtype=torch.int64),
      "t2d": t2d,
  }


HEAD_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
    "hidden_size": D, "intermediate_size": FF, "num_attention_heads": HEADS,
    "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1,
    "rms_norm_eps": 1e-5, "rope_theta": HEAD_THETA, "hidden_act": "silu",
    "max_position_embeddings": 64, "vocab_size": VOCAB, "draft_vocab_size": DRAFT,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def write_head(directory, tensors=None, config=None, torch_bin=False):
  directory.mkdir(parents=True, exist_ok=True)
  tensors = head_tensors() if tensors is None else tensors
  (directory / "config.json").write_text(json.dumps(HEAD_CONFIG if config is None else config))
  if torch_bin:
    torch.save(tensors, directory / "pytorch_model.bin")
  else:
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
  return directory


# --- an independent reference: the published forward, written out in torch ---------


def _rms(x, w, eps=1e-5):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
  """Rotate-half RoPE (Llama's) of x [B, T, H, hd] at positions [T]."""
  inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
  ang = positions[:, None].double() * inv[None]
  cos = torch.cat([ang.cos(), ang.cos()], -1).float()[None, :, None]
  sin = torch.cat([ang.sin(), ang.sin()], -1).float()[None, :, None]
  x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
  return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(t, h, e, positions, past=None):
  """One EAGLE-3 decoder layer step over slots; past: (k, v) [B, S, KV, hd] it also
  attends to (earlier slots, all visible). Returns (h_out, (k, v) of these slots)."""
  b, n = h.shape[:2]
  x = torch.cat([_rms(e, t["midlayer.input_layernorm.weight"]),
                 _rms(h, t["midlayer.hidden_norm.weight"])], -1)
  q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(b, n, HEADS, HD)
  k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(b, n, KV, HD)
  v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(b, n, KV, HD)
  q, k = _rope(q, positions, HEAD_THETA), _rope(k, positions, HEAD_THETA)
  keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1),
                                              torch.cat([past[1], v], 1))
  s = keys.shape[1]
  kr = keys.repeat_interleave(HEADS // KV, dim=2)
  vr = values.repeat_interleave(HEADS // KV, dim=2)
  scores = torch.einsum("bthd,bshd->bhts", q, kr) / HD ** 0.5
  visible = torch.ones(n, s, dtype=torch.bool).tril(s - n)
  scores = scores.masked_fill(~visible, float("-inf"))
  o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vr).reshape(b, n, HEADS * HD)
  h = h + o @ t["midlayer.self_attn.o_proj.weight"].T
  m = _rms(h, t["midlayer.post_attention_layernorm.weight"])
  m = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T)
       * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
  return h + m, (k, v)


def _logits(t, h):
  """Draft logits scattered into the target's vocabulary (-inf elsewhere)."""
  small = _rms(h, t["norm.weight"]) @ t["lm_head.weight"].T
  full = torch.full(small.shape[:-1] + (VOCAB,), float("-inf"))
  full[..., torch.arange(DRAFT) + t["d2t"]] = small
  return full


def reference(ref_target, t, tokens, anchor):
  """(first-step logits of every slot [B, T-1, V], second-step logits at `anchor`)."""
  with torch.no_grad():
    tok = torch.as_tensor(tokens, dtype=torch.long)
    hs = ref_target(tok, output_hidden_states=True).hidden_states  # hs[i]: input of layer i
    aux = torch.cat([hs[i] for i in IDS], -1)[:, :-1]
    embed = ref_target.model.embed_tokens
    n = aux.shape[1]
    h0 = aux @ t["fc.weight"].T
    h1, _ = _layer(t, h0, embed(tok[:, 1:]), torch.arange(n))
    first = _logits(t, h1)
    # The second step from `anchor`: its own output fed back with x_{anchor+2}, at
    # position anchor + 1, seeing the first step's keys of slots 0..anchor.
    _, past = _layer(t, h0[:, :anchor + 1], embed(tok[:, 1: anchor + 2]),
                     torch.arange(anchor + 1))
    h2, _ = _layer(t, h1[:, anchor: anchor + 1], embed(tok[:, anchor + 2: anchor + 3]),
                   torch.arange(anchor + 1, anchor + 2), past)
    return first.numpy(), _logits(t, h2)[:, 0].numpy()


@pytest.mark.parametrize("torch_bin", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_forward_matches_the_reference(target_dir, target, tmp_path, torch_bin):
  tensors = head_tensors()
  head = specjax.load_pretrained(write_head(tmp_path / "head", tensors, torch_bin=torch_bin),
                                 target=target)
  hc = head.config
  assert (hc.kind, hc.feature_layers, hc.vocab_size) == ("eagle3", IDS, DRAFT)
  assert hc.layer_config.rope_theta == HEAD_THETA
  tokens = np.random.RandomState(0).randint(0, VOCAB, (2, 12))
  first_ref, second_ref = reference(target_dir[1], tensors, tokens, anchor=6)
  params = head.draft_params(target)
  feats = model_lib.forward(target.graphdef, target.params, jnp.asarray(tokens),
                            hidden=hc.hidden)[1]
  h, first, _ = heads_lib.eagle_apply(hc, params, feats[:, :-1], jnp.asarray(tokens[:, 1:]),
                                      target_features=True)
  on = np.isfinite(first_ref)
  np.testing.assert_allclose(np.asarray(first)[on], first_ref[on], atol=2e-4, rtol=1e-4)
  assert np.all(np.asarray(first)[~on] == heads_lib.OFF_VOCAB)
  # The second step through the drafter's own cache.
  kv = kv_cache.init_kv(hc.layer_config, 2, 32)
  x, _, kv = heads_lib.eagle_apply(hc, params, feats[:, :7], jnp.asarray(tokens[:, 1:8]), kv,
                                   empty=True, target_features=True)
  _, second, _ = heads_lib.eagle_apply(hc, params, x[:, -1:], jnp.asarray(tokens[:, 8:9]), kv)
  on = np.isfinite(second_ref)
  np.testing.assert_allclose(np.asarray(second[:, 0])[on], second_ref[on], atol=2e-4,
                             rtol=1e-4)


def test_greedy_with_a_published_head_equals_target_greedy(target, tmp_path):
  head = specjax.load_pretrained(write_head(tmp_path / "head"), target=target)
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  expected = specjax.generate(target, prompts, max_new_tokens=10, temperature=0.0).tokens
  for tree in (None, (2, 2, 1)):
    out = specjax.generate(target, prompts, max_new_tokens=10, temperature=0.0, draft=head,
                           gamma=None if tree else 3, tree=tree)
    assert out.tokens == expected and out.stats["lossless"]


def _edited_config(**changes):
  config = dict(HEAD_CONFIG)
  for k, v in changes.items():
    if v is None:
      config.pop(k, None)
    else:
      config[k] = v
  return config


def _tensors(**changes):
  t = head_tensors()
  for k, v in changes.items():
    if v is None:
      t.pop(k)
    else:
      t[k] = v
  return t


REFUSALS = [
    (dict(config=_edited_config(hidden_size=48)), "hidden_size"),
    (dict(config=_edited_config(vocab_size=65)), "vocab_size"),
    (dict(config=_edited_config(num_hidden_layers=2)), "num_hidden_layers"),
    (dict(config=_edited_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 8]})),
     "eagle_aux_hidden_state_layer_ids"),
    (dict(config=_edited_config(draft_vocab_size=41)), "lm_head.weight"),
    (dict(config=_edited_config(norm_before_residual=True)), "norm_before_residual"),
    (dict(config=_edited_config(target_hidden_size=64)), "target_hidden_size"),
    (dict(config=_edited_config(hidden_act="gelu")), "hidden_act"),
    (dict(tensors=_tensors(**{"midlayer.hidden_norm.weight": None})), "missing tensor"),
    (dict(tensors=_tensors(**{"fc.weight": torch.zeros(D, 2 * D)})), "fc.weight"),
    (dict(tensors=_tensors(d2t=torch.zeros(DRAFT, dtype=torch.int64))), "d2t"),
    (dict(tensors=_tensors(t2d=torch.ones(VOCAB, dtype=torch.bool))), "t2d"),
    (dict(tensors=_tensors(**{"embed_tokens.weight": torch.zeros(VOCAB, D)})), "embed_tokens"),
    (dict(tensors=_tensors(**{"midlayer.extra.weight": torch.zeros(2)})), "no place"),
]


@pytest.mark.parametrize("edit,message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_a_mismatched_head_is_refused_naming_the_field(target, tmp_path, edit, message):
  directory = write_head(tmp_path / "head", **edit)
  with pytest.raises(ValueError, match=message):
    specjax.load_pretrained(directory, target=target)


def test_a_corrupt_file_no_target_or_another_architecture_is_refused(target, tmp_path):
  from conftest import tiny_model
  directory = write_head(tmp_path / "head")
  with pytest.raises(ValueError, match="target="):
    specjax.load_pretrained(directory)
  with pytest.raises(ValueError, match="Llama-family"):
    specjax.load_pretrained(directory, target=tiny_model(vocab=VOCAB, d_model=D))
  with pytest.raises(ValueError, match="target= is for published"):
    specjax.load_pretrained("stdlib-target", target=target)
  blob = (directory / "model.safetensors").read_bytes()
  (directory / "model.safetensors").write_bytes(blob[: len(blob) // 2])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    specjax.load_pretrained(directory, target=target)
  shutil.rmtree(directory)


# --- EAGLE-1/2 and Medusa-1 in their authors' layouts --------------------------------

EAGLE1_THETA = 2000.0


def eagle1_tensors(seed=2, bias=True):
  g = torch.Generator().manual_seed(seed)

  def w(*shape):
    return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

  t = {"fc.weight": w(D, 2 * D),
       "layers.0.self_attn.q_proj.weight": w(HEADS * HD, D),
       "layers.0.self_attn.k_proj.weight": w(KV * HD, D),
       "layers.0.self_attn.v_proj.weight": w(KV * HD, D),
       "layers.0.self_attn.o_proj.weight": w(D, HEADS * HD),
       "layers.0.mlp.gate_proj.weight": w(FF, D),
       "layers.0.mlp.up_proj.weight": w(FF, D),
       "layers.0.mlp.down_proj.weight": w(D, FF),
       "layers.0.post_attention_layernorm.weight": 1.0 + 0.2 * torch.randn(D, generator=g)}
  if bias:
    t["fc.bias"] = 0.1 * torch.randn(D, generator=g)
  return t


EAGLE1_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
    "intermediate_size": FF, "num_attention_heads": HEADS, "num_key_value_heads": KV,
    "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": EAGLE1_THETA,
    "hidden_act": "silu", "max_position_embeddings": 64, "vocab_size": VOCAB,
}


def medusa_tensors(k=3, seed=3):
  g = torch.Generator().manual_seed(seed)
  t = {}
  for i in range(k):
    t[f"{i}.0.linear.weight"] = torch.randn(D, D, generator=g) * D ** -0.5
    t[f"{i}.0.linear.bias"] = 0.1 * torch.randn(D, generator=g)
    t[f"{i}.1.weight"] = torch.randn(VOCAB, D, generator=g) * D ** -0.5 * 3
  return t


def write_eagle1(directory, tensors=None, config=None):
  return write_head(directory, eagle1_tensors() if tensors is None else tensors,
                    EAGLE1_CONFIG if config is None else config)


def write_medusa(directory, tensors=None, config=None, torch_pt=False):
  directory.mkdir(parents=True, exist_ok=True)
  tensors = medusa_tensors() if tensors is None else tensors
  config = {"medusa_num_heads": 3, "medusa_num_layers": 1} if config is None else config
  (directory / "config.json").write_text(json.dumps(config))
  if torch_pt:
    torch.save(tensors, directory / "medusa_lm_head.pt")
  else:
    save_file({k: v.contiguous() for k, v in tensors.items()},
              directory / "medusa_lm_head.safetensors")
  return directory


def _eagle1_layer(t, x, positions, past=None):
  """EAGLE-1's layer 0: attention on x itself (no input norm), post-attention norm + MLP."""
  b, n = x.shape[:2]
  p = "layers.0."
  q = (x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, HEADS, HD)
  k = (x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, KV, HD)
  v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, KV, HD)
  q, k = _rope(q, positions, EAGLE1_THETA), _rope(k, positions, EAGLE1_THETA)
  keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1),
                                              torch.cat([past[1], v], 1))
  s = keys.shape[1]
  scores = torch.einsum("bthd,bshd->bhts", q, keys.repeat_interleave(HEADS // KV, 2)) / HD ** 0.5
  scores = scores.masked_fill(~torch.ones(n, s, dtype=torch.bool).tril(s - n), float("-inf"))
  o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1),
                   values.repeat_interleave(HEADS // KV, 2)).reshape(b, n, HEADS * HD)
  h = x + o @ t[p + "self_attn.o_proj.weight"].T
  m = _rms(h, t[p + "post_attention_layernorm.weight"])
  m = (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T)
       * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
  return h + m, (k, v)


def eagle1_reference(ref_target, t, tokens, anchor):
  with torch.no_grad():
    tok = torch.as_tensor(tokens, dtype=torch.long)
    normed = ref_target(tok, output_hidden_states=True).hidden_states[-1]  # final-normed
    embed, lm_head = ref_target.model.embed_tokens, ref_target.lm_head

    def fuse(e, f):
      return torch.cat([e, f], -1) @ t["fc.weight"].T + t.get("fc.bias", 0.0)

    n = tok.shape[1] - 1
    x0 = fuse(embed(tok[:, 1:]), normed[:, :-1])
    h1, _ = _eagle1_layer(t, x0, torch.arange(n))
    _, past = _eagle1_layer(t, x0[:, :anchor + 1], torch.arange(anchor + 1))
    x1 = fuse(embed(tok[:, anchor + 2: anchor + 3]), h1[:, anchor: anchor + 1])
    h2, _ = _eagle1_layer(t, x1, torch.arange(anchor + 1, anchor + 2), past)
    return lm_head(h1).numpy(), lm_head(h2)[:, 0].numpy()


@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_fc_bias"])
def test_published_eagle_forward_matches_the_reference(target_dir, target, tmp_path, bias):
  tensors = eagle1_tensors(bias=bias)
  head = specjax.load_pretrained(write_eagle1(tmp_path / "eagle", tensors), target=target)
  hc = head.config
  assert (hc.kind, hc.layout, hc.layer_config.rope_theta) == ("eagle", "published",
                                                               EAGLE1_THETA)
  tokens = np.random.RandomState(1).randint(0, VOCAB, (2, 12))
  first_ref, second_ref = eagle1_reference(target_dir[1], tensors, tokens, anchor=5)
  params = head.draft_params(target)
  feats = model_lib.forward(target.graphdef, target.params, jnp.asarray(tokens),
                            hidden=True)[1]
  _, first, _ = heads_lib.eagle_apply(hc, params, feats[:, :-1], jnp.asarray(tokens[:, 1:]),
                                      target_features=True)
  np.testing.assert_allclose(first, first_ref, atol=2e-4, rtol=1e-4)
  kv = kv_cache.init_kv(hc.layer_config, 2, 32)
  x, _, kv = heads_lib.eagle_apply(hc, params, feats[:, :6], jnp.asarray(tokens[:, 1:7]), kv,
                                   empty=True, target_features=True)
  _, second, _ = heads_lib.eagle_apply(hc, params, x[:, -1:], jnp.asarray(tokens[:, 7:8]), kv)
  np.testing.assert_allclose(second[:, 0], second_ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("torch_pt", [False, True], ids=["safetensors", "pt"])
def test_published_medusa_forward_matches_the_reference(target_dir, target, tmp_path,
                                                        torch_pt):
  tensors = medusa_tensors()
  head = specjax.load_pretrained(write_medusa(tmp_path / "medusa", tensors, torch_pt=torch_pt),
                                 target=target)
  assert (head.kind, head.config.layout, head.config.medusa_heads) == ("medusa", "published", 3)
  tokens = np.random.RandomState(2).randint(0, VOCAB, (2, 9))
  with torch.no_grad():
    normed = target_dir[1](torch.as_tensor(tokens, dtype=torch.long),
                           output_hidden_states=True).hidden_states[-1]
    ref = np.stack([((normed + torch.nn.functional.silu(
        normed @ tensors[f"{i}.0.linear.weight"].T + tensors[f"{i}.0.linear.bias"]))
        @ tensors[f"{i}.1.weight"].T).numpy() for i in range(3)], axis=-2)
  feats = model_lib.forward(target.graphdef, target.params, jnp.asarray(tokens), hidden=True)[1]
  ours = heads_lib.medusa_apply(head.config, head.draft_params(target), feats)
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_with_published_eagle_and_medusa_equals_target_greedy(target, tmp_path):
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  expected = specjax.generate(target, prompts, max_new_tokens=10, temperature=0.0).tokens
  eagle = specjax.load_pretrained(write_eagle1(tmp_path / "eagle"), target=target)
  medusa = specjax.load_pretrained(write_medusa(tmp_path / "medusa"), target=target)
  for head, gamma, tree in ((eagle, 3, None), (eagle, None, (2, 2, 1)), (medusa, 3, None),
                            (medusa, None, (2, 1))):
    out = specjax.generate(target, prompts, max_new_tokens=10, temperature=0.0, draft=head,
                           gamma=gamma, tree=tree)
    assert out.tokens == expected and out.stats["lossless"]


def _without(d, key):
  return {k: v for k, v in d.items() if k != key}


PUBLISHED_REFUSALS = [
    ("eagle", dict(config={**EAGLE1_CONFIG, "hidden_size": 48}), "hidden_size"),
    ("eagle", dict(config={**EAGLE1_CONFIG, "add_para_norm": True}), "add_para_norm"),
    ("eagle", dict(tensors=_without(eagle1_tensors(), "layers.0.mlp.up_proj.weight")),
     "missing tensor"),
    ("eagle", dict(tensors={**eagle1_tensors(),
                            "layers.0.input_layernorm.weight": torch.ones(D)}), "no place"),
    ("eagle", dict(tensors={**eagle1_tensors(), "fc.weight": torch.zeros(D, 3 * D)}),
     "fc.weight"),
    ("medusa", dict(config={"medusa_num_heads": 3, "medusa_num_layers": 2}),
     "medusa_num_layers"),
    ("medusa", dict(config={"medusa_num_heads": 0}), "medusa_num_heads"),
    ("medusa", dict(config={"medusa_num_heads": 3, "vocab_size": 65}), "vocab_size"),
    ("medusa", dict(tensors={**medusa_tensors(), "1.1.weight": torch.zeros(VOCAB + 1, D)}),
     "1.1.weight"),
    ("medusa", dict(config={"medusa_num_heads": 4}), "missing tensor"),
]


@pytest.mark.parametrize("kind,edit,message", PUBLISHED_REFUSALS,
                         ids=[f"{k}-{m}" for k, _, m in PUBLISHED_REFUSALS])
def test_a_mismatched_published_head_is_refused(target, tmp_path, kind, edit, message):
  write = write_eagle1 if kind == "eagle" else write_medusa
  with pytest.raises(ValueError, match=message):
    specjax.load_pretrained(write(tmp_path / kind, **edit), target=target)
