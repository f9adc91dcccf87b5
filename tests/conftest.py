"""Shared helpers: tiny models with sharp (non-uniform) distributions."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests run tiny models where XLA's compile time dwarfs run time. Skipping backend
# optimisation halves compile time; XLA:CPU's older (non-MLIR) fusion emitters compile
# another ~40% faster and run these models as fast. Benchmarks never run under these flags.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
# One persistent compilation cache for the session, inherited by the notebooks' kernels and
# the sharding workers: a program compiled again (after `clear_cache`, in a subprocess, by
# an identical jit elsewhere) is read back instead of rebuilt.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _cache = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

# The slowest files first (seconds per file in a 2-worker run, 2026-12-03 10:18, 637 tests
# in 11 min 4 s: trees 222, notebooks 132, speculative 117, processors 96, sharding 89,
# experiments 79, heads 79, cpu_kernels 77, policies 63, stop_strings 50, generate 43,
# hf 38, model 37; the other 13 files 127 together; test_generate.py has since grown to
# 146 s, run alone at 16:02, with the log-probability, n-sample and finish-reason
# tests). setup.cfg keeps this order (--no-loadscope-reorder) and gives each worker one
# file at a time, so the two workers take the longest files first and finish within
# seconds of each other.
SLOWEST_FILES_FIRST = ("test_trees.py", "test_notebooks.py", "test_generate.py",
                       "test_speculative.py", "test_processors.py", "test_sharding.py",
                       "test_experiments.py", "test_heads.py", "test_cpu_kernels.py",
                       "test_policies.py", "test_stop_strings.py", "test_hf.py",
                       "test_model.py")


def pytest_runtest_teardown(item, nextitem):
  """Each worker compiles hundreds of programs: past a share of vm.max_map_count they are
  dropped between tests (`specjax.compile_guard`), before LLVM would abort the worker."""
  from specjax import compile_guard
  compile_guard.release_near_map_limit()


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


import contextlib  # noqa: E402
import itertools  # noqa: E402

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

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


def byte_bpe(texts, vocab_size, special_tokens, bos=None):
  """A trained byte-level BPE `tokenizers.Tokenizer` (GPT-2's kind); with `bos`, a
  post-processor that puts that special token before a text, as Llama's files do."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  raw.train_from_iterator(list(texts), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if bos is not None:
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))])
  return raw


def greedy_oracle(model, prompt, steps):
  """Repeated argmax of the uncached full forward.

  The sequence is zero-padded to a fixed width (causal attention never looks right), so
  one compiled forward serves every step, and (rounded up to 32) nearby prompts too.
  """
  seq = list(prompt)
  width = min(-(-(len(prompt) + steps) // 32) * 32, model.config.max_len)
  for _ in range(steps):
    padded = jnp.array([seq + [0] * (width - len(seq))])
    seq.append(int(jnp.argmax(model.logits(padded)[0, len(seq) - 1])))
  return seq[len(prompt):]


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 0, 1, 2, 3, 4], [7]]

# Samples of each end-to-end law test (512 continuations of 3 tokens, each within 5 sd).
# Planted bugs that move the law fail them by z >= 6 at this size (docs/ARCHITECTURE.md,
# "How the law tests are sized"); subtler ones (the i.i.d.-sibling tree rule) are the
# float64 rule tests' to catch.
LAW_ROWS = 6000


def within_law(tokens, probs, sds=5.0, vocab=8):
  """(whether every cell is within `sds` sd + 1 count, the worst cell's z = (|count −
  expected| − 1) / sd) of sampled continuations tokens [rows, L] against their exact law
  probs [vocab ** L]. 512 cells (L = 3) at 5 sd each: a family-wise false alarm rate
  below 1e-3."""
  outs = np.asarray(tokens)
  rows, length = outs.shape
  counts = np.bincount(np.ravel_multi_index(outs.T, (vocab,) * length),
                       minlength=vocab ** length)
  sd = np.sqrt(rows * probs * (1 - probs))
  excess = np.abs(counts - rows * probs) - 1
  return bool(np.all(excess <= sds * sd)), float(np.max(excess / (sd + 1e-12)))


def target_and_draft():
  return (tiny_model(vocab=8, n_layers=2, seed=0),
          tiny_model(vocab=8, d_model=16, n_layers=1, seed=1))


def exact_continuations(model, prompt, length):
  """P(x_1..x_L | prompt) for every continuation, by teacher forcing (float64)."""
  vocab = model.config.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=length)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  logp = np.asarray(jax.nn.log_softmax(model.logits(jnp.asarray(seqs)).astype(jnp.float32)),
                    np.float64)
  start = len(prompt) - 1
  steps = [logp[np.arange(len(conts)), start + i, conts[:, i]] for i in range(length)]
  return conts, np.exp(np.sum(steps, axis=0))


def tempered(model, temperature):
  """The same model with logits divided by the temperature (the final norm's scale)."""

  class Tempered:
    config = model.config

    def logits(self, tokens):
      return model.logits(tokens) / temperature

  return Tempered()




@contextlib.contextmanager
def decode_traces(n: int = 1):
  """Counts traces of the decode loop inside the block; more than n fails at once.

  The jit cache is cleared first, so the first call in the block must trace.
  """
  traced = []
  original = decode_lib.run_loop

  def counting(*args, **kwargs):
    traced.append(1)
    return original(*args, **kwargs)

  decode_lib.run_loop = chex.assert_max_traces(counting, n=n)
  decode_lib.decode.clear_cache()
  try:
    yield traced
  finally:
    decode_lib.run_loop = original
