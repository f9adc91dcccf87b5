"""What a newcomer's first sweep tells them: a summary whose recommendation is measured or
supported by a prediction that fits, a legend for its symbols, a workdir whose
config.json describes every row, and config mistakes as one line from the app.

Rows here are made up (no model runs): the summary and the workdir checks only read them.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import sweep as sweep_config
from experiments import plots
from experiments import run as run_lib

ROOT = Path(__file__).parent.parent


def test_an_unsupported_regex_escape_is_named():
  from specjax.processors import constraints

  class Chars:
    vocab_size = 4

    def decode(self, ids):
      return "".join("ab01"[i] for i in ids)

  with pytest.raises(ValueError, match=r"\\U0010ffff") as e:
    constraints.regex(r"[^\x00-\U0010ffff]", Chars())
  assert "unicode properties" not in str(e.value)
  with pytest.raises(ValueError, match=r"\\p\{L\}"):
    constraints.regex(r"\p{L}+", Chars())
  with pytest.raises(ValueError, match="lookbacks"):  # other messages pass through
    constraints.regex(r"(?<=a)b", Chars())
