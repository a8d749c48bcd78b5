// ATen glue of the GroupNorm + ELU ops: argument checks, layout choice, output allocation, CPU
// dispatch.
#include "groupnorm_elu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>

#include "glue.h"

namespace qca_lowmem {
namespace {

// x must be a real floating (N, C, H, W) tensor; returns it in a layout the kernels take.
at::Tensor checked_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(is_real_float(x.scalar_type()), op,
              ": x must be float32, float64, float16 or bfloat16, got ", describe(x));
  TORCH_CHECK(x.dim() == 4, op, ": x must have 4 dimensions (N, C, H, W), got ", describe(x));
  TORCH_CHECK(x.size(1) >= 1, op, ": x must have at least one channel, got ", describe(x));
  if (x.is_contiguous() || x.is_contiguous(at::MemoryFormat::ChannelsLast)) return x;
  return x.contiguous();
}

bool is_channels_last(const at::Tensor& x) {
  return !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

at::MemoryFormat format_of(const at::Tensor& x) {
  return is_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

at::Tensor checked_affine(const at::Tensor& x, const at::Tensor& t, const char* name,
                          const char* op) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  check_same_device(x, "x", t, name, op);
  TORCH_CHECK(is_real_float(t.scalar_type()), op, ": ", name,
              " must be float32, float64, float16 or bfloat16, got ", describe(t));
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1), op, ": ", name,
              " must have shape (C,) with C = ", x.size(1), " (the channels of x), got ",
              describe(t));
  return t.contiguous();
}

at::ScalarType stat_type_of(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_groups(const at::Tensor& x, int64_t groups, const char* op) {
  TORCH_CHECK(groups >= 1 && x.size(1) % groups == 0, op,
              ": groups must be positive and divide the channels of x (", x.size(1), "), got ",
              groups);
}

at::Tensor checked_stat(const at::Tensor& x, const at::Tensor& t, const char* name,
                        const char* op) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  check_same_device(x, "x", t, name, op);
  TORCH_CHECK(t.scalar_type() == stat_type_of(x), op, ": ", name, " must be ",
              stat_type_of(x), " (statistics of a ", x.scalar_type(), " x), got ", describe(t));
  TORCH_CHECK(t.dim() == 2 && t.size(0) == x.size(0) && t.size(1) >= 1, op, ": ", name,
              " must have shape (N, groups) with N = ", x.size(0), ", got ", describe(t));
  check_groups(x, t.size(1), op);
  return t.contiguous();
}

qca_gn_shape shape_of(const at::Tensor& x, int64_t groups) {
  return qca_gn_shape{x.size(0), x.size(1), x.size(2), x.size(3), groups,
                      is_channels_last(x) ? 1 : 0};
}

GroupNormEluForward prepare_forward_common(const at::Tensor& x_in, const at::Tensor& weight_in,
                                           const at::Tensor& bias_in, int64_t groups,
                                           const char* op) {
  GroupNormEluForward f;
  f.x = checked_input(x_in, op);
  f.weight = checked_affine(f.x, weight_in, "weight", op);
  f.bias = checked_affine(f.x, bias_in, "bias", op);
  check_groups(f.x, groups, op);
  f.y = at::empty(f.x.sizes(), f.x.options(), format_of(f.x));
  qca_gn_elu_params& p = f.params;
  p = qca_gn_elu_params{};
  p.shape = shape_of(f.x, groups);
  p.x_dtype = to_qca_dtype(f.x.scalar_type());
  p.x = f.x.const_data_ptr();
  p.affine_dtype = to_qca_dtype(f.weight.scalar_type());
  TORCH_CHECK(f.bias.scalar_type() == f.weight.scalar_type(), op,
              ": weight and bias must have the same dtype, got weight ", describe(f.weight),
              " and bias ", describe(f.bias));
  p.weight = f.weight.const_data_ptr();
  p.bias = f.bias.const_data_ptr();
  p.stat_dtype = to_qca_dtype(stat_type_of(f.x));
  p.y = f.y.mutable_data_ptr();
  return f;
}

}  // namespace

GroupNormEluForward prepare_groupnorm_elu(const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& bias, int64_t groups, double eps) {
  const char* op = "groupnorm_elu";
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  GroupNormEluForward f = prepare_forward_common(x, weight, bias, groups, op);
  f.mean = at::empty({f.x.size(0), groups}, f.x.options().dtype(stat_type_of(f.x)));
  f.rstd = at::empty_like(f.mean);
  f.params.eps = eps;
  f.params.stats_given = 0;
  f.params.mean = f.mean.mutable_data_ptr();
  f.params.rstd = f.rstd.mutable_data_ptr();
  return f;
}

GroupNormEluForward prepare_groupnorm_elu_apply(const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& bias, const at::Tensor& mean,
                                                const at::Tensor& rstd) {
  const char* op = "groupnorm_elu_apply";
  const at::Tensor x_checked = checked_input(x, op);
  const at::Tensor mean_checked = checked_stat(x_checked, mean, "mean", op);
  const at::Tensor rstd_checked = checked_stat(x_checked, rstd, "rstd", op);
  TORCH_CHECK(mean.sizes() == rstd.sizes(), op, ": mean and rstd must have the same shape, got ",
              describe(mean), " and ", describe(rstd));
  GroupNormEluForward f = prepare_forward_common(x_checked, weight, bias, mean.size(1), op);
  f.mean = mean_checked;
  f.rstd = rstd_checked;
  f.params.stats_given = 1;
  // The kernel only reads the statistics when they are given.
  f.params.mean = const_cast<void*>(f.mean.const_data_ptr());
  f.params.rstd = const_cast<void*>(f.rstd.const_data_ptr());
  return f;
}

GroupNormEluBackward prepare_groupnorm_elu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& bias, const at::Tensor& mean,
                                                    const at::Tensor& rstd) {
  const char* op = "groupnorm_elu_backward";
  GroupNormEluBackward b;
  b.x = checked_input(x, op);
  TORCH_CHECK(grad_y.defined(), op, ": grad_y is undefined");
  check_same_device(b.x, "x", grad_y, "grad_y", op);
  TORCH_CHECK(grad_y.sizes() == x.sizes() && grad_y.scalar_type() == x.scalar_type(), op,
              ": grad_y must have the shape and dtype of x (", describe(x), "), got ",
              describe(grad_y));
  b.grad_y = grad_y.contiguous(format_of(b.x));
  b.weight = checked_affine(b.x, weight, "weight", op);
  b.bias = checked_affine(b.x, bias, "bias", op);
  TORCH_CHECK(b.bias.scalar_type() == b.weight.scalar_type(), op,
              ": weight and bias must have the same dtype, got weight ", describe(b.weight),
              " and bias ", describe(b.bias));
  b.mean = checked_stat(b.x, mean, "mean", op);
  b.rstd = checked_stat(b.x, rstd, "rstd", op);
  TORCH_CHECK(mean.sizes() == rstd.sizes(), op, ": mean and rstd must have the same shape, got ",
              describe(mean), " and ", describe(rstd));
  const int64_t groups = mean.size(1);
  b.grad_x = at::empty(b.x.sizes(), b.x.options(), format_of(b.x));
  b.grad_weight_per_sample =
      at::empty({b.x.size(0), b.x.size(1)}, b.x.options().dtype(stat_type_of(b.x)));
  b.grad_bias_per_sample = at::empty_like(b.grad_weight_per_sample);
  qca_gn_elu_backward_params& p = b.params;
  p = qca_gn_elu_backward_params{};
  p.shape = shape_of(b.x, groups);
  p.x_dtype = to_qca_dtype(b.x.scalar_type());
  p.grad_y = b.grad_y.const_data_ptr();
  p.x = b.x.const_data_ptr();
  p.affine_dtype = to_qca_dtype(b.weight.scalar_type());
  p.weight = b.weight.const_data_ptr();
  p.bias = b.bias.const_data_ptr();
  p.stat_dtype = to_qca_dtype(stat_type_of(b.x));
  p.mean = b.mean.const_data_ptr();
  p.rstd = b.rstd.const_data_ptr();
  p.grad_x = b.grad_x.mutable_data_ptr();
  p.grad_weight_per_sample = b.grad_weight_per_sample.mutable_data_ptr();
  p.grad_bias_per_sample = b.grad_bias_per_sample.mutable_data_ptr();
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_groupnorm_elu_backward(
    const GroupNormEluBackward& b) {
  const auto affine_type = b.weight.scalar_type();
  return {b.grad_x, at::sum(b.grad_weight_per_sample, {0}).to(affine_type),
          at::sum(b.grad_bias_per_sample, {0}).to(affine_type)};
}

namespace {

// Splits the (sample, group) pairs over torch's intra-op thread pool.
template <typename Kernel>
void run_pairs_cpu(const qca_gn_shape& s, const char* op, Kernel kernel) {
  std::atomic<int> failure{QCA_OK};
  const int64_t per_pair = std::max<int64_t>(1, s.channels / s.groups * s.height * s.width);
  const int64_t grain = std::max<int64_t>(1, 32768 / per_pair);
  at::parallel_for(0, s.batch * s.groups, grain, [&](int64_t begin, int64_t end) {
    const qca_status status = kernel(begin, end);
    if (status != QCA_OK) failure.store(status);
  });
  check_status(static_cast<qca_status>(failure.load()), op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_cpu(const at::Tensor& x,
                                                                 const at::Tensor& weight,
                                                                 const at::Tensor& bias,
                                                                 int64_t groups, double eps) {
  const GroupNormEluForward f = prepare_groupnorm_elu(x, weight, bias, groups, eps);
  run_pairs_cpu(f.params.shape, "groupnorm_elu",
                [&](int64_t b, int64_t e) { return qca_gn_elu_forward_cpu(&f.params, b, e); });
  return {f.y, f.mean, f.rstd};
}

at::Tensor groupnorm_elu_apply_cpu(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& bias, const at::Tensor& mean,
                                   const at::Tensor& rstd) {
  const GroupNormEluForward f = prepare_groupnorm_elu_apply(x, weight, bias, mean, rstd);
  run_pairs_cpu(f.params.shape, "groupnorm_elu_apply",
                [&](int64_t b, int64_t e) { return qca_gn_elu_forward_cpu(&f.params, b, e); });
  return f.y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd) {
  const GroupNormEluBackward b = prepare_groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd);
  run_pairs_cpu(b.params.shape, "groupnorm_elu_backward",
                [&](int64_t lo, int64_t hi) { return qca_gn_elu_backward_cpu(&b.params, lo, hi); });
  return finish_groupnorm_elu_backward(b);
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) {
  m.impl("groupnorm_elu", &groupnorm_elu_cpu);
  m.impl("groupnorm_elu_apply", &groupnorm_elu_apply_cpu);
  m.impl("groupnorm_elu_backward", &groupnorm_elu_backward_cpu);
}

}  // namespace qca_lowmem
