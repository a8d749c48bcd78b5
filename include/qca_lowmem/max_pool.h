/* 2x2 max pooling of stride 2, as torch's max_pool2d(x, 2) computes it and its gradient, without
 * the int64 indices torch writes in the forward and reads in the backward: the backward finds each
 * window's pick again from x.
 *
 * x is (batch, channels, height, width), NCHW or channels_last (NHWC in memory), contiguous; y
 * is (batch, channels, height / 2, width / 2) in the same layout (floor: an odd last row or
 * column is in no window). A window's pick is torch's: its elements are visited row by row, and
 * one is taken where it is greater than the running maximum (which starts at -infinity) or is
 * NaN. So the first maximum is taken, or the last NaN. y is the picked element itself (its bits).
 * A window of four -infinities picks none: y is -infinity, and its gradient goes where torch's
 * kernel for the device and layout sends it: to its first element (torch's CPU kernels, its CUDA
 * NCHW kernel) or, with `unpicked_to_origin` (torch's CUDA channels_last kernel, whose indices
 * start at the plane's first pixel), to the plane's first pixel where that is in the window, and
 * nowhere otherwise.
 *
 * grad_x is grad_y at each window's pick, computed as 0 + grad_y in float (double for double
 * data) as torch's kernels sum it (so -0 becomes +0), and +0 everywhere else. Comparisons are
 * exact in any precision, so the C and CUDA kernels give the same bits. */
#ifndef QCA_LOWMEM_MAX_POOL_H
#define QCA_LOWMEM_MAX_POOL_H

#include "qca_lowmem/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qca_max_pool_shape {
  int64_t batch, channels, height, width; /* of x; height and width at least 2 */
  int channels_last; /* nonzero: x, y, grad_y and grad_x are NHWC in memory */
} qca_max_pool_shape;

typedef struct qca_max_pool_params {
  qca_max_pool_shape shape;
  qca_dtype dtype; /* of x and y: float16, bfloat16, float32 or float64 */
  const void* x;
  void* y;
} qca_max_pool_params;

typedef struct qca_max_pool_backward_params {
  qca_max_pool_shape shape;
  qca_dtype dtype; /* of grad_y, x and grad_x */
  const void* grad_y;
  const void* x;
  void* grad_x;
  int unpicked_to_origin; /* where a window of -infinities sends its gradient (above) */
} qca_max_pool_backward_params;

/* Windows [begin, end), numbered as the elements of y in its memory order: the forward writes
 * their elements of y, the backward their four elements of grad_x and those beside them that no
 * window holds (the last row or column of an odd height or width), so that every element of
 * grad_x is written once. */
qca_status qca_max_pool2x2_forward_cpu(const qca_max_pool_params* p, int64_t begin, int64_t end);
qca_status qca_max_pool2x2_backward_cpu(const qca_max_pool_backward_params* p, int64_t begin,
                                        int64_t end);

/* CUDA launchers; `stream` is a cudaStream_t. One launch each, a thread per window. On
 * QCA_ERR_CUDA, `err->code` holds the cudaError_t. */
qca_status qca_max_pool2x2_forward_cuda(const qca_max_pool_params* p, void* stream,
                                        qca_cuda_error* err);
qca_status qca_max_pool2x2_backward_cuda(const qca_max_pool_backward_params* p, void* stream,
                                         qca_cuda_error* err);

#ifdef __cplusplus
}
#endif

#endif
