"""`generate`'s settings in four frozen groups, as the field groups them (vLLM's
`SamplingParams` is the model): sampling, stopping, speculation and outputs.

    specjax.generate(target, prompts,
                     sampling=specjax.SamplingParams(temperature=0.8, top_p=0.95),
                     speculation=specjax.SpeculationParams(draft=draft, gamma=4))

Flat keywords (`generate(..., temperature=0.8, draft=draft)`) are the same fields:
`resolve` sorts them into their groups, so the list of settings is written once, here.
Each field is checked when a call is prepared (`specjax.arguments`), not here, so a
group can be built once and reused across calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a token is drawn: applied identically to the target's p and the draft's q.

  temperature, top_k, top_p: scalars or one value per prompt; temperature 0 is exact
    greedy, top_k 0 and top_p 1 are off.
  repetition_penalty: Hugging Face/CTRL rule over prompt + generated tokens (1 = off).
  presence_penalty, frequency_penalty: OpenAI's rule over generated tokens (0 = off).
  no_repeat_ngram_size: bans a token that would repeat an n-gram of prompt + generated.
  min_new_tokens: EOS and one-token stop sequences are banned before this many new
    tokens (vLLM's min_tokens); a longer stop sequence or a stop string completed before
    it does not count, and its tokens are not banned.
  logit_bias: {token_id: bias} (or one dict per prompt) added to the raw logits.
  constraint: a `specjax.constraints.TokenAutomaton` (e.g. `constraints.regex(...)`):
    tokens leaving its language are masked; EOS only where it accepts; a row whose text
    is complete with nothing to follow stops.

  The processors act on the raw logits, per candidate prefix, before temperature /
  top-k / top-p; speculation stays lossless with them. Where together they ban every
  token, the row ends there.
  """
  temperature: Any = 0.0
  top_k: Any = 0
  top_p: Any = 1.0
  repetition_penalty: Any = 1.0
  presence_penalty: Any = 0.0
  frequency_penalty: Any = 0.0
  no_repeat_ngram_size: Any = 0
  min_new_tokens: Any = 0
  logit_bias: Any = None
  constraint: Any = None


@dataclasses.dataclass(frozen=True)
class StoppingParams:
  """When a row ends.

  max_new_tokens: budget of new tokens per prompt.
  eos_id: an id (or list of ids) that ends a row; it is emitted, nothing after it. 'auto'
    is the target's `eos_ids` (the tokenizer's end-of-text; for a Hugging Face model the
    eos_token_id lists of config.json and generation_config.json, as vLLM stops); None
    stops at no EOS (vLLM's ignore_eos).
  stop_sequences: token-id lists, or strings, that end a row once generated; the tokens
    that complete one are emitted. A string matches the text however it was split into
    tokens: the row stops at the first token whose text completes it (")" stops a row at
    ")["). `GenerateResult.stop_reasons` names the one that ended each row.
  """
  max_new_tokens: int = 32
  eos_id: Any = "auto"
  stop_sequences: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class SpeculationParams:
  """What drafts and how it is verified. With no draft and drafter None: target-only.

  draft: a draft Model (same vocabulary as the target), or a draft head trained on this
    target (`load_pretrained('stdlib-eagle')`, 'stdlib-medusa').
  gamma: draft tokens per round (default 4; with a tree, its depth).
  drafter: 'model', 'ngram' (prompt lookup, no draft model), 'eagle' / 'medusa' (with
    draft=<that head>) or None (inferred from draft).
  tree: a token tree for the model, n-gram or Medusa drafter: branching factors
    (k_1, ..., k_d) or Medusa-style paths of child ranks, e.g. [(0,), (1,), (0, 0)].
  draft_sample: 'probabilistic' (sample from q) or 'greedy' (argmax, one-hot q).
  ngram_min, ngram_max: the suffix lengths prompt lookup tries.
  verify_rule: 'exact' (lossless, the default), 'block' (lossless block verification of a
    chain, Sun et al. 2024: accepts at least as many tokens in expectation; not with
    tree=), 'traversal' (lossless traversal verification of a tree=, Weng et al. 2025:
    leaves first, accepts at least as many as the node walk) or a research rule that is not lossless: 'typical', 'threshold', 'synthetic'
    (`specjax.verify.rules`; stats['lossless']).
  rule_params: that rule's keyword arguments, e.g. {'epsilon': 0.09, 'delta': 0.3}.
  gamma_policy: how many of its γ tokens each row drafts per round (`specjax.policies`,
    all lossless): 'fixed', 'heuristic', 'confidence' (stop below `draft_confidence`,
    default 0.4) or 'ledger' (the length maximising E(α̂, L) / (L·c + v) for the row's
    running α̂; `draft_cost` = c / v or the pair (c, v(γ)), measured if None).
  """
  draft: Any = None
  gamma: int | None = None
  drafter: str | None = None
  tree: Any = None
  draft_sample: str = "probabilistic"
  ngram_min: int = 1
  ngram_max: int = 4
  verify_rule: str = "exact"
  rule_params: dict | None = None
  gamma_policy: str = "fixed"
  draft_confidence: float | None = None
  draft_cost: Any = None


@dataclasses.dataclass(frozen=True)
class OutputParams:
  """What a result carries besides tokens and text.

  logprobs: each new token's log-probability under the target's raw logits (before
    temperature, top-k/p and the processors), from the verify pass's own logits.
  top_logprobs: with logprobs, the n most likely (token, logprob) pairs at each position.
  prompt_logprobs: with logprobs, the prompt tokens' log-probabilities (and top n).
  logprobs_mode: 'raw' or 'processed' (under the distribution actually sampled from,
    vLLM's processed_logprobs: what an RL update needs as the behaviour policy's).
  n: samples per prompt: rows i*n .. i*n + n - 1 are prompt i's, sharing one prefill.
  Each value of top_logprobs, prompt_logprobs, logprobs_mode and n compiles its own
  program (static settings of the engine).
  """
  logprobs: bool = False
  top_logprobs: int = 0
  prompt_logprobs: bool = False
  logprobs_mode: str = "raw"
  n: int = 1


GROUPS = {"sampling": SamplingParams, "stopping": StoppingParams,
          "speculation": SpeculationParams, "output": OutputParams}
FIELDS = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True, eq=False)
class Params:
  """The four groups of one call."""
  sampling: SamplingParams = SamplingParams()
  stopping: StoppingParams = StoppingParams()
  speculation: SpeculationParams = SpeculationParams()
  output: OutputParams = OutputParams()



def resolve(flat: dict[str, Any], caller: str = "generate", **groups) -> Params:
  """Params from group objects (sampling=, stopping=, speculation=, output=) and flat
  keywords; TypeError for an unknown keyword, ValueError for a field given twice."""
  unknown = sorted(set(flat) - set(FIELDS))
  if unknown:
    raise TypeError(f"{caller}() got unexpected keyword argument(s) {unknown}; settings are "
                    f"{sorted(FIELDS)} or the groups {sorted(GROUPS)}")
  out = {}
  for name, cls in GROUPS.items():
    given = groups.pop(name, None)
    if given is None:
      given = cls()
    elif not isinstance(given, cls):
      raise ValueError(f"{name}= must be a specjax.{cls.__name__}, got {type(given).__name__}")
    mine = {k: v for k, v in flat.items() if FIELDS[k] == name}
    twice = sorted(k for k in mine if _changed(getattr(given, k), _DEFAULTS[k]))
    if twice:
      raise ValueError(f"{twice} given both as keywords and in {name}=; give each once")
    out[name] = dataclasses.replace(given, **mine) if mine else given
  if groups:
    raise TypeError(f"{caller}() got unexpected group(s) {sorted(groups)}")
  return Params(**out)


_DEFAULTS = {f.name: f.default for cls in GROUPS.values() for f in dataclasses.fields(cls)}


def _changed(value, default) -> bool:
  """A group's field set to other than its default (compared by identity, then ==)."""
  if value is default:
    return False
  try:
    return bool(value != default)
  except Exception:  # an array: any value other than the default's object counts # noqa: BLE001
    return True
