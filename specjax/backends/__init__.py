"""What a forward's heavy ops run on, chosen once per compiled program.

`select(options, whole_rows)` gives the backend of the platform jax runs on:
`cpu.CpuBackend` on a CPU (specjax's kernels, XLA's products row by row without them),
the XLA default `Backend` (the model's own jnp code) elsewhere. A jitted entry point
that runs a forward (`decode.decode`, `model.forward_jit`) selects it from its static
arguments and traces under `use(backend)`; the model's layers read it with `current()`.
A trace outside any `use` gets `select()`'s defaults. Nothing here is a module global
that changes a traced program: the options are static fields of the jit's key, or the
process's default options (`set_default_options`), which are fixed once first used.

Imports point down: models import this package; it imports nothing of the engine, and
of the models only their config (duck-typed).
"""

from __future__ import annotations

import contextlib
import functools
import contextvars

import jax

from specjax.backends.base import Backend, LayerWeights, Options
from specjax.backends.cpu import CpuBackend

__all__ = ["Backend", "CpuBackend", "LayerWeights", "Options", "current", "default_options",
           "select", "set_default_options", "use"]

_DEFAULT = {"options": Options(), "used": False}


def set_default_options(options: Options) -> None:
  """The options of every backend selected without its own (an `Engine` whose
  `backend_options` is None, `generate`'s): for a script to set once, at its start.
  RuntimeError once they have been used with other values: programs compiled with the
  old ones could then be taken for programs of the new."""
  if not isinstance(options, Options):
    raise TypeError(f"set_default_options needs backends.Options, got {options!r}")
  if _DEFAULT["used"] and options != _DEFAULT["options"]:
    raise RuntimeError("the default backend options are already in use: set them before "
                       "the first forward, or pass an Engine its own backend_options")
  _DEFAULT["options"] = options


def default_options() -> Options:
  """The process's default options (fixed from now on)."""
  _DEFAULT["used"] = True
  return _DEFAULT["options"]


def select(options: Options | None = None, whole_rows: bool = False) -> Backend:
  """The backend for jax's default platform with these options (None: the default
  ones; whole_rows: a decode on a device mesh, whose rows stay together)."""
  options = default_options() if options is None else options
  if jax.default_backend() == "cpu":
    return CpuBackend(options, whole_rows)
  return Backend(options, whole_rows)


_CURRENT = contextvars.ContextVar("specjax_backend", default=None)


def current() -> Backend:
  """The backend the forward being traced runs on (`use`; else `select()`)."""
  backend = _CURRENT.get()
  return select() if backend is None else backend


@contextlib.contextmanager
def use(backend: Backend):
  """Traces inside this block run on `backend`. For jitted entry points only, with a
  backend made from their static arguments, so that a cached program is never the one
  of another backend."""
  token = _CURRENT.set(backend)
  try:
    yield backend
  finally:
    _CURRENT.reset(token)


def traced_on(backend_of):
  """A decorator: fn traced inside `use(backend_of(*args, **kwargs))`, the backend its
  caller's static arguments name (`decode`'s engine), wherever it is called from."""
  def wrap(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
      with use(backend_of(*args, **kwargs)):
        return fn(*args, **kwargs)
    return run
  return wrap
