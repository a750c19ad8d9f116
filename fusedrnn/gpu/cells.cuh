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

#ifdef __CUDACC__
#define FUSEDRNN_UNROLL _Pragma("unroll")
#else  // built as plain C++ for the host-side tests (tests/gpu/)
#define __host__
#define __device__
#define __forceinline__ inline
#define FUSEDRNN_UNROLL
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

// ---- cells: each is only its pointwise math for one (sample, unit) ----
//
// unit_forward(x, r, h_prev, c_prev, step, h, c, rec)
//   x[g]  input side of gate g's pre-activation, W_x x + b_x;  r[g]  recurrent side,
//         W_h h + b_h (kept apart: GRU's n gate scales it by r);  h_prev, c_prev the
//         unit's previous state (0 where the cell has none). Writes the new h, c (LSTM;
//         else 0) and the S-value training record rec[0..S-1].
// unit_backward(dh, dc, rec, h_prev, c_prev, c_t, step, dx, dr, dh_carry, dc_carry)
//   dh  all gradient reaching this step's h;  dc  what reaches its c from the next step.
//   Writes dx[g], dr[g] (gradient of the input-side and recurrent-side pre-activation;
//   equal but for GRU's n gate), dh_carry (reaches h_prev directly: GRU's z*dh, else 0)
//   and dc_carry (reaches c_prev: LSTM's f*dc, else 0).
// The CPU twins are fusedrnn/cpu/units.py; the same formulas in the same order.

template <bool Relu>
struct PlainCell {
  static constexpr int G = 1, S = 1;
  template <typename T>
  __host__ __device__ static void unit_forward(const T* x, const T* r, T, T, const StepInfo&,
                                               T& h, T& c, T* rec) {
    T v = x[0] + r[0];
    h = Relu ? (v < T(0) ? T(0) : v) : tanh(v);   // max(v, 0) that lets NaN through
    c = T(0);
    rec[0] = h;
  }
  template <typename T>
  __host__ __device__ static void unit_backward(T dh, T, const T* rec, T, T, T, const StepInfo&,
                                                T* dx, T* dr, T& dh_carry, T& dc_carry) {
    T h = rec[0];
    dx[0] = dr[0] = Relu ? (h > T(0) ? dh : T(0)) : dh * (T(1) - h * h);
    dh_carry = dc_carry = T(0);
  }
};
typedef PlainCell<true> ReluCell;
typedef PlainCell<false> TanhCell;

struct LstmCell {  // gates [i, f, g, o]; record [i, f, g, o]
  static constexpr int G = 4, S = 4;
  template <typename T>
  __host__ __device__ static void unit_forward(const T* x, const T* r, T, T c_prev,
                                               const StepInfo& step, T& h, T& c, T* rec) {
    T i = sigmoid(x[0] + r[0]), f = sigmoid(x[1] + r[1]);
    T g = tanh(x[2] + r[2]), o = sigmoid(x[3] + r[3]);
    c = step.clip(f * c_prev + i * g);
    h = o * tanh(c);
    rec[0] = i, rec[1] = f, rec[2] = g, rec[3] = o;
  }
  template <typename T>
  __host__ __device__ static void unit_backward(T dh, T dc, const T* rec, T, T c_prev, T c_t,
                                                const StepInfo& step, T* dx, T* dr,
                                                T& dh_carry, T& dc_carry) {
    T i = rec[0], f = rec[1], g = rec[2], o = rec[3];
    T tc = tanh(c_t);
    dc = dc + dh * o * (T(1) - tc * tc);
    // The clip's gradient: 0 where the update left [lo, hi] (recomputed pre-clip value).
    dc = dc * step.unclipped(f * c_prev + i * g);
    dx[0] = dr[0] = dc * g * i * (T(1) - i);
    dx[1] = dr[1] = dc * c_prev * f * (T(1) - f);
    dx[2] = dr[2] = dc * i * (T(1) - g * g);
    dx[3] = dr[3] = dh * tc * o * (T(1) - o);
    dh_carry = T(0);
    dc_carry = dc * f;
  }
};

struct GruCell {  // gates [r, z, n], "linear before reset"; record [r, z, n, W_hn h + b_hn]
  static constexpr int G = 3, S = 4;
  template <typename T>
  __host__ __device__ static void unit_forward(const T* x, const T* r, T h_prev, T,
                                               const StepInfo&, T& h, T& c, T* rec) {
    T rg = sigmoid(x[0] + r[0]), z = sigmoid(x[1] + r[1]);
    T n = tanh(x[2] + rg * r[2]);
    h = (T(1) - z) * n + z * h_prev;
    c = T(0);
    rec[0] = rg, rec[1] = z, rec[2] = n, rec[3] = r[2];
  }
  template <typename T>
  __host__ __device__ static void unit_backward(T dh, T, const T* rec, T h_prev, T, T,
                                                const StepInfo&, T* dx, T* dr, T& dh_carry,
                                                T& dc_carry) {
    T r = rec[0], z = rec[1], n = rec[2], hn = rec[3];
    T dn = dh * (T(1) - z) * (T(1) - n * n);
    dx[0] = dr[0] = dn * hn * r * (T(1) - r);
    dx[1] = dr[1] = dh * (h_prev - n) * z * (T(1) - z);
    dx[2] = dn;
    dr[2] = dn * r;
    dh_carry = dh * z;
    dc_carry = T(0);
  }
};

// ---- one (sample n, unit j) of a step through the per-step kernels' arguments ----

template <typename Cell, typename T>
__host__ __device__ __forceinline__ void forward_unit_at(const ForwardArgs<T>& a, idx_t n,
                                                         idx_t j, idx_t H) {
  T x[Cell::G], r[Cell::G], rec[Cell::S], h, c;
  for (int g = 0; g < Cell::G; ++g) {
    x[g] = a.gx(n, g * H + j) + a.bx[g * H + j];
    r[g] = a.gh(n, g * H + j) + a.bh[g * H + j];
  }
  Cell::unit_forward(x, r, a.h_prev.ld ? a.h_prev(n, j) : T(0),
                     a.c_prev.ld ? a.c_prev(n, j) : T(0), a.step, h, c, rec);
  a.h_next(n, j) = h;
  a.y(n, j) = h;
  if (a.c_next.ld) a.c_next(n, j) = c;
  if (a.saved.ld)
    for (int s = 0; s < Cell::S; ++s) a.saved(n, s * H + j) = rec[s];
}

template <typename Cell, typename T>
__host__ __device__ __forceinline__ void backward_unit_at(const BackwardArgs<T>& a, idx_t n,
                                                          idx_t j, idx_t H) {
  T rec[Cell::S], dx[Cell::G], dr[Cell::G], dh_carry, dc_carry;
  for (int s = 0; s < Cell::S; ++s) rec[s] = a.saved(n, s * H + j);
  Cell::unit_backward(a.dh(n, j), a.dc_carry_in.ld ? a.dc_carry_in(n, j) : T(0), rec,
                      a.h_prev.ld ? a.h_prev(n, j) : T(0), a.c_prev.ld ? a.c_prev(n, j) : T(0),
                      a.c_t.ld ? a.c_t(n, j) : T(0), a.step, dx, dr, dh_carry, dc_carry);
  for (int g = 0; g < Cell::G; ++g) {
    a.dgx(n, g * H + j) = dx[g];
    if (a.dgh.ld) a.dgh(n, g * H + j) = dr[g];
  }
  if (a.dh_carry_out.ld) a.dh_carry_out(n, j) = dh_carry;
  if (a.dc_carry_out.ld) a.dc_carry_out(n, j) = dc_carry;
}

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
  if (a.step.active(n)) forward_unit_at<Cell, T>(a, n, j, H);
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
  if (a.step.active(n)) backward_unit_at<Cell, T>(a, n, j, H);
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
