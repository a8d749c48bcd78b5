// Argument checks and kernel parameters of the noise ops, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/core/Tensor.h>

#include "qca_lowmem/noise.h"

namespace qca_lowmem {

// Checks the arguments, allocates `out` (contiguous, psi's dtype) and fills the parameters.
void prepare_noise(const at::Tensor& psi, double rate, int64_t seed, int64_t step, bool conjugate,
                   const char* op, at::Tensor& out, qca_noise_params& p);

}  // namespace qca_lowmem
