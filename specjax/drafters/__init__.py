"""Drafters: what proposes γ tokens each round, behind one small interface.

A drafter is a frozen (hashable) dataclass, so it is a static argument of the jitted
decode loop, with four pure methods:

  init(batch, size)                          -> state (a pytree; may be empty)
  prefill(params, state, tokens, n, features) -> state, ready for the first round
  propose(params, state, tokens, n, key, sampling)
                                             -> (y int[B, γ], q [B, γ, V], state)
  rollback(state, n, features, start)        -> state consistent with the committed n

`tokens[B, S]` is the sequence buffer and `n[B]` the committed length of each row; the
last committed token (index n-1) has no KV yet on either side. q is the distribution
each y was drawn from (one-hot for token-only drafts).

A drafter whose `uses_features` is True (a head on the target's hidden states) gets
the target's last hidden states (or, where it names `feature_layers`, those layers'
residual streams concatenated): of the prompt prefill in `prefill`, and of the verify
pass (inputs at positions start[b]..start[b]+γ) in `rollback`. Everything else gets None.

One file per drafter:

  none.py    NoDrafter: γ = 0, the target-only baseline on the same engine
  model.py   ModelDrafter: a small causal LM with its own KV cache
  ngram.py   NgramDrafter: prompt lookup, token-only (one-hot q)
  heads.py   EagleDrafter (EAGLE and EAGLE-3), MedusaDrafter: learned heads on the target's features

  trees.py   TreeModelDrafter, NgramTreeDrafter, TreeMedusaDrafter: a token tree per round
"""

from specjax.drafters.heads import EagleDrafter, MedusaDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.none import NoDrafter

__all__ = ["EagleDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "NoDrafter"]
