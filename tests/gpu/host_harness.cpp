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
// Entries take the device kernels' arguments after (blocks, threads); the grid barrier's
// counter is unused here.
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
        for (idx_t tid = 0; tid < threads; ++tid) backward_clear(p, part_s.data(), tid, threads);
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

#define PERSISTENT_ENTRIES(NAME, CELL, T)                                               \
  extern "C" void persistent_forward_##NAME(idx_t blocks, idx_t threads, void*,       \
                                            FUSEDRNN_PERSISTENT_FORWARD_PARAMS(T)) {   \
    host_persistent_forward<CELL, T>(blocks, threads, FUSEDRNN_PERSISTENT_FORWARD_ARGS); \
  }                                                                                     \
  extern "C" void persistent_backward_##NAME(idx_t blocks, idx_t threads, void*,      \
                                             FUSEDRNN_PERSISTENT_BACKWARD_PARAMS(T)) { \
    host_persistent_backward<CELL, T>(blocks, threads, FUSEDRNN_PERSISTENT_BACKWARD_ARGS); \
  }

#define CELL_PERSISTENT_ENTRIES(MODE, CELL) \
  PERSISTENT_ENTRIES(MODE##_float, CELL, float) PERSISTENT_ENTRIES(MODE##_double, CELL, double)
FUSEDRNN_HOST_CELLS(CELL_PERSISTENT_ENTRIES)
