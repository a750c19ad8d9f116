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

HOST_ENTRIES(rnn_relu_float, ReluCell, float)
HOST_ENTRIES(rnn_relu_double, ReluCell, double)
HOST_ENTRIES(rnn_tanh_float, TanhCell, float)
HOST_ENTRIES(rnn_tanh_double, TanhCell, double)
HOST_ENTRIES(lstm_float, LstmCell, float)
HOST_ENTRIES(lstm_double, LstmCell, double)
HOST_ENTRIES(gru_float, GruCell, float)
HOST_ENTRIES(gru_double, GruCell, double)
