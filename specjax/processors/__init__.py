"""Processors: raw logits -> the distribution each side samples from.

  sampling.py     temperature, top-k, top-p, greedy (`process_logits`) and `sample`
  history.py      history-dependent processors (penalties, n-gram bans, min length, logit
                  bias, an automaton), evaluated per candidate prefix
  constraints.py  token automata for constrained output (`regex`)
  stops.py        stop strings: a byte-level Aho–Corasick automaton lifted to the
                  vocabulary, matched on the text however the tokens split it

The same processing is applied to the target's p and the draft's q, so the verify rule
compares the distributions actually sampled from.
"""

from specjax.processors.history import (History, ProcessorConfig, ProcessorSettings,
                                        settings_from_args)
from specjax.processors.sampling import Sampling, process_logits, sample

__all__ = ["History", "ProcessorConfig", "ProcessorSettings", "Sampling", "process_logits",
           "sample", "settings_from_args"]
