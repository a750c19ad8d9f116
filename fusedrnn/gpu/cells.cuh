// Per-step pointwise cell math for the GPU backend: one forward/backward pair per cell.
//
// The same contract as the CPU kernels (fusedrnn/cpu/cells.py), so the shared driver
// (fusedrnn/recurrence.py) runs unchanged on CuPy arrays. Every 2-D argument is a
// row-major matrix given as (pointer, ld): element (n, j) is p[n * ld + j], ld >= width,
// so views of larger buffers (a direction's columns of a layer output) pass straight in.
// T is float or double; math is done in T. N = batch, H = state_size, G = Cell::G gates,
// S = Cell::S saved width in units of H. Unused arguments (c_* for non-LSTM cells,
// dgh for cells without split gate gradients, saved in inference) may be any pointer
// with ld 0: they are never dereferenced.
//
// forward_step<Cell, T>(gx, gh, bx, bh, h_prev, c_prev, h_next, c_next, y, saved,
//                       train, N, H)
//   gx     (N, G*H) in   input projection W_x x_t, without bias
//   gh     (N, G*H) in   recurrent projection W_h h_prev, without bias
//   bx, bh (G*H)    in   biases, contiguous (GRU's n gate needs b_hn alone)
//   h_prev (N, H)   in   previous state;     c_prev (N, H) in: previous cell state (LSTM)
//   h_next (N, H)   out  new state;          c_next (N, H) out: new cell state (LSTM)
//   y      (N, H)   out  this step's slice of the layer output (a copy of h_next)
//   saved  (N, S*H) out  training record read by backward; written only when train != 0
//   Outputs must not alias inputs.
//
// backward_step<Cell, T>(dy, dh_rec, dcarry_in, saved, h_prev, c_prev, c_t, dgx, dgh,
//                        dcarry_out, N, H)
//   dy, dh_rec (N, H)  in   gradient from the layer output / from the next step via W_h
//   dcarry_in  (N, H)  in   carried gradient (LSTM: dc; GRU: z*dh)
//   saved      (N, S*H) in  the forward's training record of this step
//   h_prev, c_prev, c_t (N, H) in  states before and (c_t) after this step
//   dgx        (N, G*H) out gradient w.r.t. the pre-activations fed by W_x x + b_x
//   dgh        (N, G*H) out the same for W_h h + b_h (GRU only; others equal dgx)
//   dcarry_out (N, H)  out  carried gradient to the previous step; may alias dcarry_in
//                           (each element is read before it is written, by one thread)
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

template <typename T>
struct ForwardArgs {
  Mat<const T> gx, gh;
  const T *bx, *bh;
  Mat<const T> h_prev, c_prev;
  Mat<T> h_next, c_next, y, saved;
  bool train;
  // The pre-activation of gate column `col`: both projections and both biases.
  __host__ __device__ __forceinline__ T pre(idx_t n, idx_t col) const {
    return gx(n, col) + bx[col] + gh(n, col) + bh[col];
  }
};

template <typename T>
struct BackwardArgs {
  Mat<const T> dy, dh_rec, dcarry_in, saved, h_prev, c_prev, c_t;
  Mat<T> dgx, dgh, dcarry_out;
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
    if (a.train) a.saved(n, j) = h;
  }
  template <typename T>
  __host__ __device__ static void backward(const BackwardArgs<T>& a, idx_t n, idx_t j, idx_t) {
    T h = a.saved(n, j);
    T dh = a.dy(n, j) + a.dh_rec(n, j);
    a.dgx(n, j) = Relu ? (h > T(0) ? dh : T(0)) : dh * (T(1) - h * h);
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
    T c = f * a.c_prev(n, j) + i * g;
    T h = o * tanh(c);
    a.c_next(n, j) = c;
    a.h_next(n, j) = h;
    a.y(n, j) = h;
    if (a.train) {
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
    T dh = a.dy(n, j) + a.dh_rec(n, j);
    T dc = a.dcarry_in(n, j) + dh * o * (T(1) - tc * tc);
    a.dgx(n, j) = dc * g * i * (T(1) - i);
    a.dgx(n, H + j) = dc * a.c_prev(n, j) * f * (T(1) - f);
    a.dgx(n, 2 * H + j) = dc * i * (T(1) - g * g);
    a.dgx(n, 3 * H + j) = dh * tc * o * (T(1) - o);
    a.dcarry_out(n, j) = dc * f;
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
    if (a.train) {
      a.saved(n, j) = r;
      a.saved(n, H + j) = z;
      a.saved(n, 2 * H + j) = nn;
      a.saved(n, 3 * H + j) = hn;
    }
  }
  template <typename T>
  __host__ __device__ static void backward(const BackwardArgs<T>& a, idx_t n, idx_t j, idx_t H) {
    T r = a.saved(n, j), z = a.saved(n, H + j), nn = a.saved(n, 2 * H + j), hn = a.saved(n, 3 * H + j);
    T dh = a.dy(n, j) + a.dh_rec(n, j) + a.dcarry_in(n, j);
    T dn = dh * (T(1) - z) * (T(1) - nn * nn);
    T dr = dn * hn * r * (T(1) - r);
    T dz = dh * (a.h_prev(n, j) - nn) * z * (T(1) - z);
    a.dgx(n, j) = dr;
    a.dgx(n, H + j) = dz;
    a.dgx(n, 2 * H + j) = dn;
    a.dgh(n, j) = dr;
    a.dgh(n, H + j) = dz;
    a.dgh(n, 2 * H + j) = dn * r;
    a.dcarry_out(n, j) = dh * z;
  }
};

// ---- one element of a step: shared by the kernels below and the host-side tests ----

#define FUSEDRNN_FORWARD_PARAMS(T)                                                        \
  const T *gx, idx_t ld_gx, const T *gh, idx_t ld_gh, const T *bx, const T *bh,          \
      const T *h_prev, idx_t ld_h_prev, const T *c_prev, idx_t ld_c_prev, T *h_next,     \
      idx_t ld_h_next, T *c_next, idx_t ld_c_next, T *y, idx_t ld_y, T *saved,           \
      idx_t ld_saved, idx_t train, idx_t N, idx_t H
#define FUSEDRNN_BACKWARD_PARAMS(T)                                                       \
  const T *dy, idx_t ld_dy, const T *dh_rec, idx_t ld_dh_rec, const T *dcarry_in,        \
      idx_t ld_dcarry_in, const T *saved, idx_t ld_saved, const T *h_prev,               \
      idx_t ld_h_prev, const T *c_prev, idx_t ld_c_prev, const T *c_t, idx_t ld_c_t,     \
      T *dgx, idx_t ld_dgx, T *dgh, idx_t ld_dgh, T *dcarry_out, idx_t ld_dcarry_out,    \
      idx_t N, idx_t H

#define FUSEDRNN_FORWARD_ARGS                                                             \
  gx, ld_gx, gh, ld_gh, bx, bh, h_prev, ld_h_prev, c_prev, ld_c_prev, h_next, ld_h_next,  \
      c_next, ld_c_next, y, ld_y, saved, ld_saved, train, N, H
#define FUSEDRNN_BACKWARD_ARGS                                                            \
  dy, ld_dy, dh_rec, ld_dh_rec, dcarry_in, ld_dcarry_in, saved, ld_saved, h_prev,         \
      ld_h_prev, c_prev, ld_c_prev, c_t, ld_c_t, dgx, ld_dgx, dgh, ld_dgh, dcarry_out,    \
      ld_dcarry_out, N, H

template <typename Cell, typename T>
__host__ __device__ __forceinline__ void forward_element(idx_t k, FUSEDRNN_FORWARD_PARAMS(T)) {
  ForwardArgs<T> a = {{gx, ld_gx}, {gh, ld_gh}, bx, bh, {h_prev, ld_h_prev},
                      {c_prev, ld_c_prev}, {h_next, ld_h_next}, {c_next, ld_c_next},
                      {y, ld_y}, {saved, ld_saved}, train != 0};
  (void)N;  // the caller bounds k < N*H
  Cell::forward(a, k / H, k % H, H);
}

template <typename Cell, typename T>
__host__ __device__ __forceinline__ void backward_element(idx_t k, FUSEDRNN_BACKWARD_PARAMS(T)) {
  BackwardArgs<T> a = {{dy, ld_dy}, {dh_rec, ld_dh_rec}, {dcarry_in, ld_dcarry_in},
                       {saved, ld_saved}, {h_prev, ld_h_prev}, {c_prev, ld_c_prev},
                       {c_t, ld_c_t}, {dgx, ld_dgx}, {dgh, ld_dgh},
                       {dcarry_out, ld_dcarry_out}};
  (void)N;
  Cell::backward(a, k / H, k % H, H);
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
