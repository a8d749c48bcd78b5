/* The recompute check's measure of one step (python/qca_lowmem/recompute/check.py): how far a
 * recomputed step output `actual` lies from the forward's `expected`, relative to the change the
 * forward step made (`expected` less the step's input `before`), as one float:
 *
 *   max_i d_i / max(max_i c_i, FLT_MIN)
 *
 * d_i = |actual_i - expected_i| (the modulus for complex elements), 0 where the two are equal or
 * both NaN (a NaN part makes a complex element NaN); a NaN d_i makes the result NaN.
 * c_i = |expected_i - before_i| (|expected_i| without `before`), 0 where it is not finite.
 * Computed in double for double parts, in float for float, half and bfloat16 ones. The tensors are
 * contiguous, with parts of one dtype and the same element count. Maxima are exact and do not
 * depend on the order they are taken in, so neither does the result on how the elements are
 * split over threads or blocks. */
#ifndef QCA_LOWMEM_STEP_DIFFERENCE_H
#define QCA_LOWMEM_STEP_DIFFERENCE_H

#include "qca_lowmem/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Blocks of the CUDA launch at most: its workspace holds a (d, c) pair of doubles for each. */
#define QCA_STEP_DIFFERENCE_MAX_BLOCKS 512
#define QCA_STEP_DIFFERENCE_WORKSPACE_BYTES (QCA_STEP_DIFFERENCE_MAX_BLOCKS * 2 * 8)

typedef struct qca_step_difference_params {
  qca_dtype dtype;      /* of the elements' parts */
  int complex_elements; /* nonzero: each element is an interleaved (re, im) pair of parts */
  int64_t count;        /* elements */
  const void* actual;
  const void* expected;
  const void* before;   /* NULL: the change is `expected` itself */
  float* out;           /* the result, one float */
  void* workspace;      /* CUDA only: QCA_STEP_DIFFERENCE_WORKSPACE_BYTES on the device */
} qca_step_difference_params;

/* One thread over all the elements: the check calls it only where a CPU recompute's bits already
 * differ from the forward's (torch.equal), which fails the check whatever the value. */
qca_status qca_step_difference_cpu(const qca_step_difference_params* p);

/* CUDA launcher; `stream` is a cudaStream_t. Two launches: per-block maxima into the workspace,
 * then one block combines them. On QCA_ERR_CUDA, `err->code` holds the cudaError_t. */
qca_status qca_step_difference_cuda(const qca_step_difference_params* p, void* stream,
                                    qca_cuda_error* err);

#ifdef __cplusplus
}
#endif

#endif
