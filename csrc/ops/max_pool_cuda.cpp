// CUDA dispatch of the 2x2 max pooling: the CPU glue's checks (max_pool.cpp), launched on the
// current stream of the tensors' device.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "max_pool_glue.h"

namespace qca_lowmem {
namespace {

at::Tensor max_pool2x2_cuda(const at::Tensor& x) {
  MaxPoolForward f;
  prepare_max_pool2x2(x, f);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_cuda(qca_max_pool2x2_forward_cuda, f.params, "max_pool2x2");
  return f.y;
}

at::Tensor max_pool2x2_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x) {
  MaxPoolBackward b;
  prepare_max_pool2x2_backward(grad_y, x, b);
  const c10::cuda::CUDAGuard guard(x.device());  // after the checks: they name a device mix
  // torch's CUDA channels_last kernels (which it takes by suggest_memory_format) start a
  // window's index at the plane's first pixel, so a window of -infinities sends its gradient
  // there, or nowhere; its NCHW kernel, to its first element.
  b.params.unpicked_to_origin = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  launch_cuda(qca_max_pool2x2_backward_cuda, b.params, "max_pool2x2_backward");
  return b.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CUDA, m) {
  m.impl("max_pool2x2", &max_pool2x2_cuda);
  m.impl("max_pool2x2_backward", &max_pool2x2_backward_cuda);
}

}  // namespace qca_lowmem
