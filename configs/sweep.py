"""The sweep over draft length γ, temperature, top-p, drafter and batch size.

  python -m experiments.run --config=configs/sweep.py --workdir=runs/sweep
  python -m experiments.run --config=configs/sweep.py:smoke --workdir=/tmp/smoke
  python -m experiments.run --config=configs/sweep.py --config.gamma=4 --config.temperature='(0.0,1.0)'

Variants: '' (default: 18 points on the shipped pair, each timed against target-only), 'smoke'
(about a minute on 2 cores; the test suite runs it), 'full' (a larger grid for a GPU/TPU runtime),
'rules' (the exact and block rules side by side: model and EAGLE drafters, γ = 2, 4, 6,
T = 0.7 and 1.0), 'gpt2' (a public pair from local Hugging Face directories or the hub; see docs/HF.md),
'llama3', 'qwen3', 'qwen25' (larger public pairs by hub id, for a GPU/TPU runtime; see
docs/HF.md for memory, gated repositories and local copies).
"""

import ml_collections

# Public target/draft pairs by hub id (or a variant and --config.target=DIR --config.draft=DIR).
HUB_PAIRS = {
    "llama3": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B"),  # 128256 rows each
    "qwen3": ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),  # 151936 rows each
    # 152064 vs 151936 rows: the draft must be padded (specjax.hf.pad_vocab) to pair.
    "qwen25": ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-0.5B"),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.target = "stdlib-target"  # a shipped name, a checkpoint / HF directory, or a hub id
  c.draft = "stdlib-draft"
  c.drafter = ("model", "ngram", "eagle")  # also 'medusa' (γ up to its head count)
  c.eagle_head = "stdlib-eagle"  # draft heads trained on the target: name or directory
  c.medusa_head = "stdlib-medusa"
  c.eagle3_head = "stdlib-eagle3"
  # Paired timing of three drafters: keep the default a short run. summary.md recommends
  # the best measured point, and says whether the whole-call prediction, where it fits,
  # agrees; a best γ at the grid's largest says longer drafts went unmeasured ('full'
  # sweeps them, or --config.gamma='(1,2,4,6,8)').
  c.gamma = (1, 2, 4)
  c.temperature = (0.0, 1.0)
  c.top_p = (1.0,)
  c.top_k = 0
  c.batch_size = (1,)
  c.draft_sample = "probabilistic"
  # History-dependent processors, applied per candidate prefix (1.0 / 0 = off), e.g.
  # --config.repetition_penalty='(1.0,1.2)'. A processor switched on compiles once more.
  c.repetition_penalty = (1.0,)
  c.presence_penalty = (0.0,)
  c.frequency_penalty = (0.0,)
  c.no_repeat_ngram_size = (0,)
  # Draft length policy and verify rule (specjax.policies, specjax.verify.rules), e.g.
  # --config.gamma_policy='("fixed","heuristic","ledger")' --config.verify_rule='("exact","typical")'.
  # Only 'exact' and 'block' are lossless; rows carry `lossless`.
  c.gamma_policy = ("fixed",)
  c.verify_rule = ("exact",)
  c.draft_confidence = 0.4  # for gamma_policy 'confidence'
  # Token trees (branching factors, or lists of paths), swept at the other axes' first
  # drafter and γ: e.g. --config.trees='((2,2,1,1),(4,2,1,1))' (one tree: '((2,2,1,1),)').
  # n-gram, Medusa or EAGLE trees when the first drafter is 'ngram', 'medusa' or 'eagle',
  # model-drafter trees otherwise. A dynamic tree is ('dynamic', nodes, depth, topk) or
  # ('dynamic', nodes, depth, topk, (alpha by sibling rank...)) (model or EAGLE first).
  c.trees = ()
  c.ngram_min = 1
  c.ngram_max = 4
  c.num_prompts = 8  # prompts per grid point, from the held-out split of the corpus
  c.prompt_tokens = 64
  c.max_new_tokens = 64
  c.corpus = "stdlib"  # where prompts come from: 'stdlib', a directory or a text file
  c.stop_at_eos = False  # off: every row decodes max_new_tokens, so rows compare evenly
  c.timing_pairs = 3  # speculative and target-only passes over the prompts, alternately
  c.cost_rounds = 5  # rounds of the c / v(γ) timing loops (medians of per-round ratios)
  # Also time each side's generate call stopped after 1 and after R rounds
  # (costs.call_costs, the compiled engine, nothing new to compile): a round's cost ρ in
  # target-only rounds, and the fixed part of a call (prefill, host work), for the
  # whole-call prediction next to the ledger's.
  c.call_costs = True
  c.seed = 0

  variant = (arg or "").strip()
  if variant == "smoke":
    c.gamma = (2,)
    c.temperature = (1.0,)
    c.num_prompts = 2
    c.prompt_tokens = 16
    c.max_new_tokens = 8
    c.timing_pairs = 1
    c.cost_rounds = 2
    c.trees = ((2, 1),)
    c.call_costs = False  # 8 tokens: too few rounds to time (test_experiments turns it on)
  elif variant == "rules":  # issue #51: block against token-level verification, paired
    c.drafter = ("model", "eagle")
    c.verify_rule = ("exact", "block")
    c.gamma = (2, 4, 6)
    c.temperature = (0.7, 1.0)
  elif variant == "eagle3":  # issue #53: the EAGLE-3 head beside EAGLE, paired speedups
    c.drafter = ("eagle3", "eagle")
    c.gamma = (2, 4, 6)
    c.temperature = (0.0, 1.0)
    c.num_prompts = 8
    c.timing_pairs = 5
  elif variant == "full":
    c.gamma = (1, 2, 3, 4, 5, 6, 8, 10, 12)
    c.temperature = (0.0, 0.3, 0.7, 1.0, 1.3)
    c.top_p = (1.0, 0.9)
    c.batch_size = (1, 8, 32)
    c.num_prompts = 64
    c.prompt_tokens = 128
    c.max_new_tokens = 128
    c.timing_pairs = 5
  elif variant == "gpt2":
    c.target = "gpt2-large"
    c.draft = "distilgpt2"
    c.drafter = ("model", "ngram")  # no heads trained for public pairs (configs/train.py)
    c.gamma = (2, 3, 4, 5, 6)
    c.temperature = (0.0, 1.0)
    c.batch_size = (1, 8)
    c.num_prompts = 16
    c.prompt_tokens = 64
    c.max_new_tokens = 96
  elif variant in HUB_PAIRS:
    c.target, c.draft = HUB_PAIRS[variant]
    c.drafter = ("model", "ngram")
    c.gamma = (2, 3, 4, 5, 6, 8)
    c.temperature = (0.0, 0.7, 1.0)
    c.batch_size = (1, 8)
    c.num_prompts = 16
    c.prompt_tokens = 128
    c.max_new_tokens = 128
  elif variant:
    raise ValueError(f"unknown configs/sweep.py variant {variant!r}; "
                     f"known: '', 'smoke', 'rules', 'eagle3', 'full', 'gpt2', {', '.join(map(repr, HUB_PAIRS))}")
  return c
