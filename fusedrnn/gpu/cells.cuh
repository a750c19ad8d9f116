// Per-step pointwise cell math for the GPU backend: one forward/backward pair per cell.
//
// The same contract as the CPU kernels (fusedrnn/cpu/cells.py: its docstring documents
// every argument's shape, direction and aliasing rule), so the shared driver
// (fusedrnn/recurrence.py) runs unchanged on CuPy arrays. Here every 2-D argument is a
// row-major matrix given as (pointer, ld): element (n, j) is p[n * ld + j]. ld == 0 marks
// an optional argument as absent (read as zeros, never written), which is how the
// host-side packing (fusedrnn/gpu/kernels.py) passes the CPU contract's (0, 0)
// placeholders. lengths is (pointer, count): count 0 means every sample runs all T steps.
// T is float or double; math is done in T. clip_flags: bit 0 clips the LSTM cell state
// to [clip_lo, clip_hi], bit 1 turns a NaN into clip_lo.
//
// forward_step<Cell, T>(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved,
//                       lengths, n_lengths, t, clip_lo, clip_hi, clip_flags, N, H)
// backward_step<Cell, T>(dy, dh_rec, dh_carry_in, dc_carry_in, saved, h_prev, c_prev, c_t,
//                        dgx, dgh, dh_carry_out, dc_carry_out,
//                        lengths, n_lengths, t, clip_lo, clip_hi, clip_flags, N, H)
// (each matrix followed by its ld; see FUSEDRNN_*_PARAMS below). One thread per (n, j).
#pragma once

#ifndef __CUDACC__  // built as plain C++ for the host-side tests (tests/gpu/)
#define __host__
#define __device__
#define __forceinline__ inline
#include <cmath>
using std::exp;
using std::tanh;
#endif

namespace fusedrnn {

typedef long long idx_t;

template <typename T>
struct Mat {  // a row-major matrix view: (n, j) -> p[n * ld + j]
  T* p;
  idx_t ld;
  __host__ __device__ __forceinline__ T& operator()(idx_t n, idx_t j) const { return p[n * ld + j]; }
};

template <typename T>
__host__ __device__ __forceinline__ T sigmoid(T x) { return T(1) / (T(1) + exp(-x)); }

enum { CLIP = 1, CLIP_NAN = 2 };

struct StepInfo {  // what decides whether a sample is active, and the clip
  const idx_t* lengths;
  idx_t n_lengths, t;
  double clip_lo, clip_hi;
  idx_t clip_flags;
  __host__ __device__ __forceinline__ bool active(idx_t n) const {
    return n_lengths == 0 || t < lengths[n];
  }
  template <typename T>
  __host__ __device__ __forceinline__ T clip(T c) const {
    if (clip_flags & CLIP) {
      if (c < T(clip_lo)) c = T(clip_lo);
      else if (c > T(clip_hi)) c = T(clip_hi);
      else if ((clip_flags & CLIP_NAN) && c != c) c = T(clip_lo);
    }
    return c;
  }
  template <typename T>  // 1 where the clip let c through (its gradient flows), else 0
  __host__ __device__ __forceinline__ T unclipped(T c) const {
    if (!(clip_flags & CLIP)) return T(1);
    return (T(clip_lo) <= c && c <= T(clip_hi)) ? T(1) : T(0);
  }
};

template <typename T>
struct ForwardArgs {
  Mat<const T> gx, gh;
  const T *bx, *bh;
  Mat<const T> h_prev, c_prev;
  Mat<T> h_next, c_next, y, saved;
  StepInfo step;
  // The pre-activation of gate column `col`: both projections and both biases.
  __host__ __device__ __forceinline__ T pre(idx_t n, idx_t col) const {
    return gx(n, col) + bx[col] + gh(n, col) + bh[col];
  }
};

template <typename T>
struct BackwardArgs {
  Mat<const T> dy, dh_rec, dh_carry_in, dc_carry_in, saved, h_prev, c_prev, c_t;
  Mat<T> dgx, dgh, dh_carry_out, dc_carry_out;
  StepInfo step;
  // All gradient reaching h_t: output, recurrence, and the direct carry.
  __host__ __device__ __forceinline__ T dh(idx_t n, idx_t j) const {
    T v = dy(n, j);
    if (dh_rec.ld) v += dh_rec(n, j);
    if (dh_carry_in.ld) v += dh_carry_in(n, j);
    return v;
  }
};

// ---- cells: each is only its pointwise math for one (sample n, unit j) ----

template <bool Relu>
struct PlainCell {
  static constexpr int G = 1, S = 1;
  template <typename T>
  __host__ __device__ static void forward(const ForwardArgs<T>& a, idx_t n, idx_t j, idx_t) {
    T v = a.pre(n, j);
    T h = Relu ? (v > T(0) ? v : T(0)) : tanh(v);
    a.h_next(n, j) = h;
    a.y(n, j) = h;
    if (a.saved.ld) a.saved(n, j) = h;
  }
  template <typename T>
  __host__ __device__ static void backward(const BackwardArgs<T>& a, idx_t n, idx_t j, idx_t) {
    T h = a.saved(n, j);
    T dh = a.dh(n, j);
    a.dgx(n, j) = Relu ? (h > T(0) ? dh : T(0)) : dh * (T(1) - h * h);
    if (a.dh_carry_out.ld) a.dh_carry_out(n, j) = T(0);
  }
};
typedef PlainCell<true> ReluCell;
typedef PlainCell<false> TanhCell;

struct LstmCell {  // gates [i, f, g, o]
  static constexpr int G = 4, S = 4;
  template <typename T>
  __host__ __device__ static void forward(const ForwardArgs<T>& a, idx_t n, idx_t j, idx_t H) {
    T i = sigmoid(a.pre(n, j)), f = sigmoid(a.pre(n, H + j));
    T g = tanh(a.pre(n, 2 * H + j)), o = sigmoid(a.pre(n, 3 * H + j));
    T c = a.step.clip(f * a.c_prev(n, j) + i * g);
    T h = o * tanh(c);
    a.c_next(n, j) = c;
    a.h_next(n, j) = h;
    a.y(n, j) = h;
    if (a.saved.ld) {
      a.saved(n, j) = i;
      a.saved(n, H + j) = f;
      a.saved(n, 2 * H + j) = g;
      a.saved(n, 3 * H + j) = o;
    }
  }
  template <typename T>
  __host__ __device__ static void backward(const BackwardArgs<T>& a, idx_t n, idx_t j, idx_t H) {
    T i = a.saved(n, j), f = a.saved(n, H + j), g = a.saved(n, 2 * H + j), o = a.saved(n, 3 * H + j);
    T tc = tanh(a.c_t(n, j));
    T dh = a.dh(n, j);
    T dc = a.dc_carry_in(n, j) + dh * o * (T(1) - tc * tc);
    // The clip's gradient: 0 where the update left [lo, hi] (recomputed pre-clip value).
    dc *= a.step.unclipped(f * a.c_prev(n, j) + i * g);
    a.dgx(n, j) = dc * g * i * (T(1) - i);
    a.dgx(n, H + j) = dc * a.c_prev(n, j) * f * (T(1) - f);
    a.dgx(n, 2 * H + j) = dc * i * (T(1) - g * g);
    a.dgx(n, 3 * H + j) = dh * tc * o * (T(1) - o);
    a.dc_carry_out(n, j) = dc * f;
    if (a.dh_carry_out.ld) a.dh_carry_out(n, j) = T(0);
  }
};

struct GruCell {  // gates [r, z, n], "linear before reset": r scales W_hn h + b_hn
  static constexpr int G = 3, S = 4;
  template <typename T>
  __host__ __device__ static void forward(const ForwardArgs<T>& a, idx_t n, idx_t j, idx_t H) {
    T r = sigmoid(a.pre(n, j)), z = sigmoid(a.pre(n, H + j));
    T hn = a.gh(n, 2 * H + j) + a.bh[2 * H + j];
    T nn = tanh(a.gx(n, 2 * H + j) + a.bx[2 * H + j] + r * hn);
    T h = (T(1) - z) * nn + z * a.h_prev(n, j);
    a.h_next(n, j) = h;
    a.y(n, j) = h;
    if (a.saved.ld) {
      a.saved(n, j) = r;
      a.saved(n, H + j) = z;
      a.saved(n, 2 * H + j) = nn;
      a.saved(n, 3 * H + j) = hn;
    }
  }
  template <typename T>
  __host__ __device__ static void backward(const BackwardArgs<T>& a, idx_t n, idx_t j, idx_t H) {
    T r = a.saved(n, j), z = a.saved(n, H + j), nn = a.saved(n, 2 * H + j), hn = a.saved(n, 3 * H + j);
    T dh = a.dh(n, j);
    T dn = dh * (T(1) - z) * (T(1) - nn * nn);
    T dr = dn * hn * r * (T(1) - r);
    T dz = dh * (a.h_prev(n, j) - nn) * z * (T(1) - z);
    a.dgx(n, j) = dr;
    a.dgx(n, H + j) = dz;
    a.dgx(n, 2 * H + j) = dn;
    a.dgh(n, j) = dr;
    a.dgh(n, H + j) = dz;
    a.dgh(n, 2 * H + j) = dn * r;
    a.dh_carry_out(n, j) = dh * z;
  }
};

// ---- an inactive step (past the sample's length) is the same for every cell ----

template <typename T>
__host__ __device__ __forceinline__ void carry_state(const ForwardArgs<T>& a, idx_t n, idx_t j) {
  a.h_next(n, j) = a.h_prev.ld ? a.h_prev(n, j) : T(0);
  a.y(n, j) = T(0);
  if (a.c_next.ld) a.c_next(n, j) = a.c_prev(n, j);
}

template <typename T>
__host__ __device__ __forceinline__ void carry_grads(const BackwardArgs<T>& a, int gates,
                                                     idx_t n, idx_t j, idx_t H) {
  for (int g = 0; g < gates; ++g) {
    a.dgx(n, g * H + j) = T(0);
    if (a.dgh.ld) a.dgh(n, g * H + j) = T(0);
  }
  if (a.dh_carry_out.ld)
    a.dh_carry_out(n, j) = (a.dh_rec.ld ? a.dh_rec(n, j) : T(0)) +
                           (a.dh_carry_in.ld ? a.dh_carry_in(n, j) : T(0));
  if (a.dc_carry_out.ld) a.dc_carry_out(n, j) = a.dc_carry_in(n, j);
}

// ---- one element of a step: shared by the kernels below and the host-side tests ----

#define FUSEDRNN_STEP_PARAMS                                                              \
  const idx_t *lengths, idx_t n_lengths, idx_t t, double clip_lo, double clip_hi,        \
      idx_t clip_flags, idx_t N, idx_t H
#define FUSEDRNN_STEP_ARGS lengths, n_lengths, t, clip_lo, clip_hi, clip_flags, N, H
#define FUSEDRNN_FORWARD_PARAMS(T)                                                        \
  const T *gx, idx_t ld_gx, const T *gh, idx_t ld_gh, const T *bx, const T *bh,          \
      const T *h_prev, idx_t ld_h_prev, const T *c_prev, idx_t ld_c_prev, T *h_next,     \
      idx_t ld_h_next, T *c_next, idx_t ld_c_next, T *y, idx_t ld_y, T *saved,           \
      idx_t ld_saved, FUSEDRNN_STEP_PARAMS
#define FUSEDRNN_BACKWARD_PARAMS(T)                                                       \
  const T *dy, idx_t ld_dy, const T *dh_rec, idx_t ld_dh_rec, const T *dh_carry_in,      \
      idx_t ld_dh_carry_in, const T *dc_carry_in, idx_t ld_dc_carry_in, const T *saved,  \
      idx_t ld_saved, const T *h_prev, idx_t ld_h_prev, const T *c_prev,                 \
      idx_t ld_c_prev, const T *c_t, idx_t ld_c_t, T *dgx, idx_t ld_dgx, T *dgh,         \
      idx_t ld_dgh, T *dh_carry_out, idx_t ld_dh_carry_out, T *dc_carry_out,             \
      idx_t ld_dc_carry_out, FUSEDRNN_STEP_PARAMS
#define FUSEDRNN_FORWARD_ARGS                                                             \
  gx, ld_gx, gh, ld_gh, bx, bh, h_prev, ld_h_prev, c_prev, ld_c_prev, h_next, ld_h_next,  \
      c_next, ld_c_next, y, ld_y, saved, ld_saved, FUSEDRNN_STEP_ARGS
#define FUSEDRNN_BACKWARD_ARGS                                                            \
  dy, ld_dy, dh_rec, ld_dh_rec, dh_carry_in, ld_dh_carry_in, dc_carry_in,                 \
      ld_dc_carry_in, saved, ld_saved, h_prev, ld_h_prev, c_prev, ld_c_prev, c_t, ld_c_t, \
      dgx, ld_dgx, dgh, ld_dgh, dh_carry_out, ld_dh_carry_out, dc_carry_out,              \
      ld_dc_carry_out, FUSEDRNN_STEP_ARGS

template <typename Cell, typename T>
__host__ __device__ __forceinline__ void forward_element(idx_t k, FUSEDRNN_FORWARD_PARAMS(T)) {
  ForwardArgs<T> a = {{gx, ld_gx}, {gh, ld_gh}, bx, bh, {h_prev, ld_h_prev},
                      {c_prev, ld_c_prev}, {h_next, ld_h_next}, {c_next, ld_c_next},
                      {y, ld_y}, {saved, ld_saved},
                      {lengths, n_lengths, t, clip_lo, clip_hi, clip_flags}};
  (void)N;  // the caller bounds k < N*H
  idx_t n = k / H, j = k % H;
  if (a.step.active(n)) Cell::forward(a, n, j, H);
  else carry_state(a, n, j);
}

template <typename Cell, typename T>
__host__ __device__ __forceinline__ void backward_element(idx_t k, FUSEDRNN_BACKWARD_PARAMS(T)) {
  BackwardArgs<T> a = {{dy, ld_dy}, {dh_rec, ld_dh_rec}, {dh_carry_in, ld_dh_carry_in},
                       {dc_carry_in, ld_dc_carry_in}, {saved, ld_saved}, {h_prev, ld_h_prev},
                       {c_prev, ld_c_prev}, {c_t, ld_c_t}, {dgx, ld_dgx}, {dgh, ld_dgh},
                       {dh_carry_out, ld_dh_carry_out}, {dc_carry_out, ld_dc_carry_out},
                       {lengths, n_lengths, t, clip_lo, clip_hi, clip_flags}};
  (void)N;
  idx_t n = k / H, j = k % H;
  if (a.step.active(n)) Cell::backward(a, n, j, H);
  else carry_grads(a, Cell::G, n, j, H);
}

#ifdef __CUDACC__
// One thread per (n, j), grid-stride so any grid size covers N*H.
template <typename Cell, typename T>
__global__ void forward_step(FUSEDRNN_FORWARD_PARAMS(T)) {
  for (idx_t k = blockIdx.x * (idx_t)blockDim.x + threadIdx.x; k < N * H;
       k += (idx_t)gridDim.x * blockDim.x)
    forward_element<Cell, T>(k, FUSEDRNN_FORWARD_ARGS);
}

template <typename Cell, typename T>
__global__ void backward_step(FUSEDRNN_BACKWARD_PARAMS(T)) {
  for (idx_t k = blockIdx.x * (idx_t)blockDim.x + threadIdx.x; k < N * H;
       k += (idx_t)gridDim.x * blockDim.x)
    backward_element<Cell, T>(k, FUSEDRNN_BACKWARD_ARGS);
}
#endif

}  // namespace fusedrnn
