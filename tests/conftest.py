"""Shared helpers: tiny models with sharp (non-uniform) distributions."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests run tiny models where XLA's compile time dwarfs run time; skipping backend
# optimisation halves compile time. Benchmarks never run under this flag.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import contextlib  # noqa: E402

import chex  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

import specjax  # noqa: E402
from specjax import decode as decode_lib  # noqa: E402


def tiny_model(vocab=8, d_model=32, n_layers=1, n_heads=2, max_len=64, seed=0, sharpness=4.0,
               **kw):
  """A random model whose next-token distributions are far from uniform.

  Freshly initialised weights give nearly uniform logits; scaling the embeddings makes
  the distributions peaked and context-dependent, so samplers and drafts have
  something to disagree about.
  """
  if kw.pop("llama", False):
    cfg = specjax.ModelConfig.llama(vocab_size=vocab, d_model=d_model, n_layers=n_layers,
                                    n_heads=n_heads, max_len=max_len, **kw)
  else:
    cfg = specjax.ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers,
                              n_heads=n_heads, max_len=max_len, **kw)
  model = specjax.init_model(cfg, seed=seed)
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  params["embed"]["embedding"] = params["embed"]["embedding"] * sharpness
  return model.with_params(params)


@pytest.fixture(scope="session")
def pair():
  """A (target, draft) pair over 8 tokens that disagree often."""
  return tiny_model(vocab=8, n_layers=2, seed=0, sharpness=4.0), \
      tiny_model(vocab=8, d_model=16, seed=1, sharpness=4.0)


@contextlib.contextmanager
def decode_traces():
  """Counts traces of the decode loop inside the block; more than one fails at once.

  The jit cache is cleared first, so the first call in the block must trace.
  """
  traced = []
  original = decode_lib.run_loop

  def counting(*args, **kwargs):
    traced.append(1)
    return original(*args, **kwargs)

  decode_lib.run_loop = chex.assert_max_traces(counting, n=1)
  decode_lib.decode.clear_cache()
  try:
    yield traced
  finally:
    decode_lib.run_loop = original
