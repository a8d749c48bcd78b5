// Device helpers shared by the CUDA C kernels: typed loads and stores, launch geometry, and the
// conventions that let every kernel also run on the CPU under the test emulator
// (docs/cuda_emulation.md): launches through launch_kernel, shared memory through QCA_SHARED /
// QCA_DYNAMIC_SHARED. No ATen: the kernels are plain CUDA and compile with `nvcc -c` alone.
#ifndef QCA_LOWMEM_CUDA_COMMON_CUH
#define QCA_LOWMEM_CUDA_COMMON_CUH

#ifdef QCA_CUDA_EMULATION
#include "cuda_emu.h"  // tests/cuda_emu: the CUDA subset these kernels use, run on the CPU
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// `type name[count]` in the block's shared memory; inside a kernel or device function only.
#define QCA_SHARED(type, name, count) __shared__ type name[count]
// `type* name`: the launch's dynamic shared memory (its smem_bytes), 16-byte aligned.
#define QCA_DYNAMIC_SHARED(type, name)                                 \
  extern __shared__ __align__(16) unsigned char qca_dynamic_shared_[]; \
  type* name = reinterpret_cast<type*>(qca_dynamic_shared_)
#endif

#include <stdint.h>
#include <string.h>

#include <utility>

#include "qca_lowmem/common.h"

namespace qca_lowmem_cuda {

template <typename real_t>
__device__ __forceinline__ real_t load_as(const void* base, qca_dtype dtype, int64_t index) {
  switch (dtype) {
    case QCA_F32: return (real_t)(static_cast<const float*>(base)[index]);
    case QCA_F64: return (real_t)(static_cast<const double*>(base)[index]);
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

// A product rounded on its own, never fused with a neighbouring add into one FMA (nvcc fuses
// `a * b + c` by default, C11 does not): for maths that must give the C kernels' bits.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// `v` moved `offset` lanes down the warp, word by word (any trivially copyable type of whole
// 4-byte words, such as a struct of partial sums).
template <typename T>
__device__ __forceinline__ T shfl_down_words(const T& v, int offset) {
  static_assert(sizeof(T) % 4 == 0, "shfl_down_words moves whole 4-byte words");
  unsigned int words[sizeof(T) / 4];
  memcpy(words, &v, sizeof(T));
#pragma unroll
  for (unsigned int i = 0; i < sizeof(T) / 4; ++i)
    words[i] = __shfl_down_sync(0xffffffffu, words[i], offset);
  T result;
  memcpy(&result, words, sizeof(T));
  return result;
}

// Combines one value per thread over a block of kThreads threads (every thread must call it)
// and returns the result to all of them. The order is fixed: a shuffle tree within each warp,
// then the warps' results one after another, so the bits depend only on the inputs.
template <int kThreads, typename T, typename Combine>
__device__ T block_reduce(T v, Combine combine) {
  static_assert(kThreads % 32 == 0, "block_reduce takes whole warps");
  constexpr int kWarps = kThreads / 32;
  QCA_SHARED(T, warp_results, kWarps);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = combine(v, shfl_down_words(v, offset));
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = v;
  __syncthreads();
  v = warp_results[0];
  for (int w = 1; w < kWarps; ++w) v = combine(v, warp_results[w]);
  __syncthreads();  // the slots are free for the next call
  return v;
}

// Grid for a grid-stride loop over `n` items: enough blocks to fill the device, capped so the
// block count stays in range for any n (the loop covers the rest with 64-bit indices).
inline unsigned int blocks_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = 65535LL * 8;
  if (blocks > cap) blocks = cap;
  return (unsigned int)(blocks < 1 ? 1 : blocks);
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), returning this launch's own error. A
// failed launch's error is taken out of the runtime's last-error slot here, and an error left
// there by someone else is neither blamed on this launch nor cleared.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

inline qca_status finish_launch(cudaError_t e, qca_cuda_error* err) {
  if (e == cudaSuccess) return QCA_OK;
  if (err) err->code = (int)e;
  return QCA_ERR_CUDA;
}

// Multiprocessors of the current device. A failed query's error is returned here and taken out
// of the last-error slot, so that no later launch is blamed for it.
inline cudaError_t multiprocessor_count(int* sms) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

}  // namespace qca_lowmem_cuda

#endif
