// Argument checks and kernel parameters of step_difference, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "qca_lowmem/step_difference.h"

namespace qca_lowmem {

// The tensors the kernel reads (contiguous copies where the arguments are not) and the result.
struct StepDifferenceTensors {
  at::Tensor actual, expected, before, out;
};

// Checks the arguments, allocates the result (a float32 scalar on their device) and fills the
// parameters; the workspace is the CUDA glue's.
void prepare_step_difference(const at::Tensor& actual, const at::Tensor& expected,
                             const std::optional<at::Tensor>& before, StepDifferenceTensors& t,
                             qca_step_difference_params& p);

}  // namespace qca_lowmem
