"""The shipped pair loads by name, generates text, and still measures what its card says."""

import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models import checkpoint
from specjax.models import pretrained
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_kv
from specjax.models.model import Model, forward_cached_jit, init_model
from specjax.training import lm as train_lib

CARD = json.loads((pretrained.checkpoints_dir() / "card.json").read_text())


@pytest.fixture(scope="module")
def target():
  return pretrained.load_pretrained("stdlib-target")


@pytest.fixture(scope="module")
def draft():
  return pretrained.load_pretrained("stdlib-draft")


def test_pair_loads_by_name_with_one_tokenizer(target, draft):
  for model, role in ((target, "target"), (draft, "draft")):
    assert isinstance(model, Model) and model.tokenizer is not None
    assert model.num_params == CARD[role]["num_params"]
    assert model.config == ModelConfig.from_dict(CARD[role]["config"])
    assert jax.tree_util.tree_leaves(model.params)[0].dtype == jnp.float32
  assert target.config.vocab_size == draft.config.vocab_size == target.tokenizer.vocab_size
  text = "def main():\n    print('héllo')\n"
  assert target.tokenizer.encode(text) == draft.tokenizer.encode(text)
  assert target.tokenizer.decode(target.tokenizer.encode(text)) == text
  assert draft.num_params * 5 < target.num_params


def test_target_heldout_loss_matches_the_card(target):
  from experiments.common import heldout_windows
  windows = heldout_windows(target.tokenizer, 256, CARD["target"]["test_slice_windows"])
  loss = train_lib.evaluate(target.graphdef, target.params, windows)["loss"]
  # The slice is cut from this interpreter's stdlib; other Python versions shift it a bit.
  same_python = sys.version.split()[0] == CARD["environment"]["python"]
  assert abs(loss - CARD["target"]["test_slice_loss"]) < (0.02 if same_python else 0.3)


def test_generates_text_from_a_prompt(target):
  tok = target.tokenizer
  prompt = tok.encode("import os\n\n\ndef ")
  kv = init_kv(target.config, 1, 64)
  logits, kv = forward_cached_jit(target.graphdef, target.params, jnp.asarray([prompt]), kv)
  out = []
  for _ in range(12):
    nxt = int(jnp.argmax(logits[0, -1]))
    out.append(nxt)
    logits, kv = forward_cached_jit(target.graphdef, target.params, jnp.asarray([[nxt]]), kv)
  text = tok.decode(prompt + out)
  assert text.startswith("import os\n\n\ndef ") and len(text) > len("import os\n\n\ndef ") + 5


def test_unknown_name_lists_the_known_ones():
  with pytest.raises(ValueError, match="stdlib-target, stdlib-draft"):
    pretrained.load_pretrained("no such model!")


def test_missing_shipped_folder_names_the_path(tmp_path, monkeypatch):
  monkeypatch.setenv(pretrained.ENV_VAR, str(tmp_path / "elsewhere"))
  with pytest.raises(checkpoint.CheckpointError, match="elsewhere"):
    pretrained.load_pretrained("stdlib-draft")


def test_own_directory_loads_directly(tmp_path):
  model = init_model(ModelConfig(vocab_size=20, d_model=8, n_layers=1, n_heads=1, max_len=8))
  checkpoint.save_model(tmp_path, model.config, model.params)
  loaded = pretrained.load_pretrained(tmp_path)
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, model.params)
  (tmp_path / "model.json").unlink()
  with pytest.raises(ValueError, match="neither"):
    pretrained.load_pretrained(tmp_path)


def test_hugging_face_dirs_and_hub_ids_go_to_specjax_hf(tmp_path, monkeypatch):
  calls = []
  fake = types.ModuleType("specjax.hf")
  fake.load_hf_model = lambda name, dtype, mesh=None: calls.append((name, dtype, mesh)) or "hf-model"
  monkeypatch.setitem(sys.modules, "specjax.hf", fake)
  monkeypatch.setattr(specjax, "hf", fake, raising=False)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  assert pretrained.load_pretrained(tmp_path) == "hf-model"
  assert pretrained.load_pretrained("gpt2", dtype=jnp.bfloat16) == "hf-model"
  assert pretrained.load_pretrained("org/some-model") == "hf-model"
  assert calls == [(str(tmp_path), jnp.float32, None), ("gpt2", jnp.bfloat16, None),
                   ("org/some-model", jnp.float32, None)]


@pytest.mark.parametrize("name", [None, "", "  ", 3])
def test_no_name_is_refused(name):  # "" would have been the current directory
  with pytest.raises(ValueError, match="expected a model name"):
    pretrained.load_pretrained(name)


def test_a_missing_directory_is_named(tmp_path):
  with pytest.raises(ValueError, match=f"no directory {tmp_path}/a/b/c"):
    pretrained.load_pretrained(tmp_path / "a" / "b" / "c")


def test_read_config_reads_no_weights(tmp_path):
  model = init_model(ModelConfig(vocab_size=20, d_model=8, n_layers=1, n_heads=1, max_len=8))
  checkpoint.save_model(tmp_path, model.config, model.params)
  (tmp_path / checkpoint.PARAMS).write_bytes(b"truncated")
  assert pretrained.read_config(tmp_path) == model.config  # the weights are never read
  with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
    pretrained.load_pretrained(tmp_path)
  assert pretrained.read_config("stdlib-target") == pretrained.load_pretrained(
      "stdlib-target").config
  head = pretrained.read_config("stdlib-eagle")
  assert head.kind == "eagle" and head.target == pretrained.read_config("stdlib-target")
  assert pretrained.read_config("org/some-model") is None  # a hub id is not fetched for a look
  for bad, match in ((tmp_path / "nowhere", "no directory"), ("./stdlib-targte", "known names")):
    with pytest.raises(ValueError, match=match):
      pretrained.read_config(bad)
