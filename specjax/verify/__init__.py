"""Verify rules: (candidates, q, p) -> the accepted prefix and the next token, one row at a time.

  exact.py   the lossless rule (accept min(1, p/q), else sample [p - q]+; bonus from p)
  block.py   block verification (Sun et al. 2024): a chain verified jointly, lossless
  rules.py   research rules beside it (typical, threshold, synthetic), none lossless
  layouts.py a round's candidates as a chain or a tree: pass layout, verify, commit, rollback

  tree.py    the walk down a token tree (the node rules) and the accepted path's KV compaction
  traversal.py traversal verification of a tree (leaves first), lossless: verify_rule='traversal'
  optimum.py the multi-draft optimum a node rule is measured against (float64, numpy)
"""

from specjax.verify.block import BlockRule
from specjax.verify.exact import ExactRule, acceptance_prob, residual, verify
from specjax.verify.traversal import TraversalRule
from specjax.verify.rules import RULES, SyntheticRule, ThresholdRule, TypicalRule, make_rule

__all__ = ["RULES", "BlockRule", "ExactRule", "SyntheticRule", "ThresholdRule", "TraversalRule",
           "TypicalRule",
           "acceptance_prob", "make_rule", "residual", "verify"]
