/* CPU kernels of the loss scaler (see include/qca_lowmem/scaler.h). */
#include "qca_lowmem/scaler.h"

#include <math.h>

#include "cpu_target.h"
#include "qca_scalar.h"

#include "scaler_rule.h"

int64_t qca_unscale_chunk_count(const int64_t* numel, int64_t n_tensors) {
  int64_t chunks = 0;
  for (int64_t t = 0; t < n_tensors; ++t)
    chunks += (numel[t] + QCA_SCALER_CHUNK - 1) / QCA_SCALER_CHUNK;
  return chunks;
}

int64_t qca_unscale_workspace_size(const qca_unscale_params* p) {
  return p->sumsq ? qca_unscale_chunk_count(p->numel, p->n_tensors) * QCA_SCALER_CUDA_SPLIT : 0;
}

/* Matching torch: the check is on the stored value, fp16/bf16 multiply in float and round once,
 * float64 multiplies by the float factor widened to double, and a factor of exactly 1 stores
 * nothing. Each block of kBlock values takes two short loops while it sits in L1: check and
 * multiply, then squares into kLanes independent double sums. Kept apart, both vectorize
 * without reassociating floating-point sums; fused in one loop, neither does. */
enum { kBlock = 256, kLanes = 8 };

typedef struct unscale_mode {
  int identity, check, sumsq;
} unscale_mode;

static inline uint16_t f32_to_f16_bits(float x) { return qca_f32_to_f16(x); }
static inline uint16_t f32_to_bf16_bits(float x) { return qca_f32_to_bf16(x); }
static inline float id_f32(float x) { return x; }
static inline double id_f64(double x) { return x; }

#define QCA_DEFINE_UNSCALE(NAME, TYPE, MATH, LOAD, STORE)                                         \
  QCA_ALWAYS_INLINE void NAME##_body(TYPE* v, int64_t n, MATH factor, const unscale_mode m,       \
                                     unsigned* bad_out, double* sum_out) {                        \
    unsigned bad = 0;                                                                             \
    double acc[kLanes] = {0};                                                                     \
    for (int64_t start = 0; start < n; start += kBlock) {                                         \
      TYPE* b = v + start;                                                                        \
      const int len = (int)(n - start < kBlock ? n - start : kBlock);                             \
      if (m.check || !m.identity) {                                                               \
        for (int j = 0; j < len; ++j) {                                                           \
          const MATH x = LOAD(b[j]);                                                              \
          if (m.check) bad |= !(x - x == (MATH)0); /* false only for inf and NaN */               \
          if (!m.identity) b[j] = STORE(x * factor);                                              \
        }                                                                                         \
      }                                                                                           \
      if (m.sumsq) {                                                                              \
        int j = 0;                                                                                \
        for (; j + kLanes <= len; j += kLanes)                                                    \
          for (int k = 0; k < kLanes; ++k) {                                                      \
            const double y = (double)LOAD(b[j + k]);                                              \
            acc[k] += y * y;                                                                      \
          }                                                                                       \
        for (; j < len; ++j) {                                                                    \
          const double y = (double)LOAD(b[j]);                                                    \
          acc[0] += y * y;                                                                        \
        }                                                                                         \
      }                                                                                           \
    }                                                                                             \
    double sum = 0.0;                                                                             \
    for (int k = 0; k < kLanes; ++k) sum += acc[k];                                               \
    *bad_out = bad;                                                                               \
    *sum_out = sum;                                                                               \
  }                                                                                               \
  static void NAME(TYPE* v, int64_t n, MATH factor, unscale_mode m, unsigned* bad, double* sum) { \
    /* one instantiation per mode, so the compiler sees constant flags */                         \
    const unscale_mode modes[8] = {{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1},                    \
                                   {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}};                   \
    switch (m.identity * 4 + m.check * 2 + m.sumsq) {                                             \
      case 0: NAME##_body(v, n, factor, modes[0], bad, sum); break;                               \
      case 1: NAME##_body(v, n, factor, modes[1], bad, sum); break;                               \
      case 2: NAME##_body(v, n, factor, modes[2], bad, sum); break;                               \
      case 3: NAME##_body(v, n, factor, modes[3], bad, sum); break;                               \
      case 4: NAME##_body(v, n, factor, modes[4], bad, sum); break;                               \
      case 5: NAME##_body(v, n, factor, modes[5], bad, sum); break;                               \
      case 6: NAME##_body(v, n, factor, modes[6], bad, sum); break;                               \
      default: NAME##_body(v, n, factor, modes[7], bad, sum); break;                              \
    }                                                                                             \
  }

QCA_DEFINE_UNSCALE(unscale_f32, float, float, id_f32, id_f32)
QCA_DEFINE_UNSCALE(unscale_f64, double, double, id_f64, id_f64)
QCA_DEFINE_UNSCALE(unscale_f16, uint16_t, float, qca_f16_to_f32, f32_to_f16_bits)
QCA_DEFINE_UNSCALE(unscale_bf16, uint16_t, float, qca_bf16_to_f32, f32_to_bf16_bits)

qca_status qca_unscale_range_cpu(const qca_unscale_params* p, int64_t tensor, int64_t begin,
                                 int64_t end, qca_chunk_result* out) {
  if (!p || tensor < 0 || tensor >= p->n_tensors || begin < 0 || end < begin ||
      end > p->numel[tensor] || !p->factor || (p->sumsq && !p->found_inf))
    return QCA_ERR_INVALID_ARGUMENT;
  if (!qca_dtype_is_valid(p->dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  const float factor = *p->factor;
  const unscale_mode mode = {factor == 1.0f, p->found_inf != NULL, p->sumsq != NULL && out != NULL};
  unsigned bad = 0;
  double sumsq = 0.0;
  if (begin < end && (mode.check || mode.sumsq || !mode.identity)) {
    void* data = p->tensors[tensor];
    const int64_t n = end - begin;
    switch (p->dtype) {
      case QCA_F32: unscale_f32((float*)data + begin, n, factor, mode, &bad, &sumsq); break;
      case QCA_F64:
        unscale_f64((double*)data + begin, n, (double)factor, mode, &bad, &sumsq);
        break;
      case QCA_F16: unscale_f16((uint16_t*)data + begin, n, factor, mode, &bad, &sumsq); break;
      case QCA_BF16: unscale_bf16((uint16_t*)data + begin, n, factor, mode, &bad, &sumsq); break;
    }
  }
  const int nonfinite = bad != 0;
  if (out) {
    out->sumsq = sumsq;
    out->nonfinite = nonfinite;
  }
  return QCA_OK;
}

qca_status qca_scale_update_cpu(const qca_scale_update_params* p) {
  if (!p || !p->scale || !p->growth_tracker || !p->found_inf) return QCA_ERR_INVALID_ARGUMENT;
  qca_scale_update_rule(p->scale, p->growth_tracker, p->found_inf, p->growth_factor,
                        p->backoff_factor, p->growth_interval);
  return QCA_OK;
}
