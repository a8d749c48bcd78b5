// A small glue for the emulator tests: fills each C API parameter struct from tensor
// descriptions and calls either the C kernel (over every cell / pair / chunk) or the emulated
// CUDA launcher, so that Python compares the two on the same inputs. Built with
// -Werror=missing-field-initializers: a field added to a struct must be set here.
#include <math.h>
#include <string.h>

#include <limits>
#include <vector>

#include "qca_lowmem/groupnorm_elu.h"
#include "qca_lowmem/max_pool.h"
#include "qca_lowmem/noise.h"
#include "qca_lowmem/qca_step.h"
#include "qca_lowmem/scaler.h"
#include "qca_lowmem/step_difference.h"

namespace {

enum Backend { kC = 0, kCuda = 1 };

qca_grid grid_of(const int64_t* s, int64_t d) { return qca_grid{s[0], s[1], s[2], d}; }

void copy4(int64_t* to, const int64_t* from) { memcpy(to, from, 4 * sizeof(int64_t)); }

int64_t cells(const qca_grid& g) { return g.batch * g.height * g.width; }

// A max pooling's input (batch, channels, height, width), and its 2x2 windows: y's elements.
qca_max_pool_shape pool_shape(const int64_t* sizes, int channels_last) {
  return qca_max_pool_shape{sizes[0], sizes[1], sizes[2], sizes[3], channels_last};
}

int64_t windows(const int64_t* sizes) { return sizes[0] * sizes[1] * (sizes[2] / 2) * (sizes[3] / 2); }

}  // namespace

extern "C" {

// A strided tensor: qca_dtype of its (real) elements, sizes and strides in elements (complex
// elements for a complex tensor).
struct emu_tensor {
  void* data;
  int64_t dtype;
  int64_t sizes[4];
  int64_t strides[4];
};

// psi (B, H, W, d) complex -> x (B, 2d, H, W)
int emu_qca_pack(int backend, const emu_tensor* psi, const emu_tensor* x, int* cuda_error) {
  qca_pack_params p = {
      .grid = grid_of(psi->sizes, psi->sizes[3]),
      .state_dtype = (qca_dtype)psi->dtype,
      .psi = psi->data,
      .psi_stride = {},
      .x_dtype = (qca_dtype)x->dtype,
      .x = x->data,
      .x_stride = {},
  };
  copy4(p.psi_stride, psi->strides);
  copy4(p.x_stride, x->strides);
  if (backend == kC) return qca_pack_cpu(&p, 0, cells(p.grid));
  qca_cuda_error err{};
  const int s = qca_pack_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

// x (B, 2d, H, W) -> psi (B, H, W, d) contiguous
int emu_qca_pack_backward(int backend, const emu_tensor* x, const emu_tensor* psi, int* cuda_error) {
  qca_pack_backward_params p = {
      .grid = grid_of(psi->sizes, psi->sizes[3]),
      .x_dtype = (qca_dtype)x->dtype,
      .x = x->data,
      .x_stride = {},
      .state_dtype = (qca_dtype)psi->dtype,
      .psi = psi->data,
  };
  copy4(p.x_stride, x->strides);
  if (backend == kC) return qca_pack_backward_cpu(&p, 0, cells(p.grid));
  qca_cuda_error err{};
  const int s = qca_pack_backward_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

static qca_update_params update_params(const emu_tensor* psi, const emu_tensor* delta,
                                       double gamma, int multiplicative, double eps, void* out) {
  qca_update_params p = {
      .grid = grid_of(psi->sizes, psi->sizes[3]),
      .state_dtype = (qca_dtype)psi->dtype,
      .psi = psi->data,
      .psi_stride = {},
      .delta_dtype = (qca_dtype)delta->dtype,
      .delta = delta->data,
      .delta_stride = {},
      .gamma = gamma,
      .eps = eps,
      .multiplicative = multiplicative,
      .out = out,
  };
  copy4(p.psi_stride, psi->strides);
  copy4(p.delta_stride, delta->strides);
  return p;
}

int emu_qca_update(int backend, const emu_tensor* psi, const emu_tensor* delta, double gamma,
                   int multiplicative, double eps, void* out, int* cuda_error) {
  const qca_update_params p = update_params(psi, delta, gamma, multiplicative, eps, out);
  if (backend == kC) return qca_update_cpu(&p, 0, cells(p.grid));
  qca_cuda_error err{};
  const int s = qca_update_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

int emu_qca_update_backward(int backend, const emu_tensor* grad_out, const emu_tensor* psi,
                            const emu_tensor* delta, double gamma, int multiplicative, double eps,
                            void* grad_psi, void* grad_delta, int* cuda_error) {
  qca_update_backward_params p = {
      .fwd = update_params(psi, delta, gamma, multiplicative, eps, nullptr),
      .grad_out = grad_out->data,
      .grad_out_stride = {},
      .grad_psi = grad_psi,
      .grad_delta = grad_delta,
  };
  copy4(p.grad_out_stride, grad_out->strides);
  if (backend == kC) return qca_update_backward_cpu(&p, 0, cells(p.fwd.grid));
  qca_cuda_error err{};
  const int s = qca_update_backward_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

// kind 0: phase flip, 1: bit flip
int emu_noise(int backend, int kind, const emu_tensor* psi, double rate, uint64_t seed,
              uint64_t step, int conjugate, void* out, int* cuda_error) {
  qca_noise_params p = {
      .grid = grid_of(psi->sizes, psi->sizes[3]),
      .state_dtype = (qca_dtype)psi->dtype,
      .psi = psi->data,
      .psi_stride = {},
      .out = out,
      .rate = rate,
      .seed = seed,
      .step = step,
      .conjugate = conjugate,
  };
  copy4(p.psi_stride, psi->strides);
  if (backend == kC) {
    return kind == 0 ? qca_phase_flip_cpu(&p, 0, cells(p.grid)) : qca_bit_flip_cpu(&p, 0, cells(p.grid));
  }
  qca_cuda_error err{};
  const int s = kind == 0 ? qca_phase_flip_cuda(&p, nullptr, &err) : qca_bit_flip_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

static qca_groupnorm_elu_shape gn_shape(const emu_tensor* x, int64_t groups, int channels_last) {
  return qca_groupnorm_elu_shape{x->sizes[0], x->sizes[1], x->sizes[2], x->sizes[3], groups, channels_last};
}

int64_t emu_gn_workspace_bytes(const emu_tensor* x, int64_t groups, int channels_last,
                               int64_t stat_dtype, int backward) {
  const qca_groupnorm_elu_shape shape = gn_shape(x, groups, channels_last);
  return qca_groupnorm_elu_cuda_workspace_bytes(&shape, (qca_dtype)stat_dtype, backward);
}

int emu_gn_forward(int backend, const emu_tensor* x, int64_t groups, int channels_last, double eps,
                   const emu_tensor* weight, const emu_tensor* bias, int stats_given,
                   const emu_tensor* mean, const emu_tensor* rstd, void* y, void* workspace,
                   int64_t workspace_bytes, int* cuda_error) {
  const qca_groupnorm_elu_params p = {
      .shape = gn_shape(x, groups, channels_last),
      .eps = eps,
      .x_dtype = (qca_dtype)x->dtype,
      .x = x->data,
      .affine_dtype = (qca_dtype)weight->dtype,
      .weight = weight->data,
      .bias = bias->data,
      .stat_dtype = (qca_dtype)mean->dtype,
      .mean_in = stats_given ? mean->data : nullptr,
      .rstd_in = stats_given ? rstd->data : nullptr,
      .mean_out = stats_given ? nullptr : mean->data,
      .rstd_out = stats_given ? nullptr : rstd->data,
      .y = y,
      .workspace = workspace,
      .workspace_bytes = workspace_bytes,
  };
  if (backend == kC) return qca_groupnorm_elu_forward_cpu(&p, 0, p.shape.batch * p.shape.groups);
  qca_cuda_error err{};
  const int s = qca_groupnorm_elu_forward_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

int emu_gn_backward(int backend, const emu_tensor* grad_y, const emu_tensor* x, int64_t groups,
                    int channels_last, const emu_tensor* weight, const emu_tensor* bias,
                    const emu_tensor* mean, const emu_tensor* rstd, void* grad_x,
                    void* grad_weight_per_sample, void* grad_bias_per_sample, void* workspace,
                    int64_t workspace_bytes, int* cuda_error) {
  const qca_groupnorm_elu_backward_params p = {
      .shape = gn_shape(x, groups, channels_last),
      .x_dtype = (qca_dtype)x->dtype,
      .grad_y = grad_y->data,
      .x = x->data,
      .affine_dtype = (qca_dtype)weight->dtype,
      .weight = weight->data,
      .bias = bias->data,
      .stat_dtype = (qca_dtype)mean->dtype,
      .mean = mean->data,
      .rstd = rstd->data,
      .grad_x = grad_x,
      .grad_weight_per_sample = grad_weight_per_sample,
      .grad_bias_per_sample = grad_bias_per_sample,
      .workspace = workspace,
      .workspace_bytes = workspace_bytes,
  };
  if (backend == kC) return qca_groupnorm_elu_backward_cpu(&p, 0, p.shape.batch * p.shape.groups);
  qca_cuda_error err{};
  const int s = qca_groupnorm_elu_backward_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

// The list's reals in place; found_inf and sumsq (n_tensors doubles) may be NULL. The C
// backend combines its chunks as the CPU glue does: in chunk order, NaN for a tensor with a
// non-finite value.
int emu_unscale(int backend, int64_t dtype, int64_t n_tensors, void* const* tensors,
                const int64_t* numel, const float* factor, float* found_inf, double* sumsq,
                double* workspace, int* cuda_error) {
  qca_unscale_params p = {
      .dtype = (qca_dtype)dtype,
      .n_tensors = n_tensors,
      .tensors = tensors,
      .numel = numel,
      .factor = factor,
      .found_inf = found_inf,
      .sumsq = sumsq,
      .workspace = workspace,
  };
  if (backend == kCuda) {
    qca_cuda_error err{};
    const int s = qca_unscale_cuda(&p, nullptr, &err);
    *cuda_error = err.code;
    return s;
  }
  for (int64_t t = 0; t < n_tensors; ++t) {
    if (sumsq) sumsq[t] = 0.0;
    for (int64_t begin = 0; begin < numel[t]; begin += QCA_SCALER_CHUNK) {
      const int64_t end = begin + QCA_SCALER_CHUNK < numel[t] ? begin + QCA_SCALER_CHUNK : numel[t];
      qca_chunk_result r{0.0, 0};
      const int s = qca_unscale_range_cpu(&p, t, begin, end, &r);
      if (s != QCA_OK) return s;
      if (r.nonfinite && found_inf) *found_inf = 1.0f;
      if (sumsq) sumsq[t] = r.nonfinite ? std::numeric_limits<double>::quiet_NaN() : sumsq[t] + r.sumsq;
    }
  }
  return QCA_OK;
}

int64_t emu_unscale_workspace_size(int64_t n_tensors, const int64_t* numel) {
  const qca_unscale_params p = {
      .dtype = QCA_F32,
      .n_tensors = n_tensors,
      .tensors = nullptr,
      .numel = numel,
      .factor = nullptr,
      .found_inf = nullptr,
      .sumsq = reinterpret_cast<double*>(1),  // asks for the sums' workspace
      .workspace = nullptr,
  };
  return qca_unscale_workspace_size(&p);
}

int emu_scale_update(int backend, float* scale, int32_t* growth_tracker, const float* found_inf,
                     double growth_factor, double backoff_factor, int64_t growth_interval,
                     int* cuda_error) {
  const qca_scale_update_params p = {
      .scale = scale,
      .growth_tracker = growth_tracker,
      .found_inf = found_inf,
      .growth_factor = growth_factor,
      .backoff_factor = backoff_factor,
      .growth_interval = growth_interval,
  };
  if (backend == kC) return qca_scale_update_cpu(&p);
  qca_cuda_error err{};
  const int s = qca_scale_update_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

// accumulators[t] += grads[t] over numel[t] reals, each pair with its qca_dtype codes. The C
// backend runs chunk by chunk, as the CPU glue does.
int emu_accumulate(int backend, int64_t n_tensors, void* const* accumulators,
                   const int64_t* accumulator_dtype, const void* const* grads,
                   const int64_t* grad_dtype, const int64_t* numel, int* cuda_error) {
  std::vector<qca_dtype> acc_dtypes(n_tensors), grad_dtypes(n_tensors);
  for (int64_t t = 0; t < n_tensors; ++t) {
    acc_dtypes[t] = (qca_dtype)accumulator_dtype[t];
    grad_dtypes[t] = (qca_dtype)grad_dtype[t];
  }
  const qca_accumulate_params p = {
      .n_tensors = n_tensors,
      .accumulators = accumulators,
      .accumulator_dtype = acc_dtypes.data(),
      .grads = grads,
      .grad_dtype = grad_dtypes.data(),
      .numel = numel,
  };
  if (backend == kCuda) {
    qca_cuda_error err{};
    const int s = qca_accumulate_cuda(&p, nullptr, &err);
    *cuda_error = err.code;
    return s;
  }
  for (int64_t t = 0; t < n_tensors; ++t)
    for (int64_t begin = 0; begin < numel[t]; begin += QCA_SCALER_CHUNK) {
      const int64_t end = begin + QCA_SCALER_CHUNK < numel[t] ? begin + QCA_SCALER_CHUNK : numel[t];
      const int s = qca_accumulate_range_cpu(&p, t, begin, end);
      if (s != QCA_OK) return s;
    }
  return QCA_OK;
}

// actual, expected and before (NULL for none): `count` contiguous elements of `dtype` parts,
// complex where `complex_elements`; the result to *out.
int emu_step_difference(int backend, int64_t dtype, int complex_elements, int64_t count,
                        const void* actual, const void* expected, const void* before, float* out,
                        int* cuda_error) {
  std::vector<unsigned char> workspace(QCA_STEP_DIFFERENCE_WORKSPACE_BYTES);
  const qca_step_difference_params p = {
      .dtype = (qca_dtype)dtype,
      .complex_elements = complex_elements,
      .count = count,
      .actual = actual,
      .expected = expected,
      .before = before,
      .out = out,
      .workspace = workspace.data(),
  };
  if (backend == kC) return qca_step_difference_cpu(&p);
  qca_cuda_error err{};
  const int s = qca_step_difference_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

// x (batch, channels, height, width) of `dtype`, NCHW or channels_last, contiguous; y pooled.
int emu_max_pool(int backend, int64_t dtype, const int64_t* sizes, int channels_last, const void* x,
                 void* y, int* cuda_error) {
  const qca_max_pool_params p = {
      .shape = pool_shape(sizes, channels_last),
      .dtype = (qca_dtype)dtype,
      .x = x,
      .y = y,
  };
  if (backend == kC) return qca_max_pool2x2_forward_cpu(&p, 0, windows(sizes));
  qca_cuda_error err{};
  const int s = qca_max_pool2x2_forward_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

int emu_max_pool_backward(int backend, int64_t dtype, const int64_t* sizes, int channels_last,
                          const void* grad_y, const void* x, void* grad_x, int unpicked_to_origin,
                          int* cuda_error) {
  const qca_max_pool_backward_params p = {
      .shape = pool_shape(sizes, channels_last),
      .dtype = (qca_dtype)dtype,
      .grad_y = grad_y,
      .x = x,
      .grad_x = grad_x,
      .unpicked_to_origin = unpicked_to_origin,
  };
  if (backend == kC) return qca_max_pool2x2_backward_cpu(&p, 0, windows(sizes));
  qca_cuda_error err{};
  const int s = qca_max_pool2x2_backward_cuda(&p, nullptr, &err);
  *cuda_error = err.code;
  return s;
}

}  // extern "C"
