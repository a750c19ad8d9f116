// The operands of the op's half-precision GEMMs (issue 25; host side: halfgemm.py).
//
// Why: cuBLAS multiplies float16 or bfloat16 matrices on tensor cores with float32 sums
// (cublasGemmEx, CUBLAS_COMPUTE_32F), but the op keeps its arrays in float32 between its
// conversions (config.PRECISIONS). Each operand is rounded here into a contiguous half
// copy, as the CPU's pair packers round theirs to bfloat16 (cpu/lowlevel/bf16gemm.py).
#pragma once

#include "tensorcore.cuh"

namespace fusedrnn {

// narrow_rows<P>: dst[r * cols + c] = src[r * ld + c], rounded to nearest even to the
// half type P (kProductF16 or kProductBF16; tensorcore.cuh's to_half).
//   src   (rows, ld) float       in   row stride ld >= cols, unit column stride (a column
//                                     slice of a wider array)
//   rows, cols, ld: long long
//   dst   (rows, cols) half_bits out  contiguous; must not overlap src
// One element per thread, grid-strided (any grid covers it).
template <int P>
__global__ void narrow_rows(const float* __restrict__ src, long long rows, long long cols,
                            long long ld, half_bits* __restrict__ dst) {
  const long long n = rows * cols, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const long long r = i / cols;
    dst[i] = to_half<P>(src[r * ld + (i - r * cols)]);
  }
}

}  // namespace fusedrnn
