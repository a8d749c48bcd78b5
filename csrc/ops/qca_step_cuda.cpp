// CUDA dispatch of the QCA step ops: same checks as the CPU glue (qca_step.cpp), launched on the
// current stream of psi's device.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "qca_step.h"

namespace qca_lowmem {
namespace {

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

at::Tensor pack_cuda(const at::Tensor& psi, std::optional<at::ScalarType> dtype,
                     bool channels_last) {
  const c10::cuda::CUDAGuard guard(psi.device());
  at::Tensor x;
  const qca_pack_params p = prepare_pack(psi, dtype, channels_last, x);
  qca_cuda_error err{};
  check_cuda_status(qca_pack_cuda(&p, current_stream(), &err), err, "qca_pack");
  return x;
}

at::Tensor pack_backward_cuda(const at::Tensor& grad_x, at::ScalarType psi_dtype) {
  const c10::cuda::CUDAGuard guard(grad_x.device());
  at::Tensor grad_psi;
  const qca_unpack_params p = prepare_unpack(grad_x, psi_dtype, grad_psi);
  qca_cuda_error err{};
  check_cuda_status(qca_unpack_cuda(&p, current_stream(), &err), err, "qca_pack_backward");
  return grad_psi;
}

at::Tensor update_cuda(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                       bool multiplicative, double eps) {
  qca_update_params p = prepare_update(psi, delta, gamma, multiplicative, eps, "qca_update");
  const c10::cuda::CUDAGuard guard(psi.device());  // after the checks: they name a device mix
  at::Tensor out =
      at::empty(psi.sizes(), psi.options().memory_format(at::MemoryFormat::Contiguous));
  p.out = out.mutable_data_ptr();
  qca_cuda_error err{};
  check_cuda_status(qca_update_cuda(&p, current_stream(), &err), err, "qca_update");
  return out;
}

std::tuple<at::Tensor, at::Tensor> update_backward_cuda(const at::Tensor& grad_out,
                                                        const at::Tensor& psi,
                                                        const at::Tensor& delta, double gamma,
                                                        bool multiplicative, double eps) {
  at::Tensor grad_psi, grad_delta;
  const qca_update_backward_params p = prepare_update_backward(
      grad_out, psi, delta, gamma, multiplicative, eps, grad_psi, grad_delta);
  const c10::cuda::CUDAGuard guard(psi.device());
  qca_cuda_error err{};
  check_cuda_status(qca_update_backward_cuda(&p, current_stream(), &err), err,
                    "qca_update_backward");
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
