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
