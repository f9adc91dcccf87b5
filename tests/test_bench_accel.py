"""experiments.accel's bookkeeping (`bench --part=accel`; the timings run on an accelerator)."""

import jax.numpy as jnp

from experiments import accel
from experiments import synthetic


def test_step_bytes_counts_weights_less_the_input_table_plus_the_cache():
  kwargs = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                max_len=256)
  model = synthetic.random_model(kwargs, "bfloat16", 0)
  per_layer = 64 * 64 + 64 * 128 + 64 + 128 * 64 + 64 * 256 + 64  # out, qkv, norm, down, up
  weights = 2 * per_layer + 64 + 64 * 512  # final norm, untied LM head (not the embedding)
  kv = 2 * 2 * 3 * 2 * 100 * 16  # K and V, layers, batch, kv heads, context, head dim
  assert accel.step_bytes(model, batch=3, context=100) == 2 * (weights + kv)
  assert model.params["embed"]["embedding"].dtype == jnp.bfloat16


def test_summary_keeps_finished_stages_and_names_a_failed_one():
  res = {"bandwidth": {"targets": {"t": {"params": 2e9, "step_ms": 1.0, "step_gbps": 100.0,
                                         "fraction_of_peak": 0.5, "fraction_of_copy": None,
                                         "by_gamma": {4: {"v": 1.25}}}}},
         "shipped": {"error": "RuntimeError: out of memory"}}
  text = accel.summary(res)
  assert "| t | 2.00B | 1.00 | 100 | 50% | – | – | – | 1.25 | – |" in text
  assert "stage shipped failed: RuntimeError: out of memory" in text


def test_paired_generate_gives_each_batch_its_own_seed(monkeypatch):
  from experiments import common
  seeds = []

  class Stop(Exception):
    pass

  def fake_generate(target, batch, **kwargs):
    seeds.append(kwargs["seed"])
    if len(seeds) == 3:
      raise Stop
  monkeypatch.setattr(common.specjax, "generate", fake_generate)
  try:
    common.paired_generate(None, [[1], [2], [3]], 1, 1, method=dict(seed=5), baseline={})
  except Stop:
    pass
  assert seeds == [5, 6, 7]


def test_per_step_is_the_long_call_less_the_short_over_the_extra_steps():
  got = accel._per_step([1.0, 1.2, 1.1, 1.3], [0.2, 0.2, 0.3, 0.1], steps=100)
  assert got["samples_ms"] == [8.0, 10.0, 8.0, 12.0]
  assert (got["step_ms"], got["step_ms_q1"], got["step_ms_q3"]) == (9.0, 8.0, 10.5)


def test_roofline_stage_small_runs_on_the_cpu_and_reports_sane_numbers(tmp_path):
  grid = [("llama-68m", 8, 16)]  # one fast row; the default small grid is the CLI's
  res = accel.run(tmp_path, small=True, stages=("machine", "roofline"), roofline_grid=grid)
  part = res["roofline"]
  assert "error" not in part, part
  assert part["skipped_past_budget"] == [] and len(part["rows"]) == 1
  row = part["rows"][0]
  assert (row["shape"], row["batch"], row["context"]) == grid[0]
  # The floor is a correct greedy decode: the engine's T = 0 tokens, every step of them.
  assert row["minimal_equals_engine_greedy"] is True
  assert row["equal_prefix"] == row["tokens_compared"]
  assert row["tokens_compared"] >= row["rounds"][1]
  model = synthetic.random_model(dict(accel.SMALL_SHAPES["llama-68m"], max_len=512),
                                 "bfloat16", 0)
  r1, r2 = row["rounds"]
  assert row["bytes_per_step"] == accel.step_bytes(model, 8, 16 + (r1 + r2) // 2)
  methods = row["methods"]
  assert list(methods) == ["minimal static", "minimal traced", "engine T=0", "engine T=1"]
  assert "kernel_equal_prefix" not in row  # the decode kernel's row: on a GPU only
  copy = res["machine"]["copy_gbps"]
  minimal = methods["minimal static"]["step_ms"]
  for name, m in methods.items():
    assert len(m["samples_ms"]) == row["repeats"]
    assert 0 < m["step_ms_q1"] <= m["step_ms"] <= m["step_ms_q3"], (name, m)
    assert m["step_ms"] < 1e3  # a tiny model's CPU step: milliseconds, not seconds
    assert abs(m["gbps"] - row["bytes_per_step"] / m["step_ms"] / 1e6) < 1e-6 * m["gbps"]
    assert abs(m["fraction_of_copy"] - m["gbps"] / copy) < 1e-9
    assert abs(m["ratio_to_minimal"] - m["step_ms"] / minimal) < 1e-9
    assert abs(m["tokens_per_s"] - 8e3 / m["step_ms"]) < 1e-6 * m["tokens_per_s"]
  assert methods["minimal static"]["ratio_to_minimal"] == 1.0
  text = (tmp_path / "summary.md").read_text()
  m = methods["engine T=1"]
  assert (f"| llama-68m | 8 | 16 | {row['cache_size']} | {row['bytes_per_step'] / 1e9:.3f} GB "
          f"| engine T=1 | "
          f"{m['step_ms']:.3f} ") in text
  assert (tmp_path / "accel.json").exists()


def test_roofline_decode_kernel_row_runs_interpreted_on_the_cpu(tmp_path):
  """The row a GPU run adds (`Options(decode_kernel=True)`), forced on here, in a buffer
  longer than the context (the case the kernel is for; a context off the prompt's
  16-token bucket): it runs and decodes the engine's greedy tokens; every method's cache
  is the buffer, the bytes the valid slots'."""
  res = accel.run(tmp_path, small=True, stages=("roofline",),
                  roofline_grid=[("llama-68m", 2, 21, 256)], decode_kernel=True)
  row = res["roofline"]["rows"][0]
  assert "engine T=0 decode kernel" in row["methods"]
  assert row["kernel_equal_prefix"] == row["tokens_compared"]
  assert (row["cache_size"], row["buffer"]) == (256, 256)
  r1, r2 = row["rounds"]
  model = synthetic.random_model(dict(accel.SMALL_SHAPES["llama-68m"], max_len=512),
                                 "bfloat16", 0)
  assert row["bytes_per_step"] == accel.step_bytes(model, 2, 21 + (r1 + r2) // 2)
  text = (tmp_path / "summary.md").read_text()
  assert "the decode kernel's tokens = engine T=0's" in text
  assert "| llama-68m | 2 | 21 | 256 |" in text


def test_roofline_refuses_a_buffer_without_room_before_work(tmp_path):
  res = accel.run(tmp_path, small=True, stages=("roofline",),
                  roofline_grid=[("llama-68m", 1, 16, 64)])
  assert "buffer 64 must be a multiple of 64 with room" in res["roofline"]["error"]


def test_equal_prefix_counts_the_leading_tokens_that_agree():
  assert accel._equal_prefix([1, 2, 3, 4], [1, 2, 5, 4]) == 2
  assert accel._equal_prefix([1, 2], [1, 2]) == 2
  assert accel._equal_prefix([7], [1]) == 0


def test_roofline_refuses_a_bad_grid_row_before_work(tmp_path):
  res = accel.run(tmp_path, small=True, stages=("roofline",),
                  roofline_grid=[("gpt-9", 1, 16)])
  assert "shape must be one of" in res["roofline"]["error"]
