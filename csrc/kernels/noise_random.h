/* The noise's random numbers as functions of (seed, step, cell, stream, word): the counter
 * layout of include/qca_lowmem/noise.h, shared by the C and CUDA kernels through QCA_HD. */
#ifndef QCA_LOWMEM_NOISE_RANDOM_H
#define QCA_LOWMEM_NOISE_RANDOM_H

#include "philox.h"

/* Words 4*block .. 4*block+3 of `stream` for one cell. */
static inline QCA_HD qca_philox4x32 qca_noise_block(uint64_t seed, uint64_t step, int64_t cell,
                                                    uint32_t stream, uint32_t block) {
  const uint64_t c = (uint64_t)cell;
  qca_philox4x32 counter;
  counter.v[0] = (uint32_t)c;
  counter.v[1] = (uint32_t)((c >> 32) & 0xffffu) | (block << 16) | (stream << 28);
  counter.v[2] = (uint32_t)step;
  counter.v[3] = (uint32_t)(step >> 32);
  return qca_philox4x32_10(counter, (uint32_t)seed, (uint32_t)(seed >> 32));
}

/* Whether `cell` is hit: word 0 of its stream below `rate`. */
static inline QCA_HD int qca_noise_hit(uint64_t seed, uint64_t step, int64_t cell, uint32_t stream,
                                       double rate) {
  return qca_philox_unit(qca_noise_block(seed, step, cell, stream, 0).v[0]) < rate;
}

#endif
