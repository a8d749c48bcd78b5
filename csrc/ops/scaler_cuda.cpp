// CUDA dispatch of the loss-scaler ops: same checks as the CPU glue (scaler.cpp), launched on the
// current stream of the list's device. Nothing here synchronizes with the host, so the ops can
// be captured in a CUDA graph.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "glue_cuda.h"
#include "scaler_glue.h"

namespace qca_lowmem {
namespace {

at::Tensor amp_unscale_cuda(at::TensorList grads, const at::Tensor& found_inf,
                            const at::Tensor& inv_scale, bool compute_sumsq) {
  UnscaleList list;
  prepare_unscale(grads, found_inf, inv_scale, "amp_unscale_", "grads", "inv_scale", list);
  const c10::cuda::CUDAGuard guard(inv_scale.device());
  qca_unscale_params& p = list.params;
  at::Tensor sumsq =
      at::empty({compute_sumsq ? p.n_tensors : 0}, inv_scale.options().dtype(at::kDouble));
  at::Tensor workspace;
  if (compute_sumsq) {
    p.sumsq = sumsq.mutable_data_ptr<double>();
    workspace = at::empty({std::max<int64_t>(1, qca_unscale_workspace_size(&p))},
                          inv_scale.options().dtype(at::kDouble));
    p.workspace = workspace.mutable_data_ptr<double>();
  }
  launch_cuda(qca_unscale_cuda, p, "amp_unscale_");
  list.copy_back();
  return sumsq;
}

void amp_mul_cuda(at::TensorList tensors, const at::Tensor& factor) {
  UnscaleList list;
  prepare_unscale(tensors, at::Tensor(), factor, "amp_mul_", "tensors", "factor", list);
  const c10::cuda::CUDAGuard guard(factor.device());
  launch_cuda(qca_unscale_cuda, list.params, "amp_mul_");
  list.copy_back();
}

void accumulate_cuda(at::TensorList accumulators, at::TensorList grads) {
  AccumulateList list;
  prepare_accumulate(accumulators, grads, list);
  const c10::cuda::CUDAGuard guard(accumulators[0].device());
  launch_cuda(qca_accumulate_cuda, list.params, "accumulate_");
  list.copy_back();
}

void amp_update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                           const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                           int64_t growth_interval) {
  qca_scale_update_params p;
  prepare_scale_update(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                       growth_interval, p);
  const c10::cuda::CUDAGuard guard(scale.device());
  launch_cuda(qca_scale_update_cuda, p, "amp_update_scale_");
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CUDA, m) {
  m.impl("amp_unscale_", &amp_unscale_cuda);
  m.impl("amp_mul_", &amp_mul_cuda);
  m.impl("amp_update_scale_", &amp_update_scale_cuda);
  m.impl("accumulate_", &accumulate_cuda);
}

TORCH_LIBRARY_IMPL(qca_lowmem, SparseCUDA, m) {
  m.impl("amp_unscale_", &amp_unscale_cuda);
  m.impl("amp_mul_", &amp_mul_cuda);
  m.impl("accumulate_", &accumulate_cuda);
}

}  // namespace qca_lowmem
