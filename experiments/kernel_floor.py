r"""What specjax's few-row products cost outside XLA, against the CPU's arithmetic peak.

  python -m experiments.kernel_floor                  # stdlib-target, bfloat16 panels
  python -m experiments.kernel_floor --f32 --reps=400
  python -m experiments.kernel_floor --d_model=1024 --n_layers=8 --d_ff=2816 --vocab=32000
                                                      # Llama-shaped shapes, no weights loaded

Compiles `experiments/kernel_floor.cc` (the kernel of `specjax/models/fewrow.cc` in a
plain C++ loop, with the flags specjax's library is built with) and runs, on the
model's own matrix shapes in forward order:

1. the core's multiply-add peak (10 independent FMA chains, no memory);
2. one forward's products for R = 1..(rows per group + 3) rows, on one thread and on two
   (the second thread claims chunks as the library's does, but spins between products:
   no wake-up latency), and on two without prefetching the weights of the matrices the
   library prefetches (`cpu_kernels.PREFETCH_MIN_BYTES`), interleaved, medians.

The weights (random bfloat16 values) stream from the cache hierarchy as in decoding:
every matrix once per forward. `python -m experiments.profile_forward --products` times
the same products inside XLA; the difference is XLA:CPU's runtime. v(γ) of the products
is t(γ + 1 rows) / t(1 row); no kernel brings the (γ+1)-row products below
2 · multiply-adds · (γ + 1) / (2 cores at the measured peak), which bounds v(γ) from below
for a 1-token step as fast as this one (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import os
import tempfile

from absl import app
from absl import flags

from experiments import common
from specjax import costs
from specjax.backends.cpu import kernels as cpu_kernels
from specjax.models.pretrained import load_pretrained

_MODEL = flags.DEFINE_string("model", "stdlib-target", "Model name or directory.")
_REPS = flags.DEFINE_integer("reps", 200, "Timed forwards per row count and thread count.")
_D_MODEL = flags.DEFINE_integer("d_model", 0, "With --n_layers, --d_ff and --vocab: the "
                                "shapes of a Llama-shaped model (q, k, v heads of d_model, "
                                "SwiGLU, an untied LM head) instead of --model's.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 0, "Layers of the --d_model shapes.")
_D_FF = flags.DEFINE_integer("d_ff", 0, "SwiGLU hidden width of the --d_model shapes.")
_VOCAB = flags.DEFINE_integer("vocab", 0, "Vocabulary of the --d_model shapes.")
_F32 = flags.DEFINE_bool("f32", False, "float32 panels (default: the layout specjax uses "
                         "for these weights, bfloat16 where every weight is one).")


def main(argv):
  del argv
  if _D_MODEL.value:
    name = (f"d_model {_D_MODEL.value}, {_N_LAYERS.value} layers, d_ff {_D_FF.value}, "
            f"vocab {_VOCAB.value}")
    shapes = common.llama_shapes(_D_MODEL.value, _N_LAYERS.value, _D_FF.value, _VOCAB.value)
    bf16 = not _F32.value
  else:
    name = _MODEL.value
    shapes, bf16 = common.panel_shapes(load_pretrained(_MODEL.value))
    bf16 = bf16 and not _F32.value
  with tempfile.TemporaryDirectory() as tmp:
    exe = common.build_kernel_floor(tmp)
    check = common.run_kernel_floor(exe, shapes, bf16=bf16, check=True)
    if not check["max_rel_error"] < 1e-4:  # float32 sums against a double-precision loop
      raise RuntimeError(f"kernel_floor's product is wrong: {check}")
    got = common.run_kernel_floor(exe, shapes, bf16=bf16, reps=_REPS.value)
  peak, macs = got["peak_gflops_per_core"], got["macs_per_row"]
  cores = min(os.cpu_count() or 1, 2)  # the kernel splits its work over two threads
  print(f"cpu: {costs.machine_info()['cpu']} ({os.cpu_count()} cores); multiply-add peak "
        f"{peak:.1f} GFLOP/s per core (measured), {cores * peak:.1f} on {cores}")
  print(f"{name}: {len(shapes)} matrices, {macs / 1e6:.2f}M multiply-adds a row, "
        f"{got['weight_bytes'] / 2**20:.1f} MiB of {'bfloat16' if bf16 else 'float32'} "
        f"panels; medians of {_REPS.value} interleaved forwards\n")
  print("| R | 1 thread µs | 2 threads µs | GFLOP/s | weights GB/s | / R = 1 | "
        "compute floor µs | floor / R = 1 | 2 threads, no prefetch µs | its / R = 1 |\n"
        "|---|---|---|---|---|---|---|---|---|---|")
  one = got["rows"][1]["two_threads_us"]
  one_plain = got["rows"][1]["no_prefetch_us"]
  for r, t in sorted(got["rows"].items()):
    two, plain = t["two_threads_us"], t["no_prefetch_us"]
    floor = 2 * macs * r / (cores * peak * 1e3) if peak else float("nan")
    print(f"| {r} | {t['one_thread_us']:.0f} | {two:.0f} | {2 * macs * r / two / 1e3:.1f} | "
          f"{got['weight_bytes'] / two / 1e3:.1f} | {two / one:.2f} | {floor:.0f} | "
          f"{floor / one:.2f} | {plain:.0f} | {plain / one_plain:.2f} |")
  prefetched = sum(cpu_kernels.prefetches(k * n * (2 if bf16 else 4)) for k, n in shapes)
  print(f"\n/ R = 1 is the products' v(γ) at γ = R - 1 with two threads; floor / R = 1 is "
        "the least it could be for a 1-row forward this fast, with every multiply-add at "
        f"the peak. {prefetched} of the {len(shapes)} matrices are at least "
        f"cpu_kernels.PREFETCH_MIN_BYTES = {cpu_kernels.PREFETCH_MIN_BYTES} bytes, whose "
        "weights the kernel prefetches (all columns but the last two).")


if __name__ == "__main__":
  app.run(main)
