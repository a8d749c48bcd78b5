// CUDA dispatch of the GroupNorm + ELU ops: same checks as the CPU glue (groupnorm_elu.cpp),
// launched on the current stream of x's device. Every entry point: prepare (the checks), guard,
// launch.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "groupnorm_elu_glue.h"

namespace qca_lowmem {
namespace {

// Launches with the scratch the launchers' split-pair path needs, from the caching allocator on
// x's device; `backward` picks the backward's workspace size. (The forward with given
// statistics, groupnorm_elu_apply, needs none.)
template <typename Params>
void launch_with_workspace(cuda_launcher<Params> launcher, Params& p, const at::Tensor& x,
                           int backward, const char* op) {
  const int64_t bytes = qca_groupnorm_elu_cuda_workspace_bytes(&p.shape, p.stat_dtype, backward);
  const at::Tensor workspace = at::empty({bytes}, x.options().dtype(at::kByte));
  p.workspace = workspace.mutable_data_ptr();
  p.workspace_bytes = workspace.numel();
  launch_cuda(launcher, p, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_cuda(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  const at::Tensor& bias,
                                                                  int64_t groups, double eps) {
  GroupNormEluForward f;
  prepare_groupnorm_elu(x, weight, bias, groups, eps, f);
  const c10::cuda::CUDAGuard guard(x.device());  // after the checks: they name a device mix
  launch_with_workspace(qca_groupnorm_elu_forward_cuda, f.params, f.x, 0, "groupnorm_elu");
  return {f.y, f.mean, f.rstd};
}

at::Tensor groupnorm_elu_apply_cuda(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& bias, const at::Tensor& mean,
                                    const at::Tensor& rstd) {
  GroupNormEluForward f;
  prepare_groupnorm_elu_apply(x, weight, bias, mean, rstd, f);
  const c10::cuda::CUDAGuard guard(x.device());  // after the checks: they name a device mix
  launch_cuda(qca_groupnorm_elu_forward_cuda, f.params, "groupnorm_elu_apply");
  return f.y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd) {
  GroupNormEluBackward b;
  prepare_groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd, b);
  const c10::cuda::CUDAGuard guard(x.device());  // after the checks: they name a device mix
  launch_with_workspace(qca_groupnorm_elu_backward_cuda, b.params, b.x, 1,
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
