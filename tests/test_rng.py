"""specjax's unrolled Threefry on the CPU: jax's own hash, the same bits, no loop.

The tests run under jax's own rolled lowering (tests/conftest.py sets
SPECJAX_UNROLLED_THREEFRY=0: programs compile faster); here its draws are compared with
those of a process importing specjax with the default, the unrolled lowering.
"""
import os
import subprocess
import sys

import numpy as np

from specjax import rng

# Draws of every kind a round makes: split, fold_in, bits, uniform, gumbel.
_DRAWS = """
import jax, numpy as np
key = jax.random.PRNGKey(7)
a, b = jax.random.split(key)
draws = [jax.random.split(key, 5), jax.random.fold_in(a, 3), jax.random.bits(b, (9,)),
         jax.random.uniform(a, (3, 2048)), jax.random.gumbel(b, (2, 70)),
         jax.jit(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (33,)))(a)]
loop = " while(" in jax.jit(lambda k: jax.random.uniform(k, (2048,))).lower(
    key).compile().as_text()  # jax's rolled lowering has a loop; the unrolled none
"""


def test_unrolled_by_default_without_a_loop_and_the_same_bits_as_jax_rolled_loop():
  assert rng.status() == "turned off by SPECJAX_UNROLLED_THREEFRY=0", rng.status()
  scope = {}
  exec(_DRAWS, scope)
  assert scope["loop"]  # jax's rolled lowering, in this process
  here = b"".join(np.asarray(x).tobytes() for x in scope["draws"])
  code = ("import sys, specjax\nfrom specjax import rng\n" + _DRAWS +
          "print(rng.status())\nprint(loop)\n"
          "sys.stdout.write(b''.join(np.asarray(x).tobytes() for x in draws).hex())")
  env = {k: v for k, v in os.environ.items() if k != "SPECJAX_UNROLLED_THREEFRY"}  # default
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True)
  status, loop, bits = out.stdout.strip().split("\n")
  assert status == "unrolled" and loop == "False", (status, loop)
  assert bytes.fromhex(bits) == here
