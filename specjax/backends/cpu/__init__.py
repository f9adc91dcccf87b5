"""specjax's CPU backend: few-row kernels in C++ (`fewrow.cc`, glue in `kernels`) and the
backend that runs a forward's ops through them (`backend.CpuBackend`)."""

from specjax.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
