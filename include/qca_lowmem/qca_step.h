/* The fused QCA step: pack (stock step 1) and update (stock steps 2-5), forward and backward.
 *
 * psi is complex (B, H, W, d), stored as interleaved (re, im) pairs of `state_dtype`
 * (QCA_F32 for complex64, QCA_F64 for complex128); its strides count complex elements.
 * x / delta are real (B, 2d, H, W) with arbitrary strides (NCHW, channels_last or views):
 * channels 0..d-1 hold real parts, d..2d-1 imaginary parts.
 *
 * CPU kernels process the cells [cell_begin, cell_end) of the flattened (B, H, W) grid so that
 * the caller can split the work across threads; CUDA launchers cover every cell on `stream`. */
#ifndef QCA_LOWMEM_QCA_STEP_H
#define QCA_LOWMEM_QCA_STEP_H

#include "qca_lowmem/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qca_grid {
  int64_t batch, height, width, d;
} qca_grid;

typedef struct qca_pack_params {
  qca_grid grid;
  qca_dtype state_dtype;   /* parts of psi */
  const void* psi;
  int64_t psi_stride[4];   /* b, h, w, k */
  qca_dtype x_dtype;       /* x may be narrower than the state (fp16/bf16 cast fused in) */
  void* x;
  int64_t x_stride[4];     /* b, c, h, w */
} qca_pack_params;

/* The backward of pack, the inverse layout: grad_psi[b,h,w,k] = gx[b,k] + i gx[b,d+k]. */
typedef struct qca_pack_backward_params {
  qca_grid grid;
  qca_dtype x_dtype;
  const void* x;
  int64_t x_stride[4];
  qca_dtype state_dtype;
  void* psi;               /* written contiguous (B, H, W, d) */
} qca_pack_backward_params;

typedef struct qca_update_params {
  qca_grid grid;
  qca_dtype state_dtype;
  const void* psi;
  int64_t psi_stride[4];
  qca_dtype delta_dtype;
  const void* delta;
  int64_t delta_stride[4];
  double gamma;            /* the decay term is applied only when gamma > 0, as stock does */
  double eps;
  int multiplicative;      /* u = a * psi when nonzero, u = a otherwise */
  void* out;               /* psi', contiguous (B, H, W, d), state_dtype */
} qca_update_params;

typedef struct qca_update_backward_params {
  qca_update_params fwd;   /* fwd.out unused */
  const void* grad_out;    /* complex, state_dtype */
  int64_t grad_out_stride[4];
  void* grad_psi;          /* contiguous (B, H, W, d), state_dtype; NULL to skip */
  void* grad_delta;        /* contiguous (B, 2d, H, W), delta_dtype; NULL to skip */
} qca_update_backward_params;

qca_status qca_pack_cpu(const qca_pack_params* p, int64_t cell_begin, int64_t cell_end);
qca_status qca_pack_backward_cpu(const qca_pack_backward_params* p, int64_t cell_begin,
                                 int64_t cell_end);
qca_status qca_update_cpu(const qca_update_params* p, int64_t cell_begin, int64_t cell_end);
qca_status qca_update_backward_cpu(const qca_update_backward_params* p, int64_t cell_begin,
                                   int64_t cell_end);

/* CUDA launchers; `stream` is a cudaStream_t. On QCA_ERR_CUDA, `err->code` holds the cudaError_t.
 */
qca_status qca_pack_cuda(const qca_pack_params* p, void* stream, qca_cuda_error* err);
qca_status qca_pack_backward_cuda(const qca_pack_backward_params* p, void* stream,
                                  qca_cuda_error* err);
qca_status qca_update_cuda(const qca_update_params* p, void* stream, qca_cuda_error* err);
qca_status qca_update_backward_cuda(const qca_update_backward_params* p, void* stream,
                                    qca_cuda_error* err);

#ifdef __cplusplus
}
#endif

#endif
