"""`costs.step_costs` / `verify_costs`: c and v are medians of per-round ratios.

The timers are scripted (no compile): a machine that slows down in one round must move
that round's step and pass alike, so the ratio is taken within a round, not between
the best (or median) times of separately timed loops.
"""

import types

from specjax import costs
from specjax import timing


def scripted(times):
  it = iter(times)
  return lambda: next(it)


def test_step_costs_are_medians_of_per_round_ratios(monkeypatch):
  # Round 3 ran on a machine twice as slow for every loop.
  step, verify, propose = [1.0, 2.0, 4.0], [3.0, 2.0, 4.0], [0.8, 1.6, 4.0]
  monkeypatch.setattr(timing, "forward_timer", lambda model, batch, t, **kw: scripted(
      step if t == 1 else verify))
  monkeypatch.setattr(timing, "propose_timer", lambda *a, **kw: scripted(propose))
  target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=8))
  drafter = types.SimpleNamespace(gamma=2)
  sc = costs.step_costs(target, drafter, None, 1, 16, repeats=3)
  # Per-round v = 3, 1, 1 (median 1); the ratio of best times would say 2, of medians 1.5.
  assert sc["v"] == 1.0 and (sc["v_min"], sc["v_max"]) == (1.0, 3.0)
  # Per-round c = 0.8/2/1, 1.6/2/2, 4/2/4 = 0.4, 0.4, 0.5.
  assert sc["c"] == 0.4 and sc["c_max"] == 0.5
  assert sc["target_step_s"] == 2.0 and sc["verify_s"] == 3.0


def test_a_proposal_timed_below_zero_costs_nothing(monkeypatch):
  # A lookup's `propose` is below what a differenced loop resolves: -0.01 reads as 0.
  monkeypatch.setattr(timing, "forward_timer", lambda model, batch, t, **kw: scripted(
      [1.0] * 3 if t == 1 else [2.0] * 3))
  monkeypatch.setattr(timing, "propose_timer", lambda *a, **kw: scripted([-0.01, 0.02, 0.04]))
  target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=8))
  sc = costs.step_costs(target, types.SimpleNamespace(gamma=2), None, 1, 16, repeats=3)
  assert (sc["c_min"], sc["c"], sc["c_max"]) == (0.0, 0.01, 0.02)


def test_verify_costs_pair_each_pass_with_the_step_before_it(monkeypatch):
  step = [1.0, 1.0, 3.0, 3.0]  # rounds: (γ=1, γ=2), (γ=1, γ=2); the second is slow
  passes = {2: [1.5, 3.0], 3: [2.0, 6.0]}
  monkeypatch.setattr(timing, "forward_timer", lambda model, batch, t, **kw: scripted(
      step if t == 1 else passes[t]))
  target = types.SimpleNamespace(config=types.SimpleNamespace(
      d_model=8, n_heads=2, head_dim=4, n_kv_heads=2, d_ff=16, mlp="swiglu", n_layers=1,
      vocab_size=8))
  vc = costs.verify_costs(target, 1, [1, 2], context=16, repeats=2)
  # γ = 1: per-round v = 1.5, 1.0 (median 1.25); best times say 1.5, medians 1.125.
  assert vc["by_gamma"][1]["v"] == 1.25
  assert (vc["by_gamma"][1]["v_min"], vc["by_gamma"][1]["v_max"]) == (1.0, 1.5)
  assert vc["by_gamma"][2]["v"] == 2.0


def test_call_costs_split_calls_into_rounds_and_a_fixed_part(monkeypatch):
  # rounds=16 caps R. W(1) and W(16) per side: t_m = (42 - 12) / 15 = 2, F_m = 12 - 2 = 10; t_b = 1, F_b = 5.
  # Repeat 2 ran on a machine twice as slow for both sides.
  # Repeat 4: the baseline's 16 rounds took no longer than one (jitter) three times
  # running: timed again twice, then dropped.
  walls = {"m": {1: [12.0, 24.0, 12.0] + [12.0] * 3, 16: [42.0, 84.0, 42.0] + [42.0] * 3},
           "b": {1: [6.0, 12.0, 6.0] + [6.0] * 3, 16: [21.0, 42.0, 21.0] + [5.0] * 3}}
  asked, ran = [], {}

  def call_timer(target, prompts, kw):
    side = "m" if "drafter" in kw else "b"
    return lambda rounds: asked.append((side, rounds)) or (walls[side][rounds].pop(0),
                                                            ran.get((side, rounds), rounds))

  monkeypatch.setattr(costs, "prepare", lambda target, prompts, **kw: types.SimpleNamespace(
      engine=types.SimpleNamespace(gamma=2)))
  monkeypatch.setattr(costs, "call_timer", call_timer)
  out = costs.call_costs(None, [[1]], dict(max_new_tokens=64, drafter="ngram"),
                         dict(max_new_tokens=64), rounds=16, repeats=4)
  assert out["repeats_kept"] == 3 and out["rounds_timed"] == 16  # 64 // (γ + 1) = 21: capped
  assert (out["round"], out["round_min"], out["round_max"]) == (2.0, 2.0, 2.0)
  assert out["fixed_method"] == 10.0 and out["fixed_baseline"] == 5.0
  assert out["round_method_s"] == 2.0 and out["new_tokens"] == 64
  assert asked[:4] == [("m", 1), ("m", 16), ("b", 1), ("b", 16)]
  assert asked[4:6] == [("b", 1), ("b", 16)]  # the order alternates between repeats
  assert len(asked) == 4 * 3 + 4 * 3 and not walls["b"][16]
  # One stall, then a clean time: the repeat is kept.
  walls["m"] = {1: [12.0, 12.0], 16: [42.0, 42.0]}
  walls["b"] = {1: [6.0, 6.0], 16: [5.0, 21.0]}
  out = costs.call_costs(None, [[1]], dict(max_new_tokens=64, drafter="ngram"),
                         dict(max_new_tokens=64), rounds=16, repeats=1)
  assert out["repeats_kept"] == 1 and out["round"] == 2.0
  # A budget of 8 at γ = 2 leaves room for 8 // 3 = 2 rounds, not 16; target-only for 8.
  walls["m"] = {1: [3.0], 2: [5.0]}
  walls["b"] = {1: [2.0], 8: [9.0]}
  monkeypatch.setattr(costs, "call_timer", call_timer)
  out = costs.call_costs(None, [[1]], dict(max_new_tokens=8, drafter="ngram"),
                         dict(max_new_tokens=8), repeats=1)
  assert out["rounds_timed"] == 2 and out["round"] == 2.0 and out["fixed_method"] == 1.0
  # Every row stopped (EOS) after 5 of the 8 target-only rounds asked: t_b = (9 - 2) / 4.
  walls["m"] = {1: [3.0], 2: [5.0]}
  walls["b"] = {1: [2.0], 8: [9.0]}
  ran[("b", 8)] = 5
  out = costs.call_costs(None, [[1]], dict(max_new_tokens=8, drafter="ngram"),
                         dict(max_new_tokens=8), repeats=1)
  assert out["round_baseline_s"] == 7 / 4 and out["fixed_baseline"] == (2 - 7 / 4) / (7 / 4)


def test_forward_timer_keeps_the_cache_in_the_weights_dtype():
  import jax.numpy as jnp
  from experiments import synthetic
  model = synthetic.random_model(dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                      d_ff=64, max_len=64), "bfloat16", 0)
  run = costs.forward_timer(model, 1, 2, context=8, iters=1)
  kv = run.args[2]
  assert kv.k[0].dtype == jnp.bfloat16 and kv.v[0].dtype == jnp.bfloat16


def test_forward_timer_times_a_narrowed_pass():
  # `live` reaches the timed program: where the CPU kernels run the layers (a Llama-shaped
  # model, laid out), its logits past the live tokens are the kernels' zeros.
  import jax
  import jax.numpy as jnp
  from conftest import tiny_model
  from specjax.backends.cpu import kernels as cpu_kernels
  model = tiny_model(vocab=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, llama=True)
  run = costs.forward_timer(model, 1, 4, context=8, iters=1, live=2)
  run()  # a difference of two short loops: its sign is noise
  hlo = run.loop.lower(*run.args).as_text()
  assert ("specjax_rope_attention" in hlo) == cpu_kernels.available()
  graphdef, (params, kv, tokens) = model.graphdef, run.args[1:]
  from specjax.models import model as model_lib
  logits, _ = jax.jit(lambda p, k, t: model_lib.forward_cached(graphdef, p, t, k,
                                                              live=jnp.int32(2)))(params, kv, tokens)
  if cpu_kernels.available():
    assert bool(jnp.all(logits[:, 2:] == 0)) and not bool(jnp.all(logits[:, :2] == 0))


def test_round_parts_price_a_round_in_steps_of_its_own_round(monkeypatch):
  # Loops timed in turn: step, round (as round_timer differences it), verify, propose.
  # Repeat 2 ran twice as slow for every loop; repeat 3 had a slow round only.
  step, rounds = [1.0, 2.0, 1.0], [2.0, 4.0, 3.0]
  verify, propose = [1.25, 2.5, 1.25], [0.5, 1.0, 0.5]
  monkeypatch.setattr(costs, "forward_timer", lambda model, batch, t, **kw: scripted(
      step if t == 1 else verify))
  monkeypatch.setattr(costs, "round_timer", lambda prepared, many, few: scripted(rounds))
  target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=8))
  prepared = types.SimpleNamespace(cache_size=64, weights=types.SimpleNamespace(draft=None),
                                   sampling=types.SimpleNamespace(temperature=[0.0, 0.7]),
                                   engine=types.SimpleNamespace(
                                       drafter=types.SimpleNamespace(gamma=2)))
  drafted_at = []
  monkeypatch.setattr(costs, "propose_timer", lambda *a, temperature, **kw: (
      drafted_at.append(temperature), scripted(propose))[1])
  parts = costs.round_parts(target, prepared, context=16, repeats=3)
  assert (parts["round"], parts["round_max"]) == (2.0, 3.0)
  assert parts["verify"] == 1.25 and parts["propose"] == 0.5
  assert parts["rest"] == 0.25 and parts["rest_max"] == 1.25
  # The call's highest temperature (its rows that sample), as float32 holds it.
  assert len(drafted_at) == 1 and abs(drafted_at[0] - 0.7) < 1e-6
  # Target-only (γ = 0): no propose, and the pass is the step itself.
  monkeypatch.setattr(costs, "round_timer", lambda prepared, many, few: scripted(rounds))
  monkeypatch.setattr(timing, "forward_timer", lambda model, batch, t, **kw: scripted(step))
  prepared.engine.drafter.gamma = 0
  parts = costs.round_parts(target, prepared, context=16, repeats=3)
  assert parts["propose"] == 0.0 and parts["verify"] == 1.0 and parts["rest"] == 1.0


def test_loop_timer_cancels_what_a_call_costs_besides_its_iterations(monkeypatch):
  # A loop whose every call costs a fixed 1.6 s besides 0.5 s an iteration (a clock that
  # the loop advances): per iteration 0.5 s, not (1.6 + 24 * 0.5) / 24 = 0.567 s.
  import jax.numpy as jnp
  import pytest
  clock = [0.0]
  monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
  calls = []

  def loop(count, x):
    calls.append(int(count))
    clock[0] += 1.6 + 0.5 * int(count)
    return x

  run = costs.loop_timer(loop, jnp.zeros(()), many=24, few=8, min_seconds=0)
  assert abs(run() - 0.5) < 1e-9 and calls == [24, 8, 24, 8]  # warm-up, few, many, few
  assert int(run.args[0]) == 24
  few_1 = costs.loop_timer(loop, jnp.zeros(()), many=4, min_seconds=0)  # few = 1
  assert abs(few_1() - 0.5) < 1e-9
  with pytest.raises(ValueError, match="few < many"):
    costs.loop_timer(loop, jnp.zeros(()), many=4, few=4)


def test_loop_timer_keeps_the_faster_short_run(monkeypatch):
  # A 3 s stall in the first short run (another process, say): differenced against it,
  # 24 iterations of 0.5 s would read (13.6 - 8.6) / 16 = 0.31 s, and a longer stall
  # below 0; against the short run after the long one, 0.5 s.
  import jax.numpy as jnp
  clock, stalls = [0.0], [0.0, 3.0, 0.0, 0.0]  # warm-up, few (stalled), many, few
  monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])

  def loop(count, x):
    clock[0] += 1.6 + 0.5 * int(count) + stalls.pop(0)
    return x

  run = costs.loop_timer(loop, jnp.zeros(()), many=24, few=8, min_seconds=0)
  assert abs(run() - 0.5) < 1e-9


def test_loop_timer_times_a_difference_below_zero_again(monkeypatch):
  # Stalls in both short runs (two test files sharing two cores): (13.6 - 16.6) / 16 < 0;
  # timed again, 0.5 s. A loop that never reads above 0 returns its last difference.
  import jax.numpy as jnp
  clock, stalls = [0.0], [0.0, 8.0, 0.0, 8.0] + [0.0] * 3  # warm-up, few, many, few; again
  monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])

  def loop(count, x):
    clock[0] += 1.6 + 0.5 * int(count) + stalls.pop(0)
    return x

  run = costs.loop_timer(loop, jnp.zeros(()), many=24, few=8, min_seconds=0)
  assert abs(run() - 0.5) < 1e-9 and not stalls
  calls = []

  def shrinking(count, x):  # every long run faster than its short ones
    calls.append(int(count))
    clock[0] += 2.0 if int(count) == 8 else 1.0
    return x

  run = costs.loop_timer(shrinking, jnp.zeros(()), many=24, few=8, min_seconds=0)
  calls.clear()
  assert abs(run() - (1.0 - 2.0) / 16) < 1e-9
  assert calls == [8, 24, 8] * (1 + costs.LOOP_RETRIES)


def test_loop_timer_lengthens_a_loop_too_short_to_difference(monkeypatch):
  # 1 ms a call + 0.1 ms an iteration: 8 calls take 1.8 ms, so with min_seconds 10 ms the
  # counts grow 6-fold (48 against 12); capped at 64-fold for a loop of nearly nothing.
  import jax.numpy as jnp
  clock, calls = [0.0], []
  monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])

  def loop(count, x, fixed=1e-3, per=1e-4):
    calls.append(int(count))
    clock[0] += fixed + per * int(count)
    return x

  run = costs.loop_timer(loop, jnp.zeros(()), many=8, min_seconds=0.01)
  assert abs(run() - 1e-4) < 1e-12 and calls == [8, 8, 12, 48, 12] and int(run.args[0]) == 48
  run = costs.loop_timer(lambda n, x: loop(n, x, fixed=1e-6, per=0.0), jnp.zeros(()),
                         many=8, min_seconds=0.01)
  assert int(run.args[0]) == 8 * 64


def test_paired_uses_the_times_timers_return(monkeypatch):
  got = costs.paired(scripted([9.0, 2.0, 4.0]), scripted([9.0, 4.0, 12.0]), pairs=2,
                     timers=True)
  # After a warm-up call each: ratios 4 / 2 and 12 / 4, whatever the wall clock said.
  assert got["method_s"] == [2.0, 4.0] and got["baseline_s"] == [4.0, 12.0]
  assert got["ratio"] == 2.5 and got["ratio_max"] == 3.0


def test_timed_calls_run_every_row_to_its_budget():
  """A timed call stops no row at EOS unless its kwargs name one: a row ended early would
  make the later rounds cheaper than those timed beside them."""
  import specjax
  target = specjax.load_pretrained("stdlib-target")
  assert target.eos_ids  # generate's default would stop at <|endoftext|>
  assert costs._prepare(target, [[1, 2]], dict(max_new_tokens=4)).stops.eos == ()
  given = costs._prepare(target, [[1, 2]], dict(max_new_tokens=4, eos_id=target.eos_ids))
  assert given.stops.eos == tuple(target.eos_ids)
