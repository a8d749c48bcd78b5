// Argument checks and kernel parameters of the loss-scaler ops, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "qca_lowmem/scaler.h"

namespace qca_lowmem {

// Host arrays the kernel parameters point into; they must outlive the kernel call.
struct UnscaleList {
  std::vector<void*> data;
  std::vector<int64_t> numel;
  // Tensors that are not dense (a slice with steps, say) are processed in a dense copy, which
  // copy_back() writes into the original after the kernel.
  std::vector<std::pair<at::Tensor, at::Tensor>> stand_ins;
  qca_unscale_params params{};

  void copy_back() {
    for (auto& [original, dense] : stand_ins) original.copy_(dense);
  }
};

// Validates a multi-tensor list with its factor (and found_inf when `found_inf` is defined);
// fills `list` with data pointers and real counts. `op`, `list_name` and `factor_name` name the
// arguments in error messages.
void prepare_unscale(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& factor,
                     const char* op, const char* list_name, const char* factor_name,
                     UnscaleList& list);

// Host arrays and tensors the accumulation's parameters point into; they must outlive the kernel
// call. An accumulator that is not dense is updated in a dense stand-in that copy_back() writes
// into it; a gradient laid out otherwise than its accumulator is read from a copy in its layout.
struct AccumulateList {
  std::vector<void*> accumulators;
  std::vector<const void*> grads;
  std::vector<qca_dtype> accumulator_dtype, grad_dtype;
  std::vector<int64_t> numel;
  std::vector<std::pair<at::Tensor, at::Tensor>> stand_ins;
  std::vector<at::Tensor> grad_copies;
  qca_accumulate_params params{};

  void copy_back() {
    for (auto& [original, dense] : stand_ins) original.copy_(dense);
  }
};

// Validates accumulate_'s lists (one device, pairs of one shape, floating types, no accumulator
// sharing memory with another accumulator or gradient) and fills `list`.
void prepare_accumulate(at::TensorList accumulators, at::TensorList grads, AccumulateList& list);

void prepare_scale_update(const at::Tensor& scale, const at::Tensor& growth_tracker,
                          const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                          int64_t growth_interval, qca_scale_update_params& p);

}  // namespace qca_lowmem
