"""`generate`'s arguments checked on the host, and turned into the engine's static parts.

Every check runs before any work: a bad input is a ValueError naming it, raised before
a model is laid out or a program compiled. The primitive checks (an int at least k, a
per-row value, token ids) live in `specjax.checks`, below every layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from specjax import checks
from specjax import drafters as drafters_lib
from specjax import policies
from specjax import trees
from specjax.drafters import heads as head_drafters
from specjax.drafters import trees as tree_drafters
from specjax.models import heads as heads_lib
from specjax.models import sharding
from specjax.models import tokenizer as tokenizer_lib
from specjax.models.model import Model

DRAFTERS = ("model", "ngram", "eagle", "eagle3", "medusa")


MAX_ROWS = 2 ** 20  # prompts x n: far past any batch that fits, short of numpy's overflow


DRAFT_SAMPLE_MODES = ("probabilistic", "greedy")


HEAD_DRAFTERS = ("eagle", "eagle3", "medusa")


def check_prompts(prompts, model: Model) -> list[list[int]]:
  """Token-id lists from token-id lists, a 2-D array or strings; ValueError otherwise."""
  prompts = checks.host_array(prompts)
  if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
    prompts = list(prompts)
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError("prompts must be a non-empty list of prompts (lists of token ids, "
                     "or strings when the target has a tokenizer)")
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if model.tokenizer is None:
        raise ValueError(f"prompt {i} is a string but the target has no tokenizer")
      checks.utf8(f"prompt {i}", prompt)
      prompt = tokenizer_lib.encode_prompt(model.tokenizer, prompt)
    prompt = checks.token_ids(f"prompt {i}", prompt, model.config.vocab_size)
    if not prompt:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    out.append(prompt)
  return out


def make_tree(tree, gamma, max_len: int | None = None):
  """`tree=` as a `trees.Tree`: branching factors (k_1, ..., k_d) or a list of paths;
  max_len: the target's context, which the tree's nodes must fit in."""
  if isinstance(tree, (trees.Tree, trees.DynamicTree)):
    out = tree
  elif isinstance(tree, (tuple, list)) and tree and isinstance(tree[0], str):
    # ('dynamic', nodes, depth, topk[, alpha]): a DynamicTree in a config or JSON row
    args = tuple(tree[1:])
    if tree[0] != "dynamic" or not 3 <= len(args) <= 4:
      raise ValueError(f"a dynamic tree in a config is ('dynamic', nodes, depth, topk) or "
                       f"('dynamic', nodes, depth, topk, alpha by sibling rank), got {tree!r}")
    alpha = tuple(args[3]) if len(args) == 4 else None
    out = trees.DynamicTree(*args[:3], alpha=alpha)
  elif isinstance(tree, (tuple, list)) and tree and all(checks.is_int(k) for k in tree):
    out = trees.Tree.from_branching(tree)
  elif isinstance(tree, (tuple, list)) and tree and all(isinstance(p, (tuple, list))
                                                         for p in tree):
    out = trees.Tree.from_paths(tree)
  else:
    raise ValueError(f"tree must be branching factors like (2, 2, 1), a list of paths "
                     f"like [(0,), (1,), (0, 0)], a specjax.DynamicTree or ('dynamic', nodes, "
                     f"depth, topk), got {tree!r}")
  if gamma is not None and gamma != out.depth:
    raise ValueError(f"tree has depth {out.depth} but gamma={gamma}: leave gamma unset "
                     "with a tree (the depth is the draft length)")
  if max_len is not None and out.num_nodes > max_len:  # one pass scores every node
    raise ValueError(f"tree has {out.num_nodes} nodes, more than the target's context "
                     f"max_len={max_len}")
  return out


def make_drafter(target: Model, draft: Model | None, drafter: str | None, gamma: int | None,
                 draft_sample: str, ngram_min: int, ngram_max: int, tree=None):
  """Validates the speculative settings and builds the static drafter object."""
  is_head = isinstance(draft, heads_lib.Head)
  if draft is not None and not (isinstance(draft, Model) or is_head):
    raise ValueError(f"draft must be a specjax Model (from load_pretrained, init_model or "
                     f"load_hf_model) or a draft head (heads.Head, e.g. "
                     f"load_pretrained('stdlib-eagle')), got {type(draft).__name__}")
  if drafter is None and draft is not None:
    drafter = draft.kind if is_head else "model"
  if drafter is None:
    if tree is not None:
      raise ValueError("tree= needs a drafter: draft=<a draft model, an EAGLE or a Medusa "
                       "head> or drafter='ngram'")
    if gamma is not None:  # unused (draft=None toggles speculation off), but still checked
      checks.int_at_least("gamma (draft length)", gamma, 1)
    return drafters_lib.NoDrafter(vocab_size=target.config.vocab_size)
  if drafter not in DRAFTERS:
    raise ValueError(f"drafter must be one of {DRAFTERS} (or None), got {drafter!r}")
  if drafter == "model" and is_head:
    raise ValueError(f"drafter='model' needs draft=<a draft Model>, got the {draft.kind} head "
                     f"(pass drafter={draft.kind!r}, or leave drafter out)")
  if drafter == "ngram" and draft is not None:
    raise ValueError("drafter='ngram' (prompt lookup) drafts from the context and uses no "
                     f"draft model; got draft={type(draft).__name__} as well (drop one)")
  if drafter in HEAD_DRAFTERS or is_head:
    if not is_head or draft.kind != drafter:
      got = f"a {draft.kind} head" if is_head else type(draft).__name__
      raise ValueError(f"drafter={drafter!r} needs draft=<a {drafter} head> (e.g. "
                       f"load_pretrained('stdlib-{drafter}')), got {got}")
    if isinstance(tree, trees.DynamicTree) and drafter == "medusa":
      raise ValueError(f"a DynamicTree needs drafter='model', 'eagle', 'eagle3' or 'ngram'; "
                       f"the {drafter} head drafts static trees or chains")
    if draft_sample not in DRAFT_SAMPLE_MODES:
      raise ValueError(f"draft_sample must be one of {DRAFT_SAMPLE_MODES}, "
                       f"got {draft_sample!r}")
    draft.check_target(target)  # ValueError naming what differs
    if tree is not None:
      tree = make_tree(tree, gamma, target.config.max_len)
      if drafter == "medusa":  # head d drafts every node at depth d
        return tree_drafters.TreeMedusaDrafter(draft.config, tree.depth, draft_sample, tree=tree)
      return tree_drafters.TreeEagleDrafter(draft.config, tree.depth, draft_sample, tree=tree)
    gamma = checks.int_at_least("gamma (draft length)", 4 if gamma is None else gamma, 1)
    return head_drafters.for_head(draft.config, gamma, draft_sample)
  if tree is not None:
    tree = make_tree(tree, gamma, target.config.max_len)
    gamma = tree.depth
    if drafter not in ("model", "ngram"):
      raise ValueError(f"tree= needs drafter='model' (a draft model) or 'ngram'; the "
                       f"{drafter!r} drafter proposes chains only")
  gamma = checks.int_at_least("gamma (draft length)", 4 if gamma is None else gamma, 1)
  max_len = target.config.max_len
  if gamma > max_len:  # a draft the context cannot hold (its pass would not fit either)
    raise ValueError(f"gamma (draft length) {gamma} is longer than the target's context "
                     f"max_len={max_len}")
  if drafter == "ngram":
    if not (checks.is_int(ngram_min) and checks.is_int(ngram_max) and 1 <= ngram_min <= ngram_max):
      raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
    if ngram_max > max_len:  # no longer n-gram fits the context (each size is traced)
      raise ValueError(f"ngram_max {ngram_max} is longer than the target's context "
                       f"max_len={max_len}")
    if isinstance(tree, trees.DynamicTree):  # the matches' trie, its best paths kept
      return tree_drafters.DynamicNgramTreeDrafter(
          vocab_size=target.config.vocab_size, gamma=gamma, min_n=int(ngram_min),
          max_n=int(ngram_max), tree=tree)
    if tree is not None:  # several earlier matches: distinct continuations as a tree
      return tree_drafters.NgramTreeDrafter(vocab_size=target.config.vocab_size, gamma=gamma,
                                    min_n=int(ngram_min), max_n=int(ngram_max), tree=tree)
    return drafters_lib.NgramDrafter(vocab_size=target.config.vocab_size, gamma=gamma,
                                     min_n=int(ngram_min), max_n=int(ngram_max))
  if draft is None:
    raise ValueError("drafter='model' needs a draft model: pass draft=<Model>")
  if draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft and target vocabularies differ: draft vocab_size="
                     f"{draft.config.vocab_size}, target vocab_size={target.config.vocab_size}")
  _check_same_tokens(draft.tokenizer, target.tokenizer, target.config.vocab_size)
  if draft_sample not in DRAFT_SAMPLE_MODES:
    raise ValueError(f"draft_sample must be one of {DRAFT_SAMPLE_MODES}, got {draft_sample!r}")
  if isinstance(tree, trees.DynamicTree):
    return tree_drafters.DynamicTreeModelDrafter(config=draft.config, gamma=gamma,
                                                 sample_mode=draft_sample, tree=tree)
  if tree is not None:
    return tree_drafters.TreeModelDrafter(config=draft.config, gamma=gamma, sample_mode=draft_sample,
                                  tree=tree)
  return drafters_lib.ModelDrafter(config=draft.config, gamma=gamma, sample_mode=draft_sample)


# Draft tokenizers seen to agree with a target's: the check decodes dozens of ids, once per pair.
_AGREE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


TOKEN_PROBES = 48


def _check_same_tokens(draft_tok, target_tok, vocab: int) -> None:
  """ValueError where both models carry tokenizers that read ids differently: the same
  vocabulary size with other tokens would draft tokens the target never meant. Compares
  the text of `TOKEN_PROBES` ids spread over the vocabulary."""
  if draft_tok is None or target_tok is None or draft_tok is target_tok:
    return
  try:
    seen = _AGREE.setdefault(draft_tok, weakref.WeakSet())
  except TypeError:  # not weakly referenceable: check every time
    seen = weakref.WeakSet()
  if target_tok in seen:
    return
  for i in np.unique(np.linspace(0, vocab - 1, TOKEN_PROBES).astype(int)).tolist():
    a, b = _token_text(draft_tok, i), _token_text(target_tok, i)
    if a != b:
      raise ValueError(f"draft and target tokenizers differ: token {i} is {a!r} in the "
                       f"draft's and {b!r} in the target's (one vocabulary size, not one "
                       "vocabulary)")
  seen.add(target_tok)


def _token_text(tokenizer, i: int):
  try:
    return tokenizer.decode([i])
  except Exception:  # an id past the tokenizer's own table (a padded embedding) # noqa: BLE001
    return None


def make_policy(kind, confidence, draft_cost, drafter) -> policies.GammaPolicy:
  """`gamma_policy=` and its settings as a `policies.GammaPolicy`; ValueError if unfit."""
  if kind not in policies.POLICIES:
    raise ValueError(f"gamma_policy must be one of {policies.POLICIES}, got {kind!r}")
  if kind != "fixed" and drafter.gamma == 0:
    raise ValueError(f"gamma_policy={kind!r} needs a drafter (draft=... or drafter='ngram')")
  if kind != "fixed" and getattr(drafter, "tree", None) is not None:
    raise ValueError(f"gamma_policy={kind!r} drafts chains; a tree has a fixed shape")
  if kind == "confidence" and not hasattr(drafter, "propose_until"):
    raise ValueError("gamma_policy='confidence' needs a drafter that drafts token by token "
                     "(a draft model or an EAGLE head); this one proposes all γ at once")
  if confidence is not None and kind != "confidence":
    raise ValueError(f"draft_confidence is for gamma_policy='confidence', got {kind!r}")
  if draft_cost is not None and kind != "ledger":
    raise ValueError(f"draft_cost is for gamma_policy='ledger', got {kind!r}")
  number = lambda v: not isinstance(v, bool) and isinstance(v, (int, float, np.floating))
  verify_cost = 0.0
  if isinstance(draft_cost, (tuple, list)):  # measured (c, v(γ)), both in target steps
    if len(draft_cost) != 2 or not all(number(v) for v in draft_cost):
      raise ValueError(f"draft_cost must be c / v or the pair (c, v), got {draft_cost!r}")
    c, verify_cost = (float(v) for v in draft_cost)
    if not (np.isfinite(verify_cost) and verify_cost > 0):
      raise ValueError(f"draft_cost's v (the verify pass, in target steps) must be a "
                       f"finite number > 0, got {draft_cost!r}")
    draft_cost = c / verify_cost
  for name, value in (("draft_confidence", confidence), ("draft_cost", draft_cost)):
    if value is not None and not number(value):
      raise ValueError(f"{name} must be a number, got {value!r}")
  return policies.GammaPolicy(
      kind=kind, confidence=float(0.4 if confidence is None and kind == "confidence"
                                  else confidence or 0.0),
      draft_cost=float(draft_cost or 0.0), verify_cost=verify_cost)


def resolve_eos(target: Model, eos_id):
  """generate's default 'auto' is the target's end-of-text ids (its tokenizer's, or its
  config's without one, as transformers' generation config and vLLM stop); None is no EOS."""
  if isinstance(eos_id, str):
    if eos_id != "auto":
      raise ValueError(f"eos_id must be 'auto' (the tokenizer's), None (no EOS), a token id or "
                       f"a list of ids, got {eos_id!r}")
    return target.eos_ids
  return eos_id


def eos_list(eos_id) -> list:
  return [] if eos_id is None else ([eos_id] if np.ndim(eos_id) == 0 else list(eos_id))


def stop_table(target: Model, eos_id, stop_sequences):
  """EOS ids and token-id stop sequences as one right-aligned table [K, L] plus lengths
  [K]; the stop strings (as UTF-8 bytes), which match on the text; and every stop
  sequence as given (token-id lists as tuples), in order."""
  vocab = target.config.vocab_size
  eos = eos_list(eos_id)
  seqs = [checks.token_ids("eos_id", [e], vocab) for e in eos]
  strings, given = [], []
  if isinstance(stop_sequences, (str, bytes)):  # one stop string, not a list of characters
    stop_sequences = [stop_sequences]
  if stop_sequences is not None and not isinstance(stop_sequences, Sequence):
    raise ValueError("stop_sequences must be a list of strings or token-id lists, got "
                     f"{stop_sequences!r}")
  for i, stop in enumerate([] if stop_sequences is None else list(stop_sequences)):
    if isinstance(stop, (str, bytes)):
      if target.tokenizer is None:
        raise ValueError(f"stop sequence {i} is a string but the target has no tokenizer")
      if not stop:
        raise ValueError(f"stop sequence {i} is empty")
      strings.append(checks.utf8(f"stop sequence {i}", stop) if isinstance(stop, str)
                     else bytes(stop))
      given.append(stop)
      continue
    stop = checks.token_ids(f"stop sequence {i}", stop, vocab)
    if not stop:
      raise ValueError(f"stop sequence {i} is empty")
    seqs.append(stop)
    given.append(tuple(stop))
  # The text automaton has a state per stop-string byte, each a row over the vocabulary.
  if (sum(map(len, strings)) + 1) * vocab > 2 ** 27:
    raise ValueError(f"stop strings too long: {sum(map(len, strings))} bytes in all; their "
                     f"table over {vocab} tokens would pass 2**27 entries")
  span = max([len(s) for s in seqs] + [1])
  table = np.zeros((max(len(seqs), 1), span), np.int32)
  lens = np.zeros((max(len(seqs), 1),), np.int32)
  for k, stop in enumerate(seqs):
    table[k, span - len(stop):] = stop
    lens[k] = len(stop)
  return table, lens, strings, tuple(given)


def logprob_args(logprobs, top, prompt, mode, vocab: int):
  for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt)):
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f"{name} must be True or False, got {value!r}")
  if mode not in ("raw", "processed"):
    raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {mode!r}")
  top = checks.int_at_least("top_logprobs", 0 if top is None else top, 0)
  if top > vocab:
    raise ValueError(f"top_logprobs must be <= the vocabulary size {vocab}, got {top}")
  given = [name for name, on in (("top_logprobs", top), ("prompt_logprobs", prompt),
                                  ("logprobs_mode", mode != "raw")) if on]
  if given and not logprobs:
    raise ValueError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} logprobs=True")
  return bool(logprobs), top, bool(prompt)


def check_seed(seed) -> int:
  seed = checks.int_at_least("seed", seed, 0)
  if seed >= 2 ** 32:  # PRNGKey keeps 32 bits: larger seeds would collide with small ones
    raise ValueError(f"seed must be < 2**32, got {seed}")
  return seed


def check_mesh(mesh):
  """`sharding.check_mesh` of a mesh given, before anything is timed (gamma_policy='ledger'
  measures the pair); None stays None."""
  return None if mesh is None else sharding.check_mesh(mesh)


def sampling_values(sampling, batch: int, vocab: int):
  """temperature, top_k and top_p of `params.SamplingParams` as per-row host arrays
  (float64, int32, float32), checked: top_p as given and as the engine reads it."""
  temperature = checks.per_row("temperature", sampling.temperature, batch,
                               "iuf").astype(np.float64)
  if not np.all(np.isfinite(temperature)) or np.any(temperature < 0):
    raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), "
                     f"got {temperature.tolist()}")
  if np.any(temperature > np.finfo(np.float32).max):
    raise ValueError(f"temperature must fit in float32 (<= 3.4e38), got {temperature.tolist()}")
  given_p = checks.per_row("top_p", sampling.top_p, batch, "iuf").astype(np.float64)
  top_p = given_p.astype(np.float32)
  if not np.all((given_p > 0) & (given_p <= 1) & (top_p > 0)):
    raise ValueError(f"top_p must be in (0, 1] (and > 0 in float32), got {given_p.tolist()}")
  top_k = checks.per_row("top_k", sampling.top_k, batch, "iu")
  if np.any(top_k < 0):
    raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k.tolist()}")
  # k >= vocab keeps everything; clipping first keeps huge k from wrapping in int32.
  return temperature, np.minimum(top_k, vocab).astype(np.int32), top_p
