// ATen glue of step_difference: argument checks, the result's allocation, CPU dispatch.
#include "step_difference_glue.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "glue.h"

namespace qca_lowmem {

namespace {

constexpr const char* kOp = "step_difference";

bool is_measured(at::ScalarType t) {
  return is_real_float(t) || t == at::kComplexFloat || t == at::kComplexDouble;
}

void check_like_actual(const at::Tensor& actual, const at::Tensor& t, const char* name) {
  check_same_device(actual, "actual", t, name, kOp);
  TORCH_CHECK(t.scalar_type() == actual.scalar_type() && t.sizes() == actual.sizes(), kOp, ": ",
              name, " must have actual's dtype and shape (", actual.scalar_type(), ", ",
              actual.sizes(), "), got ", describe(t));
}

}  // namespace

void prepare_step_difference(const at::Tensor& actual, const at::Tensor& expected,
                             const std::optional<at::Tensor>& before, StepDifferenceTensors& t,
                             qca_step_difference_params& p) {
  TORCH_CHECK(is_measured(actual.scalar_type()), kOp,
              ": actual must be a float16, bfloat16, float32, float64, complex64 or complex128 "
              "tensor, got ",
              describe(actual));
  check_like_actual(actual, expected, "expected");
  if (before.has_value()) check_like_actual(actual, *before, "before");
  t.actual = actual.contiguous();
  t.expected = expected.contiguous();
  t.before = before.has_value() ? before->contiguous() : at::Tensor();
  t.out = at::empty({}, actual.options().dtype(at::kFloat));
  p = qca_step_difference_params{};
  p.dtype = to_qca_dtype(actual.scalar_type());
  p.complex_elements = actual.is_complex() ? 1 : 0;
  p.count = actual.numel();
  p.actual = t.actual.const_data_ptr();
  p.expected = t.expected.const_data_ptr();
  p.before = t.before.defined() ? t.before.const_data_ptr() : nullptr;
  p.out = t.out.mutable_data_ptr<float>();
}

namespace {

at::Tensor step_difference_cpu(const at::Tensor& actual, const at::Tensor& expected,
                               const std::optional<at::Tensor>& before) {
  StepDifferenceTensors t;
  qca_step_difference_params p;
  prepare_step_difference(actual, expected, before, t, p);
  check_status(qca_step_difference_cpu(&p), kOp);
  return t.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) { m.impl("step_difference", &step_difference_cpu); }

}  // namespace qca_lowmem
