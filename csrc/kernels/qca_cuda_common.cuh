// Device helpers shared by the CUDA C kernels: typed loads and stores, launch geometry.
// No ATen: the kernels are plain CUDA and compile with `nvcc -c` alone.
#ifndef QCA_LOWMEM_CUDA_COMMON_CUH
#define QCA_LOWMEM_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "qca_lowmem/common.h"

namespace qca_lowmem_cuda {

template <typename real_t>
__device__ __forceinline__ real_t load_as(const void* base, qca_dtype dtype, int64_t index) {
  switch (dtype) {
    case QCA_F32: return (real_t)static_cast<const float*>(base)[index];
    case QCA_F64: return (real_t)static_cast<const double*>(base)[index];
    case QCA_F16: return (real_t)__half2float(static_cast<const __half*>(base)[index]);
    case QCA_BF16: return (real_t)__bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
  }
  return real_t(0);
}

template <typename real_t>
__device__ __forceinline__ void store_as(void* base, qca_dtype dtype, int64_t index, real_t v) {
  switch (dtype) {
    case QCA_F32: static_cast<float*>(base)[index] = (float)v; return;
    case QCA_F64: static_cast<double*>(base)[index] = (double)v; return;
    case QCA_F16: static_cast<__half*>(base)[index] = __float2half_rn((float)v); return;
    case QCA_BF16: static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn((float)v); return;
  }
}

// Grid for a grid-stride loop over `n` items: enough blocks to fill the device, capped so the
// block count stays in range for any n (the loop covers the rest with 64-bit indices).
inline unsigned int blocks_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = 65535LL * 8;
  if (blocks > cap) blocks = cap;
  return (unsigned int)(blocks < 1 ? 1 : blocks);
}

inline qca_status finish_launch(qca_cuda_error* err) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    if (err) err->code = (int)e;
    return QCA_ERR_CUDA;
  }
  return QCA_OK;
}

}  // namespace qca_lowmem_cuda

#endif
