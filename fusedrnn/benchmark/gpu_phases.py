"""Where a persistent kernel's step goes, on a lent GPU: staging, tasks, grid barrier.

Builds persistent.cuh with -DFUSEDRNN_PHASE_CLOCKS (each block's thread 0 adds every
step's phase cycles to a device counter, see the top of persistent.cuh), makes the op use
that build, and reports microseconds per step for the forward (inference) and the
backward of each mode at the design-doc size, next to the whole call's time. Slot 0 is
staging (and in the backward the recurrent product), 1 the tasks (in the forward also
the product), 2 the wait at the grid barrier. Cycles are averaged over blocks and steps
and converted at the SM clock the device reports, so they are estimates: a step's time
is roughly the slowest block's, and the instrumented build adds block barriers.
Beside the backward, the GEMMs the op runs after its loop (recurrence.RecurrentOp's
_backward: the weight gradients dG^T X and dG^T H, the data gradient dG W_x), timed by
themselves with CUDA events at the same shapes and dtype, per call and per step: the
training step is the loop, the record it reads and these.

    PYTHONPATH=. python3 -m fusedrnn.benchmark.gpu_phases \
        [--T 300 --N 20 --H 800 --modes lstm,gru]
"""
import argparse

import cupy
import numpy as np

import fusedrnn
from fusedrnn.config import CELLS
from fusedrnn.gpu import persistent

PHASES = ("staging", "tasks", "barrier")


def instrumented_module():
    return persistent.PERSISTENT_KERNELS.compile(cupy, "-DFUSEDRNN_PHASE_CLOCKS")


def clocks(module):
    pointer = module.get_global("fusedrnn_phase_clocks")
    return cupy.ndarray((len(PHASES),), cupy.uint64, pointer)


def per_step_us(counter, blocks, steps, clock_khz):
    cycles = cupy.asnumpy(counter).astype(np.float64) / (blocks * steps)
    return cycles / clock_khz * 1e3


def timed(fn):
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    result = fn()
    end.record()
    end.synchronize()
    return result, cupy.cuda.get_elapsed_time(start, end) * 1e3


def gemm_us(T, N, I, H, gates, dtype, repeats=20):
    """{name: us} of the backward's three GEMMs of one layer and direction (median of
    `repeats` after a warm-up), on fresh random operands."""
    rng = np.random.default_rng(1)

    def operand(*shape):
        return cupy.asarray(rng.standard_normal(shape), dtype)

    dg, x, h, w_x = operand(T * N, gates * H), operand(T * N, I), operand(T * N, H), \
        operand(gates * H, I)
    out = {"dW_x": cupy.empty((gates * H, I), dtype), "dW_h": cupy.empty((gates * H, H), dtype),
           "dX": cupy.empty((T * N, I), dtype)}
    products = {"dW_x": lambda: cupy.matmul(dg.T, x, out=out["dW_x"]),
                "dW_h": lambda: cupy.matmul(dg.T, h, out=out["dW_h"]),
                "dX": lambda: cupy.matmul(dg, w_x, out=out["dX"])}
    times = {}
    for name, product in products.items():
        product()
        times[name] = float(np.median([timed(product)[1] for _ in range(repeats)]))
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=300)
    parser.add_argument("--N", type=int, default=20)
    parser.add_argument("--H", type=int, default=800)
    parser.add_argument("--modes", default=",".join(fusedrnn.MODES))
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="float16: the op's half path (the tensor-core products and "
                             "half GEMMs unless FUSEDRNN_GPU_TENSOR_CORES=0 / "
                             "FUSEDRNN_GPU_HALF_GEMMS=0)")
    args = parser.parse_args()
    T, N, H = args.T, args.N, args.H
    module = instrumented_module()
    persistent.PERSISTENT_KERNELS._module = module   # the op's launchers now come from this build
    counter = clocks(module)
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    # cudaDeviceProp.clockRate is gone in CUDA 13; the attribute (13) remains.
    clock_khz = device.get("clockRate") or cupy.cuda.runtime.deviceGetAttribute(
        13, cupy.cuda.runtime.getDevice())
    limits = persistent.DeviceLimits.of_current_cupy_device(cupy)
    rng = np.random.default_rng(0)
    print(f"{device['name'].decode()}, SM clock {clock_khz / 1e3:.0f} MHz; T={T} N={N} "
          f"I=H={H} {args.dtype}, one layer; us per step (averaged over blocks)")
    print(f"| mode | pass | {' | '.join(PHASES)} | sum | whole call / T |")
    gemms = {}
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        storage = args.dtype if args.dtype != "float32" else None   # the op's own plan
        plan = persistent.op_plan(CELLS[mode].gates, H, N, 4, limits, storage)
        if plan is None:
            print(f"| {mode} | - | does not fit on chip | | | | |")
            continue
        kw = dict(mode=mode, state_size=H, num_layers=1)
        x = cupy.asarray(rng.standard_normal((T, N, H)), args.dtype)
        w = cupy.asarray(rng.uniform(-H ** -0.5, H ** -0.5,
                                     fusedrnn.param_size(input_size=H, **kw)), args.dtype)
        dout = cupy.asarray(rng.standard_normal((T, N, H)), args.dtype)
        for _ in range(2):   # warm-up, backward too: compile, plan, allocate
            fusedrnn.RNN(x, w, **kw)
            fusedrnn.rnn_backward(fusedrnn.RNN(x, w, **kw, train=True)[1], dout)
        counter.fill(0)
        _, infer_us = timed(lambda: fusedrnn.RNN(x, w, **kw))  # noqa: B023  (called in this iteration)
        forward = per_step_us(counter, plan.blocks, T, clock_khz)
        _, handle = fusedrnn.RNN(x, w, **kw, train=True)
        counter.fill(0)
        _, backward_call_us = timed(lambda: fusedrnn.rnn_backward(handle, dout))  # noqa: B023  (called in this iteration)
        backward = per_step_us(counter, plan.blocks, T, clock_khz)
        for name, phases, whole in (("forward", forward, infer_us),
                                    ("backward", backward, backward_call_us)):
            cells = " | ".join(f"{v:.2f}" for v in phases)
            print(f"| {mode} | {name} | {cells} | {phases.sum():.2f} | {whole / T:.2f} |")
        gemms[mode] = gemm_us(T, N, H, H, CELLS[mode].gates, args.dtype)
    print(f"\nThe backward's GEMMs of one layer (T={T} N={N} I=H={H} {args.dtype}), us per "
          f"call and per step (/T), beside the backward call above")
    print("| mode | dW_x = dG^T X | dW_h = dG^T H | dX = dG W_x | sum | sum / T |")
    print("|---|---|---|---|---|---|")
    for mode, times in gemms.items():
        total = sum(times.values())
        print(f"| {mode} | " + " | ".join(f"{v:.1f}" for v in times.values()) +
              f" | {total:.1f} | {total / T:.2f} |")


if __name__ == "__main__":
    main()
