// The element maths GroupNorm+ELU's CUDA kernels share (groupnorm_elu.cu and
// groupnorm_elu_nhwc.cuh): Welford statistics and their merge, the activation and its slope,
// typed element loads and stores.
#ifndef QCA_LOWMEM_GROUPNORM_ELU_ELEMENTS_CUH
#define QCA_LOWMEM_GROUPNORM_ELU_ELEMENTS_CUH

#include <math.h>
#include <stdint.h>

#include "qca_cuda_common.cuh"

namespace {

using qca_lowmem_cuda::mul_rn;

template <typename acc_t>
struct Welford {
  acc_t mean, m2;
  int64_t count;
};

template <typename acc_t>
__device__ Welford<acc_t> merge(const Welford<acc_t>& a, const Welford<acc_t>& b) {
  if (b.count == 0) return a;
  if (a.count == 0) return b;
  Welford<acc_t> r;
  r.count = a.count + b.count;
  const acc_t delta = b.mean - a.mean;
  const acc_t b_share = (acc_t)b.count / (acc_t)r.count;
  r.mean = a.mean + mul_rn(delta, b_share);
  r.m2 = a.m2 + b.m2 + mul_rn(mul_rn(mul_rn(delta, delta), (acc_t)a.count), b_share);
  return r;
}

template <typename acc_t>
struct SumPair {
  acc_t a, b;
};

__device__ __forceinline__ float elu(float z) { return z > 0.0f ? z : expm1f(z); }
__device__ __forceinline__ double elu(double z) { return z > 0.0 ? z : expm1(z); }
__device__ __forceinline__ float elu_grad(float z) { return z > 0.0f ? 1.0f : expf(z); }
__device__ __forceinline__ double elu_grad(double z) { return z > 0.0 ? 1.0 : exp(z); }

// Element access with the data type known at compile time (the inner loops are memory bound;
// the affine parameters and statistics, read once per channel, go through load_as instead).
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(float v) {
  return (acc_t)v;
}
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(double v) {
  return (acc_t)v;
}
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(__half v) {
  return (acc_t)__half2float(v);
}
template <typename acc_t>
__device__ __forceinline__ acc_t to_acc(__nv_bfloat16 v) {
  return (acc_t)__bfloat162float(v);
}

template <typename acc_t>
__device__ __forceinline__ void put(float* p, int64_t i, acc_t v) {
  p[i] = (float)v;
}
template <typename acc_t>
__device__ __forceinline__ void put(double* p, int64_t i, acc_t v) {
  p[i] = (double)v;
}
template <typename acc_t>
__device__ __forceinline__ void put(__half* p, int64_t i, acc_t v) {
  p[i] = __float2half_rn((float)v);
}
template <typename acc_t>
__device__ __forceinline__ void put(__nv_bfloat16* p, int64_t i, acc_t v) {
  p[i] = __float2bfloat16_rn((float)v);
}

template <typename acc_t>
struct XAndGrad {
  acc_t x, grad;
};

template <typename acc_t>
__device__ acc_t rstd_of(const Welford<acc_t>& w, double eps) {
  const acc_t var = w.count > 0 ? w.m2 / (acc_t)w.count : acc_t(0);
  return acc_t(1) / sqrt(var + (acc_t)eps);
}

}  // namespace

#endif
