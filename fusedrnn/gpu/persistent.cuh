// Persistent recurrent kernels: one cooperative launch runs a layer-direction's whole
// time loop, forward or backward (issue 9; host side: fusedrnn/gpu/persistent.py).
//
// Why: the per-step path launches a GEMM and a cell kernel per step, and cuDNN's steps
// are launch-bound at the design size. Here each block owns U consecutive hidden units
// and keeps the matching slice of W_h in shared memory for the whole sequence; per step
// it reads the previous state from L2, does its slice of the recurrent product and the
// cell's pointwise math (cells.cuh, the same unit functions as the per-step kernels), and
// the grid synchronises once (grid_barrier).
// Measured: bench/results/gpu.md#persistent-where-it-fits-the-measurement
//
// Work split: block b owns units j = b*U .. min(H, b*U+U)-1. In the forward each step has
// two phases. The recurrent product: items (s, u, n-group), n-group fastest, strided over
// the block's threads; an item sums k over its slice s of the S slices of 0..H-1 for all
// G gates of unit u and `tile` consecutive samples, so each weight read from shared
// memory feeds G*tile FMAs (a register tile), and its partial sums go to part_s. Then
// the cell: tasks (u, n), n fastest; a task adds its S partial sums per gate and runs all
// G gates of unit j for sample n, so the cell math needs no exchange. Lanes of a warp
// mostly share u (W reads are shared-memory broadcasts) and differ in n (state reads hit
// distinct banks: the staged state's row stride ldn is odd). With tile = slices = 1 there
// is no product phase: each task does its dot product over all k itself, the kernel's
// first form (product_phase).
//
// Every kernel body below is written as __host__ __device__ phases (stage weights,
// stage state, tasks) separated by barriers: the __global__ kernels run them with
// __syncthreads / grid_barrier between, and tests/gpu/host_harness.cpp runs the same
// phases block by block and thread by thread, the barriers becoming loop boundaries.
//
// Both kernels take first `barrier`, a zeroed unsigned 64-bit counter (device memory,
// one per launch in flight), then the arguments below; T (the step count) is `steps`.
// Of the arguments both share (FUSEDRNN_PERSISTENT_COMMON_PARAMS):
//   tile   1..kMaxTile   samples per item of the recurrent products; ldn (the staged
//                        rows' stride) >= ceil(N/tile)*tile
//   slices S >= 1        slices per item: of k in the forward, of each staged chunk of
//                        gate rows in the backward (the last may be short or empty)
//   precision            what the products multiply (tensorcore.cuh): kProductT, T itself
//                        on CUDA cores, tile and slices as above; kProductF16 / kProductBF16,
//                        operands rounded to float16 / bfloat16 on tensor cores (T float,
//                        threads a multiple of 32), tile 1, slices of k-steps of 16
//
// persistent_forward<Cell, T>   (PERSISTENT_FORWARD_PARAMS; shared memory
//                                (H*G*U + H*ldn + S*U*G*ldn) * sizeof(T), without the
//                                last term where tile = slices = 1)
//   xproj  (T, N, ld_x)  in   W_x x_t; gate g of unit j at column x_col + g*H + j
//   w_h    (G*H, H)      in   this direction's recurrent weights, row-major
//   bx, bh (G*H)         in   biases
//   hs     (T+1, N, H)   in/out  state sequence: row `first` (0 forward, T reversed) set
//                             on entry, every other row written
//   cs     (T+1, N, H)   in/out  the same for the LSTM cell state (has_cell), else unused
//   y      (T, N, ld_y)  out  this direction's output at columns y_col .. y_col+H-1
//   saved  (T, N, S*H)   out  training record (cells.cuh's rec) when has_record
//   lengths (n_lengths)  in   per-sample lengths; n_lengths 0: every sample runs all T
//   No output overlaps an input.
//   With a half precision the shared memory is tensorcore.cuh's (mma_smem_bytes of
//   forward_operands): W_h's rows and the staged state in half, S float partial sums.
//
// persistent_backward<Cell, T>  (PERSISTENT_BACKWARD_PARAMS; shared memory
//                                (G*H*U + chunk*ldn + S*U*ldn) * sizeof(T))
//   dy     (T, N, ld_dy) in   output gradient; this direction at columns y_col..
//   w_h, hs, cs, saved    in   as the training forward left them
//   dgx    (T, N, ld_dg) out  d(input-side pre-activation) at columns col + g*H + j
//   dgh    (T, N, ld_dg) out  d(recurrent-side pre-activation) when has_dgh (GRU)
//   dh_rec0 (N, H)       in   gradient of the final state (dhy)
//   dh_carry (N, H)      in/out  0 on entry; on exit what reaches h_0 bypassing W_h
//   dc_carry (N, H)      in/out  dcy on entry, dc_0 on exit (has_cell)
//   exchange (2, G*H, N) scratch: each step's recurrent-side gate gradients, transposed so
//                        a block stages them coalesced; two buffers alternate by step
//   chunk                rows of exchange staged in shared memory at a time (>= 1; with
//                        a half precision a multiple of 16)
//   With a half precision exchange holds (2, N, G*H) values of that precision (its first
//   half, for float32 arrays), rows per sample as the product's A operand reads them, and
//   the shared memory is mma_smem_bytes of backward_operands. float16 data's gate
//   gradients are thereby rounded to float16 (range 6e-8 .. 65504, as the data's own
//   gradients leave the op): scale a loss as for torch's float16 autocast.
//   On exit dh_0 = dg_first @ W_h + dh_carry; the caller runs that last GEMM (as for the
//   CPU's fused loop, fusedrnn/cpu/fused.py).
#pragma once

#include "cells.cuh"
#include "tensorcore.cuh"

#if defined(__CUDACC__) && defined(FUSEDRNN_PHASE_CLOCKS)
// Instrumented build only (fusedrnn/benchmark/gpu_phases.py compiles with
// -DFUSEDRNN_PHASE_CLOCKS): each block's thread 0 adds the clock64 cycles of every step's
// phases, measured from block barrier to block barrier, to slots 0 (staging, and in the
// backward the recurrent product too), 1 (tasks: the cell math; in the forward also the
// product) and 2 (the grid barrier: waiting for the slowest block). The extra block
// barriers cost a little.
__device__ unsigned long long fusedrnn_phase_clocks[3];
#define FUSEDRNN_PHASE_START(since) long long since = clock64()
#define FUSEDRNN_PHASE_MARK(slot, since)                                                  \
  do {                                                                                     \
    __syncthreads();                                                                       \
    if (threadIdx.x == 0) {                                                                \
      const long long now_ = clock64();                                                    \
      atomicAdd(&fusedrnn_phase_clocks[slot], (unsigned long long)(now_ - since));         \
      since = now_;                                                                        \
    }                                                                                      \
  } while (0)
#else
#define FUSEDRNN_PHASE_START(since) \
  do {                              \
  } while (0)
#define FUSEDRNN_PHASE_MARK(slot, since) \
  do {                                   \
  } while (0)
#endif

namespace fusedrnn {

// A value another block wrote since the last grid barrier: read past the (incoherent)
// L1 so the barrier's ordering is all that matters.
template <typename T>
__host__ __device__ __forceinline__ T load_shared_state(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldcg(p);
#else
  return *p;
#endif
}


#define FUSEDRNN_PERSISTENT_COMMON_PARAMS                                                \
  const idx_t *lengths, idx_t n_lengths, double clip_lo, double clip_hi, idx_t clip_flags, \
      idx_t steps, idx_t N, idx_t H, idx_t units, idx_t ldn, idx_t reverse, idx_t has_cell, \
      idx_t tile, idx_t slices, idx_t precision
#define FUSEDRNN_PERSISTENT_COMMON_ARGS                                                  \
  lengths, n_lengths, clip_lo, clip_hi, clip_flags, steps, N, H, units, ldn, reverse, has_cell, \
      tile, slices, precision
#define FUSEDRNN_PERSISTENT_FORWARD_PARAMS(T_)                                           \
  const T_ *xproj, idx_t ld_x, idx_t x_col, const T_ *w_h, const T_ *bx, const T_ *bh,    \
      T_ *hs, T_ *cs, T_ *y, idx_t ld_y, idx_t y_col, T_ *saved, idx_t has_record,       \
      FUSEDRNN_PERSISTENT_COMMON_PARAMS
#define FUSEDRNN_PERSISTENT_FORWARD_ARGS                                                 \
  xproj, ld_x, x_col, w_h, bx, bh, hs, cs, y, ld_y, y_col, saved, has_record,            \
      FUSEDRNN_PERSISTENT_COMMON_ARGS
#define FUSEDRNN_PERSISTENT_BACKWARD_PARAMS(T_)                                          \
  const T_ *dy, idx_t ld_dy, idx_t y_col, const T_ *w_h, const T_ *hs, const T_ *cs,      \
      const T_ *saved, T_ *dgx, T_ *dgh, idx_t ld_dg, idx_t col, idx_t has_dgh,           \
      const T_ *dh_rec0, T_ *dh_carry, T_ *dc_carry, T_ *exchange, idx_t chunk,           \
      FUSEDRNN_PERSISTENT_COMMON_PARAMS
#define FUSEDRNN_PERSISTENT_BACKWARD_ARGS                                                \
  dy, ld_dy, y_col, w_h, hs, cs, saved, dgx, dgh, ld_dg, col, has_dgh, dh_rec0, dh_carry, \
      dc_carry, exchange, chunk, FUSEDRNN_PERSISTENT_COMMON_ARGS

// The kernels' arguments gathered once (field order = parameter order), so each phase
// takes one object.
struct PersistentCommon {
  const idx_t* lengths;
  idx_t n_lengths;
  double clip_lo, clip_hi;
  idx_t clip_flags, steps, N, H, units, ldn, reverse, has_cell;
  idx_t tile, slices;   // the recurrent products' register tile and slices (of k, or of
                        // the backward's gate rows)
  idx_t precision;      // ProductPrecision (tensorcore.cuh)
  // Forward order step -> t (the backward walks the forward order back).
  __host__ __device__ __forceinline__ idx_t forward_t(idx_t step) const {
    return reverse ? steps - 1 - step : step;
  }
  __host__ __device__ __forceinline__ idx_t prev_row(idx_t t) const { return reverse ? t + 1 : t; }
  __host__ __device__ __forceinline__ idx_t next_row(idx_t t) const { return reverse ? t : t + 1; }
  __host__ __device__ __forceinline__ StepInfo info(idx_t t) const {
    StepInfo s = {lengths, n_lengths, t, clip_lo, clip_hi, clip_flags};
    return s;
  }
};

template <typename T>
struct PersistentForward {
  const T *xproj;
  idx_t ld_x, x_col;
  const T *w_h, *bx, *bh;
  T *hs, *cs, *y;
  idx_t ld_y, y_col;
  T* saved;
  idx_t has_record;
  PersistentCommon c;
};

template <typename T>
struct PersistentBackward {
  const T* dy;
  idx_t ld_dy, y_col;
  const T *w_h, *hs, *cs, *saved;
  T *dgx, *dgh;
  idx_t ld_dg, col, has_dgh;
  const T* dh_rec0;
  T *dh_carry, *dc_carry, *exchange;
  idx_t chunk;   // exchange rows staged in shared memory at a time
  PersistentCommon c;
};

#define FUSEDRNN_PERSISTENT_COMMON_INIT                                                   \
  { lengths, n_lengths, clip_lo, clip_hi, clip_flags, steps, N, H, units, ldn, reverse, has_cell, \
    tile, slices, precision }
#define FUSEDRNN_PERSISTENT_FORWARD_INIT                                                  \
  { xproj, ld_x, x_col, w_h, bx, bh, hs, cs, y, ld_y, y_col, saved, has_record,           \
    FUSEDRNN_PERSISTENT_COMMON_INIT }
#define FUSEDRNN_PERSISTENT_BACKWARD_INIT                                                 \
  { dy, ld_dy, y_col, w_h, hs, cs, saved, dgx, dgh, ld_dg, col, has_dgh, dh_rec0,         \
    dh_carry, dc_carry, exchange, chunk, FUSEDRNN_PERSISTENT_COMMON_INIT }

// ---- forward phases ----

template <typename Cell, typename T>
__host__ __device__ void forward_stage_weights(const PersistentForward<T>& p, T* w_s,
                                               idx_t block, idx_t tid, idx_t threads) {
  // w_s[(k*U + u)*G + g] = W_h[g*H + j, k]: a task's G weights for one k are adjacent
  // (one 128-bit load for an LSTM in float32), and lanes sharing u read the same ones.
  const idx_t G = Cell::G, H = p.c.H, U = p.c.units;
  for (idx_t i = tid; i < G * U * H; i += threads) {   // k fastest: coalesced reads
    idx_t k = i % H, gu = i / H, u = gu % U, g = gu / U, j = block * U + u;
    w_s[(k * U + u) * G + g] = j < H ? p.w_h[(g * H + j) * H + k] : T(0);
  }
}

// Staging copies a whole matrix (the previous state, transposed; in the backward the
// previous step's gate gradients) from L2 into shared memory every step, with few warps
// per SM: a thread that waits for each load before the next pays the L2 latency per
// element. So each thread first issues kStageBatch independent loads, then stores them;
// indices are 32-bit (the staged matrix fits in shared memory, and 64-bit division is a
// long software sequence).
// Measured: bench/results/gpu.md#the-staging-change
constexpr int kStageBatch = 16;

// dst[row * row_stride + col * col_stride] = src[i], i = row * width + col < count.
template <typename T>
__host__ __device__ __forceinline__ void stage_matrix(const T* src, int count, int width,
                                                      T* dst, int row_stride, int col_stride,
                                                      int tid, int threads) {
  for (int base = tid; base < count; base += kStageBatch * threads) {
    T v[kStageBatch];
FUSEDRNN_UNROLL
    for (int q = 0; q < kStageBatch; ++q) {
      const int i = base + q * threads;
      v[q] = i < count ? load_shared_state(src + i) : T(0);
    }
FUSEDRNN_UNROLL
    for (int q = 0; q < kStageBatch; ++q) {
      const int i = base + q * threads, row = i / width;
      if (i < count) dst[row * row_stride + (i - row * width) * col_stride] = v[q];
    }
  }
}

template <typename T>
__host__ __device__ void stage_state(const PersistentForward<T>& p, T* h_s, idx_t step,
                                     idx_t tid, idx_t threads) {
  // h_s[k*ldn + n] = h_prev[n, k]: transposed so sample n is the fast index.
  const T* rows = p.hs + p.c.prev_row(p.c.forward_t(step)) * p.c.N * p.c.H;
  stage_matrix(rows, int(p.c.N * p.c.H), int(p.c.H), h_s, 1, int(p.c.ldn), int(tid),
               int(threads));
}

// The tensor-core products' staging (tensorcore.cuh): dst[row * ld + col] = the half of
// src[row * src_ld + col] for col < width, 0 for col in [width, width_pad), rows < rows.
// src is float (a state another block wrote: read from L2) or already half (the backward's
// exchange: copied); batched loads as in stage_matrix.
template <int P>
__host__ __device__ __forceinline__ half_bits as_half(float v) { return to_half<P>(v); }
template <int P>
__host__ __device__ __forceinline__ half_bits as_half(double v) { return to_half<P>(float(v)); }
template <int P>
__host__ __device__ __forceinline__ half_bits as_half(half_bits v) { return v; }

// The wide form of stage_half_rows: 16 bytes a load (8 halves or 4 floats) where every
// row allows it - src and dst aligned, widths and strides whole vectors, as at the design
// sizes - else it returns false and the scalar form runs. Bit for bit the same result.
// Why: the backward's staging phase (2-byte loads, 16 in flight a thread) took most of the
// LSTM backward's step; a load here moves 8 of those. -DFUSEDRNN_SCALAR_STAGING
// (FUSEDRNN_GPU_WIDE_STAGING=0, persistent.py) builds without it, to compare.
// Measured: bench/results/gpu.md#half-precision-on-the-gpu-the-first-lease
// Measured: bench/results/gpu.md#half-precision-on-the-gpu-the-second-lease
struct alignas(16) Raw16 {
  unsigned w[4];
};

__host__ __device__ __forceinline__ Raw16 load_raw16(const void* p) {
  Raw16 r;
#ifdef __CUDA_ARCH__
  const uint4 v = __ldcg(static_cast<const uint4*>(p));   // L2: another block wrote it
  r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
#else
  __builtin_memcpy(&r, p, 16);
#endif
  return r;
}

__host__ __device__ __forceinline__ float raw_float(unsigned bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
#endif
}

// dst[0..V) = the halves of one Raw16: 8 halves as they are (16 bytes), or 4 floats
// rounded (8 bytes); dst is shared memory. (The last argument only picks the form.) The
// 16-byte store is spelled st.shared.v4: from a uint4 through a generic pointer nvcc 13
// split 12 of the backward's 16 into four 32-bit stores each (4-way bank conflicts).
template <int P>
__host__ __device__ __forceinline__ void store_raw16(half_bits* dst, const Raw16& r,
                                                     const half_bits*) {
#ifdef __CUDA_ARCH__
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"(unsigned(__cvta_generic_to_shared(dst))), "r"(r.w[0]), "r"(r.w[1]),
                  "r"(r.w[2]), "r"(r.w[3]) : "memory");
#else
  __builtin_memcpy(dst, &r, 16);
#endif
}
template <int P>
__host__ __device__ __forceinline__ void store_raw16(half_bits* dst, const Raw16& r,
                                                     const float*) {
  unsigned pair[2];
FUSEDRNN_UNROLL
  for (int h = 0; h < 2; ++h)
    pair[h] = unsigned(to_half<P>(raw_float(r.w[2 * h]))) |
              (unsigned(to_half<P>(raw_float(r.w[2 * h + 1]))) << 16);
#ifdef __CUDA_ARCH__
  *reinterpret_cast<uint2*>(dst) = make_uint2(pair[0], pair[1]);
#else
  __builtin_memcpy(dst, pair, 8);
#endif
}

constexpr int kWideBatch = 8;   // 16-byte loads in flight a thread (32 registers)

template <int P, typename S>
__host__ __device__ bool stage_half_rows_wide(const S* src, int rows, int width, int src_ld,
                                              int width_pad, half_bits* dst, int ld, int tid,
                                              int threads) {
#if defined(FUSEDRNN_SCALAR_STAGING)
  return false;
#else
  constexpr int V = 16 / int(sizeof(S));   // elements a load: 8 halves, 4 floats (2 doubles)
  typedef unsigned long long address;
  if (sizeof(S) > 4 || width % V || width_pad % V || src_ld % V || ld % V ||
      reinterpret_cast<address>(src) % 16 || reinterpret_cast<address>(dst) % (2 * V))
    return false;
  const int per_row = width_pad / V, full = width / V, count = rows * per_row;
  for (int base = tid; base < count; base += kWideBatch * threads) {
    Raw16 v[kWideBatch];
FUSEDRNN_UNROLL
    for (int q = 0; q < kWideBatch; ++q) {
      const int i = base + q * threads, row = i / per_row, c = i - row * per_row;
      if (i < count && c < full) {
        v[q] = load_raw16(src + row * src_ld + c * V);
      } else {
        v[q].w[0] = v[q].w[1] = v[q].w[2] = v[q].w[3] = 0u;   // the zero padding
      }
    }
FUSEDRNN_UNROLL
    for (int q = 0; q < kWideBatch; ++q) {
      const int i = base + q * threads, row = i / per_row;
      if (i < count) store_raw16<P>(dst + row * ld + (i - row * per_row) * V, v[q], src);
    }
  }
  return true;
#endif
}

template <int P, typename S>
__host__ __device__ void stage_half_rows_scalar(const S* src, int rows, int width, int src_ld,
                                                int width_pad, half_bits* dst, int ld, int tid,
                                                int threads) {
  const int count = rows * width_pad;
  for (int base = tid; base < count; base += kStageBatch * threads) {
    S v[kStageBatch];
FUSEDRNN_UNROLL
    for (int q = 0; q < kStageBatch; ++q) {
      const int i = base + q * threads, row = i / width_pad, col = i - row * width_pad;
      v[q] = (i < count && col < width) ? load_shared_state(src + row * src_ld + col) : S(0);
    }
FUSEDRNN_UNROLL
    for (int q = 0; q < kStageBatch; ++q) {
      const int i = base + q * threads, row = i / width_pad;
      if (i < count) dst[row * ld + (i - row * width_pad)] = as_half<P>(v[q]);
    }
  }
}

template <int P, typename S>
__host__ __device__ void stage_half_rows(const S* src, int rows, int width, int src_ld,
                                         int width_pad, half_bits* dst, int ld, int tid,
                                         int threads) {
  if (!stage_half_rows_wide<P>(src, rows, width, src_ld, width_pad, dst, ld, tid, threads))
    stage_half_rows_scalar<P>(src, rows, width, src_ld, width_pad, dst, ld, tid, threads);
}

// Where a product's partial sums are: slice s, output row r (forward: u*G + g; backward:
// u), sample n at part_s[at(s, r, n)]. The CUDA-core products lay them out sample-fastest,
// the tensor-core ones as their C tiles (sample rows).
struct Partials {
  idx_t slice, row, sample;
  __host__ __device__ __forceinline__ idx_t at(idx_t s, idx_t r, idx_t n) const {
    return s * slice + r * row + n * sample;
  }
};

// The most samples an item of a recurrent product covers (its accumulators: G * kMaxTile
// registers in the forward). The kernels trust the plan: tile is 1..kMaxTile
// (persistent_plan checks; a larger one would drop samples).
constexpr int kMaxTile = 4;

// An item's samples are n = ng + r*groups, r < tile: strided, not consecutive, so the
// lanes of a warp (consecutive ng) read consecutive words of a staged row for each r, as
// the untiled kernel does; consecutive samples per lane would be r-way bank conflicts
// once a warp spans more than 32/tile groups (N = 128, tile 4: 4-way).

// part_s[((s*U + u)*G + g)*ldn + n] = sum over k in slice s of W_h[g*H + j, k] h_prev[n, k]
// (j = block*U + u < H), for every slice s, unit u, gate g and sample n < N. Indices are
// 32-bit, as in stage_matrix. Samples n >= N of the last tile lane read padding of h_s
// (ldn >= groups*tile) and are never stored.
template <typename Cell, typename T>
__host__ __device__ void forward_product(const PersistentForward<T>& p, const T* w_s,
                                         const T* h_s, T* part_s, idx_t block, idx_t tid,
                                         idx_t threads) {
  constexpr int G = Cell::G;
  const int N = int(p.c.N), H = int(p.c.H), U = int(p.c.units), ldn = int(p.c.ldn);
  const int R = int(p.c.tile), S = int(p.c.slices);
  const int groups = (N + R - 1) / R, span = (H + S - 1) / S;
  for (int item = int(tid); item < S * U * groups; item += int(threads)) {
    const int ng = item % groups, u = (item / groups) % U, s = item / (groups * U);
    if (int(block) * U + u >= H) continue;   // a partial last block's idle units
    const int k0 = s * span, k1 = H < k0 + span ? H : k0 + span;
    T acc[G][kMaxTile];
FUSEDRNN_UNROLL
    for (int g = 0; g < G; ++g)
FUSEDRNN_UNROLL
      for (int r = 0; r < kMaxTile; ++r) acc[g][r] = T(0);
    for (int k = k0; k < k1; ++k) {
      const T* w = w_s + (k * U + u) * G;
      const T* h = h_s + k * ldn + ng;
      T wk[G];
FUSEDRNN_UNROLL
      for (int g = 0; g < G; ++g) wk[g] = w[g];
FUSEDRNN_UNROLL
      for (int r = 0; r < kMaxTile; ++r) {
        if (r < R) {
          const T hk = h[r * groups];
FUSEDRNN_UNROLL
          for (int g = 0; g < G; ++g) acc[g][r] += wk[g] * hk;
        }
      }
    }
FUSEDRNN_UNROLL
    for (int r = 0; r < kMaxTile; ++r) {
      if (r < R && ng + r * groups < N) {
FUSEDRNN_UNROLL
        for (int g = 0; g < G; ++g)
          part_s[((s * U + u) * G + g) * ldn + ng + r * groups] = acc[g][r];
      }
    }
  }
}

// Whether the forward runs forward_product as a phase of its own. With tile = slices = 1
// each task does its one dot product inline instead (the kernel's first form, measured:
// bench/results/gpu.md#benchmark), where the loads of x and the biases overlap it.
template <typename T>
__host__ __device__ __forceinline__ bool product_phase(const PersistentForward<T>& p) {
  return p.c.precision != kProductT || p.c.tile > 1 || p.c.slices > 1;
}

template <typename Cell, typename T>
__host__ __device__ __forceinline__ MmaOperands forward_operands(const PersistentForward<T>& p) {
  return forward_operands(Cell::G, int(p.c.H), int(p.c.N), int(p.c.units));
}

template <typename Cell, typename T>
__host__ __device__ __forceinline__ Partials forward_partials(const PersistentForward<T>& p) {
  if (p.c.precision != kProductT) {
    const MmaOperands o = forward_operands<Cell>(p);
    return Partials{o.m_rows * o.ldc, 1, o.ldc};
  }
  return Partials{p.c.units * Cell::G * p.c.ldn, p.c.ldn, 1};
}

template <typename Cell, typename T>
__host__ __device__ void forward_tasks(const PersistentForward<T>& p, const T* w_s,
                                       const T* h_s, const T* part_s, idx_t block, idx_t tid,
                                       idx_t threads, idx_t step) {
  const int G = Cell::G, S = Cell::S;
  const idx_t N = p.c.N, H = p.c.H, U = p.c.units, ldn = p.c.ldn;
  const idx_t t = p.c.forward_t(step);
  const T* h_prev = p.hs + p.c.prev_row(t) * N * H;
  T* h_next = p.hs + p.c.next_row(t) * N * H;
  const T* c_prev = p.cs + p.c.prev_row(t) * N * H;
  T* c_next = p.cs + p.c.next_row(t) * N * H;
  const StepInfo info = p.c.info(t);
  for (idx_t task = tid; task < U * N; task += threads) {
    const idx_t u = task / N, n = task % N, j = block * U + u;
    if (j >= H) continue;
    const idx_t nj = n * H + j, row = t * N + n;
    if (!info.active(n)) {   // past this sample's length: carry the state, output 0
      h_next[nj] = h_prev[nj];
      p.y[row * p.ld_y + p.y_col + j] = T(0);
      if (p.c.has_cell) c_next[nj] = c_prev[nj];
      continue;
    }
    // The loads that do not depend on this step's product go first, so their latency
    // hides behind it. h_prev[nj] was written by this same task one step earlier.
    T x[G], r[G], rec[S], h, c;
    for (int g = 0; g < G; ++g) {
      x[g] = p.xproj[row * p.ld_x + p.x_col + g * H + j] + p.bx[g * H + j];
      r[g] = p.bh[g * H + j];
    }
    const T h_old = h_prev[nj], c_old = p.c.has_cell ? c_prev[nj] : T(0);
    if (product_phase(p)) {
      const Partials at = forward_partials<Cell>(p);
      for (int g = 0; g < G; ++g) {   // the slices' partial sums, in slice order
        T acc = part_s[at.at(0, u * G + g, n)];
        for (idx_t s = 1; s < p.c.slices; ++s) acc += part_s[at.at(s, u * G + g, n)];
        r[g] += acc;
      }
    } else {
      T acc[G];
      for (int g = 0; g < G; ++g) acc[g] = T(0);
      for (idx_t k = 0; k < H; ++k) {
        const T hk = h_s[k * ldn + n];
        const T* w = w_s + (k * U + u) * G;
        for (int g = 0; g < G; ++g) acc[g] += w[g] * hk;
      }
      for (int g = 0; g < G; ++g) r[g] += acc[g];
    }
    Cell::unit_forward(x, r, h_old, c_old, info, h, c, rec);
    h_next[nj] = h;
    p.y[row * p.ld_y + p.y_col + j] = h;
    if (p.c.has_cell) c_next[nj] = c;
    if (p.has_record)
      for (int s = 0; s < S; ++s) p.saved[row * S * H + s * H + j] = rec[s];
  }
}

// The tensor-core forward (tensorcore.cuh): B = this block's W_h rows in half, staged
// once; each step A = h_{t-1} in half and the partial sums cleared, then mma_product.
template <typename T>
struct MmaShared {   // a block's shared memory under a half precision: B, A, partial sums
  half_bits *b, *a;
  T* part;
};

template <typename T>
__host__ __device__ __forceinline__ MmaShared<T> carve_mma(void* base, const MmaOperands& o) {
  half_bits* b = reinterpret_cast<half_bits*>(base);
  MmaShared<T> m = {b, b + o.b_halves(), reinterpret_cast<T*>(b + o.b_halves() + o.a_halves())};
  return m;
}

template <int P, typename Cell, typename T>
__host__ __device__ void mma_stage_weights(const PersistentForward<T>& p,
                                                   const MmaShared<T>& m, idx_t block,
                                                   idx_t tid, idx_t threads) {
  // b[(u*G + g)*ldb + k] = W_h[g*H + j, k]; 0 past H, past the block's units and in the
  // rows that pad G*U to whole tiles.
  const MmaOperands o = forward_operands<Cell>(p);
  const int G = Cell::G, H = int(p.c.H), U = int(p.c.units);
  for (int i = int(tid); i < o.n_rows * o.k; i += int(threads)) {   // k fastest: coalesced
    const int k = i % o.k, row = i / o.k, u = row / G, g = row % G, j = int(block) * U + u;
    const bool real = u < U && j < H && k < H;
    m.b[row * o.ldb + k] = to_half<P>(real ? float(p.w_h[idx_t(g * H + j) * H + k]) : 0.0f);
  }
}

template <int P, typename Cell, typename T>
__host__ __device__ void forward_mma_stage(const PersistentForward<T>& p, const MmaShared<T>& m,
                                           idx_t step, idx_t tid, idx_t threads) {
  const MmaOperands o = forward_operands<Cell>(p);
  const int N = int(p.c.N), H = int(p.c.H);
  const T* rows = p.hs + p.c.prev_row(p.c.forward_t(step)) * N * H;
  stage_half_rows<P>(rows, N, H, H, o.k, m.a, o.lda, int(tid), int(threads));
  for (int i = int(tid); i < int(p.c.slices) * o.m_rows * o.ldc; i += int(threads))
    m.part[i] = T(0);
}

// ---- backward phases ----

template <typename Cell, typename T>
__host__ __device__ __forceinline__ MmaOperands backward_operands(const PersistentBackward<T>& p) {
  return backward_operands(Cell::G, int(p.c.H), int(p.c.N), int(p.c.units), int(p.chunk));
}

template <typename Cell, typename T>
__host__ __device__ __forceinline__ Partials backward_partials(const PersistentBackward<T>& p) {
  if (p.c.precision != kProductT) {
    const MmaOperands o = backward_operands<Cell>(p);
    return Partials{o.m_rows * o.ldc, 1, o.ldc};
  }
  return Partials{p.c.units * p.c.ldn, p.c.ldn, 1};
}

template <typename Cell, typename T>
__host__ __device__ void backward_stage_weights(const PersistentBackward<T>& p, T* w_s,
                                                idx_t block, idx_t tid, idx_t threads) {
  // w_s[r*U + u] = W_h[r, j]: column j of W_h, the weights from h_j to every gate row r.
  const idx_t H = p.c.H, U = p.c.units;
  for (idx_t i = tid; i < Cell::G * H * U; i += threads) {
    idx_t r = i / U, u = i % U, j = block * U + u;
    w_s[i] = j < H ? p.w_h[r * H + j] : T(0);
  }
}

// The recurrent product dh_rec[n, j] = sum_r dg_later[n, r] W_h[r, j] in chunks: every
// block needs all of dg_later (G*H x N), so each chunk of rows is read from L2 once per
// block into shared memory (coalesced) and then shared by the block's U units, instead
// of each task re-reading it. Within a chunk an item (s, u, n-group) sums slice s of the
// chunk's rows for `tile` samples of unit u (a register tile, its samples strided as in
// the forward) into
// its own slots part_s[(s*U + u)*ldn + n], which gather the step's chunks; the cell
// phase adds a unit's S slots in slice order.

template <typename Cell, typename T>
__host__ __device__ void backward_clear(const PersistentBackward<T>& p, T* part_s, idx_t tid,
                                        idx_t threads) {
  const MmaOperands o = backward_operands<Cell>(p);
  const idx_t count = p.c.slices * (p.c.precision != kProductT ? idx_t(o.m_rows) * o.ldc
                                                               : p.c.units * p.c.ldn);
  for (idx_t i = tid; i < count; i += threads) part_s[i] = T(0);
}

template <typename Cell, typename T>
__host__ __device__ void stage_exchange(const PersistentBackward<T>& p, T* x_s, idx_t step,
                                        idx_t first, idx_t tid, idx_t threads) {
  // x_s[(r - first)*ldn + n] = dg_later[n, r] for rows first .. first+chunk-1: exchange
  // is stored (G*H, N), so this is a plain copy of `rows` rows into rows of stride ldn.
  const idx_t N = p.c.N, GH = Cell::G * p.c.H;
  const idx_t rows = GH - first < p.chunk ? GH - first : p.chunk;
  const T* later = p.exchange + ((step + 1) % 2) * GH * N + first * N;   // previous step's
  stage_matrix(later, int(rows * N), int(N), x_s, int(p.c.ldn), 1, int(tid), int(threads));
}

template <typename Cell, typename T>
__host__ __device__ void backward_accumulate(const PersistentBackward<T>& p, const T* w_s,
                                             const T* x_s, T* part_s, idx_t block, idx_t tid,
                                             idx_t threads, idx_t first) {
  const int N = int(p.c.N), H = int(p.c.H), U = int(p.c.units), ldn = int(p.c.ldn);
  const int GH = Cell::G * H, R = int(p.c.tile), S = int(p.c.slices);
  const int rows = GH - int(first) < int(p.chunk) ? GH - int(first) : int(p.chunk);
  const int groups = (N + R - 1) / R, span = (rows + S - 1) / S;
  const T* w_rows = w_s + first * U;
  // One sample per task and no slices (the default plan): the same sums in the same order
  // as the tiled loop below, whose predicated tile lanes take several times the
  // instructions per row at R = S = 1 (bench/results/gpu.md#the-backwards-dh-product-at-tile-1-1).
#if !defined(FUSEDRNN_TILED_DH)   // (FUSEDRNN_GPU_TILED_DH=1, persistent.py: to compare)
  if (R == 1 && S == 1) {
    for (int task = int(tid); task < U * N; task += int(threads)) {
      const int u = task / N, n = task % N;
      if (int(block) * U + u >= H) continue;
      T part[4] = {T(0), T(0), T(0), T(0)};
      int r = 0;
      for (; r + 4 <= rows; r += 4)
FUSEDRNN_UNROLL
        for (int q = 0; q < 4; ++q) part[q] += x_s[(r + q) * ldn + n] * w_rows[(r + q) * U + u];
      for (; r < rows; ++r) part[0] += x_s[r * ldn + n] * w_rows[r * U + u];
      part_s[u * ldn + n] += (part[0] + part[1]) + (part[2] + part[3]);
    }
    return;
  }
#endif
  for (int item = int(tid); item < S * U * groups; item += int(threads)) {
    const int ng = item % groups, u = (item / groups) % U, s = item / (groups * U);
    if (int(block) * U + u >= H) continue;
    const int r0 = s * span, r1 = rows < r0 + span ? rows : r0 + span;
    T part[4][kMaxTile];   // 4 independent chains per sample, not one long one
FUSEDRNN_UNROLL
    for (int q = 0; q < 4; ++q)
FUSEDRNN_UNROLL
      for (int i = 0; i < kMaxTile; ++i) part[q][i] = T(0);
    int r = r0;
    for (; r + 4 <= r1; r += 4)
FUSEDRNN_UNROLL
      for (int q = 0; q < 4; ++q) {
        const T w = w_rows[(r + q) * U + u];
        const T* x = x_s + (r + q) * ldn + ng;
FUSEDRNN_UNROLL
        for (int i = 0; i < kMaxTile; ++i)
          if (i < R) part[q][i] += x[i * groups] * w;
      }
    for (; r < r1; ++r) {
      const T w = w_rows[r * U + u];
      const T* x = x_s + r * ldn + ng;
FUSEDRNN_UNROLL
      for (int i = 0; i < kMaxTile; ++i)
        if (i < R) part[0][i] += x[i * groups] * w;
    }
FUSEDRNN_UNROLL
    for (int i = 0; i < kMaxTile; ++i)
      if (i < R && ng + i * groups < N)
        part_s[(s * U + u) * ldn + ng + i * groups] +=
            (part[0][i] + part[1][i]) + (part[2][i] + part[3][i]);
  }
}

// Writes gate row r of sample n into this step's half of the exchange: (G*H, N) values of
// T, or with a half precision P (N, G*H) halves (the tensor-core product's A rows).
template <int P, typename T>
__host__ __device__ __forceinline__ void exchange_store(T* exchange, idx_t step, idx_t GH,
                                                        idx_t N, idx_t r, idx_t n, T v) {
  if (P == kProductT)
    exchange[(step % 2) * GH * N + r * N + n] = v;
  else
    reinterpret_cast<half_bits*>(exchange)[(step % 2) * GH * N + n * GH + r] =
        to_half<P>(float(v));
}

template <typename Cell, typename T, int P = kProductT>
__host__ __device__ void backward_tasks(const PersistentBackward<T>& p, const T* part_s,
                                        idx_t block, idx_t tid, idx_t threads, idx_t step) {
  const int G = Cell::G, S = Cell::S;
  const idx_t N = p.c.N, H = p.c.H, U = p.c.units, GH = G * H;
  const idx_t t = p.c.forward_t(p.c.steps - 1 - step);
  const StepInfo info = p.c.info(t);
  const Partials at = backward_partials<Cell>(p);
  for (idx_t task = tid; task < U * N; task += threads) {
    const idx_t u = task / N, n = task % N, j = block * U + u;
    if (j >= H) continue;
    const idx_t nj = n * H + j, row = t * N + n;
    T dh_rec = step == 0 ? p.dh_rec0[nj] : part_s[at.at(0, u, n)];
    if (step > 0)   // the slices' partial sums, in slice order
      for (idx_t s = 1; s < p.c.slices; ++s) dh_rec += part_s[at.at(s, u, n)];
    T* dgx = p.dgx + row * p.ld_dg + p.col + j;
    T* dgh = p.dgh + row * p.ld_dg + p.col + j;
    if (!info.active(n)) {   // no gate gradient; dh and dc pass on to the step before
      for (int g = 0; g < G; ++g) {
        dgx[g * H] = T(0);
        if (p.has_dgh) dgh[g * H] = T(0);
        exchange_store<P>(p.exchange, step, GH, N, g * H + j, n, T(0));
      }
      p.dh_carry[nj] += dh_rec;
      continue;
    }
    T rec[S], dx[G], dr[G], dh_c, dc_c;
    for (int s = 0; s < S; ++s) rec[s] = p.saved[row * S * H + s * H + j];
    const T* h_prev = p.hs + p.c.prev_row(t) * N * H;
    const T* c_prev = p.cs + p.c.prev_row(t) * N * H;
    const T* c_t = p.cs + p.c.next_row(t) * N * H;
    const bool has_cell = p.c.has_cell;
    Cell::unit_backward(p.dy[row * p.ld_dy + p.y_col + j] + dh_rec + p.dh_carry[nj],
                        has_cell ? p.dc_carry[nj] : T(0), rec, h_prev[nj],
                        has_cell ? c_prev[nj] : T(0), has_cell ? c_t[nj] : T(0), info, dx, dr,
                        dh_c, dc_c);
    for (int g = 0; g < G; ++g) {
      dgx[g * H] = dx[g];
      if (p.has_dgh) dgh[g * H] = dr[g];
      exchange_store<P>(p.exchange, step, GH, N, g * H + j, n, dr[g]);
    }
    p.dh_carry[nj] = dh_c;
    if (has_cell) p.dc_carry[nj] = dc_c;
  }
}

// The tensor-core backward (tensorcore.cuh): B = this block's W_h columns in half, staged
// once; per chunk of gate rows A = those rows of the previous step's exchange (already
// half), then mma_product adds into the step's partial sums (backward_clear zeroes them).
template <int P, typename Cell, typename T>
__host__ __device__ void mma_stage_weights(const PersistentBackward<T>& p,
                                                    const MmaShared<T>& m, idx_t block,
                                                    idx_t tid, idx_t threads) {
  // b[u*ldb + r] = W_h[r, j]; 0 past G*H (to whole k-steps), past the block's units and
  // in the rows that pad U to a whole tile. u fastest: the reads are coalesced.
  const MmaOperands o = backward_operands<Cell>(p);
  const int H = int(p.c.H), U = int(p.c.units), GH = Cell::G * H, k = round_up(GH, 16);
  for (int i = int(tid); i < o.n_rows * k; i += int(threads)) {
    const int u = i % o.n_rows, r = i / o.n_rows, j = int(block) * U + u;
    const bool real = u < U && j < H && r < GH;
    m.b[u * o.ldb + r] = to_half<P>(real ? float(p.w_h[idx_t(r) * H + j]) : 0.0f);
  }
}

template <int P, typename Cell, typename T>
__host__ __device__ void backward_mma_chunk(const PersistentBackward<T>& p, const MmaShared<T>& m,
                                            idx_t step, idx_t first, idx_t tid, idx_t threads) {
  // A[n][c] = dg_later[n, first + c] for c < rows, 0 up to the next k-step.
  const MmaOperands o = backward_operands<Cell>(p);
  const int N = int(p.c.N), GH = Cell::G * int(p.c.H);
  const int rows = GH - int(first) < int(p.chunk) ? GH - int(first) : int(p.chunk);
  const half_bits* later = reinterpret_cast<const half_bits*>(p.exchange) +
                           ((step + 1) % 2) * idx_t(GH) * N + first;   // previous step's
  stage_half_rows<P>(later, N, rows, GH, round_up(rows, 16), m.a, o.lda, int(tid), int(threads));
}

template <int P, typename Cell, typename T>
__host__ __device__ void backward_mma_product(const PersistentBackward<T>& p,
                                              const MmaShared<T>& m, idx_t first, idx_t tid,
                                              idx_t threads) {
  const MmaOperands o = backward_operands<Cell>(p);
  const int GH = Cell::G * int(p.c.H);
  const int rows = GH - int(first) < int(p.chunk) ? GH - int(first) : int(p.chunk);
  mma_product<P>(o, m.a, m.b + first, m.part, rows, int(p.c.slices), int(tid), int(threads));
}

#ifdef __CUDACC__
// A grid-wide barrier on one 64-bit counter (zeroed by the host before each launch;
// `arrivals` counts this block's barriers so far). The launch is cooperative, so every
// block is resident and the spin cannot deadlock. Our own rather than
// cooperative_groups::grid_group::sync(): CUDA 13's cooperative_groups.h needs C++17 and
// a toolkit include path that CuPy's NVRTC builds may not have; the pattern is the same
// (block barrier, one thread fences and arrives, spins until all have, fences again).
__device__ __forceinline__ void grid_barrier(unsigned long long* counter,
                                             unsigned long long& arrivals) {
  __syncthreads();
  arrivals += 1;
  if (threadIdx.x == 0) {
    __threadfence();   // this block's writes are visible before it arrives
    atomicAdd(counter, 1ULL);
    const unsigned long long target = arrivals * gridDim.x;
    while (*reinterpret_cast<volatile unsigned long long*>(counter) < target) {
    }
    __threadfence();
  }
  __syncthreads();
}

// At most one block per SM (the host checks co-residency): __launch_bounds__(512, 1) lets
// the compiler spend up to 128 registers per thread at 512 threads. Without the 1 ptxas
// kept some instantiations at 64 registers and spilled once the tensor-core paths joined.
extern __shared__ __align__(16) double persistent_smem[];   // aligned for either T and vector loads

// The forward and the backward with their products on tensor cores (precision P; the
// phases above).
template <int P, typename Cell, typename T>
__device__ void mma_loop(unsigned long long* barrier, const PersistentForward<T>& p) {
  const MmaOperands o = forward_operands<Cell>(p);
  const MmaShared<T> m = carve_mma<T>(persistent_smem, o);
  unsigned long long arrivals = 0;
  mma_stage_weights<P, Cell>(p, m, blockIdx.x, threadIdx.x, blockDim.x);
  for (idx_t step = 0; step < p.c.steps; ++step) {
    FUSEDRNN_PHASE_START(since);
    forward_mma_stage<P, Cell>(p, m, step, threadIdx.x, blockDim.x);
    __syncthreads();   // (on the first step the weights too)
    FUSEDRNN_PHASE_MARK(0, since);
    mma_product<P>(o, m.a, m.b, m.part, int(p.c.H), int(p.c.slices), threadIdx.x, blockDim.x);
    __syncthreads();
    forward_tasks<Cell, T>(p, nullptr, nullptr, m.part, blockIdx.x, threadIdx.x, blockDim.x,
                           step);
    FUSEDRNN_PHASE_MARK(1, since);
    grid_barrier(barrier, arrivals);
    FUSEDRNN_PHASE_MARK(2, since);
  }
}

template <int P, typename Cell, typename T>
__device__ void mma_loop(unsigned long long* barrier, const PersistentBackward<T>& p) {
  const MmaShared<T> m = carve_mma<T>(persistent_smem, backward_operands<Cell>(p));
  unsigned long long arrivals = 0;
  mma_stage_weights<P, Cell>(p, m, blockIdx.x, threadIdx.x, blockDim.x);
  __syncthreads();
  for (idx_t step = 0; step < p.c.steps; ++step) {
    FUSEDRNN_PHASE_START(since);
    if (step > 0) {
      backward_clear<Cell>(p, m.part, threadIdx.x, blockDim.x);
      for (idx_t first = 0; first < Cell::G * p.c.H; first += p.chunk) {
        backward_mma_chunk<P, Cell>(p, m, step, first, threadIdx.x, blockDim.x);
        __syncthreads();
        backward_mma_product<P, Cell>(p, m, first, threadIdx.x, blockDim.x);
        __syncthreads();   // A is restaged next
      }
    }
    FUSEDRNN_PHASE_MARK(0, since);
    backward_tasks<Cell, T, P>(p, m.part, blockIdx.x, threadIdx.x, blockDim.x, step);
    FUSEDRNN_PHASE_MARK(1, since);
    grid_barrier(barrier, arrivals);   // every block's gate gradients are in `exchange`
    FUSEDRNN_PHASE_MARK(2, since);
  }
}

// The tensor-core loops serve float arrays only (their partial sums are 4 bytes wide in
// mma_smem_bytes): true where one ran; for double arrays false, the host never plans
// them there.
template <typename Cell, template <typename> class Params>
__device__ __forceinline__ bool on_tensor_cores(unsigned long long* barrier,
                                                const Params<float>& p) {
  if (p.c.precision == kProductF16) mma_loop<kProductF16, Cell>(barrier, p);
  else if (p.c.precision == kProductBF16) mma_loop<kProductBF16, Cell>(barrier, p);
  return p.c.precision != kProductT;
}
template <typename Cell, template <typename> class Params>
__device__ __forceinline__ bool on_tensor_cores(unsigned long long*, const Params<double>&) {
  return false;
}

template <typename Cell, typename T>
__global__ void __launch_bounds__(512, 1) persistent_forward(unsigned long long* barrier,
                                                          FUSEDRNN_PERSISTENT_FORWARD_PARAMS(T)) {
  const PersistentForward<T> p = FUSEDRNN_PERSISTENT_FORWARD_INIT;
  if (on_tensor_cores<Cell>(barrier, p)) return;
  unsigned long long arrivals = 0;
  T* w_s = reinterpret_cast<T*>(persistent_smem);
  T* h_s = w_s + H * Cell::G * units;
  T* part_s = h_s + H * ldn;
  forward_stage_weights<Cell, T>(p, w_s, blockIdx.x, threadIdx.x, blockDim.x);
  for (idx_t step = 0; step < steps; ++step) {
    FUSEDRNN_PHASE_START(since);
    stage_state(p, h_s, step, threadIdx.x, blockDim.x);
    __syncthreads();
    FUSEDRNN_PHASE_MARK(0, since);
    if (product_phase(p)) {   // the same for every thread: the barrier is reached by all
      forward_product<Cell, T>(p, w_s, h_s, part_s, blockIdx.x, threadIdx.x, blockDim.x);
      __syncthreads();   // every item's partial sums are in part_s
    }
    forward_tasks<Cell, T>(p, w_s, h_s, part_s, blockIdx.x, threadIdx.x, blockDim.x, step);
    FUSEDRNN_PHASE_MARK(1, since);
    grid_barrier(barrier, arrivals);   // every block's h_t is written before anyone stages it
    FUSEDRNN_PHASE_MARK(2, since);
  }
}

template <typename Cell, typename T>
__global__ void __launch_bounds__(512, 1) persistent_backward(unsigned long long* barrier,
                                                           FUSEDRNN_PERSISTENT_BACKWARD_PARAMS(T)) {
  const PersistentBackward<T> p = FUSEDRNN_PERSISTENT_BACKWARD_INIT;
  if (on_tensor_cores<Cell>(barrier, p)) return;
  unsigned long long arrivals = 0;
  T* w_s = reinterpret_cast<T*>(persistent_smem);
  T* x_s = w_s + Cell::G * H * units;
  T* part_s = x_s + chunk * ldn;
  backward_stage_weights<Cell, T>(p, w_s, blockIdx.x, threadIdx.x, blockDim.x);
  __syncthreads();
  for (idx_t step = 0; step < steps; ++step) {
    FUSEDRNN_PHASE_START(since);
    if (step > 0) {
      backward_clear<Cell>(p, part_s, threadIdx.x, blockDim.x);
      for (idx_t first = 0; first < Cell::G * H; first += chunk) {
        stage_exchange<Cell, T>(p, x_s, step, first, threadIdx.x, blockDim.x);
        __syncthreads();
        backward_accumulate<Cell, T>(p, w_s, x_s, part_s, blockIdx.x, threadIdx.x, blockDim.x,
                                     first);
        __syncthreads();   // x_s is restaged next
      }
    }
    FUSEDRNN_PHASE_MARK(0, since);
    backward_tasks<Cell, T>(p, part_s, blockIdx.x, threadIdx.x, blockDim.x, step);
    FUSEDRNN_PHASE_MARK(1, since);
    grid_barrier(barrier, arrivals);   // every block's gate gradients are in `exchange`
    FUSEDRNN_PHASE_MARK(2, since);
  }
}
#endif

}  // namespace fusedrnn
