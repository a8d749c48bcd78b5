/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
 * counter-based generator behind the training noise. One copy of the maths, compiled by the C
 * kernels and, as device functions (QCA_HD), by the CUDA kernels, so a given
 * (key, counter) yields the same words on the CPU and the GPU. */
#ifndef QCA_LOWMEM_PHILOX_H
#define QCA_LOWMEM_PHILOX_H

#include <stdint.h>

#include "qca_shared.h"

typedef struct qca_philox4x32 {
  uint32_t v[4];
} qca_philox4x32;

static inline QCA_HD qca_philox4x32 qca_philox4x32_10(qca_philox4x32 counter, uint32_t key0,
                                                      uint32_t key1) {
  const uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
  const uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  uint32_t* c = counter.v;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = (uint64_t)m0 * c[0];
    const uint64_t p1 = (uint64_t)m1 * c[2];
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    const uint32_t next0 = hi1 ^ c[1] ^ key0;
    const uint32_t next2 = hi0 ^ c[3] ^ key1;
    c[0] = next0;
    c[1] = lo1;
    c[2] = next2;
    c[3] = lo0;
    key0 += w0;
    key1 += w1;
  }
  return counter;
}

/* A 32-bit word as a double in [0, 1): exact, so `u < rate` hits with probability rate to 2^-32. */
static inline QCA_HD double qca_philox_unit(uint32_t word) {
  return (double)word * 2.3283064365386963e-10;
}

#endif
