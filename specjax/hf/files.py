"""Hugging Face model directories: reading weights, tokenizer and config; writing them.

A model is a local directory (config.json, safetensors weights whole or sharded, or
pytorch_model.bin; tokenizer.json) or a hub id fetched with huggingface_hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.hf.config import config_from_hf, config_to_hf, export_type
from specjax.hf.weights import params_from_hf, params_to_hf
from specjax.models import tokenizer as tokenizer_lib
from specjax.models.model import Model, float_dtype

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class CheckpointTensors:
  """Names and shapes of a checkpoint's tensors up front; the arrays on demand."""

  def __init__(self, directory: Path, file: Path | None = None):
    """The weights of a model directory, or of one named `file` (.safetensors or a
    torch state dict)."""
    self._file_of: dict[str, Path] = {}
    self._shapes: dict[str, tuple[int, ...]] = {}
    self._bf16: set[str] = set()  # safetensors' numpy reader has no bfloat16
    self._torch_state = None
    if file is not None:
      if file.suffix == ".safetensors":
        self._read_safetensors([file])
      else:
        self._read_torch([file])
    elif (directory / "model.safetensors").is_file():
      self._read_safetensors([directory / "model.safetensors"])
    elif (directory / "model.safetensors.index.json").is_file():
      self._read_safetensors(self._shards(directory / "model.safetensors.index.json"))
    elif (directory / "pytorch_model.bin").is_file():
      self._read_torch([directory / "pytorch_model.bin"])
    elif (directory / "pytorch_model.bin.index.json").is_file():
      self._read_torch(self._shards(directory / "pytorch_model.bin.index.json"))
    else:
      raise ValueError(f"no weights in {directory}: expected one of {', '.join(WEIGHT_FILES)}")

  @staticmethod
  def _shards(index_path: Path) -> list[Path]:
    weight_map = read_config(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index_path} has no 'weight_map'")
    shards = sorted({index_path.parent / name for name in weight_map.values()})
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
      raise ValueError(f"{index_path} names shard files that are missing: {missing}")
    return shards

  def _read_safetensors(self, files: list[Path]):
    try:
      from safetensors import safe_open
    except ImportError as e:
      raise ValueError("reading Hugging Face weights needs safetensors "
                       "(pip install 'specjax[hf]')") from e
    for path in files:
      try:
        with safe_open(str(path), framework="numpy") as f:
          for name in f.keys():
            self._file_of[name] = path
            self._shapes[name] = tuple(f.get_slice(name).get_shape())
            if f.get_slice(name).get_dtype() == "BF16":
              self._bf16.add(name)
      except Exception as e:  # safetensors raises its own SafetensorError (not a ValueError)
        raise ValueError(f"weights file {path} is truncated or corrupt: "
                         f"{type(e).__name__}: {e}") from e

  def _read_torch(self, files: list[Path]):
    try:
      import torch
    except ImportError as e:
      raise ValueError("this checkpoint has only pytorch_model.bin weights, which need torch "
                       "(pip install 'specjax[hf]'); safetensors weights do not") from e
    self._torch_state = {}
    for path in files:
      try:
        self._torch_state.update(torch.load(str(path), map_location="cpu", weights_only=True,
                                            mmap=True))
      except Exception as e:  # torch raises OSError, RuntimeError or pickle errors
        raise ValueError(f"weights file {path} is truncated or corrupt: "
                         f"{type(e).__name__}: {e}") from e
    self._shapes = {k: tuple(t.shape) for k, t in self._torch_state.items()}

  def names(self) -> list[str]:
    return list(self._shapes)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._shapes[name]

  def load(self, name: str) -> np.ndarray:
    if self._torch_state is not None:
      import torch
      tensor = self._torch_state[name]
      if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16 of its own
        tensor = tensor.float()
      return tensor.numpy()
    if name in self._bf16:
      return _read_bf16(self._file_of[name], name)
    from safetensors import safe_open
    with safe_open(str(self._file_of[name]), framework="numpy") as f:
      return f.get_tensor(name)


def looks_like_hub_id(name: str) -> bool:
  """'gpt2' or 'org/name': no path syntax beyond one slash, nothing that exists locally.

  The one rule for both `specjax.load_pretrained` and `load_hf_model`.
  """
  parts = name.split("/")
  return (len(parts) <= 2 and all(parts) and not name.startswith((".", "~"))
          and all(c.isalnum() or c in "-_." for p in parts for c in p)
          and not Path(name).exists())


def _read_bf16(path: Path, name: str) -> np.ndarray:
  """One bfloat16 tensor of a safetensors file, as ml_dtypes.bfloat16 (what jax uses).

  The format: an 8-byte little-endian header length, a JSON header giving each tensor's
  dtype, shape and byte range after the header, then the data.
  """
  import ml_dtypes
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    info = json.loads(f.read(header_len))[name]
  start, end = info["data_offsets"]
  shape = tuple(info["shape"])
  count = (end - start) // 2
  if count != int(np.prod(shape)):
    raise ValueError(f"{path}: tensor {name!r} has {end - start} bytes for shape {shape}")
  return np.fromfile(path, dtype=ml_dtypes.bfloat16, count=count,
                     offset=8 + header_len + start).reshape(shape)


def read_config(path: Path) -> dict:
  """A JSON object from `path`; ValueError naming the file if it is not one."""
  try:
    data = json.loads(path.read_text())
  except (ValueError, OSError) as e:
    raise ValueError(f"{path} is unreadable or not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
  return data


def resolve(path_or_id: str | os.PathLike) -> Path:
  """A local directory as is; a hub id (`looks_like_hub_id`) fetched with huggingface_hub."""
  if not isinstance(path_or_id, (str, os.PathLike)) or not str(path_or_id):
    raise ValueError(f"expected a model directory or a hub id, got {path_or_id!r}")
  path = Path(path_or_id).expanduser()
  if path.is_dir():
    return path
  text = os.fspath(path_or_id)
  if not looks_like_hub_id(text):
    raise ValueError(f"{text!r} is not a model directory (and does not look like a hub id)")
  try:
    from huggingface_hub import snapshot_download
  except ImportError as e:
    raise ValueError(f"{text!r} is not a local directory, and downloading it needs "
                     "huggingface_hub (pip install 'specjax[hf]')") from e
  files = ["config.json", "generation_config.json", "tokenizer.json"]
  try:
    local = Path(snapshot_download(text, allow_patterns=files + ["*.safetensors",
                                                                  "*.safetensors.index.json"]))
    if not any((local / name).is_file() for name in WEIGHT_FILES[:2]):
      # Older repositories have only torch pickles.
      local = Path(snapshot_download(text, allow_patterns=files + ["pytorch_model*.bin*"]))
  except Exception as e:  # network, offline mode, missing repo: all end up here
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
    hint = ("HF_HUB_OFFLINE is set and the model is not in the local cache"
            if offline else "no network, or no such repository on the Hub")
    raise ValueError(f"{text!r} is not a local directory ({path.resolve()} does not exist), "
                     f"and could not be fetched from the Hugging Face Hub ({hint}): "
                     f"{type(e).__name__}: {e}. Pass a local model directory instead.") from e
  return local


def eos_ids(directory: Path, hf_config: dict) -> list[int]:
  """The ids that end text: config.json names the end-of-text token (the tokenizer file
  alone can only guess it), and chat models list more (Llama 3's <|eot_id|>) there or in
  generation_config.json. Both lists, as vLLM adds generation_config.json's to the
  tokenizer's (transformers reads generation_config.json's alone where it exists)."""
  ids = _ids(hf_config.get("eos_token_id"))
  gen_path = directory / "generation_config.json"
  if gen_path.is_file():
    ids += _ids(read_config(gen_path).get("eos_token_id"))
  return list(dict.fromkeys(ids))


def load_tokenizer(directory: Path, hf_config: dict):
  """The directory's tokenizer.json as a specjax Tokenizer, ending text where config.json says."""
  path = directory / "tokenizer.json"
  if not path.is_file():
    return None
  import tokenizers
  from specjax.models.tokenizer import Tokenizer
  try:
    raw = tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # the Rust side raises a bare Exception
    raise ValueError(f"cannot read tokenizer file {path}: {e}") from e
  ids = [i for i in eos_ids(directory, hf_config) if raw.id_to_token(i) is not None]
  eos_token = raw.id_to_token(ids[0]) if ids else None
  return Tokenizer(raw, eos_token=eos_token, more_eos_ids=ids[1:])


def _ids(value) -> list[int]:
  """An eos_token_id entry (an id, a list of ids, or null) as a list of ids."""
  values = value if isinstance(value, list) else [value]
  return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def load_hf_model(path_or_id: str | os.PathLike, dtype=jnp.float32, mesh=None) -> Model:
  """A Hugging Face GPT-2 / Llama / Mistral / Qwen2 / Qwen3 checkpoint as a specjax `Model`.

  Args:
    path_or_id: a local directory holding config.json and safetensors weights
      (model.safetensors or a sharded index; pytorch_model.bin with torch installed),
      or a hub id such as 'distilgpt2' or 'Qwen/Qwen3-0.6B', downloaded (or taken from
      the local cache) with huggingface_hub.
    dtype: parameter dtype (float32, bfloat16, float16); the forward and the KV cache
      run in it, logits and sampling in float32.
    mesh: a jax Mesh ('data', 'model'): the weights go from the files through host
      memory straight into their shards (`specjax.shard`), never whole onto one device.

  The tokenizer (tokenizer.json) is attached as `model.tokenizer` when present.
  Raises ValueError for unsupported architectures or features and for missing,
  unexpected or mis-shaped tensors, naming them.
  """
  dt = float_dtype(dtype)
  directory = resolve(path_or_id)
  config_path = directory / "config.json"
  if not config_path.is_file():
    raise ValueError(f"{directory} has no config.json")
  hf_config = read_config(config_path)
  cfg = config_from_hf(hf_config)
  tensors = CheckpointTensors(directory)
  params = params_from_hf(cfg, hf_config["model_type"], tensors, dt, where=str(directory),
                          host=mesh is not None)
  tokenizer = load_tokenizer(directory, hf_config)
  # Without tokenizer.json (a sentencepiece-only repository) token-id prompts still stop
  # where transformers would.
  eos = None if tokenizer is not None else eos_ids(directory, hf_config)
  model = Model(cfg, params, tokenizer, eos_ids=eos)
  if mesh is not None:
    from specjax.models import sharding
    model = sharding.shard(model, mesh)
  return model


def _tokenizer_saver(tokenizer):
  """A function writing `tokenizer` as tokenizer.json, or None if it is not that kind."""
  import tokenizers
  from specjax.models.tokenizer import Tokenizer
  if isinstance(tokenizer, (Tokenizer, tokenizers.Tokenizer)):
    return lambda path: tokenizer.save(str(path))
  return None


EXPORTED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def export_hf(model: Model, out_dir: str | os.PathLike) -> Path:
  """Writes `model` as a Hugging Face directory transformers loads with AutoModelForCausalLM.

  GPT-2-style configs become GPT2LMHeadModel, Llama-style ones LlamaForCausalLM (or
  Qwen2ForCausalLM for q/k/v biases without an output bias, Qwen3ForCausalLM for q/k
  norms). Writes config.json, model.safetensors and, when the model has a tokenizer,
  tokenizer.json and tokenizer_config.json (for AutoTokenizer: the end-of-text token).
  Returns the directory. Raises ValueError for configs no transformers
  architecture computes and for a directory holding files other than an earlier
  export's.
  """
  if not isinstance(model, Model):
    raise ValueError(f"export_hf expects a specjax Model, got {type(model).__name__}")
  from specjax.models import quantization
  from specjax.models import sharding
  if any(quantization.is_quantized(node) for node in jax.tree_util.tree_leaves(
      model.params, is_leaf=quantization.is_quantized)):
    raise ValueError("export_hf needs float weights; this model is int8-quantised "
                     "(export the model before specjax.quantize)")
  if (model.config.qkv_groups, model.config.mlp_groups) != (1, 1):
    model = sharding.unshard(model)  # the usual q|k|v and gate|up layout again
  cfg = model.config
  export_type(cfg)  # refuse before writing anything
  tok = model.tokenizer
  save_tokenizer = None if tok is None else _tokenizer_saver(tok)
  ends = model.eos_ids or []
  eos_id = ends[0] if ends else None
  # The BOS a Llama tokenizer's post-processor puts first; GPT-2's files name EOS for it;
  # without a tokenizer it is not known.
  prefix = tokenizer_lib.prompt_prefix(tok) if hasattr(tok, "encode_prompt") else []
  if len(prefix) == 1 and prefix[0] < cfg.vocab_size:
    bos_id = prefix[0]
  else:
    bos_id = eos_id if tok is not None else None
  # Every id that ends generation, as a list where there are several (Llama 3's style).
  hf_config = config_to_hf(cfg, bos_id=bos_id, eos_id=eos_id if len(ends) < 2 else ends)
  tensors = params_to_hf(cfg, model.params)
  dtypes = {str(a.dtype) for a in tensors.values()}
  hf_config["torch_dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"

  from safetensors.numpy import save_file
  out = Path(out_dir)
  if out.exists() and not out.is_dir():
    raise ValueError(f"export_hf: {out} is a file")
  # Only an earlier export's own files are replaced: anything else (a specjax checkpoint,
  # sharded weights, torch files) would be loaded beside or instead of the new weights.
  others = sorted(p.name for p in out.iterdir() if p.name not in EXPORTED) if out.exists() else []
  if others:
    raise ValueError(f"export_hf: {out} holds files an export does not write ({', '.join(others)}); "
                     "export into a new or empty directory")
  out.mkdir(parents=True, exist_ok=True)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    if save_tokenizer is None and (out / name).is_file():
      (out / name).unlink()  # an earlier export's: this model has none
  (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  # transformers refuses safetensors files without format metadata.
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  if save_tokenizer is not None:
    save_tokenizer(out / "tokenizer.json")
    # What AutoTokenizer needs beyond tokenizer.json: its end-of-text token (else None),
    # and decode as ours does (no cleanup of spaces before punctuation).
    # The tokens config.json names (the tokenizer's own EOS may lie past the embedding).
    tok_config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=cfg.max_len,
                      clean_up_tokenization_spaces=False)
    for name, i in (("eos_token", eos_id), ("bos_token", bos_id)):
      if i is not None and tok.id_to_token(i) is not None:
        tok_config[name] = tok.id_to_token(i)
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
  return out
