"""Hugging Face import/export, checked against transformers itself (the `hf` extra).

Tiny random checkpoints are made by transformers with torch and saved with
`save_pretrained`; every weight is perturbed first, so a bias or norm left at its
initial 0 or 1 cannot hide a mapping error. Float32 throughout.
"""

import json
import os
import shutil

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
from specjax.config import ModelConfig  # noqa: E402
from specjax.model import init_model  # noqa: E402
from specjax.tokenizer import Tokenizer  # noqa: E402

ATOL = 1e-4

# Each a family/feature the importer must get right: GPT-2 with a non-default MLP width
# and epsilon; Llama with grouped-query attention, head_dim != hidden/heads and a
# non-default RoPE base; Qwen2 with q/k/v biases, one KV head and a tied head; Llama with
# attention and MLP biases; Mistral (no window within max_len; Llama's draft below).
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
  assert hf.load_hf_model(checkpoints["mistral"][0]).config.head_dim is None  # the default
  assert not llama.tie_embeddings and not llama.qkv_bias
  qwen2 = hf.load_hf_model(checkpoints["qwen2"][0]).config
  assert qwen2.qkv_bias and not qwen2.out_bias and qwen2.tie_embeddings
  gpt2 = hf.load_hf_model(checkpoints["gpt2"][0]).config
  assert (gpt2.max_len, gpt2.ff_dim, gpt2.norm_eps) == (40, 80, 1e-4)


# Llama's greedy output is checked through the speculative test below (same output).
@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
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


def _perturbed_init(cfg, seed):
  """A random specjax model whose biases and norm scales are not 0 and 1."""
  model = init_model(cfg, seed)
  rng = np.random.RandomState(seed)
  return model.with_params(jax.tree_util.tree_map(
      lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(np.float32), model.params))


EXPORT_CONFIGS = {
    "GPT2LMHeadModel": ModelConfig(vocab_size=72, d_model=32, n_layers=2, n_heads=4,
                                   max_len=24, d_ff=48, norm_eps=1e-5),
    "LlamaForCausalLM": ModelConfig.llama(vocab_size=72, d_model=32, n_layers=2, n_heads=4,
                                          n_kv_heads=2, head_dim=12, d_ff=40, max_len=24,
                                          rope_theta=2000.0),
    "Qwen2ForCausalLM": ModelConfig.llama(vocab_size=72, d_model=32, n_layers=2, n_heads=4,
                                          n_kv_heads=2, max_len=24, qkv_bias=True,
                                          tie_embeddings=True),
}


@pytest.mark.parametrize("arch", list(EXPORT_CONFIGS))
def test_export_loads_in_transformers_with_same_logits(tmp_path, arch):
  model = _perturbed_init(EXPORT_CONFIGS[arch], seed=1)
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


def test_export_writes_tokenizer_and_import_attaches_it(tmp_path):
  tokenizer = Tokenizer.train(["the cat sat on the mat. " * 20, "a dog ran."], vocab_size=270)
  cfg = EXPORT_CONFIGS["GPT2LMHeadModel"]
  cfg = ModelConfig(**{**cfg.to_dict(), "vocab_size": tokenizer.vocab_size})
  model = init_model(cfg, 0)
  model.tokenizer = tokenizer
  hf.export_hf(model, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["eos_token_id"] == tokenizer.eos_id
  loaded = hf.load_hf_model(tmp_path)
  assert loaded.tokenizer.encode("the cat ran") == tokenizer.encode("the cat ran")
  assert loaded.tokenizer.eos_id == tokenizer.eos_id


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
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "RoPE scaling 'llama3'"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_architectures_are_refused(checkpoints, tmp_path, name, changes, message):
  directory = _copy(checkpoints[name][0], tmp_path)
  _edit_config(directory, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load_hf_model(directory)


def test_sliding_window_caps_max_len(checkpoints, tmp_path):
  directory = _copy(checkpoints["mistral"][0], tmp_path)
  _edit_config(directory, sliding_window=16)
  assert hf.load_hf_model(directory).config.max_len == 16


def test_export_refuses_configs_transformers_cannot_run(tmp_path):
  cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8,
                    position="rope")  # GPT-2 with RoPE exists nowhere in transformers
  with pytest.raises(ValueError, match="position='rope'"):
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
