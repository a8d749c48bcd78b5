/* Training noise (the stock noise, docs/design.md) with counter-based randoms: every random
 * number is a Philox4x32-10 word keyed by the 64-bit `seed` with a counter made of the 64-bit
 * `step`, the cell index, a stream id and the word's position, so it depends only on
 * (seed, step, cell, component). Replaying a step needs no stored masks, CPU and CUDA draw the
 * same hits and phases, and a cell's randoms do not depend on how the work is split.
 *
 * Counter layout: c0 = cell bits 0..31; c1 = cell bits 32..47 | block << 16 | stream << 28;
 * c2, c3 = step bits 0..31, 32..63; key = seed bits 0..31, 32..63. Block b holds words
 * 4b..4b+3 of a cell's stream. Phase stream: word 0 decides the hit, word 1+k gives theta_k.
 * Bit stream: word 0 decides the hit. Coin stream: cell 0, word 0.
 *
 * psi is complex (B, H, W, d) as interleaved (re, im) pairs of `state_dtype` (QCA_F32 or
 * QCA_F64) with strides in complex elements; `out` is written contiguous. */
#ifndef QCA_LOWMEM_NOISE_H
#define QCA_LOWMEM_NOISE_H

#include "qca_lowmem/common.h"
#include "qca_lowmem/qca_step.h"

#ifdef __cplusplus
extern "C" {
#endif

#define QCA_NOISE_MAX_CELLS (INT64_C(1) << 48)
#define QCA_NOISE_MAX_D 16379 /* words 0..d of the phase stream fit in 12 bits of blocks */

enum { QCA_NOISE_STREAM_PHASE = 0, QCA_NOISE_STREAM_BIT = 1, QCA_NOISE_STREAM_COIN = 2 };

typedef struct qca_noise_params {
  qca_grid grid;
  qca_dtype state_dtype;
  const void* psi;
  int64_t psi_stride[4]; /* b, h, w, k */
  void* out;             /* contiguous (B, H, W, d), state_dtype */
  double rate;           /* probability that a cell is hit, in [0, 1] */
  uint64_t seed;
  uint64_t step;
  int conjugate;         /* phase flip: multiply by exp(-i theta) (the backward) when nonzero */
} qca_noise_params;

/* A hit cell gets psi_k * exp(i theta_k) (exp(-i theta_k) with `conjugate`),
 * theta_k = 2 pi u_k, u_k ~ U[0, 1); other cells are copied. */
qca_status qca_phase_flip_cpu(const qca_noise_params* p, int64_t cell_begin, int64_t cell_end);
/* A hit cell gets -psi; other cells are copied. Its own adjoint, so also its backward. */
qca_status qca_bit_flip_cpu(const qca_noise_params* p, int64_t cell_begin, int64_t cell_end);

/* The per-step coin in [0, 1) (stock: bit flip the step when coin < 0.2). Host only. */
double qca_noise_coin(uint64_t seed, uint64_t step);

/* CUDA launchers; `stream` is a cudaStream_t. On QCA_ERR_CUDA, `err->code` holds the cudaError_t.
 */
qca_status qca_phase_flip_cuda(const qca_noise_params* p, void* stream, qca_cuda_error* err);
qca_status qca_bit_flip_cuda(const qca_noise_params* p, void* stream, qca_cuda_error* err);

#ifdef __cplusplus
}
#endif

#endif
