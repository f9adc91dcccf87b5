"""Threefry without the loop on a CPU: the same random bits, a fraction of the time.

jax lowers its Threefry-2x32 hash (every `jax.random` split, fold_in and draw) on a CPU
as a loop of five iterations, to keep compile times down; XLA:CPU runs each iteration
as thunks of its own, so a draw costs a sizeable share of a small model's decode step
(docs/ARCHITECTURE.md, "Why a step costs what it does"), and each round draws several (a T > 0 draft
token, the verify rule's residual or bonus, key splits at any T). Everywhere else jax
emits the twenty rounds unrolled, which XLA fuses into one loop over the counts.
`use_unrolled_threefry` registers that lowering for the CPU too: the hash is the same
function, so every key and draw keeps its bits (tested); only programs traced afterwards
change. It changes every jax program of the process on the CPU (runtime down, compile
time up a little per call site), so importing specjax does not do it: a process that
wants it calls it once, before tracing (the benchmarks and the sweep do;
SPECJAX_UNROLLED_THREEFRY=0 turns the call into a no-op).
"""

import os
import warnings

_STATE = {"unrolled": False, "why": "not tried"}


def use_unrolled_threefry() -> bool:
  """Registers jax's unrolled Threefry lowering for the CPU; True where it is in effect."""
  if _STATE["unrolled"]:
    return True
  if os.environ.get("SPECJAX_UNROLLED_THREEFRY", "1") == "0":
    _STATE["why"] = "turned off by SPECJAX_UNROLLED_THREEFRY=0"
    return False
  try:  # jax internals (0.10): absent elsewhere, the rolled loop stays
    from jax._src.random import threefry2x32 as threefry
    from jax.interpreters import mlir
    mlir.register_lowering(threefry.threefry2x32_p, threefry._threefry2x32_lowering_rule,
                           platform="cpu")
  except (ImportError, AttributeError) as e:
    warnings.warn(f"specjax: jax's Threefry stays rolled on the CPU ({e!r})")
    _STATE["why"] = repr(e)
    return False
  _STATE.update(unrolled=True, why="unrolled")
  return True


def status() -> str:
  return _STATE["why"]
