// ATen glue of the GroupNorm + ELU ops: argument checks, layout choice, output allocation, CPU
// dispatch.
#include "groupnorm_elu_glue.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <cmath>
#include <utility>

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

at::ScalarType stat_type_of(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_groups(const at::Tensor& x, int64_t groups, const char* op) {
  TORCH_CHECK(groups >= 1 && x.size(1) % groups == 0, op,
              ": groups must be positive and divide the channels of x (", x.size(1), "), got ",
              groups);
}

// weight and bias: (C,) real floating tensors of one dtype on x's device; made contiguous.
std::pair<at::Tensor, at::Tensor> checked_affine(const at::Tensor& x, const at::Tensor& weight,
                                                 const at::Tensor& bias, const char* op) {
  auto checked = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
    check_same_device(x, "x", t, name, op);
    TORCH_CHECK(is_real_float(t.scalar_type()), op, ": ", name,
                " must be float32, float64, float16 or bfloat16, got ", describe(t));
    TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1), op, ": ", name,
                " must have shape (C,) with C = ", x.size(1), " (the channels of x), got ",
                describe(t));
    return t.contiguous();
  };
  at::Tensor w = checked(weight, "weight"), b = checked(bias, "bias");
  TORCH_CHECK(b.scalar_type() == w.scalar_type(), op,
              ": weight and bias must have the same dtype, got weight ", describe(w), " and bias ",
              describe(b));
  return {w, b};
}

// mean and rstd: (N, groups) statistics of x in its statistics dtype; made contiguous.
std::pair<at::Tensor, at::Tensor> checked_stats(const at::Tensor& x, const at::Tensor& mean,
                                                const at::Tensor& rstd, const char* op) {
  auto checked = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
    check_same_device(x, "x", t, name, op);
    TORCH_CHECK(t.scalar_type() == stat_type_of(x), op, ": ", name, " must be ", stat_type_of(x),
                " (statistics of a ", x.scalar_type(), " x), got ", describe(t));
    TORCH_CHECK(t.dim() == 2 && t.size(0) == x.size(0) && t.size(1) >= 1, op, ": ", name,
                " must have shape (N, groups) with N = ", x.size(0), ", got ", describe(t));
    check_groups(x, t.size(1), op);
    return t.contiguous();
  };
  std::pair<at::Tensor, at::Tensor> stats{checked(mean, "mean"), checked(rstd, "rstd")};
  TORCH_CHECK(mean.sizes() == rstd.sizes(), op, ": mean and rstd must have the same shape, got ",
              describe(mean), " and ", describe(rstd));
  return stats;
}

// The fields the forward and backward parameters share.
template <typename Params>
void fill_inputs(Params& p, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                 int64_t groups) {
  p.shape = qca_groupnorm_elu_shape{x.size(0), x.size(1), x.size(2),
                                    x.size(3), groups,    is_channels_last(x) ? 1 : 0};
  p.x_dtype = to_qca_dtype(x.scalar_type());
  p.x = x.const_data_ptr();
  p.affine_dtype = to_qca_dtype(weight.scalar_type());
  p.weight = weight.const_data_ptr();
  p.bias = bias.const_data_ptr();
  p.stat_dtype = to_qca_dtype(stat_type_of(x));
}

// Forward and apply without their statistics, which the callers add.
void prepare_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     int64_t groups, const char* op, GroupNormEluForward& f) {
  f.x = checked_input(x, op);
  std::tie(f.weight, f.bias) = checked_affine(f.x, weight, bias, op);
  check_groups(f.x, groups, op);
  f.y = at::empty(f.x.sizes(), f.x.options(), format_of(f.x));
  f.params = qca_groupnorm_elu_params{};
  fill_inputs(f.params, f.x, f.weight, f.bias, groups);
  f.params.y = f.y.mutable_data_ptr();
}

}  // namespace

void prepare_groupnorm_elu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           int64_t groups, double eps, GroupNormEluForward& f) {
  const char* op = "groupnorm_elu";
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  prepare_forward(x, weight, bias, groups, op, f);
  f.mean = at::empty({f.x.size(0), groups}, f.x.options().dtype(stat_type_of(f.x)));
  f.rstd = at::empty_like(f.mean);
  f.params.eps = eps;
  f.params.mean_out = f.mean.mutable_data_ptr();
  f.params.rstd_out = f.rstd.mutable_data_ptr();
}

void prepare_groupnorm_elu_apply(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& bias, const at::Tensor& mean,
                                 const at::Tensor& rstd, GroupNormEluForward& f) {
  const char* op = "groupnorm_elu_apply";
  const at::Tensor x_checked = checked_input(x, op);
  const auto [mean_in, rstd_in] = checked_stats(x_checked, mean, rstd, op);
  prepare_forward(x_checked, weight, bias, mean.size(1), op, f);
  f.mean = mean_in;
  f.rstd = rstd_in;
  f.params.mean_in = f.mean.const_data_ptr();
  f.params.rstd_in = f.rstd.const_data_ptr();
}

void prepare_groupnorm_elu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                    const at::Tensor& weight, const at::Tensor& bias,
                                    const at::Tensor& mean, const at::Tensor& rstd,
                                    GroupNormEluBackward& b) {
  const char* op = "groupnorm_elu_backward";
  b.x = checked_input(x, op);
  TORCH_CHECK(grad_y.defined(), op, ": grad_y is undefined");
  check_same_device(b.x, "x", grad_y, "grad_y", op);
  TORCH_CHECK(grad_y.sizes() == x.sizes() && grad_y.scalar_type() == x.scalar_type(), op,
              ": grad_y must have the shape and dtype of x (", describe(x), "), got ",
              describe(grad_y));
  b.grad_y = grad_y.contiguous(format_of(b.x));
  std::tie(b.weight, b.bias) = checked_affine(b.x, weight, bias, op);
  std::tie(b.mean, b.rstd) = checked_stats(b.x, mean, rstd, op);
  b.grad_x = at::empty(b.x.sizes(), b.x.options(), format_of(b.x));
  b.grad_weight_per_sample =
      at::empty({b.x.size(0) * b.x.size(1)}, b.x.options().dtype(stat_type_of(b.x)));
  b.grad_bias_per_sample = at::empty_like(b.grad_weight_per_sample);
  qca_groupnorm_elu_backward_params& p = b.params;
  p = qca_groupnorm_elu_backward_params{};
  fill_inputs(p, b.x, b.weight, b.bias, mean.size(1));
  p.grad_y = b.grad_y.const_data_ptr();
  p.mean = b.mean.const_data_ptr();
  p.rstd = b.rstd.const_data_ptr();
  p.grad_x = b.grad_x.mutable_data_ptr();
  p.grad_weight_per_sample = b.grad_weight_per_sample.mutable_data_ptr();
  p.grad_bias_per_sample = b.grad_bias_per_sample.mutable_data_ptr();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_groupnorm_elu_backward(
    const GroupNormEluBackward& b) {
  const auto affine_type = b.weight.scalar_type();
  // One sample's sums are the totals: the reduction cost a few microseconds a call, a twentieth
  // of the CPU kernel at the U-Net's 16x16 planes.
  const auto total = [&](const at::Tensor& per_sample) {
    const int64_t samples = b.x.size(0), channels = b.x.size(1);
    return (samples == 1 ? per_sample : at::sum(per_sample.view({samples, channels}), {0}))
        .to(affine_type);
  };
  return {b.grad_x, total(b.grad_weight_per_sample), total(b.grad_bias_per_sample)};
}

namespace {

// A kernel over (sample, group) pairs [begin, end), on the CPU: about 32K elements a task.
template <typename Kernel>
void parallel_pairs_cpu(const qca_groupnorm_elu_shape& s, const char* op, const Kernel& kernel) {
  const int64_t per_pair = std::max<int64_t>(1, s.channels / s.groups * s.height * s.width);
  parallel_for_checked(s.batch * s.groups, 32768 / per_pair, op, kernel);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_cpu(const at::Tensor& x,
                                                                 const at::Tensor& weight,
                                                                 const at::Tensor& bias,
                                                                 int64_t groups, double eps) {
  GroupNormEluForward f;
  prepare_groupnorm_elu(x, weight, bias, groups, eps, f);
  parallel_pairs_cpu(f.params.shape, "groupnorm_elu", [&](int64_t lo, int64_t hi) {
    return qca_groupnorm_elu_forward_cpu(&f.params, lo, hi);
  });
  return {f.y, f.mean, f.rstd};
}

at::Tensor groupnorm_elu_apply_cpu(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& bias, const at::Tensor& mean,
                                   const at::Tensor& rstd) {
  GroupNormEluForward f;
  prepare_groupnorm_elu_apply(x, weight, bias, mean, rstd, f);
  parallel_pairs_cpu(f.params.shape, "groupnorm_elu_apply", [&](int64_t lo, int64_t hi) {
    return qca_groupnorm_elu_forward_cpu(&f.params, lo, hi);
  });
  return f.y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_elu_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd) {
  GroupNormEluBackward b;
  prepare_groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd, b);
  parallel_pairs_cpu(b.params.shape, "groupnorm_elu_backward", [&](int64_t lo, int64_t hi) {
    return qca_groupnorm_elu_backward_cpu(&b.params, lo, hi);
  });
  return finish_groupnorm_elu_backward(b);
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) {
  m.impl("groupnorm_elu", &groupnorm_elu_cpu);
  m.impl("groupnorm_elu_apply", &groupnorm_elu_apply_cpu);
  m.impl("groupnorm_elu_backward", &groupnorm_elu_backward_cpu);
}

}  // namespace qca_lowmem
