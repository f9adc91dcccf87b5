"""Hugging Face import/export, checked against transformers itself (the `hf` extra).

Tiny random checkpoints are made by transformers with torch and saved with
`save_pretrained`; every weight is perturbed first, so a bias or norm left at its
initial 0 or 1 cannot hide a mapping error. Float32 throughout.
"""

import json
import os
import shutil
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

import chex
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

import specjax  # noqa: E402
from specjax import hf  # noqa: E402
from specjax.models import checkpoint  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.model import Model, init_model, rope_frequencies  # noqa: E402
from specjax.models.tokenizer import Tokenizer  # noqa: E402
from conftest import byte_bpe  # noqa: E402

ATOL = 1e-4

# Each a family/feature the importer must get right: GPT-2 with a non-default MLP width
# and epsilon; Llama with grouped-query attention, head_dim != hidden/heads and a
# non-default RoPE base; Qwen2 with q/k/v biases, one KV head and a tied head; Llama with
# attention and MLP biases; Mistral (no window within max_len; Llama's draft below);
# Llama 3.x RoPE scaling (head_dim 16 at base 500 with an original context of 64 puts
# frequencies in all three bands: kept, interpolated, divided by `factor`); Qwen3 with q/k
# norms and head_dim != hidden/heads, tied, and untied with attention biases.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=96, n_positions=40, n_embd=32, n_layer=2, n_head=4, n_inner=80,
        layer_norm_epsilon=1e-4, bos_token_id=None, eos_token_id=None),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=112, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=40,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        bos_token_id=None, eos_token_id=None),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=40,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama_biases": lambda: transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=40, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=112, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
        bos_token_id=None, eos_token_id=None),
    "llama3": lambda: transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=40,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        bos_token_id=None, eos_token_id=None),
    "qwen3_untied": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, max_position_embeddings=40,
        tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None),
}


def _perturb_(module, seed):
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return module.eval()


def _torch_logits(ref, tokens):
  with torch.no_grad():
    return ref(torch.tensor(np.asarray(tokens))).logits.numpy()


def _tokens(vocab, shape, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (directory, transformers model) for every config in HF_CONFIGS."""
  out = {}
  for i, (name, make_config) in enumerate(HF_CONFIGS.items()):
    ref = _perturb_(transformers.AutoModelForCausalLM.from_config(make_config()), seed=i)
    directory = tmp_path_factory.mktemp(name)
    ref.save_pretrained(directory)
    out[name] = (directory, ref)
  return out


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers(checkpoints, name):
  directory, ref = checkpoints[name]
  model = hf.load_hf_model(directory)
  tokens = _tokens(model.config.vocab_size, (2, 13))
  ours = np.asarray(model.logits(tokens))
  chex.assert_shape(ours, (2, 13, model.config.vocab_size))
  chex.assert_trees_all_close(ours, _torch_logits(ref, tokens), atol=ATOL, rtol=0)


def test_config_mapping(checkpoints):
  llama = hf.load_hf_model(checkpoints["llama"][0]).config
  assert (llama.n_kv_heads, llama.head_dim, llama.rope_theta, llama.norm_eps) == (2, 16, 500.0, 1e-5)
  mistral = hf.load_hf_model(checkpoints["mistral"][0]).config
  assert mistral.head_dim == mistral.d_model // mistral.n_heads  # the default, filled in
  assert not llama.tie_embeddings and not llama.qkv_bias
  qwen2 = hf.load_hf_model(checkpoints["qwen2"][0]).config
  assert qwen2.qkv_bias and not qwen2.out_bias and qwen2.tie_embeddings
  gpt2 = hf.load_hf_model(checkpoints["gpt2"][0]).config
  assert (gpt2.max_len, gpt2.d_ff, gpt2.norm_eps) == (40, 80, 1e-4)
  assert gpt2.rope_scaling is None and not gpt2.qk_norm and not llama.qk_norm
  llama3 = hf.load_hf_model(checkpoints["llama3"][0]).config
  assert dict(llama3.rope_scaling) == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
  assert (llama3.rope_theta, llama3.max_len, llama3.head_dim) == (500.0, 256, 16)
  qwen3 = hf.load_hf_model(checkpoints["qwen3"][0]).config
  assert qwen3.qk_norm and qwen3.head_dim == 12 and qwen3.tie_embeddings
  assert not (qwen3.qkv_bias or qwen3.out_bias or qwen3.mlp_bias)
  untied = hf.load_hf_model(checkpoints["qwen3_untied"][0]).config
  assert untied.qk_norm and untied.head_dim == 24 and not untied.tie_embeddings
  assert untied.qkv_bias and untied.out_bias and not untied.mlp_bias


def _v4_style(config: dict) -> dict:
  """A transformers-5 config.json rewritten as 4.x wrote it: rope_theta + rope_scaling."""
  config = dict(config)
  rope = dict(config.pop("rope_parameters"))
  config["rope_theta"] = rope.pop("rope_theta")
  config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}  # 4.x's older key name
  return config


def test_llama3_rope_reads_from_both_config_styles(checkpoints):
  v5 = json.loads((checkpoints["llama3"][0] / "config.json").read_text())
  assert v5["rope_parameters"]["rope_type"] == "llama3" and "rope_scaling" not in v5
  assert hf.config_from_hf(_v4_style(v5)) == hf.config_from_hf(v5)
  # 4.x configs may leave original_max_position_embeddings out: it is then the context.
  v4 = _v4_style(v5)
  del v4["rope_scaling"]["original_max_position_embeddings"]
  scaling = dict(hf.config_from_hf(v4).rope_scaling)
  assert scaling["original_max_position_embeddings"] == v5["max_position_embeddings"]


@pytest.mark.parametrize("head_dim, theta, original, factors", [
    (16, 500.0, 64, (8.0, 1.0, 4.0)),  # the test checkpoint's: every band is used
    (128, 500000.0, 8192, (8.0, 1.0, 4.0)),  # Llama 3.1 8B
    (64, 500000.0, 8192, (32.0, 1.0, 4.0)),  # Llama 3.2 1B
])
def test_llama3_rope_frequencies_equal_transformers(head_dim, theta, original, factors):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  factor, low, high = factors
  rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
          "high_freq_factor": high, "original_max_position_embeddings": original}
  ref_config = transformers.LlamaConfig(
      vocab_size=16, hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
      num_hidden_layers=1, intermediate_size=8, max_position_embeddings=16 * original,
      rope_parameters=rope)
  theirs, attention_scale = ROPE_INIT_FUNCTIONS["llama3"](ref_config, "cpu")
  assert attention_scale == 1.0
  cfg = hf.config_from_hf(ref_config.to_dict())
  ours = rope_frequencies(cfg)
  assert ours.shape == (head_dim // 2,) and ours.dtype == np.float32
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)
  # And the scaling is not a no-op here: plain RoPE's frequencies differ.
  plain = rope_frequencies(ModelConfig(**{**cfg.to_dict(), "rope_scaling": None}))
  np.testing.assert_allclose((plain / ours).max(), factor, rtol=1e-5)  # the low band


# Llama's greedy output is checked through the speculative test below (same output).
@pytest.mark.parametrize("name", ["gpt2", "qwen2", "llama3", "qwen3", "qwen3_untied"])
def test_greedy_generation_matches_transformers(checkpoints, name):
  directory, ref = checkpoints[name]
  model = hf.load_hf_model(directory)
  prompts = [[3, 5, 7, 9, 11, 2], [1, 4]]  # ragged on our side, one at a time on theirs
  ours = specjax.generate(model, prompts, max_new_tokens=8, temperature=0.0).tokens
  for prompt, row in zip(prompts, ours):
    theirs = ref.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert row == theirs[0, len(prompt):].tolist()


def test_speculative_greedy_with_imported_pair_matches_transformers(checkpoints):
  """Imported target + imported draft (different weights, same vocabulary), temperature 0."""
  (target_dir, ref), (draft_dir, _) = checkpoints["llama"], checkpoints["mistral"]
  target, draft = hf.load_hf_model(target_dir), hf.load_hf_model(draft_dir)
  prompt = [5, 9, 2, 5, 9, 2, 7]
  result = specjax.generate(target, [prompt], max_new_tokens=10, temperature=0.0, draft=draft,
                            gamma=3)
  theirs = ref.generate(
      torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0, eos_token_id=None)
  assert result.tokens[0] == theirs[0, len(prompt):].tolist()


def test_other_checkpoint_layouts(checkpoints, tmp_path):
  """Sharded safetensors, the original GPT-2 names (no prefix, mask buffers), torch pickles."""
  directory, ref = checkpoints["llama"]
  tokens = _tokens(112, (1, 9))
  sharded = tmp_path / "sharded"
  ref.save_pretrained(sharded, max_shard_size="20KB")
  assert (sharded / "model.safetensors.index.json").is_file()
  chex.assert_trees_all_close(np.asarray(hf.load_hf_model(sharded).logits(tokens)),
                              _torch_logits(ref, tokens), atol=ATOL, rtol=0)
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  shutil.copy(directory / "config.json", pickled)
  torch.save(ref.state_dict(), pickled / "pytorch_model.bin")
  chex.assert_trees_all_close(np.asarray(hf.load_hf_model(pickled).logits(tokens)),
                              _torch_logits(ref, tokens), atol=ATOL, rtol=0)

  directory, ref = checkpoints["gpt2"]
  legacy = _copy(directory, tmp_path)
  tensors = {k.removeprefix("transformer."): v
             for k, v in load_file(legacy / "model.safetensors").items()}
  for i in range(2):  # the causal-mask buffers old GPT-2 files carry
    tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 40, 40), np.float32))
  save_file(tensors, legacy / "model.safetensors", metadata={"format": "pt"})
  tokens = _tokens(96, (1, 9))
  chex.assert_trees_all_close(np.asarray(hf.load_hf_model(legacy).logits(tokens)),
                              _torch_logits(ref, tokens), atol=ATOL, rtol=0)


def test_bfloat16_safetensors(tmp_path):
  """Llama 3.x and Qwen checkpoints store bfloat16, which safetensors' numpy reader lacks."""
  ref = _perturb_(transformers.AutoModelForCausalLM.from_config(HF_CONFIGS["qwen3"]()), seed=7)
  ref.to(torch.bfloat16).save_pretrained(tmp_path)
  from safetensors import safe_open
  with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
  # The stored values in float32 (a fresh load: `.float()` would keep bfloat16 RoPE buffers).
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  model = hf.load_hf_model(tmp_path)
  tokens = _tokens(64, (2, 9))
  chex.assert_trees_all_close(np.asarray(model.logits(tokens)), _torch_logits(ref, tokens),
                              atol=ATOL, rtol=0)
  half = hf.load_hf_model(tmp_path, dtype=jax.numpy.bfloat16)
  dtypes = {x.dtype for x in jax.tree_util.tree_leaves(half.params)}
  assert dtypes == {np.dtype(jax.numpy.bfloat16)}
  chex.assert_trees_all_equal(
      jax.tree_util.tree_map(lambda x: x.astype(np.float32), half.params), model.params)


def _perturbed_init(cfg, seed):
  """A random specjax model whose biases and norm scales are not 0 and 1."""
  model = init_model(cfg, seed)
  rng = np.random.RandomState(seed)
  return model.with_params(jax.tree_util.tree_map(
      lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(np.float32), model.params))


EXPORT_CONFIGS = {  # name: (the transformers class it must become, config)
    "gpt2": ("GPT2LMHeadModel", ModelConfig(vocab_size=72, d_model=32, n_layers=2, n_heads=4,
                                            max_len=24, d_ff=48, norm_eps=1e-5)),
    "llama": ("LlamaForCausalLM", ModelConfig.llama(
        vocab_size=72, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=40,
        max_len=24, rope_theta=2000.0)),
    "qwen2": ("Qwen2ForCausalLM", ModelConfig.llama(
        vocab_size=72, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_len=24,
        qkv_bias=True, tie_embeddings=True)),
    "llama3": ("LlamaForCausalLM", ModelConfig.llama(
        vocab_size=72, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=40,
        max_len=24, rope_theta=500.0, tie_embeddings=True,
        rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})),
    "qwen3": ("Qwen3ForCausalLM", ModelConfig.llama(
        vocab_size=72, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=40,
        max_len=24, qk_norm=True, tie_embeddings=True)),
    "qwen3_biases": ("Qwen3ForCausalLM", ModelConfig.llama(
        vocab_size=72, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=20, d_ff=40,
        max_len=24, qk_norm=True, qkv_bias=True, out_bias=True)),
}


@pytest.mark.parametrize("name", list(EXPORT_CONFIGS))
def test_export_loads_in_transformers_with_same_logits(tmp_path, name):
  arch, cfg = EXPORT_CONFIGS[name]
  model = _perturbed_init(cfg, seed=1)
  hf.export_hf(model, tmp_path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(ref).__name__ == arch
  tokens = _tokens(72, (2, 11), seed=2)
  chex.assert_trees_all_close(_torch_logits(ref, tokens), np.asarray(model.logits(tokens)),
                              atol=ATOL, rtol=0)
  # And back: the round trip is exact.
  again = hf.load_hf_model(tmp_path)
  assert again.config == model.config
  chex.assert_trees_all_equal(again.params, model.params)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_untied"])
def test_import_then_export_gives_back_the_checkpoint(checkpoints, name):
  """transformers' own files -> specjax -> export: the same tensors, bit for bit."""
  directory, _ = checkpoints[name]
  model = hf.load_hf_model(directory)
  from specjax.models import pretrained
  assert pretrained.read_config(directory) == model.config  # config.json alone, first
  original = load_file(directory / "model.safetensors")
  exported = hf.params_to_hf(model.config, model.params)
  if model.config.tie_embeddings:  # a stored copy of a tied head is not ours to write
    original.pop("lm_head.weight", None)
  assert sorted(exported) == sorted(original)
  chex.assert_trees_all_equal(exported, original)
  assert hf.config_from_hf(hf.config_to_hf(model.config)) == model.config


def test_llama3_scaling_changes_the_logits(checkpoints):
  """The logits check above would catch ignored scaling: it moves them well past ATOL."""
  model = hf.load_hf_model(checkpoints["llama3"][0])
  plain_cfg = ModelConfig(**{**model.config.to_dict(), "rope_scaling": None})
  plain = Model(plain_cfg, model.params)
  tokens = _tokens(64, (1, 13))
  moved = np.abs(np.asarray(model.logits(tokens)) - np.asarray(plain.logits(tokens))).max()
  assert moved > 100 * ATOL


def test_pad_vocab_keeps_the_logits_and_adds_zero_rows():
  for tie in (True, False):
    model = _perturbed_init(ModelConfig.llama(vocab_size=40, d_model=16, n_layers=1, n_heads=2,
                                              max_len=16, tie_embeddings=tie), seed=3)
    padded = hf.pad_vocab(model, 48)
    assert padded.config.vocab_size == 48 and padded.config.tie_embeddings == tie
    tokens = _tokens(40, (1, 7))
    ours, theirs = np.asarray(padded.logits(tokens)), np.asarray(model.logits(tokens))
    np.testing.assert_allclose(ours[..., :40], theirs, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(ours[..., 40:], 0.0)
  with pytest.raises(ValueError, match="vocab_size must be"):
    hf.pad_vocab(model, 39)


def test_export_writes_tokenizer_and_import_attaches_it(tmp_path):
  tokenizer = Tokenizer.train(["the cat sat on the mat. " * 20, "a dog ran."], vocab_size=270)
  cfg = EXPORT_CONFIGS["gpt2"][1]
  cfg = ModelConfig(**{**cfg.to_dict(), "vocab_size": tokenizer.vocab_size})
  model = init_model(cfg, 0)
  model.tokenizer = tokenizer
  hf.export_hf(model, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["eos_token_id"] == tokenizer.eos_id
  loaded = hf.load_hf_model(tmp_path)
  assert loaded.tokenizer.encode("the cat ran") == tokenizer.encode("the cat ran")
  assert loaded.tokenizer.eos_id == tokenizer.eos_id
  # transformers' AutoTokenizer reads the end-of-text token and decodes as ours does.
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == tokenizer.eos_id
  text = "the cat , sat . on"
  assert auto(text)["input_ids"] == tokenizer.encode_prompt(text)
  assert auto.decode(tokenizer.encode(text)) == text
  assert config["bos_token_id"] == tokenizer.eos_id  # GPT-2's files name EOS for BOS


def _llama_style_tokenizer(extra_special=()):
  """A byte-level BPE whose post-processor puts <s> (id 1) first; </s> (id 2) ends text."""
  raw = byte_bpe(["def f(x):\n    return x\n"] * 10, 280, ["<unk>", "<s>", "</s>"], bos="<s>")
  size = raw.get_vocab_size()
  raw.add_special_tokens(list(extra_special))
  return Tokenizer(raw, eos_token="</s>"), size


def test_export_names_a_llama_tokenizers_bos(tmp_path):
  """A tokenizer whose post-processor puts <s> first exports <s> as its BOS (config.json
  and tokenizer_config.json), not its EOS: transformers' AutoTokenizer agrees with the ids
  it encodes."""
  tokenizer, size = _llama_style_tokenizer()
  model = init_model(ModelConfig.llama(vocab_size=size, d_model=16, n_layers=1, n_heads=2,
                                       max_len=32), 0)
  model.tokenizer = tokenizer
  hf.export_hf(model, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert (auto.bos_token, auto.bos_token_id, auto.eos_token) == ("<s>", 1, "</s>")
  assert auto("def f")["input_ids"] == tokenizer.encode_prompt("def f") == [1] + \
      tokenizer.encode("def f")


def test_end_of_text_ids_past_the_embedding_are_left_out(tmp_path):
  """A tokenizer larger than its model (an end-of-turn token added past the embedding)
  whose end-of-text list names the extra id: the model can never emit it, so the default
  eos_id='auto' stops at the rest instead of refusing an id the caller never passed."""
  tokenizer, size = _llama_style_tokenizer(["<|eot|>"])
  model = init_model(ModelConfig.llama(vocab_size=size, d_model=16, n_layers=1, n_heads=2,
                                       max_len=32), 0)
  model.tokenizer = tokenizer
  hf.export_hf(model, tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, size]}))
  loaded = hf.load_hf_model(tmp_path)
  assert loaded.tokenizer.eos_ids == (2, size) and loaded.eos_ids == [2]
  res = specjax.generate(loaded, ["def"], max_new_tokens=6, min_new_tokens=2,
                         logit_bias={2: 60.0})
  assert res.tokens[0][-1] == 2 and len(res.tokens[0]) == 3
  # Its own end-of-text token past the embedding: the export names the one config.json does.
  model.tokenizer = Tokenizer(tokenizer._tok, eos_token="<|eot|>", more_eos_ids=[2])
  assert model.eos_ids == [2]
  hf.export_hf(model, tmp_path / "again")
  assert json.loads((tmp_path / "again" / "config.json").read_text())["eos_token_id"] == 2
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
  assert (auto.eos_token, auto.eos_token_id, auto.bos_token_id) == ("</s>", 2, 1)


def test_every_end_of_text_id_in_the_configs_stops_a_row(tmp_path):
  """config.json's eos_token_id list and generation_config.json's (Llama 3 lists
  <|eot_id|> there) all end generation, as in transformers' generate; ids the tokenizer
  lacks are dropped; an unreadable generation_config.json is named."""
  tokenizer = Tokenizer.train(["the cat sat on the mat. " * 20, "a dog ran."], vocab_size=270)
  cfg = EXPORT_CONFIGS["gpt2"][1]
  model = init_model(ModelConfig(**{**cfg.to_dict(), "vocab_size": tokenizer.vocab_size}), 0)
  model.tokenizer = tokenizer
  hf.export_hf(model, tmp_path)
  _edit_config(tmp_path, eos_token_id=[tokenizer.eos_id, 7, 10**6])
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
  loaded = hf.load_hf_model(tmp_path)
  assert loaded.tokenizer.eos_id == tokenizer.eos_id
  assert loaded.tokenizer.eos_ids == (tokenizer.eos_id, 7, 9)
  res = specjax.generate(loaded, [[1, 2]], max_new_tokens=8, min_new_tokens=2,
                         logit_bias={9: 60.0})
  assert len(res.tokens[0]) == 3 and res.tokens[0][-1] == 9 and res.stop_reasons == [9]
  hf.export_hf(loaded, tmp_path / "again")  # all of them in its config.json's list
  assert json.loads((tmp_path / "again" / "config.json").read_text())["eos_token_id"] == [
      tokenizer.eos_id, 7, 9]
  assert hf.load_hf_model(tmp_path / "again").tokenizer.eos_ids == (tokenizer.eos_id, 7, 9)
  # Without tokenizer.json (a sentencepiece-only repository) token-id prompts stop there too,
  # and an export keeps the list; ids past the vocabulary are dropped.
  (tmp_path / "tokenizer.json").unlink()
  bare = hf.load_hf_model(tmp_path)
  assert bare.tokenizer is None and bare.eos_ids == [tokenizer.eos_id, 7, 9]
  res = specjax.generate(bare, [[1, 2]], max_new_tokens=8, min_new_tokens=2,
                         logit_bias={9: 60.0})
  assert len(res.tokens[0]) == 3 and res.stop_reasons == [9]
  assert specjax.shard(bare, jax.make_mesh((1, 1), ("data", "model"))).eos_ids == bare.eos_ids
  assert specjax.quantize(bare).eos_ids == bare.eos_ids
  hf.export_hf(bare, tmp_path / "bare")
  assert hf.load_hf_model(tmp_path / "bare").eos_ids == [tokenizer.eos_id, 7, 9]
  assert json.loads((tmp_path / "bare" / "config.json").read_text())["bos_token_id"] is None
  # A tokenizer the user attaches (sentencepiece, say) that names no EOS keeps the config's.
  bare.tokenizer = types.SimpleNamespace(encode=lambda text: [1], decode=lambda ids: "")
  assert bare.eos_ids == [tokenizer.eos_id, 7, 9]
  (tmp_path / "generation_config.json").write_text("{")
  with pytest.raises(ValueError, match="generation_config.json is unreadable"):
    hf.load_hf_model(tmp_path)


def test_stop_strings_stop_where_transformers_stops(tmp_path):
  """The shipped target exported with its tokenizer: greedy output cut by text stop
  strings (inside a token, spanning tokens, running past a token's end) as transformers'
  `stop_strings` cut it."""
  target = specjax.load_pretrained("stdlib-target")
  hf.export_hf(target, tmp_path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
  prompt = target.tokenizer.encode("def read_lines(path):\n   ")
  stopped = 0
  for stop in [None, " file obj", "\n\n", "le ob", "ject.", "bjec", "Return the file",
               ". The"]:
    ours = specjax.generate(target, [prompt], max_new_tokens=32,
                            stop_sequences=None if stop is None else [stop]).tokens[0]
    extra = {} if stop is None else dict(stop_strings=[stop], tokenizer=tok)
    theirs = ref.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=32, pad_token_id=0, eos_token_id=None, **extra)
    assert ours == theirs[0, len(prompt):].tolist(), stop
    stopped += len(ours) < 32
  assert stopped >= 5  # most of the strings do occur, and stop both


# -- errors ------------------------------------------------------------------------


def _copy(directory, tmp_path):
  return shutil.copytree(directory, tmp_path / "ckpt")


def _edit_config(directory, **changes):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def test_mismatched_shape_names_the_tensor(checkpoints, tmp_path):
  directory = _copy(checkpoints["llama"][0], tmp_path)
  tensors = load_file(directory / "model.safetensors")
  name = "model.layers.1.self_attn.k_proj.weight"
  tensors[name] = np.zeros((48, 48), np.float32)  # as if the heads were not grouped
  save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"k_proj\.weight.*\(48, 48\).*\(32, 48\)"):
    hf.load_hf_model(directory)


def test_missing_tensor_is_named(checkpoints, tmp_path):
  directory = _copy(checkpoints["gpt2"][0], tmp_path)
  tensors = load_file(directory / "model.safetensors")
  del tensors["transformer.h.1.mlp.c_fc.bias"]
  save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"missing.*h\.1\.mlp\.c_fc\.bias"):
    hf.load_hf_model(directory)


def test_weights_the_config_does_not_explain_are_refused(checkpoints, tmp_path):
  # Qwen2 weights (q/k/v biases) under a Llama config that says there are none.
  directory = _copy(checkpoints["qwen2"][0], tmp_path)
  _edit_config(directory, model_type="llama", architectures=["LlamaForCausalLM"])
  with pytest.raises(ValueError, match=r"q_proj\.bias"):
    hf.load_hf_model(directory)


@pytest.mark.parametrize("name, changes, message", [
    ("gpt2", {"model_type": "gpt_neox"}, "unsupported Hugging Face model_type 'gpt_neox'"),
    ("gpt2", {"activation_function": "gelu"}, "activation_function 'gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
     "RoPE scaling 'yarn'"),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
    ("llama3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "RoPE scaling 'dynamic'"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     r"'llama3' needs \['low_freq_factor', 'high_freq_factor'\]"),
    ("llama3", {"rope_parameters": {**LLAMA3_ROPE, "beta_fast": 32}}, "beta_fast"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    # Values a hand edit gets wrong: read as they were, the model would be another one.
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ("gpt2", {"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false"),
    ("llama", {"rms_norm_eps": -1.0}, "norm_eps must be a finite number > 0"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a positive int, got 0"),
    ("mistral", {"sliding_window": "x"}, "sliding_window must be a positive int, got 'x'"),
])
def test_unsupported_architectures_are_refused(checkpoints, tmp_path, name, changes, message):
  directory = _copy(checkpoints[name][0], tmp_path)
  _edit_config(directory, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_hf_model(directory)


def test_overwritten_weight_bytes_are_refused(checkpoints, tmp_path):
  """safetensors has no checksum: bytes overwritten at the file's end read as NaNs."""
  directory = _copy(checkpoints["llama"][0], tmp_path)
  weights = directory / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[-64:] = b"\xff" * 64
  weights.write_bytes(bytes(data))
  for dtype in ("float32", "bfloat16"):
    with pytest.raises(ValueError, match="holds NaN or inf values"):
      hf.load_hf_model(directory, dtype=dtype)


def test_sliding_window_caps_max_len(checkpoints, tmp_path):
  directory = _copy(checkpoints["mistral"][0], tmp_path)
  _edit_config(directory, sliding_window=16)
  assert hf.load_hf_model(directory).config.max_len == 16


def test_export_replaces_only_an_earlier_export(tmp_path):
  cfg = ModelConfig.llama(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8)
  model = init_model(cfg)
  checkpoint.save_model(tmp_path / "ours", model.config, model.params)
  with pytest.raises(ValueError, match=r"holds files an export does not write \(model.json, params.npz\)"):
    hf.export_hf(model, tmp_path / "ours")
  assert hf.load_hf_model(hf.export_hf(model, tmp_path / "out")).config == cfg
  for name in ("tokenizer.json", "tokenizer_config.json"):  # as from a model with one
    (tmp_path / "out" / name).write_text("{}")
  hf.export_hf(model, tmp_path / "out")  # again, a model without: no stale tokenizer
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json",
                                                                  "model.safetensors"]


def test_export_refuses_configs_transformers_cannot_run(tmp_path):
  cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8,
                    position="rope")  # GPT-2 with RoPE exists nowhere in transformers
  with pytest.raises(ValueError, match="position='rope'"):
    hf.export_hf(init_model(cfg), tmp_path / "out")
  cfg = ModelConfig.llama(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8,
                          qk_norm=True, mlp_bias=True)  # Qwen3 has no MLP biases
  with pytest.raises(ValueError, match="qk_norm=True.*mlp_bias=True"):
    hf.export_hf(init_model(cfg), tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_bad_paths_and_offline_hub(tmp_path):
  with pytest.raises(ValueError, match="has no config.json"):
    hf.load_hf_model(tmp_path)
  with pytest.raises(ValueError, match="not a model directory"):
    hf.load_hf_model(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="Hugging Face Hub"):
    hf.load_hf_model("specjax-tests/no-such-model")
  with pytest.raises(ValueError, match="floating dtype"):
    hf.load_hf_model(tmp_path, dtype="int32")


def test_corrupt_files_are_named(checkpoints, tmp_path):
  directory = _copy(checkpoints["gpt2"][0], tmp_path)
  blob = (directory / "model.safetensors").read_bytes()
  (directory / "model.safetensors").write_bytes(blob[: len(blob) // 3])
  with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt"):
    hf.load_hf_model(directory)
  (directory / "model.safetensors").unlink()
  (directory / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a whole zip")
  with pytest.raises(ValueError, match=r"pytorch_model\.bin is truncated or corrupt"):
    hf.load_hf_model(directory)
  (directory / "config.json").write_text('{"model_type": "gpt2",')
  with pytest.raises(ValueError, match=r"config\.json is unreadable or not valid JSON"):
    hf.load_hf_model(directory)
  with pytest.raises(ValueError, match=r"config\.json is unreadable or not valid JSON"):
    specjax.load_pretrained(directory)
