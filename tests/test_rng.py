"""specjax's unrolled Threefry on the CPU: jax's own hash, the same bits, no loop.

Importing specjax leaves jax's lowering alone (the tests run under jax's own rolled one:
programs compile faster); here its draws are compared with those of a process that
opted in with `rng.use_unrolled_threefry()`.
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


def test_opt_in_unrolls_without_a_loop_and_keeps_the_bits_of_jax_rolled_loop():
  import specjax  # noqa: F401  (importing the package changes no lowering)
  assert rng.status() == "not tried", rng.status()
  scope = {}
  exec(_DRAWS, scope)
  assert scope["loop"]  # jax's rolled lowering, in this process
  here = b"".join(np.asarray(x).tobytes() for x in scope["draws"])
  code = ("import sys, specjax\nfrom specjax import rng\nrng.use_unrolled_threefry()\n" + _DRAWS +
          "print(rng.status())\nprint(loop)\n"
          "sys.stdout.write(b''.join(np.asarray(x).tobytes() for x in draws).hex())")
  env = {k: v for k, v in os.environ.items() if k != "SPECJAX_UNROLLED_THREEFRY"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True)
  status, loop, bits = out.stdout.strip().split("\n")
  assert status == "unrolled" and loop == "False", (status, loop)
  assert bytes.fromhex(bits) == here
