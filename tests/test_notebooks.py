"""Every notebook under notebooks/ runs top to bottom on the CPU with nbclient.

Cells tagged 'colab' are skipped. A notebook with a cell tagged 'parameters' (papermill's
convention) gets the values its entry in PARAMETERS returns in a cell inserted right after
that one; tpu_real_pair.ipynb is pointed at a tiny random pair written here in Hugging
Face format, shrunk to its SMALL grid, kept off the network and given two host devices
(so it shards the target as it would over a TPU's chips).
"""

import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def tiny_pair(directory: Path) -> Path:
  """Random Qwen3 target (2 layers) and draft (1 layer) with a byte-level BPE tokenizer.

  Saved by transformers in bfloat16, as the public Qwen3 and Llama 3.x checkpoints are,
  under the names the notebook derives from the hub ids (LOCAL_DIR/Qwen3-8B, ...).
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  from experiments import prompts

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator([prompts.TEMPLATES["qwen3"].format(q=q) for _, q in prompts.BUILTIN],
                          trainer=trainer)
  for name, layers in (("Qwen3-8B", 2), ("Qwen3-0.6B", 1)):
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(layers)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory / name)
    tok.save(str(directory / name / "tokenizer.json"))
  return directory


def real_pair_parameters(tmp_path: Path) -> dict:
  return {"LOCAL_DIR": str(tiny_pair(tmp_path / "models")), "SMALL": True,
          "WORKDIR": str(tmp_path / "run"),
          # Nothing to download: the built-in prompts, through the failure path.
          "PROMPTS_URL": (tmp_path / "no-such-question.jsonl").as_uri()}


PARAMETERS = {"tpu_real_pair": real_pair_parameters,
              # The smallest samples whose checks still hold by a wide margin.
              "lossless": lambda tmp_path: {"SCALE": 0.5}}
# Two CPU devices: the notebook splits the target over them as over a TPU's chips.
DEVICES = {"tpu_real_pair": 2}


def execute(path: Path, parameters: dict | None = None, devices: int = 1):
  nb = nbformat.read(path, as_version=4)
  nb.cells = [c for c in nb.cells if "colab" not in c.get("metadata", {}).get("tags", [])]
  if parameters:
    at = [i for i, c in enumerate(nb.cells)
          if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert at, f"{path.name} has no cell tagged 'parameters'"
    source = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    nb.cells.insert(at[0] + 1, nbformat.v4.new_code_cell(
        source, metadata={"tags": ["injected-parameters"]}))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  env = {**os.environ, "HF_HUB_OFFLINE": "1"}
  if devices > 1:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
  client.execute(env=env)  # raises on the first failing cell
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  return outputs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
  make = PARAMETERS.get(path.stem)
  parameters = make(tmp_path) if make else None
  outputs = execute(path, parameters, DEVICES.get(path.stem, 1))
  if path.stem == "tpu_real_pair":
    check_real_pair(outputs, parameters)
  if path.stem == "quickstart":  # the agreement is reported, as on an accelerator
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "prompt 0: identical for 32/32 tokens" in text
    assert "prompt 1: identical for 32/32 tokens" in text


def setup_url() -> str:
  import ast
  call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
  return next(k.value.value for k in call.keywords if k.arg == "url")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_install_cell_clones_setup_py_url_unless_told_otherwise(path):
  """A notebook runs on Colab as shipped: its install cell's default is the project's URL
  (setup.py's, the one place it is written), and SPECJAX_REPO overrides it."""
  url = setup_url()
  assert url.startswith("https://")
  cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
           if c["cell_type"] == "code"]
  install = [c for c in cells if "git clone" in c or "'git', 'clone'" in c]
  assert len(install) == 1, path.name
  assert f"os.environ.get('SPECJAX_REPO', '{url}')" in install[0]
  assert "assert" not in install[0] and "<org>" not in install[0]


def check_real_pair(outputs, parameters):
  """The sweep ran its grid and the notebook shows its table and every plot."""
  from experiments import plots
  workdir = Path(parameters["WORKDIR"])
  rows = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
  assert sorted((r["gamma"], r["temperature"]) for r in rows) == [(2, 0.0), (2, 1.0)]
  config = json.loads((workdir / "config.json").read_text())
  assert config["target"] == str(Path(parameters["LOCAL_DIR"]) / "Qwen3-8B")
  assert config["corpus"].startswith("built-in")
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "identical for 8/8 tokens" in text  # speculative greedy = greedy (float32, CPU)
  import specjax
  if hasattr(specjax, "shard"):
    assert "target split over 2 devices" in text
  markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert len(markdown) == 1 and "| drafter |" in markdown[0] and "Best measured" in markdown[0]
  assert markdown[0] == (workdir / "summary.md").read_text()
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == len(plots.PLOTS)
  for name in plots.PLOTS:
    assert (workdir / name).stat().st_size > 1000, name


def test_there_is_a_notebook():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path):
  """nbformat 4.5 cells carry unique ids (a missing one is a warning now, an error later)."""
  ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
  assert None not in ids and "" not in ids and len(set(ids)) == len(ids)


def test_the_notebooks_readme_lists_every_notebook():
  """notebooks/README.md says which to open first and what each needs, for each of them."""
  text = (ROOT / "notebooks" / "README.md").read_text()
  assert "Open **`quickstart.ipynb`** first" in text
  rows = [line for line in text.splitlines() if line.startswith("| `")]
  assert sorted(line.split("`")[1] for line in rows) == [p.name for p in NOTEBOOKS]
  assert setup_url() in text
