"""specjax's unrolled Threefry on the CPU: jax's own hash, the same bits, no loop."""
import os
import subprocess
import sys

import jax
import numpy as np

from specjax import rng  # importing specjax registers the lowering

# Draws of every kind a round makes: split, fold_in, bits, uniform, gumbel.
_DRAWS = """
import jax, numpy as np
key = jax.random.PRNGKey(7)
a, b = jax.random.split(key)
draws = [jax.random.split(key, 5), jax.random.fold_in(a, 3), jax.random.bits(b, (9,)),
         jax.random.uniform(a, (3, 2048)), jax.random.gumbel(b, (2, 70)),
         jax.jit(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (33,)))(a)]
"""


def test_unrolled_on_import_without_a_loop():
  assert rng.status() == "unrolled", rng.status()
  hlo = jax.jit(lambda k: jax.random.uniform(k, (2048,))).lower(
      jax.random.PRNGKey(0)).compile().as_text()
  assert " while(" not in hlo


def test_the_same_bits_as_jax_rolled_loop():
  scope = {}
  exec(_DRAWS, scope)
  here = b"".join(np.asarray(x).tobytes() for x in scope["draws"])
  code = (_DRAWS + "import sys, specjax\nfrom specjax import rng\nprint(rng.status())\n"
          "hlo = jax.jit(lambda k: jax.random.uniform(k, (8,))).lower(key).compile().as_text()\n"
          "print(' while(' in hlo)\n"
          "sys.stdout.write(b''.join(np.asarray(x).tobytes() for x in draws).hex())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "SPECJAX_UNROLLED_THREEFRY": "0"}, check=True)
  status, rolled, bits = out.stdout.strip().split("\n")
  assert status == "turned off by SPECJAX_UNROLLED_THREEFRY=0" and rolled == "True"
  assert bytes.fromhex(bits) == here
