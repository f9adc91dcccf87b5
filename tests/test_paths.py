"""The decode loop holds only the path that runs: no `conditional` where the host knows.

On XLA:GPU every conditional in a while loop brings its predicate to the host each
round (docs/ARCHITECTURE.md, "On an accelerator"). `prepare` knows on the host whether
every row is greedy and whether any filter is on (`sampling.Paths`), so target-only and
prompt-lookup decoding compile without one; so do mixed-temperature batches, top-k,
the draft-model chain and adaptive draft lengths (conditions that must stay traced run
as the path that serves every value, or as a loop's condition); the numbers are the
ones the traced conditionals gave.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode as decode_lib
from specjax.prepare import prepare, seed_key
from specjax.processors.sampling import Paths, process_logits
from conftest import tiny_model


def _compiled_text(model, **kw):
  p = prepare(model, [[1, 2, 3], [4, 5]], max_new_tokens=6, **kw)
  return decode_lib.decode.lower(
      p.engine, p.prompt_width, p.cache_size, p.laid_out, p.tokens, p.prompt_len,
      p.sampling, seed_key(0), decode_lib.NO_ROUND_LIMIT).compile().as_text()


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab=16, d_model=32)


_DRAFT = tiny_model(vocab=16, d_model=16, seed=4)
CASES = {
    "target-T0": dict(temperature=0.0), "target-T1": dict(temperature=1.0),
    "ngram-T0": dict(temperature=0.0, drafter="ngram", gamma=2),
    "mixed-T": dict(temperature=[0.0, 1.0]),  # the rule: verify_batch, not a conditional
    "mixed-top-k": dict(temperature=[0.0, 0.7], top_k=[0, 3]),  # no top-p: no cut
    "draft-T1": dict(temperature=1.0, draft=_DRAFT, gamma=2),
    "draft-mixed": dict(temperature=[0.0, 1.0], draft=_DRAFT, gamma=2),
    # propose_until: the draft forward is skipped by the loop's condition
    "heuristic-T0": dict(temperature=0.0, draft=_DRAFT, gamma=3, gamma_policy="heuristic"),
    "block-T0": dict(temperature=0.0, draft=_DRAFT, gamma=2, verify_rule="block"),
    "block-T1": dict(temperature=1.0, draft=_DRAFT, gamma=2, verify_rule="block"),
    "block-heuristic-T1": dict(temperature=1.0, draft=_DRAFT, gamma=3, verify_rule="block",
                               gamma_policy="heuristic"),
    "confidence-T1": dict(temperature=1.0, draft=_DRAFT, gamma=3, gamma_policy="confidence",
                          draft_confidence=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_conditional_in_the_decode_program(model, name):
  text = _compiled_text(model, **CASES[name])
  assert " while(" in text  # the program is the decode loop
  assert " conditional(" not in text


def test_the_check_sees_a_conditional_where_one_is_left(model):
  # top-p's cut depends on the logits: that program keeps its conditional.
  assert " conditional(" in _compiled_text(model, temperature=1.0, top_p=0.9)


def test_paths_of_host_settings():
  assert Paths.of([0.0, 0.0], 0, 1.0) == Paths(greedy=True, filters=False, deep_top_k=False,
                                               nucleus=False)
  assert Paths.of([0.5, 1.0], 0, 1.0) == Paths(greedy=False, filters=False, deep_top_k=False,
                                               nucleus=False)
  assert Paths.of(1.0, 5, 1.0).filters and not Paths.of(1.0, 5, 1.0).nucleus
  assert Paths.of(1.0, 0, [1.0, 0.9]).nucleus
  assert Paths.of([0.0, 1.0], [0, 3], 1.0).greedy is None  # mixed rows
  assert Paths.of(1.0, 0, [1.0, 0.9]).filters
  assert Paths.of(1.0, [3, 200], 1.0).deep_top_k and not Paths.of(1.0, 3, 1.0).deep_top_k
  # With history-dependent processors only an all-greedy batch is claimed.
  assert Paths.of(1.0, 0, 1.0, adjusts=True) == Paths()
  assert Paths.of(0.0, 0, 1.0, adjusts=True).greedy


@pytest.mark.parametrize("temperature,top_k,top_p", [
    ([0.0, 0.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0]),   # all greedy
    ([0.7, 1.0, 2.0], [0, 0, 0], [1.0, 1.0, 1.0]),   # sampled, no filter
    ([0.7, 0.0, 1.3], [0, 5, 0], [1.0, 1.0, 1.0]),   # mixed rows, top-k
    ([1.0, 1.0, 0.8], [100, 0, 2], [0.9, 1.0, 1.0]),  # a top-k past the head, top-p
])
def test_static_paths_give_the_traced_numbers(temperature, top_k, top_p):
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 160)) * 3
  args = [jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p)]
  traced = process_logits(logits, *args)  # Paths(): every choice a conditional
  static = process_logits(logits, *args, Paths.of(temperature, top_k, top_p))
  chex.assert_trees_all_close(static, traced, atol=1e-6)
  assert np.all(np.isfinite(np.asarray(static)))
