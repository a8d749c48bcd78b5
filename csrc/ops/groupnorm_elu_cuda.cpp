// CUDA dispatch of the GroupNorm + ELU ops: same checks as the CPU glue (groupnorm_elu.cpp),
// launched on the current stream of x's device.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "groupnorm_elu.h"

namespace qca_lowmem {
namespace {

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Scratch for the launchers' split-pair path, from the caching allocator on x's device.
at::Tensor workspace_for(const at::Tensor& x, const qca_gn_shape& shape, qca_dtype stat_dtype,
                         int backward) {
  const int64_t bytes = qca_gn_elu_cuda_workspace_bytes(&shape, stat_dtype, backward);
  return at::empty({bytes}, x.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_cuda(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  const at::Tensor& bias,
                                                                  int64_t groups, double eps) {
  GroupNormEluForward f = prepare_groupnorm_elu(x, weight, bias, groups, eps);
  const c10::cuda::CUDAGuard guard(f.x.device());  // after the checks: they name a device mix
  const at::Tensor workspace = workspace_for(f.x, f.params.shape, f.params.stat_dtype, 0);
  f.params.workspace = workspace.mutable_data_ptr();
  f.params.workspace_bytes = workspace.numel();
  qca_cuda_error err{};
  check_cuda_status(qca_gn_elu_forward_cuda(&f.params, current_stream(), &err), err,
                    "groupnorm_elu");
  return {f.y, f.mean, f.rstd};
}

at::Tensor groupnorm_elu_apply_cuda(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& bias, const at::Tensor& mean,
                                    const at::Tensor& rstd) {
  GroupNormEluForward f = prepare_groupnorm_elu_apply(x, weight, bias, mean, rstd);
  const c10::cuda::CUDAGuard guard(f.x.device());
  const at::Tensor workspace = workspace_for(f.x, f.params.shape, f.params.stat_dtype, 0);
  f.params.workspace = workspace.mutable_data_ptr();
  f.params.workspace_bytes = workspace.numel();
  qca_cuda_error err{};
  check_cuda_status(qca_gn_elu_forward_cuda(&f.params, current_stream(), &err), err,
                    "groupnorm_elu_apply");
  return f.y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd) {
  GroupNormEluBackward b = prepare_groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd);
  const c10::cuda::CUDAGuard guard(b.x.device());
  const at::Tensor workspace = workspace_for(b.x, b.params.shape, b.params.stat_dtype, 1);
  b.params.workspace = workspace.mutable_data_ptr();
  b.params.workspace_bytes = workspace.numel();
  qca_cuda_error err{};
  check_cuda_status(qca_gn_elu_backward_cuda(&b.params, current_stream(), &err), err,
                    "groupnorm_elu_backward");
  return finish_groupnorm_elu_backward(b);
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CUDA, m) {
  m.impl("groupnorm_elu", &groupnorm_elu_cuda);
  m.impl("groupnorm_elu_apply", &groupnorm_elu_apply_cuda);
  m.impl("groupnorm_elu_backward", &groupnorm_elu_backward_cuda);
}

}  // namespace qca_lowmem
