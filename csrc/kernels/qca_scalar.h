/* Scalar loads and stores of the element types the kernels accept, for the C (CPU) kernels.
 * fp16 and bf16 conversions round to nearest even, as torch's own casts do, so a fused cast
 * gives the same bits as `tensor.to(dtype)`. Portable C11: no compiler half-float extensions. */
#ifndef QCA_LOWMEM_SCALAR_H
#define QCA_LOWMEM_SCALAR_H

#include <stdint.h>
#include <string.h>

#include "qca_lowmem/common.h"

static inline float qca_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    /* zero or subnormal: mantissa * 2^-24 is exact in float */
    float magnitude = (float)mantissa * 5.9604644775390625e-08f;
    memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* The three cases (infinity or NaN, subnormal, normal) are all computed and one is kept, with no
 * branch, so that loops of conversions vectorise. */
static inline uint16_t qca_f32_to_f16(float f) {
  const uint32_t f32_infinity = 255u << 23;
  const uint32_t f16_overflow = (127u + 16u) << 23; /* 65536.0f: rounds to infinity */
  const uint32_t subnormal_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t special = u > f32_infinity ? 0x7e00u : 0x7c00u;
  /* Subnormal result: the FPU rounds when a magic number aligns the bits. */
  float magnitude, magic;
  memcpy(&magnitude, &u, sizeof magnitude);
  memcpy(&magic, &subnormal_magic, sizeof magic);
  magnitude += magic;
  uint32_t aligned;
  memcpy(&aligned, &magnitude, sizeof aligned);
  const uint32_t subnormal = aligned - subnormal_magic;
  const uint32_t normal = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= f16_overflow ? special : u < (113u << 23) ? subnormal : normal;
  return (uint16_t)(out | (sign >> 16));
}

static inline float qca_bf16_to_f32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Branch-free (both results, then a select), so that loops of conversions vectorise. */
static inline uint16_t qca_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float qca_load_f32(const void* base, qca_dtype dtype, int64_t index) {
  switch (dtype) {
    case QCA_F32: return ((const float*)base)[index];
    case QCA_F64: return (float)((const double*)base)[index];
    case QCA_F16: return qca_f16_to_f32(((const uint16_t*)base)[index]);
    case QCA_BF16: return qca_bf16_to_f32(((const uint16_t*)base)[index]);
  }
  return 0.0f;
}

static inline double qca_load_f64(const void* base, qca_dtype dtype, int64_t index) {
  if (dtype == QCA_F64) return ((const double*)base)[index];
  return (double)qca_load_f32(base, dtype, index);
}

static inline void qca_store_f32(void* base, qca_dtype dtype, int64_t index, float value) {
  switch (dtype) {
    case QCA_F32: ((float*)base)[index] = value; return;
    case QCA_F64: ((double*)base)[index] = (double)value; return;
    case QCA_F16: ((uint16_t*)base)[index] = qca_f32_to_f16(value); return;
    case QCA_BF16: ((uint16_t*)base)[index] = qca_f32_to_bf16(value); return;
  }
}

static inline void qca_store_f64(void* base, qca_dtype dtype, int64_t index, double value) {
  if (dtype == QCA_F64) {
    ((double*)base)[index] = value;
    return;
  }
  /* Narrow types round through float, as torch's double -> half cast does. */
  qca_store_f32(base, dtype, index, (float)value);
}

static inline int qca_dtype_is_valid(qca_dtype dtype) {
  return dtype == QCA_F32 || dtype == QCA_F64 || dtype == QCA_F16 || dtype == QCA_BF16;
}

#endif
