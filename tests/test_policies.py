"""Adaptive draft length (`gamma_policy`): lossless for every policy, per-row lengths,
an early-ending draft loop, and the pieces (cut, schedule, ledger choice) by table."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import decode as decode_lib
from specjax import policies
from specjax import backends
from specjax.generation import prepare
from specjax.processors.sampling import Sampling
from conftest import (LAW_ROWS, PROMPTS, exact_continuations, greedy_oracle, target_and_draft,
                      tiny_model, within_law)

SETTINGS = {  # each policy set so that rows really draft fewer than γ tokens
    "heuristic": {},
    "confidence": dict(draft_confidence=0.36),  # about the median top probability
    "ledger": dict(draft_cost=0.5),  # prior α 0.6: L = 1 until a row shows better
    # Measured costs as a pair: a pass growing by 0.5 of a step a token, on a CPU.
    "ledger_pair": dict(draft_cost=(0.1, 3.0)),
}


@functools.lru_cache(maxsize=None)
def greedy_pair():
  return (tiny_model(vocab=16, n_layers=2, seed=3),
          tiny_model(vocab=16, d_model=16, n_layers=1, seed=5))  # accepts about half


@pytest.mark.parametrize("policy,drafter", [
    ("heuristic", "model"), ("confidence", "model"), ("ledger", "ngram"),
    ("ledger_pair", "model")])
def test_greedy_equals_target_greedy(policy, drafter):
  target, draft = greedy_pair()
  kw = dict(drafter="ngram") if drafter == "ngram" else dict(draft=draft)
  res = specjax.generate(target, PROMPTS, max_new_tokens=12, gamma=4,
                         gamma_policy=policy.split("_")[0], **kw, **SETTINGS[policy])
  for prompt, out in zip(PROMPTS, res.tokens):
    assert out == greedy_oracle(target, prompt, 12)
  s = res.stats
  assert s["lossless"] and s["gamma_policy"] == policy.split("_")[0]
  assert s["drafted"] < 4 * s["rounds"]  # some rows drafted fewer than γ
  assert sum(s["verified_at"]) == s["overlap_count"] and s["accepted"] <= s["drafted"]


def test_greedy_with_an_eagle_head_and_confidence():
  from test_heads import random_head
  target = tiny_model(vocab=32, d_model=32, n_layers=2, llama=True, seed=0)
  head = random_head(target, "eagle")
  prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1]]
  res = specjax.generate(target, prompts, max_new_tokens=10, gamma=3, draft=head,
                         gamma_policy="confidence", draft_confidence=0.5)
  assert res.tokens == specjax.generate(target, prompts, max_new_tokens=10).tokens
  assert res.stats["draft_steps"] < 3 * res.stats["target_calls"]


@pytest.mark.parametrize("policy,gamma", [("heuristic", 2), ("confidence", 3), ("ledger", 3)])
def test_three_token_law(policy, gamma):
  target, draft = target_and_draft()
  prompt, length, rows = [3, 1, 3], 3, LAW_ROWS
  _, probs = exact_continuations(target, prompt, length)
  res = specjax.generate(target, [prompt] * rows, max_new_tokens=length, temperature=1.0,
                         seed=5, draft=draft, gamma=gamma, gamma_policy=policy,
                         **SETTINGS[policy])
  ok, worst = within_law(res.tokens, probs)
  assert ok, f"worst z={worst}"
  s = res.stats
  assert s["drafted"] < gamma * s["rounds"]  # rounds with short drafts really happened
  assert s["acceptance_rate"] < 0.95 and s["rounds"] > rows


def test_rows_draft_different_lengths_and_the_loop_stops_early():
  target, draft = target_and_draft()
  prompts = [[3, 1, 3], [0, 5], [7, 7, 2, 1], [6]]
  args = prepare(target, prompts, max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0,
                 eos_id=None, draft=draft, gamma=4, gamma_policy="confidence",
                 draft_confidence=0.36)
  state = args.run(jax.random.PRNGKey(3))
  s = jax.device_get(state.stats)
  per_round = s.drafted / s.rounds
  assert len(set(np.round(per_round, 6))) > 1  # rows drafted different mean lengths
  assert np.all(s.drafted <= 4 * s.rounds) and np.all(s.drafted >= s.rounds)
  # The loop ran as many steps as the longest row each round: fewer than γ per round.
  assert int(state.draft_steps) < 4 * int(state.target_calls)
  assert int(state.draft_steps) >= int(np.max(s.drafted))


def test_propose_until_cuts_rows_and_keeps_the_draws():
  _, draft = target_and_draft()
  drafter = specjax.drafters.ModelDrafter(config=draft.config, gamma=4)
  b, size = 4, 32
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 8, (b, size)), jnp.int32)
  n = jnp.asarray([5, 6, 7, 8], jnp.int32)
  kv = drafter.prefill(draft.params, drafter.init(b, size), tokens, n)
  sampling = Sampling.create(b, temperature=1.0)
  key = jax.random.PRNGKey(7)
  ys, qs, _ = jax.jit(drafter.propose)(draft.params, kv, tokens, n, key, sampling)
  until = jax.jit(drafter.propose_until)
  limit = jnp.asarray([1, 3, 0, 2], jnp.int32)
  ys2, qs2, _, lengths, steps = until(draft.params, kv, tokens, n, key, sampling, limit, 0.0)
  np.testing.assert_array_equal(lengths, limit)
  assert int(steps) == 3  # the longest row; row 2 (limit 0) drafts nothing
  for row, length in enumerate(np.asarray(limit)):
    np.testing.assert_array_equal(ys2[row, :length], ys[row, :length])
    np.testing.assert_allclose(qs2[row, :length], qs[row, :length], atol=1e-6)
  # Every row stops after its first token when no draft is that confident.
  *_, lengths, steps = until(draft.params, kv, tokens, n, key, sampling,
                             jnp.full((b,), 4, jnp.int32), 0.999999)
  np.testing.assert_array_equal(lengths, [1, 1, 1, 1])
  assert int(steps) == 1
  # No row drafts: no step runs and nothing is drawn.
  ys3, qs3, _, lengths, steps = until(draft.params, kv, tokens, n, key, sampling,
                                      jnp.zeros((b,), jnp.int32), 0.0)
  np.testing.assert_array_equal(lengths, 0)
  assert int(steps) == 0 and not np.any(ys3) and not np.any(qs3)


def test_cut_is_a_chain_of_each_rows_length():
  ps = jnp.asarray(np.eye(5, dtype=np.float32)[None].repeat(4, 0))  # p_i = one-hot(i)
  n_accepted = jnp.asarray([0, 2, 4, 3])
  next_token = jnp.asarray([9, 9, 9, 9])
  lengths = jnp.asarray([2, 2, 1, 4])
  n, nxt = policies.cut(n_accepted, next_token, ps, lengths, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(n, [0, 2, 1, 3])
  # Rejected inside the length: the rule's token; all L accepted: a draw from p_L.
  np.testing.assert_array_equal(nxt, [9, 2, 1, 9])
  # Each p's token given (a greedy round): the same outcome without reading p.
  top = jnp.argmax(ps, axis=-1).astype(jnp.int32)
  n2, nxt2 = policies.cut(n_accepted, next_token, jnp.zeros_like(ps), lengths,
                          jax.random.PRNGKey(0), True, top)
  np.testing.assert_array_equal(n2, n)
  np.testing.assert_array_equal(nxt2, nxt)


def test_heuristic_schedule_and_ledger_choice():
  policy = policies.GammaPolicy("heuristic")
  lengths = jnp.asarray([1, 3, 4, 1, 4])
  n_acc = jnp.asarray([1, 2, 4, 0, 3])
  out = policy.update(lengths, lengths, n_acc, 4)
  np.testing.assert_array_equal(out, [3, 2, 4, 1, 3])  # +2 / -1 within [1, γ]
  alpha = np.array([0.1, 0.5, 0.8, 0.95])
  for cost in (0.05, 0.3, 1.0):
    got = np.asarray(policies.ledger_length(jnp.asarray(alpha, jnp.float32), 6, cost))
    ls = np.arange(1, 7)
    want = [ls[np.argmax((1 - a ** (ls + 1)) / (1 - a) / (ls * cost + 1))] for a in alpha]
    np.testing.assert_array_equal(got, want)
  # A cheap draft and a good row draft long; an expensive draft short.
  assert policies.ledger_length(jnp.asarray([0.95]), 6, 0.01)[0] == 6
  assert policies.ledger_length(jnp.asarray([0.3]), 6, 1.0)[0] == 1
  # A pass that grows with the draft: the cost per token is c + its slope.
  for slope in (0.1, 0.3):
    got = np.asarray(policies.ledger_length(jnp.asarray(alpha, jnp.float32), 6, 0.02, slope))
    want = [ls[np.argmax((1 - a ** (ls + 1)) / (1 - a) / (ls * (0.02 + slope) + 1))]
            for a in alpha]
    np.testing.assert_array_equal(got, want)


def test_ledger_prices_a_narrowing_pass_by_its_width():
  # v(4) = 2 (slope 0.25 a token), c = 0.02: a row with α̂ 0.3 drafts 1 token where the
  # pass narrows to its drafts, and 3 where every pass costs v(4) whatever it drafted.
  policy = policies.GammaPolicy("ledger", draft_cost=0.01, verify_cost=2.0)
  stats = decode_lib.Stats.zeros(2, 5)
  stats = stats.replace(overlap_sum=jnp.asarray([30.0, 95.0]),
                        overlap_count=jnp.asarray([100, 100]))
  draft_len = jnp.full((2,), 4, jnp.int32)
  alpha = (np.array([30.0, 95.0]) + 0.6 * 4) / 104
  for narrow, c, slope in ((True, 0.02, 0.25), (False, 0.01, 0.0)):
    got = np.asarray(policy.limits(draft_len, stats, 4, narrow))
    ls = np.arange(1, 5)
    want = [ls[np.argmax((1 - a ** (ls + 1)) / (1 - a) / (ls * (c + slope) + 1))] for a in alpha]
    np.testing.assert_array_equal(got, want)
  assert policy.limits(draft_len, stats, 4, True)[0] == 1
  assert policy.limits(draft_len, stats, 4, False)[0] == 3
  # v unknown (a number given as draft_cost): the fixed-width price either way.
  plain = policies.GammaPolicy("ledger", draft_cost=0.01)
  np.testing.assert_array_equal(plain.limits(draft_len, stats, 4, True),
                                plain.limits(draft_len, stats, 4, False))
  # End to end on Llama-shaped models (the CPU kernels narrow their pass): with a pass
  # growing by half a step a token the rows draft 1 token; priced as a fixed-width pass
  # (the same c / v as a number), more. Both give the target's greedy tokens.
  target = tiny_model(vocab=16, n_layers=2, seed=3, llama=True)
  draft = tiny_model(vocab=16, d_model=16, n_layers=1, seed=5, llama=True)
  kw = dict(max_new_tokens=10, gamma=4, draft=draft, gamma_policy="ledger")
  by_width = specjax.generate(target, PROMPTS[:2], draft_cost=(0.1, 3.0), **kw)
  fixed_width = specjax.generate(target, PROMPTS[:2], draft_cost=0.1 / 3.0, **kw)
  want = [greedy_oracle(target, p, 10) for p in PROMPTS[:2]]
  assert by_width.tokens == want and fixed_width.tokens == want
  if backends.select().narrow_pass:
    assert by_width.stats["drafted"] == by_width.stats["rounds"]
    assert fixed_width.stats["drafted"] > fixed_width.stats["rounds"]
  # generate's draft_cost=(c, v) sets both.
  from specjax.arguments import make_policy
  drafter = types.SimpleNamespace(gamma=4, tree=None)
  assert make_policy("ledger", None, (0.02, 2.0), drafter) == policy


def test_stats_without_policy_are_unchanged():
  s = decode_lib.update_stats(decode_lib.Stats.zeros(2, 3), jnp.asarray([True, True]),
                              jnp.asarray([1, 3]), jnp.asarray([2, 4]),
                              jnp.full((2, 3), 0.5))
  np.testing.assert_array_equal(s.drafted, [3, 3])
  np.testing.assert_array_equal(s.verified_at, [[1, 1, 0], [1, 1, 1]])
  cut = decode_lib.update_stats(decode_lib.Stats.zeros(2, 3), jnp.asarray([True, True]),
                                jnp.asarray([1, 2]), jnp.asarray([2, 3]),
                                jnp.full((2, 3), 0.5), lengths=jnp.asarray([1, 2]))
  np.testing.assert_array_equal(cut.drafted, [1, 2])
  np.testing.assert_array_equal(cut.verified_at, [[1, 0, 0], [1, 1, 0]])
  np.testing.assert_allclose(cut.overlap_sum, [0.5, 1.0])


@pytest.mark.parametrize("kwargs,message", [
    (dict(gamma_policy="adaptive"), "gamma_policy must be one of"),
    (dict(gamma_policy="confidence", draft_confidence=1.5), "draft_confidence"),
    (dict(gamma_policy="confidence", draft_confidence=0.0), "draft_confidence"),
    (dict(gamma_policy="heuristic", draft_confidence=0.5), "draft_confidence is for"),
    (dict(gamma_policy="ledger", draft_cost=-1.0), "draft_cost"),
    (dict(gamma_policy="ledger", draft_cost=float("nan")), "draft_cost"),
    (dict(gamma_policy="ledger", draft_cost=(0.1, 0.0)), "v \\(the verify pass"),
    (dict(gamma_policy="ledger", draft_cost=(0.1, 2.0, 3.0)), "pair"),
    (dict(gamma_policy="ledger", draft_cost=(-0.1, 2.0)), "draft_cost"),
    (dict(gamma_policy="fixed", draft_cost=0.2), "draft_cost is for"),
    (dict(gamma_policy="heuristic", tree=(2, 1)), "tree"),
    (dict(gamma_policy="confidence", drafter="ngram"), "token by token"),
    (dict(gamma_policy="heuristic", draft=None), "needs a drafter"),
])
def test_bad_input(kwargs, message):
  target, draft = target_and_draft()
  kwargs = dict(dict(draft=draft), **kwargs)
  if kwargs.get("drafter") == "ngram":
    kwargs["draft"] = None
  with pytest.raises(ValueError, match=message):
    specjax.generate(target, [[1, 2]], max_new_tokens=4, **kwargs)
