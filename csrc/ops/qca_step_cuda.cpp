// CUDA dispatch of the QCA step ops: same checks as the CPU glue (qca_step.cpp), launched on the
// current stream of psi's device.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "qca_step_glue.h"

namespace qca_lowmem {
namespace {

at::Tensor pack_cuda(const at::Tensor& psi, std::optional<at::ScalarType> dtype,
                     bool channels_last) {
  at::Tensor x;
  qca_pack_params p;
  prepare_pack(psi, dtype, channels_last, x, p);
  const c10::cuda::CUDAGuard guard(psi.device());  // after the checks: they name a device mix
  launch_cuda(qca_pack_cuda, p, "qca_pack");
  return x;
}

at::Tensor pack_backward_cuda(const at::Tensor& grad_x, at::ScalarType psi_dtype) {
  at::Tensor grad_psi;
  qca_pack_backward_params p;
  prepare_pack_backward(grad_x, psi_dtype, grad_psi, p);
  const c10::cuda::CUDAGuard guard(grad_x.device());  // after the checks: they name a device mix
  launch_cuda(qca_pack_backward_cuda, p, "qca_pack_backward");
  return grad_psi;
}

at::Tensor update_cuda(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                       bool multiplicative, double eps) {
  at::Tensor out;
  qca_update_params p;
  prepare_update(psi, delta, gamma, multiplicative, eps, out, p);
  const c10::cuda::CUDAGuard guard(psi.device());  // after the checks: they name a device mix
  launch_cuda(qca_update_cuda, p, "qca_update");
  return out;
}

std::tuple<at::Tensor, at::Tensor> update_backward_cuda(const at::Tensor& grad_out,
                                                        const at::Tensor& psi,
                                                        const at::Tensor& delta, double gamma,
                                                        bool multiplicative, double eps) {
  at::Tensor grad_psi, grad_delta;
  qca_update_backward_params p;
  prepare_update_backward(grad_out, psi, delta, gamma, multiplicative, eps, grad_psi, grad_delta,
                          p);
  const c10::cuda::CUDAGuard guard(psi.device());  // after the checks: they name a device mix
  launch_cuda(qca_update_backward_cuda, p, "qca_update_backward");
  return {grad_psi, grad_delta};
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CUDA, m) {
  m.impl("qca_pack", &pack_cuda);
  m.impl("qca_pack_backward", &pack_backward_cuda);
  m.impl("qca_update", &update_cuda);
  m.impl("qca_update_backward", &update_backward_cuda);
}

}  // namespace qca_lowmem
