"""A guard for processes that compile many programs: the test and benchmark harnesses'.

XLA:CPU keeps each compiled program's code in its own memory mappings: ~500-600 for a
`decode` program of the shipped pair. A process holding ~100 of them reaches Linux's
vm.max_map_count (65,530 by default), and LLVM then aborts the process at the next
compile ("Cannot allocate memory"). The library never calls this: a harness that
compiles program after program (the test suite, a sweep) calls `release_near_map_limit`
between its pieces of work.
"""

from __future__ import annotations

import warnings

import jax

# Past this share of the limit every compiled program is dropped; the next call compiles again.
MAP_LIMIT_SHARE = 0.6


def memory_maps() -> tuple[int, int] | None:
  """(mappings this process holds, vm.max_map_count), or None where /proc has neither."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = f.read().count(b"\n")
    with open("/proc/sys/vm/max_map_count") as f:
      return used, int(f.read())
  except (OSError, ValueError):
    return None


def release_near_map_limit(pending=None) -> bool:
  """Drops every compiled program (`jax.clear_caches`) when the process's memory mappings
  have passed `MAP_LIMIT_SHARE` of the limit, once `pending` (a call's result) is ready;
  returns whether it did. Reading /proc takes under a millisecond at a few hundred
  mappings."""
  maps = memory_maps()
  if maps is None or maps[0] < MAP_LIMIT_SHARE * maps[1]:
    return False
  warnings.warn(f"specjax: {maps[0]} memory mappings of the {maps[1]} this process may hold "
                f"(vm.max_map_count), most of them compiled programs' code: dropping every "
                f"compiled program (jax.clear_caches) before LLVM runs out; calls compile again")
  jax.block_until_ready(pending)
  jax.clear_caches()
  return True
