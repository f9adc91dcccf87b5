"""Token-level automata for constrained output: `regex(pattern, tokenizer)`.

A `TokenAutomaton` is a transition table `next[state, token]` (DEAD = -1 where the token
would leave the language), the accepting states and a start state. `generate(...,
constraint=automaton)` masks every token whose transition is DEAD, per candidate prefix
(`history.py`); EOS is allowed only in accepting states, and a row stops once its
state accepts and nothing can follow.

The regex is compiled to a character automaton by `interegular`; each token's text is
then walked through it from every live state. Tokens that decode to no text or to an
incomplete UTF-8 sequence never match (they are DEAD everywhere).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from specjax.models import tokenizer as tokenizer_lib

DEAD = -1


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
  next: np.ndarray  # int32[Q, V]
  accept: np.ndarray  # bool[Q]
  start: int = 0
  pattern: str | None = None

  def __post_init__(self):
    nxt, acc = np.asarray(self.next), np.asarray(self.accept)
    if nxt.ndim != 2 or acc.shape != (nxt.shape[0],):
      raise ValueError(f"automaton needs next [states, vocab] and accept [states], got "
                       f"{nxt.shape} and {acc.shape}")
    if not 0 <= self.start < nxt.shape[0]:
      raise ValueError(f"automaton start state {self.start} outside [0, {nxt.shape[0]})")
    if np.any((nxt < DEAD) | (nxt >= nxt.shape[0])):
      raise ValueError("automaton transitions must be states in [0, Q) or DEAD (-1)")
    object.__setattr__(self, "next", nxt.astype(np.int32))
    object.__setattr__(self, "accept", acc.astype(bool))
    if not self._accepts_something():
      raise ValueError(f"no token sequence can match the constraint"
                       f"{'' if self.pattern is None else f' {self.pattern!r}'} from its start state")

  @property
  def vocab_size(self) -> int:
    return self.next.shape[1]

  @property
  def num_states(self) -> int:
    return self.next.shape[0]

  def _accepts_something(self) -> bool:
    seen, frontier = {self.start}, [self.start]
    while frontier:
      state = frontier.pop()
      if self.accept[state]:
        return True
      for nxt in set(self.next[state].tolist()) - seen - {DEAD}:
        seen.add(nxt)
        frontier.append(nxt)
    return False

  def matches(self, tokens) -> bool:
    """Whether the token sequence ends in an accepting state."""
    state = self.start
    for t in tokens:
      state = int(self.next[state, t])
      if state == DEAD:
        return False
    return bool(self.accept[state])


def regex(pattern: str, tokenizer) -> TokenAutomaton:
  """The automaton of token sequences whose decoded text matches `pattern` in full."""
  if tokenizer is None:
    raise ValueError("constraints.regex needs the target's tokenizer (target.tokenizer), "
                     "which maps the pattern's text onto tokens; got None")
  import interegular

  try:
    fsm = interegular.parse_pattern(pattern).to_fsm()
  except Exception as e:  # interegular raises its own parse errors
    # interegular says 'unicode properties' for every \u, \U, \N, \p and \P escape.
    escape = re.search(r"(?<!\\)(?:\\\\)*(\\(?:[pP]\{[^}]*\}|N\{[^}]*\}|u[0-9a-fA-F]{0,4}"
                       r"|U[0-9a-fA-F]{0,8}|[NpP]))", pattern)
    if "unicode properties" in str(e) and escape:
      raise ValueError(
          f"cannot compile regex {pattern!r}: the escape {escape.group(1)} (at character "
          f"{escape.start(1)}) is not supported: the regex compiler (interegular) takes no "
          f"\\u, \\U, \\N{{...}}, \\p{{...}} or \\P{{...}} escape (\\xHH it takes); write "
          "the character itself, or list the characters a property stands for") from e
    raise ValueError(f"cannot parse regex {pattern!r}: {e}") from e
  states = sorted(fsm.states)
  # Only states from which an accepting state is reachable are kept; the rest are DEAD.
  reverse = {s: set() for s in states}
  for s, edges in fsm.map.items():
    for t in edges.values():
      reverse[t].add(s)
  live, frontier = set(fsm.finals), list(fsm.finals)
  while frontier:
    for s in reverse[frontier.pop()] - live:
      live.add(s)
      frontier.append(s)
  index = {s: i for i, s in enumerate(sorted(live))}
  if fsm.initial not in index:
    raise ValueError(f"no text matches the regex {pattern!r}")
  alphabet = fsm.alphabet
  other = alphabet[interegular.fsm.anything_else]

  def step(state, ch):
    symbol = alphabet[ch] if ch in alphabet else other
    return fsm.map.get(state, {}).get(symbol)

  vocab = tokenizer.vocab_size
  text_of = tokenizer_lib.output_text(tokenizer)  # special tokens are no text: banned
  texts = [text_of([t]) for t in range(vocab)]
  table = np.full((len(index), vocab), DEAD, np.int32)
  for state, row in index.items():
    for token, text in enumerate(texts):
      if not text or "\ufffd" in text:
        continue
      s = state
      for ch in text:
        s = step(s, ch)
        if s is None or s not in index:
          break
      else:
        table[row, token] = index[s]
  accept = np.array([s in fsm.finals for s in sorted(live)], bool)
  return TokenAutomaton(next=table, accept=accept, start=index[fsm.initial], pattern=pattern)
