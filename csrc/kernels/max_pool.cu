// CUDA kernels of the 2x2 max pooling (see include/qca_lowmem/max_pool.h): a thread per window
// both ways, with the C kernels' window geometry and pick (max_pool_windows.h). Neighbouring
// threads take neighbouring windows in y's memory order, so in either layout their loads and
// stores fall on neighbouring elements.
#include "qca_cuda_common.cuh"
#include "max_pool_windows.h"
#include "qca_lowmem/max_pool.h"

namespace {

using qca_lowmem_cuda::load_as;
using qca_lowmem_cuda::store_as;

constexpr int kThreads = 256;

__device__ int window_pick(const float (&values)[4]) { return qca_window_pick_f32(values); }
__device__ int window_pick(const double (&values)[4]) { return qca_window_pick_f64(values); }

// REAL: double for double data, float for the others (the comparisons' and the sum's precision).
template <typename REAL>
__device__ int pick_of(const void* x, qca_dtype dtype, const int64_t (&elements)[4]) {
  REAL values[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) values[k] = load_as<REAL>(x, dtype, elements[k]);
  return window_pick(values);
}

template <typename REAL, typename Element>
__global__ void __launch_bounds__(kThreads) forward_kernel(const qca_max_pool_params p) {
  const qca_max_pool_shape& s = p.shape;
  const int64_t out_h = s.height / 2, out_w = s.width / 2;
  const int64_t count = s.batch * s.channels * out_h * out_w;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < count; o += stride) {
    int64_t elements[4];
    qca_pool_window(&s, qca_pool_place_of(o, s.channels, out_h, out_w, s.channels_last), elements);
    const int pick = pick_of<REAL>(p.x, p.dtype, elements);
    // Selected without indexing the array by a run-time value, which would put it in local memory.
    const int64_t picked = pick == 3   ? elements[3]
                           : pick == 2 ? elements[2]
                           : pick == 1 ? elements[1]
                                       : elements[0];
    static_cast<Element*>(p.y)[o] = static_cast<const Element*>(p.x)[picked];
  }
}

// grad_x[i] = 0 + grad (as torch's kernels sum it: -0 becomes +0) or +0.
template <typename REAL>
__device__ void put_gradient(const qca_max_pool_backward_params& p, int64_t i, bool sent,
                             int64_t o) {
  store_as<REAL>(p.grad_x, p.dtype, i,
                 sent ? REAL(0) + load_as<REAL>(p.grad_y, p.dtype, o) : REAL(0));
}

template <typename REAL>
__global__ void __launch_bounds__(kThreads) backward_kernel(const qca_max_pool_backward_params p) {
  const qca_max_pool_shape& s = p.shape;
  const int64_t out_h = s.height / 2, out_w = s.width / 2;
  const int64_t count = s.batch * s.channels * out_h * out_w;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < count; o += stride) {
    const qca_pool_place win = qca_pool_place_of(o, s.channels, out_h, out_w, s.channels_last);
    int64_t elements[4], leftovers[5];
    qca_pool_window(&s, win, elements);
    const int sends = qca_window_gradient_element(pick_of<REAL>(p.x, p.dtype, elements), win,
                                                  p.unpicked_to_origin);
#pragma unroll
    for (int k = 0; k < 4; ++k) put_gradient<REAL>(p, elements[k], k == sends, o);
    const int beside = qca_pool_leftovers(&s, win, leftovers);
#pragma unroll
    for (int k = 0; k < 5; ++k)
      if (beside & (1 << k)) put_gradient<REAL>(p, leftovers[k], false, o);
  }
}

bool shape_ok(const qca_max_pool_shape& s, qca_dtype dtype) {
  return s.batch >= 0 && s.channels >= 0 && s.height >= 2 && s.width >= 2 &&
         (dtype == QCA_F32 || dtype == QCA_F64 || dtype == QCA_F16 || dtype == QCA_BF16);
}

}  // namespace

extern "C" qca_status qca_max_pool2x2_forward_cuda(const qca_max_pool_params* p, void* stream,
                                                   qca_cuda_error* err) {
  if (!shape_ok(p->shape, p->dtype)) return QCA_ERR_INVALID_ARGUMENT;
  const int64_t count =
      p->shape.batch * p->shape.channels * (p->shape.height / 2) * (p->shape.width / 2);
  if (count == 0) return QCA_OK;
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(count, kThreads);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  using qca_lowmem_cuda::launch_kernel;
  cudaError_t e;
  switch (p->dtype) {
    case QCA_F64:
      e = launch_kernel(forward_kernel<double, double>, blocks, kThreads, 0, s, *p);
      break;
    case QCA_F32:
      e = launch_kernel(forward_kernel<float, float>, blocks, kThreads, 0, s, *p);
      break;
    default: e = launch_kernel(forward_kernel<float, uint16_t>, blocks, kThreads, 0, s, *p); break;
  }
  return qca_lowmem_cuda::finish_launch(e, err);
}

extern "C" qca_status qca_max_pool2x2_backward_cuda(const qca_max_pool_backward_params* p,
                                                    void* stream, qca_cuda_error* err) {
  if (!shape_ok(p->shape, p->dtype)) return QCA_ERR_INVALID_ARGUMENT;
  const int64_t count =
      p->shape.batch * p->shape.channels * (p->shape.height / 2) * (p->shape.width / 2);
  if (count == 0) return QCA_OK;
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(count, kThreads);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e =
      p->dtype == QCA_F64
          ? qca_lowmem_cuda::launch_kernel(backward_kernel<double>, blocks, kThreads, 0, s, *p)
          : qca_lowmem_cuda::launch_kernel(backward_kernel<float>, blocks, kThreads, 0, s, *p);
  return qca_lowmem_cuda::finish_launch(e, err);
}
