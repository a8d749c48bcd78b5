// ATen glue of the noise ops: argument checks, output allocation, CPU dispatch.
#include "noise_glue.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "glue.h"

namespace qca_lowmem {

void prepare_noise(const at::Tensor& psi, double rate, int64_t seed, int64_t step, bool conjugate,
                   const char* op, at::Tensor& out, qca_noise_params& p) {
  check_state(psi, op);
  TORCH_CHECK(psi.size(3) <= QCA_NOISE_MAX_D, op, ": psi's last dimension d must be at most ",
              QCA_NOISE_MAX_D, ", got ", describe(psi));
  TORCH_CHECK(psi.size(0) * psi.size(1) * psi.size(2) <= QCA_NOISE_MAX_CELLS, op,
              ": psi has more than 2^48 cells: ", describe(psi));
  TORCH_CHECK(std::isfinite(rate) && rate >= 0.0 && rate <= 1.0, op,
              ": rate must be a probability in [0, 1], got ", rate);
  out = at::empty(psi.sizes(), psi.options().memory_format(at::MemoryFormat::Contiguous));
  p = qca_noise_params{};
  p.grid = grid_of(psi);
  p.state_dtype = to_qca_dtype(psi.scalar_type());
  p.psi = psi.const_data_ptr();
  copy_strides(psi, p.psi_stride);
  p.out = out.mutable_data_ptr();
  p.rate = rate;
  // int64 seeds and steps are taken as their two's-complement 64-bit patterns.
  p.seed = static_cast<uint64_t>(seed);
  p.step = static_cast<uint64_t>(step);
  p.conjugate = conjugate ? 1 : 0;
}

namespace {

at::Tensor phase_flip_cpu(const at::Tensor& psi, double rate, int64_t seed, int64_t step,
                          bool conjugate) {
  at::Tensor out;
  qca_noise_params p;
  prepare_noise(psi, rate, seed, step, conjugate, "phase_flip", out, p);
  parallel_cells_cpu(p.grid, "phase_flip",
                     [&](int64_t b, int64_t e) { return qca_phase_flip_cpu(&p, b, e); });
  return out;
}

at::Tensor bit_flip_cpu(const at::Tensor& psi, double rate, int64_t seed, int64_t step) {
  at::Tensor out;
  qca_noise_params p;
  prepare_noise(psi, rate, seed, step, false, "bit_flip", out, p);
  parallel_cells_cpu(p.grid, "bit_flip",
                     [&](int64_t b, int64_t e) { return qca_bit_flip_cpu(&p, b, e); });
  return out;
}

// No tensor arguments: the coin is pure host arithmetic on (seed, step), the same on any device.
double noise_coin(int64_t seed, int64_t step) {
  return qca_noise_coin(static_cast<uint64_t>(seed), static_cast<uint64_t>(step));
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) {
  m.impl("phase_flip", &phase_flip_cpu);
  m.impl("bit_flip", &bit_flip_cpu);
}

TORCH_LIBRARY_IMPL(qca_lowmem, CompositeExplicitAutograd, m) { m.impl("noise_coin", &noise_coin); }

}  // namespace qca_lowmem
