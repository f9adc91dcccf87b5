"""The EAGLE head drafting token trees (drafters.trees.TreeEagleDrafter), static and
dynamic: every node's q against the chain reference on its own root-to-node path, the
true features kept along the accepted path, greedy equality, and the law of 3-token
continuations at T > 0."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import trees
from specjax.drafters import trees as tree_drafters
from specjax.processors.sampling import process_logits
from conftest import LAW_ROWS, target_and_draft, within_law
from test_block import filtered_law
from test_heads import (N, P, SIZE, TOKENS, eagle_reference, features_of, head_target,
                        random_head, settings, tree_rounds)


@pytest.fixture(scope="module")
def target():
  return head_target()


TREES = {"static": trees.Tree.from_branching((2, 2, 1)),
         "dynamic": trees.DynamicTree(6, 3, 2, alpha=(0.6, 0.3))}


def path_of(parents, i):
  out = []
  while i >= 0:
    out.append(i)
    i = parents[i]
  return out[::-1]


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_nodes_q_is_the_chain_reference_on_its_path(target, name, temperature):
  """Node i was drawn from the head's distribution after its parent's path: the chain
  step's logits with the path's tokens drafted (an uncached reference)."""
  head = random_head(target, "eagle")
  tree = TREES[name]
  drafter = tree_drafters.TreeEagleDrafter(head.config, tree.depth, tree=tree)
  params = head.draft_params(target)
  tokens, n = jnp.asarray(TOKENS), jnp.asarray(N)
  state = jax.jit(drafter.prefill)(params, drafter.init(2, SIZE), tokens, n,
                                   features_of(target, TOKENS[:, :P]))
  ys, qs, new = jax.jit(drafter.propose)(params, state, tokens, n, jax.random.PRNGKey(5),
                                         settings(2, temperature))
  parents = np.asarray(new.parents)
  full = features_of(target, TOKENS)
  shapes = set()
  for b in range(2):
    shapes.add(tuple(parents[b]))
    for i in range(tree.num_nodes):
      path = path_of(parents[b], i)
      drafted = [int(ys[b, j]) for j in path]
      logits = eagle_reference(head.config, params, TOKENS[b], full[b], int(N[b]), drafted)
      q_ref = process_logits(logits[len(path) - 1], temperature, 0, 1.0)
      np.testing.assert_allclose(qs[b, i], q_ref, atol=2e-5)
      assert q_ref[drafted[-1]] > 0 or temperature == 0
    for p in set(parents[b].tolist()):  # siblings never repeat a token
      sibs = [int(ys[b, j]) for j in range(tree.num_nodes) if parents[b, j] == p]
      assert len(sibs) == len(set(sibs))
  if name == "static":
    assert shapes == {tree.parents}


@pytest.mark.parametrize("name", list(TREES))
def test_rounds_keep_the_true_features_of_the_accepted_path(target, name):
  """After real tree rounds the head's pending features are the target's own at the
  committed positions, as a head prefilled from scratch on the text would hold them."""
  for state, n, fresh in tree_rounds(target, random_head(target, "eagle"), TREES[name]):
    ds = state.draft_state
    for b in range(2):
      start = int(ds.kv.length[b])
      k = n[b] - 1 - start
      assert k >= 1
      np.testing.assert_allclose(ds.feats[b, :k], fresh[b, start:n[b] - 1], atol=1e-4)
      assert not np.any(np.asarray(ds.feats[b, k:]))


@pytest.mark.parametrize("name", list(TREES))
def test_equals_target_greedy(target, name):
  head = random_head(target, "eagle")
  prompts = [TOKENS[0, :7].tolist(), TOKENS[1, :3].tolist()]
  for mode in ("probabilistic", "greedy"):
    res = specjax.generate(target, prompts, max_new_tokens=12, draft=head, tree=TREES[name],
                           draft_sample=mode)
    assert res.tokens == specjax.generate(target, prompts, max_new_tokens=12).tokens
    assert res.stats["tokens_per_target_call"] > 1.0


@pytest.mark.parametrize("tree", [(2, 2), trees.DynamicTree(5, 2, 3, alpha=(0.6, 0.3))],
                         ids=["static", "dynamic"])
def test_three_token_law(tree):
  small, _ = target_and_draft()  # vocabulary 8: 512 continuations of 3 tokens
  head = random_head(small, "eagle")
  prompt = [3, 1, 3]
  res = specjax.generate(small, [prompt] * LAW_ROWS, max_new_tokens=3, draft=head, tree=tree,
                         temperature=0.8, top_p=0.9, seed=4)
  ok, worst = within_law(res.tokens, filtered_law(small, prompt, 3, 0.8, 0, 0.9))
  assert ok, f"worst z={worst}"
  assert res.stats["lossless"]
  assert 0.05 < res.stats["acceptance_rate"] < 0.95  # drafts both accepted and rejected
