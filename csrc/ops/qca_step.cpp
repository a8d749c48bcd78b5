// ATen glue of the QCA step ops: argument checks, output allocation, CPU dispatch.
#include "qca_step_glue.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "glue.h"

namespace qca_lowmem {
namespace {

// The real tensor of a step, (B, 2d, H, W), must line up with psi (B, H, W, d).
void check_step_layout(const at::Tensor& psi, const at::Tensor& t, const char* name,
                       const char* op) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  check_same_device(psi, "psi", t, name, op);
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must have 4 dimensions (B, 2d, H, W), got ",
              describe(t));
  const int64_t d = psi.size(3);
  TORCH_CHECK(t.size(1) == 2 * d, op, ": ", name, " must have 2*d = ", 2 * d, " channels (d = ", d,
              " from psi's last dimension), got ", describe(t));
  TORCH_CHECK(t.size(0) == psi.size(0), op, ": ", name, " has batch size ", t.size(0),
              " but psi has ", psi.size(0), "; got ", describe(t), " and psi ", describe(psi));
  TORCH_CHECK(t.size(2) == psi.size(1) && t.size(3) == psi.size(2), op, ": ", name,
              " must have the spatial size of psi (", psi.size(1), ", ", psi.size(2), "), got ",
              describe(t));
}

at::ScalarType state_real_type(const at::Tensor& psi) {
  return psi.scalar_type() == at::kComplexDouble ? at::kDouble : at::kFloat;
}

// The update's parameters without an output: the forward adds one, the backward does not.
qca_update_params update_params(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                                bool multiplicative, double eps, const char* op) {
  check_state(psi, op);
  check_step_layout(psi, delta, "delta", op);
  if (psi.scalar_type() == at::kComplexFloat) {
    const at::ScalarType t = delta.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
                ": delta must be float32, float16 or bfloat16 for a complex64 psi, got ",
                describe(delta));
  } else {
    TORCH_CHECK(delta.scalar_type() == at::kDouble, op,
                ": delta must be float64 for a complex128 psi, got ", describe(delta));
  }
  TORCH_CHECK(std::isfinite(gamma), op, ": gamma must be finite, got ", gamma);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  qca_update_params p{};
  p.grid = grid_of(psi);
  p.state_dtype = to_qca_dtype(psi.scalar_type());
  p.psi = psi.const_data_ptr();
  copy_strides(psi, p.psi_stride);
  p.delta_dtype = to_qca_dtype(delta.scalar_type());
  p.delta = delta.const_data_ptr();
  copy_strides(delta, p.delta_stride);
  p.gamma = gamma;
  p.eps = eps;
  p.multiplicative = multiplicative ? 1 : 0;
  p.out = nullptr;
  return p;
}

at::Tensor empty_contiguous_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

void prepare_pack(const at::Tensor& psi, std::optional<at::ScalarType> dtype, bool channels_last,
                  at::Tensor& x_out, qca_pack_params& p) {
  const char* op = "qca_pack";
  check_state(psi, op);
  const at::ScalarType x_dtype = dtype.value_or(state_real_type(psi));
  TORCH_CHECK(is_real_float(x_dtype), op,
              ": dtype must be float32, float64, float16 or bfloat16, got ", x_dtype);
  const int64_t B = psi.size(0), H = psi.size(1), W = psi.size(2), d = psi.size(3);
  x_out = at::empty({B, 2 * d, H, W}, psi.options().dtype(x_dtype),
                    channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  p = qca_pack_params{};
  p.grid = grid_of(psi);
  p.state_dtype = to_qca_dtype(psi.scalar_type());
  p.psi = psi.const_data_ptr();
  copy_strides(psi, p.psi_stride);
  p.x_dtype = to_qca_dtype(x_dtype);
  p.x = x_out.mutable_data_ptr();
  copy_strides(x_out, p.x_stride);
}

void prepare_pack_backward(const at::Tensor& grad_x, at::ScalarType psi_dtype,
                           at::Tensor& grad_psi_out, qca_pack_backward_params& p) {
  const char* op = "qca_pack_backward";
  TORCH_CHECK(grad_x.defined() && grad_x.dim() == 4 && grad_x.size(1) % 2 == 0 &&
                  grad_x.size(1) >= 2 && is_real_float(grad_x.scalar_type()),
              op, ": grad_x must be a real floating tensor (B, 2d, H, W), got ", describe(grad_x));
  TORCH_CHECK(psi_dtype == at::kComplexFloat || psi_dtype == at::kComplexDouble, op,
              ": psi_dtype must be complex64 or complex128, got ", psi_dtype);
  const int64_t B = grad_x.size(0), d = grad_x.size(1) / 2, H = grad_x.size(2), W = grad_x.size(3);
  grad_psi_out = at::empty({B, H, W, d}, grad_x.options().dtype(psi_dtype));
  p = qca_pack_backward_params{};
  p.grid = qca_grid{B, H, W, d};
  p.x_dtype = to_qca_dtype(grad_x.scalar_type());
  p.x = grad_x.const_data_ptr();
  copy_strides(grad_x, p.x_stride);
  p.state_dtype = to_qca_dtype(psi_dtype);
  p.psi = grad_psi_out.mutable_data_ptr();
}

void prepare_update(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                    bool multiplicative, double eps, at::Tensor& out, qca_update_params& p) {
  p = update_params(psi, delta, gamma, multiplicative, eps, "qca_update");
  out = empty_contiguous_like(psi);
  p.out = out.mutable_data_ptr();
}

void prepare_update_backward(const at::Tensor& grad_out, const at::Tensor& psi,
                             const at::Tensor& delta, double gamma, bool multiplicative, double eps,
                             at::Tensor& grad_psi, at::Tensor& grad_delta,
                             qca_update_backward_params& bp) {
  const char* op = "qca_update_backward";
  bp = qca_update_backward_params{};
  bp.fwd = update_params(psi, delta, gamma, multiplicative, eps, op);
  TORCH_CHECK(grad_out.defined() && grad_out.scalar_type() == psi.scalar_type() &&
                  grad_out.sizes() == psi.sizes(),
              op, ": grad_out must match psi (", describe(psi), "), got ", describe(grad_out));
  check_same_device(psi, "psi", grad_out, "grad_out", op);
  grad_psi = empty_contiguous_like(psi);
  grad_delta = empty_contiguous_like(delta);
  bp.grad_out = grad_out.const_data_ptr();
  copy_strides(grad_out, bp.grad_out_stride);
  bp.grad_psi = grad_psi.mutable_data_ptr();
  bp.grad_delta = grad_delta.mutable_data_ptr();
}

namespace {

at::Tensor pack_cpu(const at::Tensor& psi, std::optional<at::ScalarType> dtype,
                    bool channels_last) {
  at::Tensor x;
  qca_pack_params p;
  prepare_pack(psi, dtype, channels_last, x, p);
  parallel_cells_cpu(p.grid, "qca_pack",
                     [&](int64_t b, int64_t e) { return qca_pack_cpu(&p, b, e); });
  return x;
}

at::Tensor pack_backward_cpu(const at::Tensor& grad_x, at::ScalarType psi_dtype) {
  at::Tensor grad_psi;
  qca_pack_backward_params p;
  prepare_pack_backward(grad_x, psi_dtype, grad_psi, p);
  parallel_cells_cpu(p.grid, "qca_pack_backward",
                     [&](int64_t b, int64_t e) { return qca_pack_backward_cpu(&p, b, e); });
  return grad_psi;
}

at::Tensor update_cpu(const at::Tensor& psi, const at::Tensor& delta, double gamma,
                      bool multiplicative, double eps) {
  at::Tensor out;
  qca_update_params p;
  prepare_update(psi, delta, gamma, multiplicative, eps, out, p);
  parallel_cells_cpu(p.grid, "qca_update",
                     [&](int64_t b, int64_t e) { return qca_update_cpu(&p, b, e); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> update_backward_cpu(const at::Tensor& grad_out,
                                                       const at::Tensor& psi,
                                                       const at::Tensor& delta, double gamma,
                                                       bool multiplicative, double eps) {
  at::Tensor grad_psi, grad_delta;
  qca_update_backward_params p;
  prepare_update_backward(grad_out, psi, delta, gamma, multiplicative, eps, grad_psi, grad_delta,
                          p);
  parallel_cells_cpu(p.fwd.grid, "qca_update_backward",
                     [&](int64_t b, int64_t e) { return qca_update_backward_cpu(&p, b, e); });
  return {grad_psi, grad_delta};
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) {
  m.impl("qca_pack", &pack_cpu);
  m.impl("qca_pack_backward", &pack_backward_cpu);
  m.impl("qca_update", &update_cpu);
  m.impl("qca_update_backward", &update_backward_cpu);
}

}  // namespace qca_lowmem
