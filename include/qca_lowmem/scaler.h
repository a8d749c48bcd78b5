/* Mixed-precision loss scaler: multi-tensor unscale with a non-finite check (and, in the same
 * pass, the sum of squares that gradient clipping needs), and the dynamic scale update. And, on
 * the same multi-tensor engine, gradient accumulation: a list of gradients of any floating types
 * added into their accumulators in one pass.
 *
 * A list holds tensors of one device and one element type; complex tensors are passed as their
 * interleaved real parts (numel counts reals). Work is split into chunks of QCA_SCALER_CHUNK
 * reals per tensor: the CPU kernel processes one chunk range at a time so the caller can spread
 * chunks over threads, the CUDA launcher processes the whole list on `stream` in batches whose
 * metadata travels by value in the kernel arguments (no host-to-device copy, so it can be
 * captured in a CUDA graph). */
#ifndef QCA_LOWMEM_SCALER_H
#define QCA_LOWMEM_SCALER_H

#include "qca_lowmem/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define QCA_SCALER_CHUNK ((int64_t)65536)
/* The CUDA launcher splits each chunk over this many thread blocks. */
#define QCA_SCALER_CUDA_SPLIT 4

typedef struct qca_unscale_params {
  qca_dtype dtype;          /* element type of every tensor's reals */
  int64_t n_tensors;
  void* const* tensors;     /* host array of n_tensors data pointers (device memory for CUDA) */
  const int64_t* numel;     /* host array: reals per tensor; 0 is allowed */
  const float* factor;      /* one float on the tensors' device: every value is multiplied by it;
                               when it is exactly 1 the values are left untouched */
  float* found_inf;         /* NULL: plain multiply. Otherwise one float on the device, set to
                               1.0f when a value is inf or NaN before the multiply; never cleared */
  double* sumsq;            /* NULL, or n_tensors doubles on the device: per tensor, the sum of
                               squares of the values as stored after the multiply (accumulated
                               in double); NaN exactly when the tensor had a non-finite value
                               before the multiply (requires found_inf) */
  double* workspace;        /* CUDA with sumsq only: qca_unscale_workspace_size() doubles on
                               the device (one per thread block) */
} qca_unscale_params;

/* Result of one chunk range on the CPU; the caller adds per-chunk results in chunk order so that
 * the sums do not depend on the thread count. */
typedef struct qca_chunk_result {
  double sumsq;
  int nonfinite;
} qca_chunk_result;

/* Chunks in a list (sum over tensors of ceil(numel / QCA_SCALER_CHUNK)). */
int64_t qca_unscale_chunk_count(const int64_t* numel, int64_t n_tensors);
/* Doubles of device workspace the CUDA launcher needs when sumsq is requested:
 * QCA_SCALER_CUDA_SPLIT per chunk. */
int64_t qca_unscale_workspace_size(const qca_unscale_params* p);

/* Reals [begin, end) of tensor `tensor`, on the CPU. Writes nothing to found_inf/sumsq: the
 * caller combines the results. `out` may be NULL when neither is wanted. */
qca_status qca_unscale_range_cpu(const qca_unscale_params* p, int64_t tensor, int64_t begin,
                                 int64_t end, qca_chunk_result* out);

/* The whole list on the GPU. On QCA_ERR_CUDA, err->code holds the cudaError_t. */
qca_status qca_unscale_cuda(const qca_unscale_params* p, void* stream, qca_cuda_error* err);

/* torch._amp_update_scale_'s rule, in place. On found_inf != 0: scale *= backoff, tracker = 0.
 * Otherwise tracker + 1; when that reaches growth_interval, scale *= growth if the product is
 * finite, and tracker = 0. Products are taken in double and rounded to float. */
typedef struct qca_scale_update_params {
  float* scale;             /* one float */
  int32_t* growth_tracker;  /* one int32 */
  const float* found_inf;   /* one float */
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
} qca_scale_update_params;

qca_status qca_scale_update_cpu(const qca_scale_update_params* p);
qca_status qca_scale_update_cuda(const qca_scale_update_params* p, void* stream,
                                 qca_cuda_error* err);

/* accumulators[t] += grads[t], real by real over numel[t] reals, each pair of tensors with its
 * own element types: the sum is taken in double when either type is float64, else in float, and
 * rounded once into the accumulator's type (torch's add_ with type promotion, bit for bit but for
 * a NaN's payload). The two tensors of a pair share one dense layout; no two accumulators
 * overlap, and a gradient overlaps its accumulator fully or not at all. */
typedef struct qca_accumulate_params {
  int64_t n_tensors;
  void* const* accumulators;         /* host array of n_tensors data pointers */
  const qca_dtype* accumulator_dtype; /* host array: each accumulator's element type */
  const void* const* grads;          /* host array of n_tensors data pointers */
  const qca_dtype* grad_dtype;       /* host array: each gradient's element type */
  const int64_t* numel;              /* host array: reals per pair; 0 is allowed */
} qca_accumulate_params;

/* Reals [begin, end) of pair `tensor`, on the CPU. */
qca_status qca_accumulate_range_cpu(const qca_accumulate_params* p, int64_t tensor, int64_t begin,
                                    int64_t end);

/* The whole list on the GPU, in as few launches as its batches take (one for up to 64 pairs
 * and 320 chunks). On QCA_ERR_CUDA, err->code holds the cudaError_t. */
qca_status qca_accumulate_cuda(const qca_accumulate_params* p, void* stream, qca_cuda_error* err);

#ifdef __cplusplus
}
#endif

#endif
