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

// Calls body(o, win, elements) for each window this thread takes (a grid-stride loop over y's
// elements o): its place, and the memory indices of its four elements in x.
template <typename Body>
__device__ __forceinline__ void for_windows(const qca_max_pool_shape& s, Body body) {
  const int64_t out_h = s.height / 2, out_w = s.width / 2;
  const int64_t count = s.batch * s.channels * out_h * out_w;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < count; o += stride) {
    const qca_pool_place win = qca_pool_place_of(o, s.channels, out_h, out_w, s.channels_last);
    int64_t elements[4];
    qca_pool_window(&s, win, elements);
    body(o, win, elements);
  }
}

template <typename REAL, typename Element>
__global__ void __launch_bounds__(kThreads) forward_kernel(const qca_max_pool_params p) {
  for_windows(p.shape, [&](int64_t o, qca_pool_place, const int64_t (&elements)[4]) {
    const int pick = pick_of<REAL>(p.x, p.dtype, elements);
    // Selected without indexing the array by a run-time value, which would put it in local memory.
    const int64_t picked = pick == 3   ? elements[3]
                           : pick == 2 ? elements[2]
                           : pick == 1 ? elements[1]
                                       : elements[0];
    static_cast<Element*>(p.y)[o] = static_cast<const Element*>(p.x)[picked];
  });
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
  for_windows(p.shape, [&](int64_t o, qca_pool_place win, const int64_t (&elements)[4]) {
    const int sends = qca_window_gradient_element(pick_of<REAL>(p.x, p.dtype, elements), win,
                                                  p.unpicked_to_origin);
#pragma unroll
    for (int k = 0; k < 4; ++k) put_gradient<REAL>(p, elements[k], k == sends, o);
    int64_t leftovers[5];
    const int beside = qca_pool_leftovers(&p.shape, win, leftovers);
#pragma unroll
    for (int k = 0; k < 5; ++k)
      if (beside & (1 << k)) put_gradient<REAL>(p, leftovers[k], false, o);
  });
}

// `kernel` over the windows of p's shape, a thread each, once the shape and dtype are checked.
template <typename Params>
qca_status launch_over_windows(void (*kernel)(Params), const Params& p, void* stream,
                               qca_cuda_error* err) {
  const qca_max_pool_shape& s = p.shape;
  if (!qca_pool_arguments_ok(&s, p.dtype)) return QCA_ERR_INVALID_ARGUMENT;
  const int64_t count = s.batch * s.channels * (s.height / 2) * (s.width / 2);
  if (count == 0) return QCA_OK;
  return qca_lowmem_cuda::finish_launch(
      qca_lowmem_cuda::launch_kernel(kernel, qca_lowmem_cuda::blocks_for(count, kThreads), kThreads,
                                     0, static_cast<cudaStream_t>(stream), p),
      err);
}

}  // namespace

extern "C" qca_status qca_max_pool2x2_forward_cuda(const qca_max_pool_params* p, void* stream,
                                                   qca_cuda_error* err) {
  switch (p->dtype) {
    case QCA_F64: return launch_over_windows(forward_kernel<double, double>, *p, stream, err);
    case QCA_F32: return launch_over_windows(forward_kernel<float, float>, *p, stream, err);
    default: return launch_over_windows(forward_kernel<float, uint16_t>, *p, stream, err);
  }
}

extern "C" qca_status qca_max_pool2x2_backward_cuda(const qca_max_pool_backward_params* p,
                                                    void* stream, qca_cuda_error* err) {
  return p->dtype == QCA_F64 ? launch_over_windows(backward_kernel<double>, *p, stream, err)
                             : launch_over_windows(backward_kernel<float>, *p, stream, err);
}
