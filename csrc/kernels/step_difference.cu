// CUDA kernels of the step difference (see include/qca_lowmem/step_difference.h): each block
// takes the maxima over its share of the elements, one block then takes them over the blocks.
// Maxima do not depend on their order, so the result is the C kernel's whatever the split.
#include <float.h>
#include <math.h>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/step_difference.h"
#include "qca_shared.h"

#define QCA_PER_PRECISION "step_difference_elements.inc"
#include "qca_per_precision.inc"

namespace {

using qca_lowmem_cuda::load_as;

constexpr int kThreads = 256;

// The per-precision functions of the shared maths under one name each.
__device__ float nan_max(float a, float b) { return nan_max_f32(a, b); }
__device__ double nan_max(double a, double b) { return nan_max_f64(a, b); }
__device__ void element_measures(float ar, float ai, float er, float ei, float br, float bi,
                                 int complex_elements, float* d, float* c) {
  element_measures_f32(ar, ai, er, ei, br, bi, complex_elements, d, c);
}
__device__ void element_measures(double ar, double ai, double er, double ei, double br, double bi,
                                 int complex_elements, double* d, double* c) {
  element_measures_f64(ar, ai, er, ei, br, bi, complex_elements, d, c);
}
__device__ float ratio(float d, float c) { return ratio_f32(d, c); }
__device__ float ratio(double d, double c) { return ratio_f64(d, c); }

template <typename REAL>
struct Maxima {
  REAL d, c;
};

struct NanMaxima {
  template <typename REAL>
  __device__ Maxima<REAL> operator()(const Maxima<REAL>& a, const Maxima<REAL>& b) const {
    return Maxima<REAL>{nan_max(a.d, b.d), nan_max(a.c, b.c)};
  }
};

// Each block's maxima over the elements of its grid-stride loop, to workspace[block].
template <typename REAL>
__global__ void __launch_bounds__(kThreads)
    block_maxima_kernel(const qca_step_difference_params p) {
  const int64_t parts = p.complex_elements ? 2 : 1;
  Maxima<REAL> m{REAL(0), REAL(0)};
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    const int64_t k = i * parts;
    const REAL ar = load_as<REAL>(p.actual, p.dtype, k);
    const REAL ai = parts == 2 ? load_as<REAL>(p.actual, p.dtype, k + 1) : REAL(0);
    const REAL er = load_as<REAL>(p.expected, p.dtype, k);
    const REAL ei = parts == 2 ? load_as<REAL>(p.expected, p.dtype, k + 1) : REAL(0);
    REAL br = 0, bi = 0, d, c;
    if (p.before) {
      br = load_as<REAL>(p.before, p.dtype, k);
      bi = parts == 2 ? load_as<REAL>(p.before, p.dtype, k + 1) : REAL(0);
    }
    element_measures(ar, ai, er, ei, br, bi, p.complex_elements, &d, &c);
    m = NanMaxima()(m, Maxima<REAL>{d, c});
  }
  m = qca_lowmem_cuda::block_reduce<kThreads>(m, NanMaxima());
  if (threadIdx.x == 0) static_cast<Maxima<REAL>*>(p.workspace)[blockIdx.x] = m;
}

// One block: the maxima over the first kernel's `blocks` partials, and the result.
template <typename REAL>
__global__ void __launch_bounds__(kThreads)
    ratio_kernel(const qca_step_difference_params p, int blocks) {
  const Maxima<REAL>* partials = static_cast<const Maxima<REAL>*>(p.workspace);
  Maxima<REAL> m{REAL(0), REAL(0)};
  for (int b = threadIdx.x; b < blocks; b += kThreads) m = NanMaxima()(m, partials[b]);
  m = qca_lowmem_cuda::block_reduce<kThreads>(m, NanMaxima());
  if (threadIdx.x == 0) *p.out = ratio(m.d, m.c);
}

template <typename REAL>
cudaError_t launch(const qca_step_difference_params& p, cudaStream_t s) {
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(p.count, kThreads);
  const int used =
      blocks < QCA_STEP_DIFFERENCE_MAX_BLOCKS ? (int)blocks : QCA_STEP_DIFFERENCE_MAX_BLOCKS;
  cudaError_t e =
      qca_lowmem_cuda::launch_kernel(block_maxima_kernel<REAL>, used, kThreads, 0, s, p);
  if (e == cudaSuccess)
    e = qca_lowmem_cuda::launch_kernel(ratio_kernel<REAL>, 1, kThreads, 0, s, p, used);
  return e;
}

}  // namespace

extern "C" qca_status qca_step_difference_cuda(const qca_step_difference_params* p, void* stream,
                                               qca_cuda_error* err) {
  if (p->count < 0 || !p->out || !p->workspace || (p->count > 0 && (!p->actual || !p->expected)))
    return QCA_ERR_INVALID_ARGUMENT;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  switch (p->dtype) {
    case QCA_F64: e = launch<double>(*p, s); break;
    case QCA_F32:
    case QCA_F16:
    case QCA_BF16: e = launch<float>(*p, s); break;
    default: return QCA_ERR_UNSUPPORTED_DTYPE;
  }
  return qca_lowmem_cuda::finish_launch(e, err);
}
