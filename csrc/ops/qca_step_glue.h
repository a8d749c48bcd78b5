// Argument checks and kernel parameters of the QCA step ops, shared by the CPU and CUDA glue.
// Each prepare_* checks the arguments, allocates the outputs and fills the C API parameters
// (the contract: glue.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "qca_lowmem/qca_step.h"

namespace qca_lowmem {

void prepare_pack(const at::Tensor& psi, std::optional<at::ScalarType> dtype, bool channels_last,
                  at::Tensor& x_out, qca_pack_params& p);
void prepare_pack_backward(const at::Tensor& grad_x, at::ScalarType psi_dtype,
                           at::Tensor& grad_psi_out, qca_pack_backward_params& p);
void prepare_update(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                    bool multiplicative, double eps, at::Tensor& out, qca_update_params& p);
void prepare_update_backward(const at::Tensor& grad_out, const at::Tensor& psi,
                             const at::Tensor& delta, double gamma, bool multiplicative, double eps,
                             at::Tensor& grad_psi, at::Tensor& grad_delta,
                             qca_update_backward_params& bp);

}  // namespace qca_lowmem
