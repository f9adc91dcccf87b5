r"""specjax against transformers on identical weights (the app; the library is `peer.py`).

  python -m experiments.bench_peer --target=stdlib-target --draft=stdlib-draft --out=peer.json
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app
from absl import flags

from experiments import peer
from specjax.models.pretrained import load_pretrained

_TARGET = flags.DEFINE_string("target", "stdlib-target",
                              "Target: a shipped name, directory or hub id.")
_DRAFT = flags.DEFINE_string("draft", "stdlib-draft", "Draft: a shipped name, directory or hub id.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft tokens per round.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size of the batched specjax rows.")
_NGRAM_MAX = flags.DEFINE_integer("ngram_max", 3, "Longest suffix prompt lookup matches.")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 8, "Number of prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Tokens per prompt.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes per method (median reported).")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 1,
                                      "torch threads for transformers (0: default).")
_OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")


def main(argv):
  del argv
  target = load_pretrained(_TARGET.value)
  draft = load_pretrained(_DRAFT.value)
  prompts = peer.default_prompts(target, _N_PROMPTS.value, _PROMPT_LEN.value)
  result = peer.run_peer_benchmark(target, draft, prompts, max_new_tokens=_MAX_NEW.value,
                                   gamma=_GAMMA.value, batch=_BATCH.value,
                                   ngram_max=_NGRAM_MAX.value, repeats=_REPEATS.value,
                                   torch_threads=_TORCH_THREADS.value)
  print(peer.format_table(result))
  if _OUT.value:
    Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
    Path(_OUT.value).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
