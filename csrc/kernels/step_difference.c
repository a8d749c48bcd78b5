/* C kernel of the step difference (see include/qca_lowmem/step_difference.h). */
#include "qca_lowmem/step_difference.h"

#include <float.h>
#include <math.h>
#include <stddef.h>

#include "qca_scalar.h"
#include "qca_shared.h"

#define QCA_PER_PRECISION "step_difference_elements.inc"
#include "qca_per_precision.inc"

/* Part `i` of float, half or bfloat16 parts, as a float. */
static float part_f32(const void* base, qca_dtype dtype, int64_t i) {
  switch (dtype) {
    case QCA_F16: return qca_f16_to_f32(((const uint16_t*)base)[i]);
    case QCA_BF16: return qca_bf16_to_f32(((const uint16_t*)base)[i]);
    default: return ((const float*)base)[i];
  }
}

static double part_f64(const void* base, int64_t i) { return ((const double*)base)[i]; }

#define QCA_DEFINE_MEASURE(SUFFIX_, REAL_, PART)                                             \
  static void measure_##SUFFIX_(const qca_step_difference_params* p) {                       \
    const int64_t parts = p->complex_elements ? 2 : 1;                                       \
    REAL_ d_max = 0, c_max = 0;                                                              \
    for (int64_t i = 0; i < p->count; ++i) {                                                 \
      const int64_t k = i * parts;                                                           \
      const REAL_ ar = PART(p->actual, k), ai = parts == 2 ? PART(p->actual, k + 1) : 0;     \
      const REAL_ er = PART(p->expected, k), ei = parts == 2 ? PART(p->expected, k + 1) : 0; \
      REAL_ br = 0, bi = 0, d, c;                                                            \
      if (p->before) {                                                                       \
        br = PART(p->before, k);                                                             \
        bi = parts == 2 ? PART(p->before, k + 1) : 0;                                        \
      }                                                                                      \
      element_measures_##SUFFIX_(ar, ai, er, ei, br, bi, p->complex_elements, &d, &c);       \
      d_max = nan_max_##SUFFIX_(d_max, d);                                                   \
      c_max = nan_max_##SUFFIX_(c_max, c);                                                   \
    }                                                                                        \
    *p->out = ratio_##SUFFIX_(d_max, c_max);                                                 \
  }

#define PART_F32(base, i) part_f32((base), p->dtype, (i))
#define PART_F64(base, i) part_f64((base), (i))
QCA_DEFINE_MEASURE(f32, float, PART_F32)
QCA_DEFINE_MEASURE(f64, double, PART_F64)

qca_status qca_step_difference_cpu(const qca_step_difference_params* p) {
  if (p->count < 0 || !p->out || (p->count > 0 && (!p->actual || !p->expected)))
    return QCA_ERR_INVALID_ARGUMENT;
  switch (p->dtype) {
    case QCA_F64: measure_f64(p); return QCA_OK;
    case QCA_F32:
    case QCA_F16:
    case QCA_BF16: measure_f32(p); return QCA_OK;
  }
  return QCA_ERR_UNSUPPORTED_DTYPE;
}
