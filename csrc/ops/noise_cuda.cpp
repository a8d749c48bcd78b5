// CUDA dispatch of the noise ops: same checks as the CPU glue (noise.cpp), launched on the
// current stream of psi's device.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "noise_glue.h"

namespace qca_lowmem {
namespace {

at::Tensor phase_flip_cuda(const at::Tensor& psi, double rate, int64_t seed, int64_t step,
                           bool conjugate) {
  at::Tensor out;
  qca_noise_params p;
  prepare_noise(psi, rate, seed, step, conjugate, "phase_flip", out, p);
  const c10::cuda::CUDAGuard guard(psi.device());  // after the checks: they name a device mix
  launch_cuda(qca_phase_flip_cuda, p, "phase_flip");
  return out;
}

at::Tensor bit_flip_cuda(const at::Tensor& psi, double rate, int64_t seed, int64_t step) {
  at::Tensor out;
  qca_noise_params p;
  prepare_noise(psi, rate, seed, step, false, "bit_flip", out, p);
  const c10::cuda::CUDAGuard guard(psi.device());  // after the checks: they name a device mix
  launch_cuda(qca_bit_flip_cuda, p, "bit_flip");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CUDA, m) {
  m.impl("phase_flip", &phase_flip_cuda);
  m.impl("bit_flip", &bit_flip_cuda);
}

}  // namespace qca_lowmem
