/* Fused GroupNorm + ELU, forward and backward: y = ELU(weight * xhat + bias), alpha = 1, with
 * xhat = (x - mean) * rstd over each (sample, group), rstd = 1 / sqrt(biased var + eps).
 * Same function as nn.GroupNorm(groups, C, eps, affine=True) followed by nn.ELU().
 *
 * x, y, grad_y and grad_x are dense (N, C, H, W) tensors in one of two layouts: NCHW contiguous
 * or channels_last contiguous (`shape.channels_last`). weight and bias are contiguous (C,).
 * Statistics (mean, rstd: contiguous (N, G)) and all accumulation are in `stat_dtype`: QCA_F32,
 * or QCA_F64 for float64 data.
 *
 * CPU kernels process the (sample, group) pairs [pair_begin, pair_end) of the N * G pairs, so
 * the caller can split the work across threads. CUDA launchers take stat_dtype QCA_F64 for
 * QCA_F64 data and QCA_F32 for the others (QCA_ERR_UNSUPPORTED_DTYPE otherwise); they run one
 * thread block per pair, or, when there are too few pairs to fill the GPU, several blocks per
 * pair that exchange partial sums through `workspace` (device memory of at least
 * qca_groupnorm_elu_cuda_workspace_bytes(...) bytes, asked for on the device of the launch).
 * channels_last data with groups of up to 256 channels always takes the workspace: blocks of
 * pixel tiles by slabs of groups write partial sums, then each block combines them itself.
 * Either way a sample's results have the same bits whatever the batch size or GPU. */
#ifndef QCA_LOWMEM_GROUPNORM_ELU_H
#define QCA_LOWMEM_GROUPNORM_ELU_H

#include "qca_lowmem/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qca_groupnorm_elu_shape {
  int64_t batch, channels, height, width, groups; /* groups divides channels */
  int channels_last;                              /* 0: NCHW, 1: channels_last */
} qca_groupnorm_elu_shape;

typedef struct qca_groupnorm_elu_params {
  qca_groupnorm_elu_shape shape;
  double eps;
  qca_dtype x_dtype;       /* x and y */
  const void* x;
  qca_dtype affine_dtype;  /* weight and bias */
  const void* weight;
  const void* bias;
  qca_dtype stat_dtype;
  /* Statistics: given (mean_in and rstd_in, a recompute; mean_out/rstd_out unused, may be NULL),
   * or, when mean_in is NULL, computed and written to mean_out and rstd_out. */
  const void* mean_in;
  const void* rstd_in;
  void* mean_out;
  void* rstd_out;
  void* y;                 /* same layout as x */
  void* workspace;         /* CUDA only; unused by the CPU kernels */
  int64_t workspace_bytes;
} qca_groupnorm_elu_params;

/* grad_x = d loss / d x; the ELU derivative is recomputed from x. Weight and bias gradients are
 * written per sample, (N, C) in stat_dtype, so that no two pairs write the same element; the
 * caller sums them over N. */
typedef struct qca_groupnorm_elu_backward_params {
  qca_groupnorm_elu_shape shape;
  qca_dtype x_dtype;       /* x, grad_y, grad_x */
  const void* grad_y;      /* same layout as x */
  const void* x;
  qca_dtype affine_dtype;
  const void* weight;
  const void* bias;
  qca_dtype stat_dtype;
  const void* mean;
  const void* rstd;
  void* grad_x;            /* same layout as x */
  void* grad_weight_per_sample;
  void* grad_bias_per_sample;
  void* workspace;         /* CUDA only; unused by the CPU kernels */
  int64_t workspace_bytes;
} qca_groupnorm_elu_backward_params;

qca_status qca_groupnorm_elu_forward_cpu(const qca_groupnorm_elu_params* p, int64_t pair_begin,
                                         int64_t pair_end);
qca_status qca_groupnorm_elu_backward_cpu(const qca_groupnorm_elu_backward_params* p,
                                          int64_t pair_begin, int64_t pair_end);

/* Device workspace the CUDA launchers need for `shape` on the current device (0 when none):
 * for the forward that computes statistics when `backward` is 0, else for the backward. The
 * forward with given statistics (mean_in) needs none. */
int64_t qca_groupnorm_elu_cuda_workspace_bytes(const qca_groupnorm_elu_shape* shape,
                                               qca_dtype stat_dtype, int backward);

/* CUDA launchers; `stream` is a cudaStream_t. On QCA_ERR_CUDA, `err->code` holds the cudaError_t.
 * QCA_ERR_INVALID_ARGUMENT when the workspace is smaller than the shape needs. */
qca_status qca_groupnorm_elu_forward_cuda(const qca_groupnorm_elu_params* p, void* stream,
                                          qca_cuda_error* err);
qca_status qca_groupnorm_elu_backward_cuda(const qca_groupnorm_elu_backward_params* p, void* stream,
                                           qca_cuda_error* err);

#ifdef __cplusplus
}
#endif

#endif
