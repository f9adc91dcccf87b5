"""The decode loop's structure: `done` tested once every K rounds, a static trip count
where the host knows the rounds (`decode.run_loop`), and the same outputs as K = 1.

On XLA:GPU a while loop without a static trip count brings its predicate to the host
every iteration; an inner loop of K rounds, in which a finished row commits nothing,
waits once per K. Every output the caller reads (tokens, stats, finish reasons,
logprobs, stream chunks, target_calls) must be what K = 1 gives, and no loop may run
past max_rounds.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from specjax import decode as decode_lib
from specjax.prepare import prepare, seed_key
from specjax.results import Stream, build_result
from conftest import tiny_model


@pytest.fixture(scope="module")
def pair():
  return tiny_model(vocab=8, seed=3), tiny_model(vocab=8, d_model=16, seed=5)


PROMPTS = [[1, 2, 3], [4, 5], [6, 1, 2, 7, 3]]
# Each EOS (picked for these seeds) ends some rows early, at different rounds and inside
# speculative rounds, and every row is done after a count of rounds that K = 3 or 4 does
# not divide: the inner loop runs rounds after the last row's end.
CASES = {
    "target-T0": dict(temperature=0.0),
    "target-T1-eos": dict(temperature=1.0, eos_id=2),
    "draft-T1-eos": dict(temperature=1.0, draft="draft", gamma=3, eos_id=1),
    "draft-T0-logprobs": dict(temperature=0.0, draft="draft", gamma=2, logprobs=True,
                              top_logprobs=2),
    "ngram-T0-eos": dict(temperature=0.0, drafter="ngram", gamma=2, eos_id=3),
    "tree-T1-eos": dict(temperature=1.0, draft="draft", tree=(2, 1), eos_id=6),
    "heuristic-T1-eos": dict(temperature=1.0, draft="draft", gamma=3,
                             gamma_policy="heuristic", eos_id=1),
    "stops-T1": dict(temperature=1.0, draft="draft", gamma=2, stop_sequences=[[3, 4]],
                     logprobs=True),
}


def _with(p, check_every, static=True):
  # static: the static trip count where the host knows the rounds (off by default on a
  # CPU; on here, so the tests run it).
  return dataclasses.replace(p, engine=dataclasses.replace(
      p.engine, check_every=check_every, static_trip=static))


def _prepared(pair, check_every, kw, max_new=9, static=True):
  target, draft = pair
  kw = dict(kw)
  if kw.get("draft") == "draft":
    kw["draft"] = draft
  return _with(prepare(target, PROMPTS, max_new_tokens=max_new, **kw), check_every, static)


def _result(pair, check_every, kw, max_rounds=decode_lib.NO_ROUND_LIMIT, seed=7,
            static=True):
  p = _prepared(pair, check_every, kw, static=static)
  state = p.run(seed_key(seed), max_rounds)
  return build_result(pair[0], p.engine, state, p.stops), int(state.target_calls)


@pytest.mark.parametrize("name", list(CASES))
def test_checking_done_every_k_rounds_changes_no_output(pair, name):
  want, calls = _result(pair, 1, CASES[name])
  for k in (3, 4):
    got, got_calls = _result(pair, k, CASES[name])
    assert got == want, (k, got, want)  # tokens, stats, finish/stop reasons, logprobs
    assert got_calls == calls == want.stats["target_calls"]
  if "eos" in name:  # the case ends rows early, and the inner loop runs past the end
    assert "stop" in want.finish_reasons and any(calls % k for k in (3, 4))


@pytest.mark.parametrize("name", ["target-T1-eos", "draft-T1-eos", "tree-T1-eos"])
@pytest.mark.parametrize("limit", [1, 3, 5, 6])
def test_no_loop_runs_past_max_rounds(pair, name, limit):
  want, calls = _result(pair, 1, CASES[name], max_rounds=limit)
  assert calls <= limit
  got, got_calls = _result(pair, 4, CASES[name], max_rounds=limit)
  assert got == want and got_calls == calls


# Chunks of 2 rounds run below K = 4 (one test a round); chunks of 5 run one inner loop
# of 4, then one round.
@pytest.mark.parametrize("name,chunk", [("target-T0", 2), ("target-T0", 5),
                                        ("draft-T1-eos", 2), ("draft-T0-logprobs", 2),
                                        ("tree-T1-eos", 2), ("target-T1-eos", 5)])
def test_stream_chunks_are_unchanged(pair, name, chunk):
  def chunks(k):
    p = _prepared(pair, k, CASES[name])
    s = Stream(pair[0], p, seed_key(7), chunk)
    return list(s), s.result

  want_chunks, want = chunks(1)
  got_chunks, got = chunks(4)
  assert got_chunks == want_chunks and got == want
  assert len(want_chunks) >= 2  # several chunks, each cut by its round limit


def test_the_static_trip_count_is_what_the_loop_needs(pair):
  # Nothing ends a row early: one token a round until the budget; the host knows the
  # rounds, and the loop of that static count gives what the while loop gives.
  kw = dict(temperature=1.0)
  p = _prepared(pair, 1, kw)
  assert p.rounds == 9
  for k in (1, 4):
    got, calls = _result(pair, k, kw)
    want, want_calls = _result(pair, k, kw, static=False)
    assert got == want and calls == want_calls == 9
  # Anything that can end a row early leaves it to the loop's test.
  for other in (dict(eos_id=2), dict(stop_sequences=[[3, 4]]), dict(no_repeat_ngram_size=2),
                dict(drafter="ngram", gamma=2), dict(min_new_tokens=2, eos_id=2)):
    assert _prepared(pair, 1, {**kw, **other}).rounds is None, other
  # At the context limit: every row commits its budget in exactly that many rounds.
  target = tiny_model(vocab=8, seed=3, max_len=16)
  q = prepare(target, [[1] * 10, [2]], max_new_tokens=6)
  assert q.rounds == 6
  for static in (True, False):
    state = _with(q, 1, static).run(seed_key(0))
    assert int(state.target_calls) == 6 and list(np.asarray(state.n)) == [16, 7]


def _loop_hlo(pair, check_every, kw, rounds):
  p = _prepared(pair, check_every, kw)
  return decode_lib.decode.lower(
      p.engine, p.prompt_width, p.cache_size, p.laid_out, p.tokens, p.prompt_len,
      p.sampling, seed_key(0), decode_lib.NO_ROUND_LIMIT, rounds=rounds).compile().as_text()


def _trip_counts(text):
  return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)]


def test_the_compiled_loops(pair):
  kw = dict(temperature=1.0)
  # The static case: the decode loop has the known trip count 9 (rounds), and no loop
  # of the decode is left without one.
  static = _loop_hlo(pair, 4, kw, rounds=9)
  assert 9 in _trip_counts(static)
  # K = 4 without a known count: an inner loop of 4 rounds inside the outer while loop.
  chunked = _loop_hlo(pair, 4, kw, rounds=None)
  assert 4 in _trip_counts(chunked) and 9 not in _trip_counts(chunked)
  # K = 1: no loop of 4 rounds (the check sees the difference).
  assert 4 not in _trip_counts(_loop_hlo(pair, 1, kw, rounds=None))


def test_check_every_is_checked():
  cfg = tiny_model(vocab=8).config
  from specjax.drafters import NoDrafter
  for bad in (0, -2, 1.5, True, "4"):
    with pytest.raises(ValueError, match="check_every"):
      decode_lib.Engine(target=cfg, drafter=NoDrafter(8), check_every=bad)
  for bad in (0, 1, "yes"):
    with pytest.raises(ValueError, match="static_trip"):
      decode_lib.Engine(target=cfg, drafter=NoDrafter(8), static_trip=bad)
  engine = decode_lib.Engine(target=cfg, drafter=NoDrafter(8))
  on_cpu = jax.default_backend() == "cpu"
  assert engine.check_period == (1 if on_cpu else 8)
  assert engine.static_trip_count == (not on_cpu)
  assert dataclasses.replace(engine, check_every=5).check_period == 5
  assert dataclasses.replace(engine, static_trip=True).static_trip_count
