// ATen glue of the loss-scaler ops: argument checks and CPU dispatch.
#include "scaler_glue.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/library.h>

#include <limits>
#include <utility>

#include "glue.h"

namespace qca_lowmem {
namespace {

bool has_kernel_dtype(at::ScalarType t) {
  return is_real_float(t) || t == at::kComplexFloat || t == at::kComplexDouble;
}

// A one-element tensor of `dtype` on `device`, as torch's own amp kernels require.
void check_scalar(const at::Tensor& t, const char* name, at::ScalarType dtype,
                  const at::Device& device, const char* device_of, const char* op) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == 1, op, ": ", name, " must be a one-element ",
              dtype, " tensor, got ", describe(t));
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on the same device as ", device_of,
              " (", device, "), got ", describe(t));
}

}  // namespace

void prepare_unscale(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& factor,
                     const char* op, const char* list_name, const char* factor_name,
                     UnscaleList& list) {
  TORCH_CHECK(factor.defined(), op, ": ", factor_name, " is undefined");
  const at::Device device = tensors.empty() ? factor.device() : tensors[0].device();
  const char* device_of = tensors.empty() ? factor_name : "the first tensor of the list";
  at::ScalarType dtype = at::kFloat;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": ", list_name, "[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": ", list_name, "[", i,
                "] must be a strided (dense) tensor; pass a sparse tensor's _values(); got layout ",
                t.layout());
    if (i == 0) {
      dtype = t.scalar_type();
      TORCH_CHECK(has_kernel_dtype(dtype), op, ": ", list_name,
                  " must hold float32, float64, float16, bfloat16, complex64 or complex128 "
                  "tensors, got ",
                  describe(t));
    }
    TORCH_CHECK(t.device() == device, op, ": every tensor of ", list_name,
                " must be on one device (", device, ", from ", list_name, "[0]); ", list_name, "[",
                i, "] is ", describe(t));
    TORCH_CHECK(t.scalar_type() == dtype, op, ": every tensor of ", list_name,
                " must have one dtype (", dtype, ", from ", list_name, "[0]); ", list_name, "[", i,
                "] is ", describe(t));
    TORCH_CHECK(
        at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", list_name, "[", i,
        "] has elements that share memory (an expanded tensor?), so it cannot be updated in "
        "place; got ",
        describe(t));
  }
  check_scalar(factor, factor_name, at::kFloat, device, device_of, op);
  if (found_inf.defined()) check_scalar(found_inf, "found_inf", at::kFloat, device, device_of, op);

  const int64_t reals_per_element = at::isComplexType(dtype) ? 2 : 1;
  list.data.clear();
  list.numel.clear();
  list.stand_ins.clear();
  for (const at::Tensor& t : tensors) {
    // A dense tensor's elements fill [data_ptr, data_ptr + numel) in some order, which is all an
    // elementwise kernel needs.
    at::Tensor dense = t;
    if (!t.is_non_overlapping_and_dense()) {
      dense = t.contiguous();
      list.stand_ins.emplace_back(t, dense);
    }
    list.data.push_back(dense.numel() > 0 ? dense.mutable_data_ptr() : nullptr);
    list.numel.push_back(dense.numel() * reals_per_element);
  }
  qca_unscale_params& p = list.params;
  p = qca_unscale_params{};
  p.dtype = to_qca_dtype(dtype);
  p.n_tensors = static_cast<int64_t>(tensors.size());
  p.tensors = list.data.data();
  p.numel = list.numel.data();
  p.factor = factor.const_data_ptr<float>();
  p.found_inf = found_inf.defined() ? found_inf.mutable_data_ptr<float>() : nullptr;
}

namespace {

bool is_floating(at::ScalarType t) {
  return is_real_float(t) || t == at::kComplexFloat || t == at::kComplexDouble;
}

// Whether a and b (dense, one shape) put each element at the same offset from their data.
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

void check_pair(at::TensorList accumulators, at::TensorList grads, size_t i) {
  const char* op = "accumulate_";
  const at::Tensor &acc = accumulators[i], &grad = grads[i];
  for (const auto& [t, name] : {std::pair(acc, "accumulators"), std::pair(grad, "grads")}) {
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, "[", i,
                "] must be a strided (dense) tensor, got layout ", t.layout());
    TORCH_CHECK(is_floating(t.scalar_type()), op, ": ", name, "[", i,
                "] must be a float32, float64, float16, bfloat16, complex64 or complex128 tensor, "
                "got ",
                describe(t));
    TORCH_CHECK(t.device() == accumulators[0].device(), op,
                ": every tensor must be on the device of accumulators[0] (",
                accumulators[0].device(), "); ", name, "[", i, "] is ", describe(t));
  }
  TORCH_CHECK(acc.sizes() == grad.sizes(), op, ": grads[", i,
              "] must have the shape of accumulators[", i, "] (", acc.sizes(), "), got ",
              describe(grad));
  TORCH_CHECK(acc.is_complex() == grad.is_complex(), op, ": accumulators[", i, "] and grads[", i,
              "] must be both complex or both real, got ", describe(acc), " and ", describe(grad));
  TORCH_CHECK(at::has_internal_overlap(acc) != at::MemOverlap::Yes, op, ": accumulators[", i,
              "] has elements that share memory (an expanded tensor?), so it cannot be added to "
              "in place; got ",
              describe(acc));
}

}  // namespace

void prepare_accumulate(at::TensorList accumulators, at::TensorList grads, AccumulateList& list) {
  const char* op = "accumulate_";
  TORCH_CHECK(accumulators.size() == grads.size(), op,
              ": accumulators and grads must be lists of one length, got ", accumulators.size(),
              " and ", grads.size());
  for (size_t i = 0; i < accumulators.size(); ++i) check_pair(accumulators, grads, i);
  // Every element is added by some thread of one launch: an accumulator read or written by
  // another pair's thread would race. (Overlap within one storage only; where torch cannot tell,
  // a layout that is not dense, it counts as shared.)
  const auto shares = [](const at::Tensor& a, const at::Tensor& b) {
    return a.numel() > 0 && b.numel() > 0 && a.is_alias_of(b) ? at::get_overlap_status(a, b)
                                                              : at::MemOverlapStatus::No;
  };
  for (size_t i = 0; i < accumulators.size(); ++i)
    for (size_t j = 0; j < accumulators.size(); ++j) {
      TORCH_CHECK(j == i || shares(accumulators[i], accumulators[j]) == at::MemOverlapStatus::No,
                  op, ": accumulators[", i, "] and accumulators[", j, "] share memory");
      const at::MemOverlapStatus with_grad = shares(accumulators[i], grads[j]);
      TORCH_CHECK(with_grad == at::MemOverlapStatus::No ||
                      (j == i && with_grad == at::MemOverlapStatus::Full),
                  op, ": accumulators[", i, "] shares memory with grads[", j,
                  "], which is not its own gradient (it would be read while written)");
    }

  list = AccumulateList{};
  for (size_t i = 0; i < accumulators.size(); ++i) {
    const at::Tensor& acc = accumulators[i];
    at::Tensor dense = acc;
    if (!acc.is_non_overlapping_and_dense()) {
      dense = acc.contiguous();
      list.stand_ins.emplace_back(acc, dense);
    }
    at::Tensor grad = grads[i];
    if (!grad.is_non_overlapping_and_dense() || !same_layout(dense, grad)) {
      grad = at::empty_strided(dense.sizes(), dense.strides(), grad.options()).copy_(grad);
      list.grad_copies.push_back(grad);
    }
    const int64_t reals_per_element = acc.is_complex() ? 2 : 1;
    list.accumulators.push_back(dense.numel() > 0 ? dense.mutable_data_ptr() : nullptr);
    list.grads.push_back(grad.numel() > 0 ? grad.const_data_ptr() : nullptr);
    list.accumulator_dtype.push_back(to_qca_dtype(acc.scalar_type()));
    list.grad_dtype.push_back(to_qca_dtype(grad.scalar_type()));
    list.numel.push_back(dense.numel() * reals_per_element);
  }
  qca_accumulate_params& p = list.params;
  p.n_tensors = static_cast<int64_t>(accumulators.size());
  p.accumulators = list.accumulators.data();
  p.accumulator_dtype = list.accumulator_dtype.data();
  p.grads = list.grads.data();
  p.grad_dtype = list.grad_dtype.data();
  p.numel = list.numel.data();
}

void prepare_scale_update(const at::Tensor& scale, const at::Tensor& growth_tracker,
                          const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                          int64_t growth_interval, qca_scale_update_params& p) {
  const char* op = "amp_update_scale_";
  TORCH_CHECK(scale.defined(), op, ": scale is undefined");
  check_scalar(scale, "scale", at::kFloat, scale.device(), "scale", op);
  check_scalar(growth_tracker, "growth_tracker", at::kInt, scale.device(), "scale", op);
  check_scalar(found_inf, "found_inf", at::kFloat, scale.device(), "scale", op);
  p = qca_scale_update_params{};
  p.scale = scale.mutable_data_ptr<float>();
  p.growth_tracker = growth_tracker.mutable_data_ptr<int32_t>();
  p.found_inf = found_inf.const_data_ptr<float>();
  p.growth_factor = growth_factor;
  p.backoff_factor = backoff_factor;
  p.growth_interval = growth_interval;
}

namespace {

// Every tensor's chunks of QCA_SCALER_CHUNK reals, as (tensor, first real): the CPU kernels' tasks.
std::vector<std::pair<int64_t, int64_t>> chunks_of(const int64_t* numel, int64_t n_tensors) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t t = 0; t < n_tensors; ++t)
    for (int64_t begin = 0; begin < numel[t]; begin += QCA_SCALER_CHUNK)
      chunks.emplace_back(t, begin);
  return chunks;
}

// Chunks go to torch's thread pool; per-chunk results are combined afterwards in chunk order,
// so sums do not depend on the thread count. Writes found_inf and sumsq when the params ask.
void run_chunks_cpu(const qca_unscale_params& p, const char* op) {
  const std::vector<std::pair<int64_t, int64_t>> chunks = chunks_of(p.numel, p.n_tensors);
  std::vector<qca_chunk_result> results(chunks.size(), qca_chunk_result{0.0, 0});
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  parallel_for_checked(n_chunks, 1, op, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const auto [t, begin] = chunks[c];
      const int64_t end = std::min(p.numel[t], begin + QCA_SCALER_CHUNK);
      const qca_status s = qca_unscale_range_cpu(&p, t, begin, end, &results[c]);
      if (s != QCA_OK) return s;
    }
    return QCA_OK;
  });

  if (p.sumsq)
    for (int64_t t = 0; t < p.n_tensors; ++t) p.sumsq[t] = 0.0;
  bool any_nonfinite = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const bool nonfinite = results[c].nonfinite != 0;
    any_nonfinite |= nonfinite;
    if (p.sumsq) {
      double& sum = p.sumsq[chunks[c].first];
      sum = nonfinite ? std::numeric_limits<double>::quiet_NaN() : sum + results[c].sumsq;
    }
  }
  if (any_nonfinite && p.found_inf) *p.found_inf = 1.0f;
}

at::Tensor amp_unscale_cpu(at::TensorList grads, const at::Tensor& found_inf,
                           const at::Tensor& inv_scale, bool compute_sumsq) {
  UnscaleList list;
  prepare_unscale(grads, found_inf, inv_scale, "amp_unscale_", "grads", "inv_scale", list);
  at::Tensor sumsq = at::empty({compute_sumsq ? list.params.n_tensors : 0},
                               inv_scale.options().dtype(at::kDouble));
  if (compute_sumsq) list.params.sumsq = sumsq.mutable_data_ptr<double>();
  run_chunks_cpu(list.params, "amp_unscale_");
  list.copy_back();
  return sumsq;
}

void amp_mul_cpu(at::TensorList tensors, const at::Tensor& factor) {
  UnscaleList list;
  prepare_unscale(tensors, at::Tensor(), factor, "amp_mul_", "tensors", "factor", list);
  run_chunks_cpu(list.params, "amp_mul_");
  list.copy_back();
}

void accumulate_cpu(at::TensorList accumulators, at::TensorList grads) {
  AccumulateList list;
  prepare_accumulate(accumulators, grads, list);
  const qca_accumulate_params& p = list.params;
  const std::vector<std::pair<int64_t, int64_t>> chunks = chunks_of(p.numel, p.n_tensors);
  parallel_for_checked(static_cast<int64_t>(chunks.size()), 1, "accumulate_",
                       [&](int64_t first, int64_t last) {
                         for (int64_t c = first; c < last; ++c) {
                           const auto [t, begin] = chunks[c];
                           const int64_t end = std::min(p.numel[t], begin + QCA_SCALER_CHUNK);
                           const qca_status s = qca_accumulate_range_cpu(&p, t, begin, end);
                           if (s != QCA_OK) return s;
                         }
                         return QCA_OK;
                       });
  list.copy_back();
}

void amp_update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                          const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                          int64_t growth_interval) {
  qca_scale_update_params p;
  prepare_scale_update(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                       growth_interval, p);
  check_status(qca_scale_update_cpu(&p), "amp_update_scale_");
}

// Like torch's own in-place ops, bump the version counters of the arguments the schema marks
// as written, so autograd notices when a tensor it saved was modified; then go on to the kernel.
void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                           torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    const c10::IValue& value = (*stack)[first + i];
    if (value.isTensor()) {
      value.toTensor().unsafeGetTensorImpl()->bump_version();
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) t.unsafeGetTensorImpl()->bump_version();
    }
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, ADInplaceOrView, m) {
  for (const char* name : {"amp_unscale_", "amp_mul_", "amp_update_scale_", "accumulate_"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
}

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) {
  m.impl("amp_unscale_", &amp_unscale_cpu);
  m.impl("amp_mul_", &amp_mul_cpu);
  m.impl("amp_update_scale_", &amp_update_scale_cpu);
  m.impl("accumulate_", &accumulate_cpu);
}

// Sparse tensors reach the same checks, which ask for their _values() (or refuse them).
TORCH_LIBRARY_IMPL(qca_lowmem, SparseCPU, m) {
  m.impl("amp_unscale_", &amp_unscale_cpu);
  m.impl("amp_mul_", &amp_mul_cpu);
  m.impl("accumulate_", &accumulate_cpu);
}

}  // namespace qca_lowmem
