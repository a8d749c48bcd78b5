// CUDA dispatch of step_difference: the CPU glue's checks (step_difference.cpp), launched on the
// current stream of the tensors' device with a workspace from torch's allocator.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "step_difference_glue.h"

namespace qca_lowmem {
namespace {

at::Tensor step_difference_cuda(const at::Tensor& actual, const at::Tensor& expected,
                                const std::optional<at::Tensor>& before) {
  StepDifferenceTensors t;
  qca_step_difference_params p;
  prepare_step_difference(actual, expected, before, t, p);
  const c10::cuda::CUDAGuard guard(actual.device());  // after the checks: they name a device mix
  const at::Tensor workspace =
      at::empty({QCA_STEP_DIFFERENCE_WORKSPACE_BYTES}, actual.options().dtype(at::kByte));
  p.workspace = workspace.mutable_data_ptr();
  launch_cuda(qca_step_difference_cuda, p, "step_difference");
  return t.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CUDA, m) { m.impl("step_difference", &step_difference_cuda); }

}  // namespace qca_lowmem
