// Argument checks and kernel parameters of the QCA step ops, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "qca_lowmem/qca_step.h"

namespace qca_lowmem {

qca_pack_params prepare_pack(const at::Tensor& psi, std::optional<at::ScalarType> dtype,
                             bool channels_last, at::Tensor& x_out);
qca_unpack_params prepare_unpack(const at::Tensor& grad_x, at::ScalarType psi_dtype,
                                 at::Tensor& grad_psi_out);
qca_update_params prepare_update(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                                 bool multiplicative, double eps, const char* op);
qca_update_backward_params prepare_update_backward(const at::Tensor& grad_out,
                                                   const at::Tensor& psi, const at::Tensor& delta,
                                                   double gamma, bool multiplicative, double eps,
                                                   at::Tensor& grad_psi, at::Tensor& grad_delta);

}  // namespace qca_lowmem
