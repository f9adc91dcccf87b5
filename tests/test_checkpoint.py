"""Model checkpoints: bit-exact round trips and clear errors for broken files."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import checkpoint
from specjax.models.config import ModelConfig
from specjax.models.model import abstract_params, init_model
from specjax.models.tokenizer import Tokenizer

CONFIGS = {
    "gpt2": ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, max_len=32),
    "llama": ModelConfig.llama(vocab_size=50, d_model=16, n_layers=2, n_heads=4,
                               n_kv_heads=2, max_len=32),
    # Qwen3-style q/k norms with a head_dim of its own, and Llama 3.x RoPE scaling.
    "qk_norm_llama3": ModelConfig.llama(
        vocab_size=50, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6,
        max_len=32, qk_norm=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def _assert_bit_equal(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  jax.tree_util.tree_map(
      lambda x, y: np.testing.assert_array_equal(
          np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), a, b)
  chex.assert_trees_all_equal_dtypes(a, b)


@pytest.mark.parametrize("style", sorted(CONFIGS))
def test_round_trip_is_bit_exact(style, tmp_path):
  model = init_model(CONFIGS[style], seed=3)
  checkpoint.save_model(tmp_path / "m", model.config, model.params, metadata={"note": "x"})
  assert checkpoint.is_checkpoint(tmp_path / "m")
  cfg, params = checkpoint.load_params(tmp_path / "m")
  assert cfg == model.config
  _assert_bit_equal(params, model.params)
  loaded = checkpoint.load_model(tmp_path / "m")
  assert loaded.tokenizer is None and loaded.num_params == model.num_params
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  np.testing.assert_array_equal(loaded.logits(tokens), model.logits(tokens))
  manifest = checkpoint.read_manifest(tmp_path / "m")
  assert manifest["metadata"] == {"note": "x"} and manifest["num_params"] == model.num_params


def test_bfloat16_storage_round_trips_its_bits(tmp_path):
  model = init_model(CONFIGS["llama"], seed=0)
  checkpoint.save_model(tmp_path, model.config, model.params, dtype=jnp.bfloat16)
  as_bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), model.params)
  _, stored = checkpoint.load_params(tmp_path)  # as stored
  _assert_bit_equal(stored, as_bf16)
  _, widened = checkpoint.load_params(tmp_path, dtype=jnp.float32)
  _assert_bit_equal(widened, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), as_bf16))
  checkpoint.save_model(tmp_path / "f32", model.config, model.params)
  assert (tmp_path / "params.npz").stat().st_size < (tmp_path / "f32" / "params.npz").stat().st_size
  manifest = json.loads((tmp_path / "model.json").read_text())
  for other in ("float16", "int16"):  # bfloat16's width, not its bits
    for spec in manifest["params"].values():
      spec["dtype"] = other
    (tmp_path / "model.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=f"uint16, which cannot be read as "
                                                          f"the manifest's {other}"):
      checkpoint.load_params(tmp_path)


def test_tokenizer_travels_with_the_model(tmp_path):
  tok = Tokenizer.train(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
  model = init_model(ModelConfig(vocab_size=300, d_model=8, n_layers=1, n_heads=1,
                                 max_len=16), seed=0)
  checkpoint.save_model(tmp_path, model.config, model.params, tokenizer=tok)
  loaded = checkpoint.load_model(tmp_path)
  assert loaded.tokenizer.encode("return x") == tok.encode("return x")
  assert loaded.tokenizer.eos_id == tok.eos_id


@pytest.fixture
def saved(tmp_path):
  model = init_model(CONFIGS["gpt2"], seed=0)
  return checkpoint.save_model(tmp_path / "ckpt", model.config, model.params)


def test_missing_checkpoint_names_the_path(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(checkpoint.CheckpointError, match="not found.*nowhere"):
    checkpoint.load_model(missing)
  assert issubclass(checkpoint.CheckpointError, ValueError)


def test_truncated_params_names_the_file(saved):
  params_file = saved / "params.npz"
  blob = params_file.read_bytes()
  params_file.write_bytes(blob[: len(blob) // 2])
  with pytest.raises(checkpoint.CheckpointError, match=r"params\.npz.*truncated or corrupt"):
    checkpoint.load_model(saved)


def test_flipped_byte_is_caught(saved):
  params_file = saved / "params.npz"
  blob = bytearray(params_file.read_bytes())
  blob[len(blob) // 2] ^= 0xFF
  params_file.write_bytes(bytes(blob))
  with pytest.raises(checkpoint.CheckpointError, match="ckpt"):
    checkpoint.load_params(saved)


def test_missing_files_and_bad_manifest(saved):
  (saved / "params.npz").unlink()
  with pytest.raises(checkpoint.CheckpointError, match="missing params.npz"):
    checkpoint.load_model(saved)
  (saved / "model.json").write_text("{ not json")
  with pytest.raises(checkpoint.CheckpointError, match="model.json.*unreadable"):
    checkpoint.load_model(saved)
  (saved / "model.json").unlink()
  with pytest.raises(checkpoint.CheckpointError, match="no model.json"):
    checkpoint.load_model(saved)
  assert not checkpoint.is_checkpoint(saved)


def test_params_that_do_not_fit_the_config(saved):
  manifest = json.loads((saved / "model.json").read_text())
  manifest["config"]["n_layers"] = 3
  (saved / "model.json").write_text(json.dumps(manifest))
  with pytest.raises(checkpoint.CheckpointError, match="does not match its config"):
    checkpoint.load_model(saved)


def test_an_array_the_manifest_does_not_list_is_refused(saved):
  """params.npz and model.json must name the same parameters (heads share this check)."""
  import hashlib
  import io
  with np.load(saved / "params.npz") as stored:
    arrays = dict(stored)
  arrays["blocks/2/mlp/up/kernel"] = np.zeros((2, 2), np.float32)
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  (saved / "params.npz").write_bytes(buffer.getvalue())
  manifest = json.loads((saved / "model.json").read_text())
  manifest["params_sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
  (saved / "model.json").write_text(json.dumps(manifest))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"ckpt does not match its config: .*unexpected \['blocks/2/mlp"):
    checkpoint.load_model(saved)


def test_config_fields_are_hashable_and_json_round_trip():
  cfg = CONFIGS["qk_norm_llama3"]
  assert isinstance(cfg.rope_scaling, tuple) and hash(cfg) == hash(ModelConfig.from_dict(
      json.loads(cfg.to_json())))
  assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
  assert json.loads(cfg.to_json())["rope_scaling"]["rope_type"] == "llama3"
  # The same scaling given as pairs in another order (or ints for floats) is the same config.
  pairs = tuple(reversed(cfg.rope_scaling))
  assert ModelConfig(**{**cfg.to_dict(), "rope_scaling": pairs}) == cfg
  # Manifests written before these fields existed still load, with the fields off.
  old = {k: v for k, v in CONFIGS["llama"].to_dict().items()
         if k not in ("rope_scaling", "qk_norm")}
  assert ModelConfig.from_dict(old) == CONFIGS["llama"]
  assert CONFIGS["llama"].rope_scaling is None and not CONFIGS["llama"].qk_norm


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
    ({"rope_type": "llama3", "factor": 8.0}, "missing.*low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 16}, "high_freq_factor > low_freq_factor"),
    ({"rope_type": "llama3", "factor": -1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, "factor must be a positive number"),
])
def test_bad_rope_scaling_is_refused(scaling, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.llama(vocab_size=8, d_model=8, n_layers=1, n_heads=2, max_len=8,
                      rope_scaling=scaling)
  with pytest.raises(ValueError, match="needs position='rope'"):
    ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, max_len=8,
                rope_scaling=CONFIGS["qk_norm_llama3"].rope_scaling)


def test_abstract_params_describe_the_real_ones():
  for cfg in CONFIGS.values():
    params = init_model(cfg, seed=0).params
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract_params(cfg), params)
  # q/k norms add exactly their two scales per layer: other trees are unchanged.
  with_norms = abstract_params(CONFIGS["qk_norm_llama3"])["blocks"][0]["attn"]
  assert with_norms["q_norm"]["scale"].shape == with_norms["k_norm"]["scale"].shape == (6,)
  assert set(abstract_params(CONFIGS["llama"])["blocks"][0]["attn"]) == {"qkv", "out"}


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("params_sha256"), "no 'params_sha256' entry"),
    (lambda m: m.pop("config"), "no 'config' entry"),
    (lambda m: m.update(params=[1]), "'params' must be an object"),
    (lambda m: m["config"].update(vocab_size=-3), "config is invalid.*vocab_size"),
    (lambda m: m["config"].update(colour="red"), "config is invalid.*colour"),
    (lambda m: next(iter(m["params"].values())).pop("dtype"), "no valid dtype"),
    (lambda m: next(iter(m["params"].values())).update(dtype=None), "no valid dtype"),
    (lambda m: [v.update(dtype="float64") for v in m["params"].values()],
     "cannot be read as|has shape"),
    (lambda m: m["config"].update(n_kv_heads=0), "config is invalid.*n_kv_heads"),
    # The same width, other bits: read as those bits, every weight would be wrong.
    (lambda m: [v.update(dtype="int32") for v in m["params"].values()],
     "stored as float32, which cannot be read as the manifest's int32"),
    (lambda m: m["config"].update(norm_eps=-1.0), "config is invalid.*norm_eps"),
    (lambda m: m["config"].update(rope_theta=0), "config is invalid.*rope_theta"),
    (lambda m: m["config"].update(tie_embeddings="false"), "config is invalid.*tie_embeddings"),
])
def test_a_hand_edited_manifest_names_what_is_wrong(saved, edit, message):
  manifest = json.loads((saved / "model.json").read_text())
  edit(manifest)
  (saved / "model.json").write_text(json.dumps(manifest))
  with pytest.raises(checkpoint.CheckpointError, match=message):
    checkpoint.load_model(saved)


def test_a_manifest_that_is_not_an_object(saved):
  (saved / "model.json").write_text("[1, 2]")
  with pytest.raises(checkpoint.CheckpointError, match="not a specjax-model manifest"):
    checkpoint.load_model(saved)


@pytest.mark.parametrize("dtype", ["int8", "bogus"])
def test_a_dtype_that_is_not_floating_is_refused(saved, dtype):
  with pytest.raises(ValueError, match="dtype must be a floating dtype"):
    checkpoint.load_model(saved, dtype=dtype)
