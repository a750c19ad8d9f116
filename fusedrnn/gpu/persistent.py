"""The persistent recurrent kernels' host side (persistent.cuh): the plan and the rule
that selects it, argument packing, and the layer object the shared driver calls.

Like kernels.py this needs no CuPy: launching takes a `launch(grid, block, args,
shared_mem)` callable, a cooperative CuPy RawKernel on a GPU and a host build of the
same source in tests/gpu.

Selection rule (persistent_plan): a layer runs persistent when one block per SM holds
its slice of W_h and the staged state in shared memory (forward: H*G*U + H*ldn values,
plus S*U*G*ldn partial sums where tile or slices exceed 1; backward: G*H*U + S*U*ldn
values plus at least 32 staged gate-gradient rows of ldn; U = ceil(H / SMs) units per
block), so the grid is co-resident and can synchronise; else the per-step path (one
cuBLAS GEMM and one cell kernel per step). FUSEDRNN_GPU_PERSISTENT=0 turns the
persistent kernels off.

float16 and bfloat16 data (the op's float32 inside, config.PRECISIONS) take the products on
tensor cores where the device has them (compute capability 8.0 and later;
fusedrnn/gpu/tensorcore.cuh): W_h and the staged operands in half, float32 sums; the
plan's shared memory then follows tensorcore.cuh's operand layout (mma_forward_operands,
mma_backward_operands), and `slices` splits each product's k-steps of 16 so the tiles
fill the block's warps. On by default since they were checked and timed on an H200 (with
the half GEMMs, faster than the float32 products in inference and training);
FUSEDRNN_GPU_TENSOR_CORES=0 keeps half data on the float32 products.
Measured: bench/results/gpu.md#half-precision-on-the-gpu-the-first-lease

Both recurrent products (persistent.cuh) take a register tile of `tile` samples per item
and split their reduction into `slices` (k in the forward, each staged chunk of gate rows
in the backward). The plan keeps tile = slices = 1, the form measured
(bench/results/gpu.md#benchmark), until the tiled products are measured on a GPU:
FUSEDRNN_GPU_TILE="R" (slices chosen to fill the block, tile_slices) or "R,S" sets both
for that measurement (bench/gpu_session.sh tiles).

Why persistent: a persistent layer keeps W_h on chip for the whole sequence and pays one grid
barrier per step instead of a GEMM and a kernel launch; on an H100 it beat the per-step
path wherever the plan fit, the one-step decoder (nothing to keep between steps) level.
Measured: bench/results/gpu.md#persistent-where-it-fits-the-measurement
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np

from ..config import CELLS
from .build import KernelFamily

__all__ = ["PERSISTENT_KERNELS", "MAX_THREADS", "MAX_TILE", "DeviceLimits", "PersistentPlan",
           "HALF_PRODUCTS", "MmaOperands", "mma_forward_operands", "mma_backward_operands",
           "tensor_cores_enabled", "product_precision", "op_plan", "build_options",
           "persistent_plan", "persistent_enabled", "tile_setting", "tile_slices", "persistent_forward_args",
           "persistent_backward_args", "PersistentLayer", "cupy_persistent_layer"]

# Not built with CuPy's enable_cooperative_groups, which adds relocatable code and links
# libcudadevrt from a CUDA toolkit a pip install may lack: the kernels use no
# cooperative_groups API, only a cooperative launch (_cupy_launcher).
WIDE_STAGING_ENV = "FUSEDRNN_GPU_WIDE_STAGING"
TILED_DH_ENV = "FUSEDRNN_GPU_TILED_DH"


def build_options(environ=os.environ):
    """The persistent kernels' own NVRTC options, each to time a form against the default;
    read when a process first builds the kernels. FUSEDRNN_GPU_WIDE_STAGING=0: without
    persistent.cuh's 16-byte staging loads (stage_half_rows_wide); FUSEDRNN_GPU_TILED_DH=1:
    the backward's dh product on its tiled loop at tile (1, 1) too (backward_accumulate)."""
    return ((("-DFUSEDRNN_SCALAR_STAGING",) if environ.get(WIDE_STAGING_ENV) == "0" else ())
            + (("-DFUSEDRNN_TILED_DH",) if environ.get(TILED_DH_ENV) == "1" else ()))


PERSISTENT_KERNELS = KernelFamily("persistent.cuh", "persistent_forward", "persistent_backward",
                                  build_options)
MAX_THREADS = 512      # persistent.cuh's __launch_bounds__
MIN_THREADS = 256
MAX_CHUNK = 512
MAX_TILE = 4           # persistent.cuh's kMaxTile
ENV = "FUSEDRNN_GPU_PERSISTENT"
TILE_ENV = "FUSEDRNN_GPU_TILE"
TENSOR_CORES_ENV = "FUSEDRNN_GPU_TENSOR_CORES"
# persistent.cuh's `precision` argument (tensorcore.cuh's ProductPrecision) by storage dtype.
HALF_PRODUCTS = {"float16": 1, "bfloat16": 2}
MIN_TENSOR_CORE_CAPABILITY = 80   # mma.sync m16n8k16 with f16 and bf16 operands


@dataclass(frozen=True)
class DeviceLimits:
    sm_count: int
    smem_per_block: int   # the opt-in maximum of dynamic shared memory per block, bytes
    capability: int = 0   # compute capability as 10*major + minor (0: unknown)

    @classmethod
    def of_current_cupy_device(cls, cupy):
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        return cls(int(props["multiProcessorCount"]), int(props["sharedMemPerBlockOptin"]),
                   10 * int(props["major"]) + int(props["minor"]))


@dataclass(frozen=True)
class MmaOperands:
    """tensorcore.cuh's MmaOperands: A (m_rows x lda) and B (n_rows x ldb) halves, k the
    product's extent in whole k-steps, the float partial sums' row stride ldc."""
    m_rows: int
    n_rows: int
    k: int
    lda: int
    ldb: int
    ldc: int

    def smem_bytes(self, slices):
        """tensorcore.cuh's mma_smem_bytes."""
        return 2 * (self.n_rows * self.ldb + self.m_rows * self.lda) + \
            4 * slices * self.m_rows * self.ldc


def _round(x, to):
    return -(-x // to) * to


def mma_forward_operands(gates, hidden, batch, units):
    """tensorcore.cuh's forward_operands (a host test compares the two)."""
    k, n_rows = _round(hidden, 16), _round(gates * units, 8)
    return MmaOperands(_round(batch, 16), n_rows, k, k + 8, k + 8, n_rows + 1)


def mma_backward_operands(gates, hidden, batch, units, chunk):
    """tensorcore.cuh's backward_operands, for chunks of `chunk` gate rows."""
    n_rows = _round(units, 8)
    return MmaOperands(_round(batch, 16), n_rows, chunk, chunk + 8,
                       _round(gates * hidden, 16) + 8, n_rows + 1)


@dataclass(frozen=True)
class PersistentPlan:
    blocks: int          # grid size: at most one block per SM
    units: int           # hidden units per block
    threads: int         # per block, a multiple of 32
    ldn: int             # staged row stride: N (padded to whole tiles) made odd (no
                         # shared-memory bank conflicts)
    chunk: int           # backward: rows of the gate-gradient exchange staged at a time
    forward_smem: int    # bytes of dynamic shared memory per block
    backward_smem: int
    tile: int = 1        # samples per item of both recurrent products
    slices: int = 1      # slices of the reduction per item: of k (forward), of each
                         # staged chunk of gate rows (backward)
    precision: str | None = None   # "float16"/"bfloat16": the products on tensor cores
    backward_slices: int | None = None   # the backward's slices where they differ (the
                                         # tensor-core backward has its own tile count)


def tile_slices(units, batch, hidden, tile):
    """Slices of k that fill a block of MAX_THREADS with items of `tile` samples (at
    least 1, at most one k per 8)."""
    items = units * -(-batch // tile)
    return max(1, min(max(1, hidden // 8), MAX_THREADS // items))


def persistent_plan(gates, hidden, batch, itemsize, limits, tile=1, slices=1, precision=None):
    """The launch shape for one layer, or None where it does not fit on chip. `tile` and
    `slices` shape both recurrent products (module docstring); slices=None picks
    tile_slices, fewer where their partial sums would not fit beside W_h. `precision`
    ("float16", "bfloat16") plans the tensor-core products (float32 arrays, tile 1)."""
    if not (isinstance(tile, int) and 1 <= tile <= MAX_TILE):
        raise ValueError(f"persistent_plan: tile must be an int in 1..{MAX_TILE}, got {tile!r}")
    if not (slices is None or (isinstance(slices, int) and slices >= 1)):
        raise ValueError(f"persistent_plan: slices must be an int >= 1, got {slices!r}")
    units = -(-hidden // limits.sm_count)
    blocks = -(-hidden // units)
    if precision is not None:
        if precision not in HALF_PRODUCTS or itemsize != 4 or tile != 1:
            raise ValueError(f"persistent_plan: tensor-core products take precision in "
                             f"{sorted(HALF_PRODUCTS)} with float32 arrays and tile 1, got "
                             f"{precision!r}, itemsize {itemsize}, tile {tile}")
        return _mma_plan(gates, hidden, batch, limits, slices, units, blocks, precision)
    ldn = (-(-batch // tile) * tile) | 1
    for count in ([slices] if slices else range(tile_slices(units, batch, hidden, tile), 0, -1)):
        plan = _plan(gates, hidden, batch, itemsize, limits, tile, count, units, blocks, ldn)
        if plan is not None:
            return plan
    return None


def _plan(gates, hidden, batch, itemsize, limits, tile, slices, units, blocks, ldn):
    # The forward's partial sums exist only where it runs a product phase (persistent.cuh,
    # product_phase).
    partials = slices * units * gates * ldn if (tile, slices) != (1, 1) else 0
    forward_smem = (hidden * gates * units + hidden * ldn + partials) * itemsize
    # The backward stages up to MAX_CHUNK exchange rows (of ldn values each) at a time,
    # fewer where the W_h columns leave less shared memory; at least 32.
    fixed = (gates * hidden * units + slices * units * ldn) * itemsize
    chunk = min(gates * hidden, MAX_CHUNK, (limits.smem_per_block - fixed) // (ldn * itemsize))
    if forward_smem > limits.smem_per_block or chunk < min(32, gates * hidden):
        return None
    backward_smem = fixed + chunk * ldn * itemsize
    # At least 256 threads even where there are fewer tasks: staging (persistent.cuh)
    # needs that many loads in flight.
    work = max(units * batch, slices * units * -(-batch // tile))
    threads = min(MAX_THREADS, max(MIN_THREADS, -(-work // 32) * 32))
    return PersistentPlan(blocks, units, threads, ldn, chunk, forward_smem, backward_smem,
                          tile, slices)


def _mma_plan(gates, hidden, batch, limits, slices, units, blocks, precision):
    warps = MAX_THREADS // 32
    forward = mma_forward_operands(gates, hidden, batch, units)
    tiles = forward.m_rows // 16 * (forward.n_rows // 8)
    backward_tiles = forward.m_rows // 16 * (_round(units, 8) // 8)
    # Enough slices of k for one tile per warp of a full block, each product its own.
    forward_slices = slices or max(1, min(forward.k // 16, warps // tiles))
    backward_slices = slices or max(1, warps // backward_tiles)
    forward_smem = forward.smem_bytes(forward_slices)
    # The backward stages as many gate rows at a time as fit, in whole k-steps (each
    # chunk costs two block barriers), at least 16.
    fixed = mma_backward_operands(gates, hidden, batch, units, 0).smem_bytes(backward_slices)
    room = (limits.smem_per_block - fixed) // (2 * forward.m_rows)
    chunk = min(_round(gates * hidden, 16), room // 16 * 16)
    if forward_smem > limits.smem_per_block or chunk < 16:
        return None
    if slices is None:   # no more slices than a chunk has k-steps
        backward_slices = min(backward_slices, chunk // 16)
    backward_smem = mma_backward_operands(gates, hidden, batch, units,
                                          chunk).smem_bytes(backward_slices)
    # Whole warps (each C tile is a warp's), at least 256 threads for staging, and enough
    # for one tile per warp or one cell task per thread.
    work = max(units * batch, 32 * tiles * forward_slices,
               32 * backward_tiles * backward_slices)
    threads = min(MAX_THREADS, max(MIN_THREADS, -(-work // 32) * 32))
    return PersistentPlan(blocks, units, threads, batch | 1, chunk, forward_smem, backward_smem,
                          1, forward_slices, precision, backward_slices)


def tensor_cores_enabled(environ=os.environ):
    """Whether half data may take the tensor-core products: unless
    FUSEDRNN_GPU_TENSOR_CORES=0 (module docstring: the measurement behind the default)."""
    return environ.get(TENSOR_CORES_ENV, "1") != "0"


def product_precision(storage, limits, environ=os.environ):
    """The plan's `precision` for data stored as `storage` (None: float32 and float64
    data, a device before compute capability 8.0, or tensor cores turned off)."""
    if storage not in HALF_PRODUCTS or limits.capability < MIN_TENSOR_CORE_CAPABILITY:
        return None
    return storage if tensor_cores_enabled(environ) else None


def tile_setting(environ=os.environ):
    """(tile, slices) for persistent_plan from FUSEDRNN_GPU_TILE: unset (1, 1); "R" (R,
    None: slices to fill the block); "R,S". Anything else is a ValueError naming it."""
    text = environ.get(TILE_ENV, "").strip()
    if not text:
        return 1, 1
    parts = text.split(",")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(parts) not in (1, 2) or len(values) != len(parts) or \
            not 1 <= values[0] <= MAX_TILE or (len(values) == 2 and values[1] < 1):
        raise ValueError(f"{TILE_ENV}: expected 'R' or 'R,S' with R in 1..{MAX_TILE} and "
                         f"S >= 1, got {text!r}")
    return values[0], values[1] if len(values) == 2 else None


def op_plan(gates, hidden, batch, itemsize, limits, storage=None, environ=os.environ):
    """The plan the op takes for one layer on `limits`' device, the environment's settings
    applied (FUSEDRNN_GPU_TILE, FUSEDRNN_GPU_TENSOR_CORES); storage: the data's dtype name
    where the op converts it. FUSEDRNN_GPU_TILE's slices apply to the tensor-core
    products too; their tile is the mma's."""
    tile, slices = tile_setting(environ)
    precision = product_precision(storage, limits, environ)
    if precision is not None:
        tile, slices = 1, slices if environ.get(TILE_ENV, "").strip() else None
    return persistent_plan(gates, hidden, batch, itemsize, limits, tile, slices, precision)


def persistent_enabled():
    """On unless FUSEDRNN_GPU_PERSISTENT=0 (the per-step path everywhere)."""
    return os.environ.get(ENV, "1") != "0"


def _common(lengths, clip_lo, clip_hi, clip_flags, steps, batch, hidden, plan, d, has_cell,
            slices):
    i = np.int64
    return (lengths, i(lengths.size), np.float64(clip_lo), np.float64(clip_hi), i(clip_flags),
            i(steps), i(batch), i(hidden), i(plan.units), i(plan.ldn), i(d), i(has_cell),
            i(plan.tile), i(slices), i(HALF_PRODUCTS.get(plan.precision, 0)))


def persistent_forward_args(gates, plan, xproj, d, w_h, bx, bh, hs, cs, y, saved, lengths,
                            clip_lo, clip_hi, clip_flags):
    """persistent_forward's argument list for direction d, from FusedLayer.forward's
    arrays (fusedrnn/cpu/fused.py documents them; w_h is the (G*H, H) weight itself)."""
    T, N, H = xproj.shape[0], xproj.shape[1], hs.shape[3]
    i = np.int64
    has_cell, record = cs.shape[3] != 0, saved.shape[0] != 0
    return (xproj, i(xproj.shape[2]), i(d * gates * H), w_h, bx, bh, hs[d],
            cs[d] if has_cell else cs, y, i(y.shape[2]), i(d * H),
            saved[d] if record else saved, i(record),
            *_common(lengths, clip_lo, clip_hi, clip_flags, T, N, H, plan, d, has_cell,
                     plan.slices))


def persistent_backward_args(gates, plan, dy, d, w_h, hs, cs, saved, dgx, dgh, dh_rec0,
                             dh_carry, dc_carry, exchange, lengths, clip_lo, clip_hi,
                             clip_flags):
    """persistent_backward's argument list for direction d (FusedLayer.backward's arrays;
    exchange (2, G*H, N) scratch)."""
    T, N, H = dy.shape[0], dy.shape[1], hs.shape[3]
    i = np.int64
    has_cell = cs.shape[3] != 0
    return (dy, i(dy.shape[2]), i(d * H), w_h, hs[d], cs[d] if has_cell else cs, saved[d],
            dgx, dgh, i(dgx.shape[2]), i(d * gates * H), i(dgh.shape[2] != 0), dh_rec0,
            dh_carry, dc_carry, exchange, i(plan.chunk),
            *_common(lengths, clip_lo, clip_hi, clip_flags, T, N, H, plan, d, has_cell,
                     plan.backward_slices or plan.slices))


class PersistentLayer:
    """The recurrence's FusedLayer protocol over the persistent kernels: the input
    projection stays the driver's one GEMM per layer (cuBLAS), W_h is read in place (each
    block stages its own slice), and each direction is one launch."""

    projects_input = False
    fuses_single_step = False
    reads_storage = reads_weights = False

    def __init__(self, mode, plan, xp, launch_forward, launch_backward):
        self.gates, self.plan, self.xp = CELLS[mode].gates, plan, xp
        self._launch_forward, self._launch_backward = launch_forward, launch_backward

    def _barrier(self):
        """A fresh zeroed grid_barrier counter per launch: one shared by launches on two
        streams could be reset under a kernel still spinning on it (a hang)."""
        return self.xp.zeros(1, dtype=np.uint64)

    @staticmethod
    def forward_scratch(config, steps, batch):
        return {}

    @staticmethod
    def fuses_input(steps, batch):
        return False   # xproj comes from the op's GEMM

    @staticmethod
    def backward_scratch(config, batch):
        return {"exchange": (2, config.gate_rows, batch)}   # the gate-gradient exchange

    def forward(self, xproj, d, w_h, bx, bh, hs, cs, y, saved, scratch, lengths, clip_lo,
                clip_hi, clip_flags, x_pairs=None, w_x=None):
        if x_pairs is not None or w_x is not None:
            raise ValueError("PersistentLayer.forward: takes xproj (fuses_input is False)")
        args = persistent_forward_args(self.gates, self.plan, xproj, d, w_h, bx, bh, hs, cs,
                                       y, saved, lengths, clip_lo, clip_hi, clip_flags)
        self._launch_forward((self.plan.blocks,), (self.plan.threads,),
                             (self._barrier(), *args), self.plan.forward_smem)

    def backward(self, dy, d, w_h, hs, cs, saved, dgx, dgh, dh_rec0, dh_carry, dc_carry,
                 scratch, lengths, clip_lo, clip_hi, clip_flags):
        args = persistent_backward_args(self.gates, self.plan, dy, d, w_h, hs, cs, saved, dgx,
                                        dgh, dh_rec0, dh_carry, dc_carry, scratch.exchange,
                                        lengths, clip_lo, clip_hi, clip_flags)
        self._launch_backward((self.plan.blocks,), (self.plan.threads,),
                              (self._barrier(), *args), self.plan.backward_smem)


def _cupy_launcher(cupy, function, plan, shared_mem, sm_count):
    """A cooperative launcher for `function`, or None where the grid would not be
    co-resident (every block owns fixed units and waits for all others each step)."""
    if function.max_dynamic_shared_size_bytes < shared_mem:
        function.max_dynamic_shared_size_bytes = shared_mem
    kernel = function.kernel   # the cupy.cuda.Function on the current device
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.ptr, plan.threads, shared_mem)
    if per_sm * sm_count < plan.blocks:
        return None

    def launch(grid, block, args, shared_mem):
        kernel(grid, block, args, shared_mem=shared_mem, enable_cooperative_groups=True)
    return launch


def cupy_persistent_layer(cupy, config, dtype, batch, storage=None):
    """The persistent layer for this op on the current device, or None where the rule
    (module docstring) sends it down the per-step path. storage: the data's dtype name
    where the op converts it (half precision)."""
    if not persistent_enabled() or config.projection_size:
        return None
    limits = DeviceLimits.of_current_cupy_device(cupy)
    plan = op_plan(config.cell.gates, config.state_size, batch, np.dtype(dtype).itemsize,
                   limits, storage)
    if plan is None:
        return None
    try:
        forward, backward = PERSISTENT_KERNELS.cupy_functions(cupy, config.mode, dtype)
        launch_forward = _cupy_launcher(cupy, forward, plan, plan.forward_smem, limits.sm_count)
        launch_backward = _cupy_launcher(cupy, backward, plan, plan.backward_smem,
                                         limits.sm_count)
    except Exception as error:  # noqa: BLE001  (any build or attribute failure: fall back)
        warnings.warn(f"fusedrnn: persistent GPU kernels unavailable ({error!r}); using the "
                      f"per-step path", RuntimeWarning, stacklevel=2)
        return None
    if launch_forward is None or launch_backward is None:
        return None
    return PersistentLayer(config.mode, plan, cupy, launch_forward, launch_backward)
