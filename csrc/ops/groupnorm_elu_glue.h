// Argument checks and kernel parameters of the GroupNorm + ELU ops, shared by the CPU and CUDA
// glue. Each prepare_* checks the arguments, picks the layout, allocates the outputs and fills
// the C API parameters.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "qca_lowmem/groupnorm_elu.h"

namespace qca_lowmem {

// Forward (statistics computed) and apply (statistics given): y in the layout of x; mean and
// rstd (N, G), fp32 (fp64 for fp64 x): the outputs of the forward, the inputs of apply.
struct GroupNormEluForward {
  qca_groupnorm_elu_params params;
  at::Tensor x, weight, bias, y, mean, rstd;  // x/weight/bias as passed to the kernel
};

void prepare_groupnorm_elu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           int64_t groups, double eps, GroupNormEluForward& f);
void prepare_groupnorm_elu_apply(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& bias, const at::Tensor& mean,
                                 const at::Tensor& rstd, GroupNormEluForward& f);

struct GroupNormEluBackward {
  qca_groupnorm_elu_backward_params params;
  at::Tensor grad_y, x, weight, bias, mean, rstd, grad_x;
  at::Tensor grad_weight_per_sample, grad_bias_per_sample;  // (N C), summed over N afterwards
};

void prepare_groupnorm_elu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                    const at::Tensor& weight, const at::Tensor& bias,
                                    const at::Tensor& mean, const at::Tensor& rstd,
                                    GroupNormEluBackward& b);

// (grad_x, grad_weight, grad_bias) once the kernel has run.
std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_groupnorm_elu_backward(
    const GroupNormEluBackward& b);

}  // namespace qca_lowmem
