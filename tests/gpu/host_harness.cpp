// Host build of fusedrnn/gpu/cells.cuh for tests without a GPU: each entry runs the
// kernels' per-element body over every element, taking the kernels' exact arguments.
#include "cells.cuh"

using namespace fusedrnn;

#define HOST_ENTRIES(NAME, CELL, T)                                                    \
  extern "C" void forward_##NAME(FUSEDRNN_FORWARD_PARAMS(T)) {                         \
    for (idx_t k = 0; k < N * H; ++k) forward_element<CELL, T>(k, FUSEDRNN_FORWARD_ARGS); \
  }                                                                                    \
  extern "C" void backward_##NAME(FUSEDRNN_BACKWARD_PARAMS(T)) {                       \
    for (idx_t k = 0; k < N * H; ++k)                                                  \
      backward_element<CELL, T>(k, FUSEDRNN_BACKWARD_ARGS);                            \
  }

// FUSEDRNN_HOST_CELLS(X) expands X(mode, CellStruct) once per mode of fusedrnn.config.CELLS;
// host_backend.py passes it with -D, so a new mode needs no edit here.
#ifndef FUSEDRNN_HOST_CELLS
#error "FUSEDRNN_HOST_CELLS(X): build through tests/gpu/host_backend.py, which defines it"
#endif
#define CELL_ENTRIES(MODE, CELL) \
  HOST_ENTRIES(MODE##_float, CELL, float) HOST_ENTRIES(MODE##_double, CELL, double)
FUSEDRNN_HOST_CELLS(CELL_ENTRIES)

// ---- the persistent kernels (persistent.cuh), phase by phase ----
// Entries take the device kernels' arguments after (blocks, threads, shared memory bytes),
// and return 0, or 1 where the tensor-core layout needs more shared memory than the
// launch gives, 2 for a half precision with double arrays; the grid barrier's counter is
// unused here.
// The device kernels run these phases with __syncthreads / grid.sync between; here the
// barriers are loop boundaries: every block's weights are staged, then per step each
// block stages its state (all threads) before any of its tasks run, and every block
// finishes a step before any block starts the next.
#include <limits>
#include <vector>

#include "persistent.cuh"

template <typename Cell, typename T>
void host_persistent_forward(idx_t blocks, idx_t threads, FUSEDRNN_PERSISTENT_FORWARD_PARAMS(T)) {
  const PersistentForward<T> p = FUSEDRNN_PERSISTENT_FORWARD_INIT;
  std::vector<std::vector<T>> w_s(blocks, std::vector<T>(H * Cell::G * units));
  // Padding columns of h_s (n >= N) hold NaN: the product may read them but must never
  // let them reach a result.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<std::vector<T>> h_s(blocks, std::vector<T>(H * ldn, nan));
  std::vector<T> part_s(slices * units * Cell::G * ldn, nan);   // reused block after block
  for (idx_t b = 0; b < blocks; ++b)
    for (idx_t tid = 0; tid < threads; ++tid)
      forward_stage_weights<Cell, T>(p, w_s[b].data(), b, tid, threads);
  for (idx_t step = 0; step < steps; ++step)
    for (idx_t b = 0; b < blocks; ++b) {
      for (idx_t tid = 0; tid < threads; ++tid) stage_state(p, h_s[b].data(), step, tid, threads);
      if (product_phase(p))
        for (idx_t tid = 0; tid < threads; ++tid)
          forward_product<Cell, T>(p, w_s[b].data(), h_s[b].data(), part_s.data(), b, tid,
                                   threads);
      for (idx_t tid = 0; tid < threads; ++tid)
        forward_tasks<Cell, T>(p, w_s[b].data(), h_s[b].data(), part_s.data(), b, tid, threads,
                               step);
    }
}

template <typename Cell, typename T>
void host_persistent_backward(idx_t blocks, idx_t threads, FUSEDRNN_PERSISTENT_BACKWARD_PARAMS(T)) {
  const PersistentBackward<T> p = FUSEDRNN_PERSISTENT_BACKWARD_INIT;
  std::vector<std::vector<T>> w_s(blocks, std::vector<T>(Cell::G * H * units));
  // Reused block after block; padding columns of x_s (n >= N) hold NaN, as in the forward.
  std::vector<T> x_s(chunk * ldn, std::numeric_limits<T>::quiet_NaN());
  std::vector<T> part_s(slices * units * ldn);
  for (idx_t b = 0; b < blocks; ++b)
    for (idx_t tid = 0; tid < threads; ++tid)
      backward_stage_weights<Cell, T>(p, w_s[b].data(), b, tid, threads);
  for (idx_t step = 0; step < steps; ++step)
    for (idx_t b = 0; b < blocks; ++b) {
      if (step > 0) {
        for (idx_t tid = 0; tid < threads; ++tid)
          backward_clear<Cell>(p, part_s.data(), tid, threads);
        for (idx_t first = 0; first < Cell::G * H; first += chunk) {
          for (idx_t tid = 0; tid < threads; ++tid)
            stage_exchange<Cell, T>(p, x_s.data(), step, first, tid, threads);
          for (idx_t tid = 0; tid < threads; ++tid)
            backward_accumulate<Cell, T>(p, w_s[b].data(), x_s.data(), part_s.data(), b, tid,
                                         threads, first);
        }
      }
      for (idx_t tid = 0; tid < threads; ++tid)
        backward_tasks<Cell, T>(p, part_s.data(), b, tid, threads, step);
    }
}

// The tensor-core forms (tensorcore.cuh). Each block's shared memory is the launch's
// bytes, first filled with 0xff (NaN as float, float16 and bfloat16), so padding that
// reached a result would show; mma.sync runs as tensorcore.cuh's host stand-in, lane by
// lane (threads is a multiple of 32).
typedef std::vector<std::vector<unsigned char>> BlockMemory;

// Every block's shared memory (0xff bytes) with its B operand staged (mma_stage_weights,
// forward or backward by p's type); none where the launch's bytes or threads do not fit
// the layout `o`.
template <int P, typename Cell, template <typename> class Params, typename T>
BlockMemory staged_blocks(idx_t blocks, idx_t threads, idx_t smem, const Params<T>& p,
                          const MmaOperands& o) {
  if (mma_smem_bytes(o, int(p.c.slices)) > smem || threads % 32) return BlockMemory();
  BlockMemory mem(blocks, std::vector<unsigned char>(smem, 0xff));
  for (idx_t b = 0; b < blocks; ++b)
    for (idx_t tid = 0; tid < threads; ++tid)
      mma_stage_weights<P, Cell>(p, carve_mma<T>(mem[b].data(), o), b, tid, threads);
  return mem;
}

template <int P, typename Cell, typename T>
int host_mma_loop(idx_t blocks, idx_t threads, idx_t smem, const PersistentForward<T>& p) {
  const MmaOperands o = forward_operands<Cell>(p);
  BlockMemory mem = staged_blocks<P, Cell>(blocks, threads, smem, p, o);
  if (mem.empty()) return 1;
  for (idx_t step = 0; step < p.c.steps; ++step)
    for (idx_t b = 0; b < blocks; ++b) {
      const MmaShared<T> m = carve_mma<T>(mem[b].data(), o);
      for (idx_t tid = 0; tid < threads; ++tid) forward_mma_stage<P, Cell>(p, m, step, tid, threads);
      for (idx_t tid = 0; tid < threads; ++tid)
        mma_product<P>(o, m.a, m.b, m.part, int(p.c.H), int(p.c.slices), int(tid), int(threads));
      for (idx_t tid = 0; tid < threads; ++tid)
        forward_tasks<Cell, T>(p, nullptr, nullptr, m.part, b, tid, threads, step);
    }
  return 0;
}

template <int P, typename Cell, typename T>
int host_mma_loop(idx_t blocks, idx_t threads, idx_t smem, const PersistentBackward<T>& p) {
  const MmaOperands o = backward_operands<Cell>(p);
  BlockMemory mem = staged_blocks<P, Cell>(blocks, threads, smem, p, o);
  if (mem.empty() || p.chunk % 16) return 1;
  for (idx_t step = 0; step < p.c.steps; ++step)
    for (idx_t b = 0; b < blocks; ++b) {
      const MmaShared<T> m = carve_mma<T>(mem[b].data(), o);
      if (step > 0) {
        for (idx_t tid = 0; tid < threads; ++tid) backward_clear<Cell>(p, m.part, tid, threads);
        for (idx_t first = 0; first < Cell::G * p.c.H; first += p.chunk) {
          for (idx_t tid = 0; tid < threads; ++tid)
            backward_mma_chunk<P, Cell>(p, m, step, first, tid, threads);
          for (idx_t tid = 0; tid < threads; ++tid)
            backward_mma_product<P, Cell>(p, m, first, tid, threads);
        }
      }
      for (idx_t tid = 0; tid < threads; ++tid)
        backward_tasks<Cell, T, P>(p, m.part, b, tid, threads, step);
    }
  return 0;
}

// As the kernels' on_tensor_cores: float arrays only (-1: not this path; 2: a half
// precision with double arrays, never planned).
template <typename Cell, template <typename> class Params>
int host_mma(idx_t blocks, idx_t threads, idx_t smem, const Params<float>& p) {
  if (p.c.precision == kProductF16) return host_mma_loop<kProductF16, Cell>(blocks, threads, smem, p);
  if (p.c.precision == kProductBF16) return host_mma_loop<kProductBF16, Cell>(blocks, threads, smem, p);
  return -1;
}
template <typename Cell, template <typename> class Params>
int host_mma(idx_t, idx_t, idx_t, const Params<double>& p) {
  return p.c.precision == kProductT ? -1 : 2;
}

template <typename Cell, typename T>
int host_forward(idx_t blocks, idx_t threads, idx_t smem, FUSEDRNN_PERSISTENT_FORWARD_PARAMS(T)) {
  const PersistentForward<T> p = FUSEDRNN_PERSISTENT_FORWARD_INIT;
  const int status = host_mma<Cell>(blocks, threads, smem, p);
  if (status >= 0) return status;
  host_persistent_forward<Cell, T>(blocks, threads, FUSEDRNN_PERSISTENT_FORWARD_ARGS);
  return 0;
}

template <typename Cell, typename T>
int host_backward(idx_t blocks, idx_t threads, idx_t smem, FUSEDRNN_PERSISTENT_BACKWARD_PARAMS(T)) {
  const PersistentBackward<T> p = FUSEDRNN_PERSISTENT_BACKWARD_INIT;
  const int status = host_mma<Cell>(blocks, threads, smem, p);
  if (status >= 0) return status;
  host_persistent_backward<Cell, T>(blocks, threads, FUSEDRNN_PERSISTENT_BACKWARD_ARGS);
  return 0;
}

#define PERSISTENT_ENTRIES(NAME, CELL, T)                                                  \
  extern "C" int persistent_forward_##NAME(idx_t blocks, idx_t threads, idx_t smem, void*, \
                                           FUSEDRNN_PERSISTENT_FORWARD_PARAMS(T)) {        \
    return host_forward<CELL, T>(blocks, threads, smem, FUSEDRNN_PERSISTENT_FORWARD_ARGS);   \
  }                                                                                        \
  extern "C" int persistent_backward_##NAME(idx_t blocks, idx_t threads, idx_t smem, void*, \
                                            FUSEDRNN_PERSISTENT_BACKWARD_PARAMS(T)) {       \
    return host_backward<CELL, T>(blocks, threads, smem, FUSEDRNN_PERSISTENT_BACKWARD_ARGS); \
  }

#define CELL_PERSISTENT_ENTRIES(MODE, CELL) \
  PERSISTENT_ENTRIES(MODE##_float, CELL, float) PERSISTENT_ENTRIES(MODE##_double, CELL, double)
FUSEDRNN_HOST_CELLS(CELL_PERSISTENT_ENTRIES)

// tensorcore.cuh's layout and conversions, for tests that hold them to persistent.py's
// mirror and to numpy / ml_dtypes.
extern "C" long long mma_forward_smem(int G, int H, int N, int units, int slices) {
  return mma_smem_bytes(forward_operands(G, H, N, units), slices);
}
extern "C" long long mma_backward_smem(int G, int H, int N, int units, int chunk, int slices) {
  return mma_smem_bytes(backward_operands(G, H, N, units, chunk), slices);
}
extern "C" void round_to_half(const float* x, long long n, int precision, unsigned short* out) {
  for (long long i = 0; i < n; ++i)
    out[i] = precision == kProductBF16 ? host_to_bf16(x[i]) : host_to_f16(x[i]);
}

// persistent.cuh's staging of half rows, every thread of one block in turn: src_bytes 2
// (half bits, copied) or 4 (floats, rounded by `precision`); wide 1 tries the 16-byte form
// (returns whether it ran), 0 runs the scalar form (returns 0).
template <int P, typename S>
int stage_rows_as(const void* src, int rows, int width, int src_ld, int width_pad,
                  unsigned short* dst, int ld, int threads, int wide) {
  const S* s = static_cast<const S*>(src);
  int ran = 0;
  for (int tid = 0; tid < threads; ++tid) {
    if (wide)
      ran = stage_half_rows_wide<P>(s, rows, width, src_ld, width_pad, dst, ld, tid, threads);
    else
      stage_half_rows_scalar<P>(s, rows, width, src_ld, width_pad, dst, ld, tid, threads);
  }
  return ran;
}

extern "C" int stage_rows(const void* src, int src_bytes, int rows, int width, int src_ld,
                          int width_pad, unsigned short* dst, int ld, int precision,
                          int threads, int wide) {
  if (precision == kProductBF16)
    return src_bytes == 2 ? stage_rows_as<kProductBF16, half_bits>(src, rows, width, src_ld,
                                                                    width_pad, dst, ld, threads, wide)
                          : stage_rows_as<kProductBF16, float>(src, rows, width, src_ld,
                                                                width_pad, dst, ld, threads, wide);
  return src_bytes == 2 ? stage_rows_as<kProductF16, half_bits>(src, rows, width, src_ld,
                                                                 width_pad, dst, ld, threads, wide)
                        : stage_rows_as<kProductF16, float>(src, rows, width, src_ld, width_pad,
                                                             dst, ld, threads, wide);
}
