// The persistent kernels' recurrent products on tensor cores, for float16 and bfloat16
// data (issue 25; the host side: fusedrnn/gpu/persistent.py, persistent_plan's precision).
//
// Why: in half precision the product is what tensor cores do (mma.sync m16n8k16, f32
// accumulators; sm_80 and later), and half-width operands halve the shared memory a block
// keeps W_h in. The op keeps its arrays in float32 between its conversions (config.
// PRECISIONS): state, cell math, record and partial sums stay float32; the operands are
// rounded to the data's half type as they are staged into shared memory, as the CPU's
// bfloat16 path rounds h_{t-1} for vdpbf16ps. W_h came from half data, so its rounding
// is exact.
//
// Both products are C (M x N, float) = A (M x K) B^T with A and B half, k-contiguous rows
// in shared memory (MmaOperands); the C tiles go to float partial sums per slice of k,
// which the cell tasks add in slice order (persistent.cuh's Partials):
//   forward   A = the staged state, row n = h_{t-1}[n, :]   (samples x H)
//             B = this block's W_h rows, row u*G + g = W_h[g*H + j, :]   (G*U x H)
//   backward  A = a staged chunk of the previous step's gate gradients, row n =
//             dg_later[n, first .. first+chunk)   (samples x chunk)
//             B = this block's W_h columns, row u = W_h[:, j]   (U x G*H)
// Padding: A's rows past N and B's rows past G*U (or U) are never stored from C, so they
// may hold anything (the host harness fills them with NaN); k past the real extent is 0
// in both operands (0 * NaN would not be 0).
//
// Every row stride (lda, ldb) is an odd multiple of 8 halves: the 8 row groups of a
// fragment load then start 4 banks apart (conflict-free 32-bit loads); the partial sums'
// stride is odd, so the cell tasks' reads (one sample per lane) hit distinct banks.
#pragma once

#include "cells.cuh"

#ifndef __CUDACC__
#include <cstring>
#endif

namespace fusedrnn {

// PersistentCommon::precision: what the recurrent products multiply.
enum ProductPrecision { kProductT = 0, kProductF16 = 1, kProductBF16 = 2 };

typedef unsigned short half_bits;   // a float16 or bfloat16 value as stored

__host__ __device__ __forceinline__ int round_up(int x, int to) { return (x + to - 1) / to * to; }

// ---- conversions (round to nearest even; NaN stays NaN) ----

#ifndef __CUDACC__
inline unsigned float_bits(float v) {
  unsigned x;
  std::memcpy(&x, &v, 4);
  return x;
}
inline float bits_float(unsigned x) {
  float v;
  std::memcpy(&v, &x, 4);
  return v;
}
inline half_bits host_to_f16(float v) {
  const unsigned x = float_bits(v), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return half_bits(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return half_bits(sign | 0x7c00u);   // rounds to 65520 or more: inf
  const int e = int(ax >> 23);
  unsigned mant = ax & 0x7fffffu, r, rem, tie;
  if (e < 113) {   // below 2^-14: a subnormal half, in units of 2^-24
    const int shift = 126 - e;
    if (e == 0 || shift > 24) return half_bits(sign);
    mant |= 0x800000u;
    r = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    tie = 1u << (shift - 1);
  } else {
    r = (unsigned(e - 112) << 10) | (mant >> 13);
    rem = mant & 0x1fffu;
    tie = 0x1000u;
  }
  if (rem > tie || (rem == tie && (r & 1u))) ++r;   // a carry into the exponent is right
  return half_bits(sign | r);
}
inline half_bits host_to_bf16(float v) {
  const unsigned x = float_bits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return half_bits((x >> 16) | 0x40u);
  return half_bits((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float host_f16_value(half_bits h) {
  const unsigned sign = unsigned(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return (sign ? -1.0f : 1.0f) * float(m) * 5.9604644775390625e-8f;   // 2^-24
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}
#endif

// The instructions below exist from sm_80 (cvt.rn.bf16.f32, mma.sync with bf16). The
// kernels are also built for older devices (their float32 paths), where the host never
// plans a half precision (persistent.py: compute capability 8.0): there these trap.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FUSEDRNN_NO_TENSOR_CORES 1
#endif

template <int P>
__host__ __device__ __forceinline__ half_bits to_half(float v) {
#if defined(FUSEDRNN_NO_TENSOR_CORES)
  __trap();
  return 0;
#elif defined(__CUDACC__)
  unsigned short r;
  if (P == kProductBF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
#else
  return P == kProductBF16 ? host_to_bf16(v) : host_to_f16(v);
#endif
}

// ---- the shared-memory operands and their layout ----

// Sizes in elements; every region starts 16-byte aligned.
struct MmaOperands {
  int m_rows, n_rows, k;   // A (m_rows x lda), B (n_rows x ldb): m_rows a multiple of 16,
  int lda, ldb, ldc;       // n_rows of 8, k of 16; C partials (slices x m_rows x ldc)
  __host__ __device__ __forceinline__ int a_halves() const { return m_rows * lda; }
  __host__ __device__ __forceinline__ int b_halves() const { return n_rows * ldb; }
};

// The forward product's operands for a block of `units` units (persistent.py's
// _mma_forward mirrors these sizes; a host test compares them).
__host__ __device__ __forceinline__ MmaOperands forward_operands(int G, int H, int N, int units) {
  const int k = round_up(H, 16), n_rows = round_up(G * units, 8);
  MmaOperands o = {round_up(N, 16), n_rows, k, k + 8, k + 8, n_rows + 1};
  return o;
}

// The backward product's, for chunks of `chunk` gate rows (a multiple of 16): A holds one
// chunk, B every gate row (persistent.py's _mma_backward).
__host__ __device__ __forceinline__ MmaOperands backward_operands(int G, int H, int N, int units,
                                                                  int chunk) {
  const int n_rows = round_up(units, 8);
  MmaOperands o = {round_up(N, 16), n_rows, chunk, chunk + 8, round_up(G * H, 16) + 8,
                   n_rows + 1};
  return o;
}

// Bytes of shared memory: B (kept for the whole sequence), A (restaged every step or
// chunk), then `slices` float partial-sum tiles.
__host__ __device__ __forceinline__ long long mma_smem_bytes(const MmaOperands& o, int slices) {
  return 2LL * (o.b_halves() + o.a_halves()) + 4LL * slices * o.m_rows * o.ldc;
}

// ---- one warp's 16 x 8 tile ----
//
// mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16" with .f16/.bf16): lane
// = 4*g + t holds A at rows g, g+8 and k pairs 2t, 2t+8; B at column (here: B row) g and
// k pairs 2t, 2t+8; C at rows g, g+8, columns 2t, 2t+1. A k pair is two adjacent halves
// of a k-contiguous row: one 32-bit load.

struct Fragments {
  unsigned a[4], b[2];
};

__host__ __device__ __forceinline__ unsigned load_pair(const half_bits* p) {
#ifdef __CUDACC__
  return *reinterpret_cast<const unsigned*>(p);
#else
  unsigned v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

// This lane's fragments of the k-step at `k` of A's rows m0.. and B's rows n0...
__host__ __device__ __forceinline__ void load_fragments(const half_bits* a, int lda,
                                                        const half_bits* b, int ldb, int k,
                                                        int lane, Fragments& f) {
  const int g = lane >> 2, t = lane & 3;
  const half_bits* a0 = a + g * lda + k + 2 * t;
  const half_bits* a8 = a0 + 8 * lda;
  const half_bits* b0 = b + g * ldb + k + 2 * t;
  f.a[0] = load_pair(a0);
  f.a[1] = load_pair(a8);
  f.a[2] = load_pair(a0 + 8);
  f.a[3] = load_pair(a8 + 8);
  f.b[0] = load_pair(b0);
  f.b[1] = load_pair(b0 + 8);
}

#ifdef __CUDACC__
template <int P>
__device__ __forceinline__ void mma_16816(float c[4], const Fragments& f) {
#if defined(FUSEDRNN_NO_TENSOR_CORES)
  __trap();
#else
  if (P == kProductBF16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(f.a[0]), "r"(f.a[1]), "r"(f.a[2]), "r"(f.a[3]), "r"(f.b[0]), "r"(f.b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(f.a[0]), "r"(f.a[1]), "r"(f.a[2]), "r"(f.a[3]), "r"(f.b[0]), "r"(f.b[1]));
#endif
}
#else
// The host's stand-in for the warp instruction: it gathers all 32 lanes' fragments (the
// same load_fragments the device runs), places them by the PTX layout above, and returns
// this lane's four sums. So a host test checks the loads' addressing against the layout.
template <int P>
inline float half_value(unsigned pair, int half) {
  const half_bits h = half_bits(half ? pair >> 16 : pair & 0xffffu);
  return P == kProductBF16 ? bits_float(unsigned(h) << 16) : host_f16_value(h);
}
template <int P>
inline void emulated_mma(float c[4], const half_bits* a, int lda, const half_bits* b, int ldb,
                         int k, int lane) {
  float A[16][16], B[8][16];
  for (int l = 0; l < 32; ++l) {
    Fragments f;
    load_fragments(a, lda, b, ldb, k, l, f);
    const int g = l >> 2, t = l & 3;
    for (int q = 0; q < 4; ++q)
      for (int h = 0; h < 2; ++h)
        A[g + 8 * (q & 1)][2 * t + 8 * (q >> 1) + h] = half_value<P>(f.a[q], h);
    for (int q = 0; q < 2; ++q)
      for (int h = 0; h < 2; ++h) B[g][2 * t + 8 * q + h] = half_value<P>(f.b[q], h);
  }
  const int g = lane >> 2, t = lane & 3;
  for (int q = 0; q < 4; ++q) {
    const int row = g + 8 * (q >> 1), col = 2 * t + (q & 1);
    float sum = 0.0f;
    for (int kk = 0; kk < 16; ++kk) sum += A[row][kk] * B[col][kk];
    c[q] += sum;
  }
}
#endif

// c += this lane's share of A[0..16, k..k+16) B[0..8, k..k+16)^T.
template <int P>
__host__ __device__ __forceinline__ void mma_step(float c[4], const half_bits* a, int lda,
                                                  const half_bits* b, int ldb, int k, int lane) {
#ifdef __CUDACC__
  Fragments f;
  load_fragments(a, lda, b, ldb, k, lane, f);
  mma_16816<P>(c, f);
#else
  emulated_mma<P>(c, a, lda, b, ldb, k, lane);
#endif
}

// C tile (m0, n0) over k in [k0, k1) (multiples of 16) of A and B, added to the float
// partial sums `part` (row stride ldc); every lane of the warp calls it alike. Two
// accumulator sets over alternate k-steps keep two mma chains in flight.
template <int P, typename T>
__host__ __device__ void warp_tile(const MmaOperands& o, const half_bits* a, const half_bits* b,
                                   T* part, int m0, int n0, int k0, int k1, int lane) {
  const half_bits* at = a + m0 * o.lda;
  const half_bits* bt = b + n0 * o.ldb;
  float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
  int k = k0;
  for (; k + 16 < k1; k += 32) {   // (named sets: an index chosen at run time would put
    mma_step<P>(c0, at, o.lda, bt, o.ldb, k, lane);   // them in local memory)
    mma_step<P>(c1, at, o.lda, bt, o.ldb, k + 16, lane);
  }
  if (k < k1) mma_step<P>(c0, at, o.lda, bt, o.ldb, k, lane);
  const int g = lane >> 2, t = lane & 3;
FUSEDRNN_UNROLL
  for (int q = 0; q < 4; ++q) {
    const int row = m0 + g + 8 * (q >> 1), col = n0 + 2 * t + (q & 1);
    part[row * o.ldc + col] += T(c0[q] + c1[q]);
  }
}

// Every C tile of the product, each over `slices` slices of k (a slice may be empty), as
// items (slice, m-tile, n-tile) spread over the block's warps; slice s adds into
// part + s * m_rows * ldc, which the caller zeroed. Within a block no two warps share an
// item, so the additions need no atomics.
template <int P, typename T>
__host__ __device__ void mma_product(const MmaOperands& o, const half_bits* a, const half_bits* b,
                                     T* part, int k_extent, int slices, int tid, int threads) {
  const int mt = o.m_rows / 16, nt = o.n_rows / 8, steps = round_up(k_extent, 16) / 16;
  const int per = (steps + slices - 1) / slices, warp = tid / 32, lane = tid % 32;
  for (int item = warp; item < slices * mt * nt; item += threads / 32) {
    const int n = item % nt, m = (item / nt) % mt, s = item / (nt * mt);
    const int k0 = s * per * 16, k1 = (s + 1) * per < steps ? (s + 1) * per * 16 : steps * 16;
    if (k0 < k1)
      warp_tile<P>(o, a, b, part + s * o.m_rows * o.ldc, m * 16, n * 8, k0, k1, lane);
  }
}

}  // namespace fusedrnn
