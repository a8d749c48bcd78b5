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

/* Gradient accumulation, one loop per pair of element types: the sum in float, or in double when
 * either type is float64, rounded once into the accumulator (narrow types through float, as
 * torch's double -> half cast). */
static inline float f16_f(uint16_t x) { return qca_f16_to_f32(x); }
static inline float bf16_f(uint16_t x) { return qca_bf16_to_f32(x); }
static inline double f32_d(float x) { return (double)x; }
static inline double f16_d(uint16_t x) { return (double)qca_f16_to_f32(x); }
static inline double bf16_d(uint16_t x) { return (double)qca_bf16_to_f32(x); }
static inline float d_f32(double x) { return (float)x; }
static inline uint16_t d_f16(double x) { return qca_f32_to_f16((float)x); }
static inline uint16_t d_bf16(double x) { return qca_f32_to_bf16((float)x); }

#define QCA_DEFINE_ACCUMULATE(NAME, ACC, GRAD, LOAD_ACC, LOAD_GRAD, STORE)                 \
  static void NAME(void* acc_data, const void* grad_data, int64_t n) {                     \
    ACC* acc = (ACC*)acc_data;                                                             \
    const GRAD* grad = (const GRAD*)grad_data;                                             \
    for (int64_t i = 0; i < n; ++i) acc[i] = STORE(LOAD_ACC(acc[i]) + LOAD_GRAD(grad[i])); \
  }

/* float sums */
QCA_DEFINE_ACCUMULATE(acc_f32_f32, float, float, id_f32, id_f32, id_f32)
QCA_DEFINE_ACCUMULATE(acc_f32_f16, float, uint16_t, id_f32, f16_f, id_f32)
QCA_DEFINE_ACCUMULATE(acc_f32_bf16, float, uint16_t, id_f32, bf16_f, id_f32)
QCA_DEFINE_ACCUMULATE(acc_f16_f32, uint16_t, float, f16_f, id_f32, f32_to_f16_bits)
QCA_DEFINE_ACCUMULATE(acc_f16_f16, uint16_t, uint16_t, f16_f, f16_f, f32_to_f16_bits)
QCA_DEFINE_ACCUMULATE(acc_f16_bf16, uint16_t, uint16_t, f16_f, bf16_f, f32_to_f16_bits)
QCA_DEFINE_ACCUMULATE(acc_bf16_f32, uint16_t, float, bf16_f, id_f32, f32_to_bf16_bits)
QCA_DEFINE_ACCUMULATE(acc_bf16_f16, uint16_t, uint16_t, bf16_f, f16_f, f32_to_bf16_bits)
QCA_DEFINE_ACCUMULATE(acc_bf16_bf16, uint16_t, uint16_t, bf16_f, bf16_f, f32_to_bf16_bits)
/* double sums */
QCA_DEFINE_ACCUMULATE(acc_f64_f64, double, double, id_f64, id_f64, id_f64)
QCA_DEFINE_ACCUMULATE(acc_f64_f32, double, float, id_f64, f32_d, id_f64)
QCA_DEFINE_ACCUMULATE(acc_f64_f16, double, uint16_t, id_f64, f16_d, id_f64)
QCA_DEFINE_ACCUMULATE(acc_f64_bf16, double, uint16_t, id_f64, bf16_d, id_f64)
QCA_DEFINE_ACCUMULATE(acc_f32_f64, float, double, f32_d, id_f64, d_f32)
QCA_DEFINE_ACCUMULATE(acc_f16_f64, uint16_t, double, f16_d, id_f64, d_f16)
QCA_DEFINE_ACCUMULATE(acc_bf16_f64, uint16_t, double, bf16_d, id_f64, d_bf16)

typedef void (*accumulate_fn)(void*, const void*, int64_t);

qca_status qca_accumulate_range_cpu(const qca_accumulate_params* p, int64_t tensor, int64_t begin,
                                    int64_t end) {
  if (!p || tensor < 0 || tensor >= p->n_tensors || begin < 0 || end < begin ||
      end > p->numel[tensor])
    return QCA_ERR_INVALID_ARGUMENT;
  const qca_dtype a = p->accumulator_dtype[tensor], g = p->grad_dtype[tensor];
  if (!qca_dtype_is_valid(a) || !qca_dtype_is_valid(g)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (begin == end) return QCA_OK;
  /* [accumulator][gradient], in qca_dtype order: F32, F64, F16, BF16 */
  static const accumulate_fn kernels[4][4] = {
      {acc_f32_f32, acc_f32_f64, acc_f32_f16, acc_f32_bf16},
      {acc_f64_f32, acc_f64_f64, acc_f64_f16, acc_f64_bf16},
      {acc_f16_f32, acc_f16_f64, acc_f16_f16, acc_f16_bf16},
      {acc_bf16_f32, acc_bf16_f64, acc_bf16_f16, acc_bf16_bf16},
  };
  const size_t acc_size = a == QCA_F64 ? 8 : a == QCA_F32 ? 4 : 2;
  const size_t grad_size = g == QCA_F64 ? 8 : g == QCA_F32 ? 4 : 2;
  kernels[a][g]((char*)p->accumulators[tensor] + begin * acc_size,
                (const char*)p->grads[tensor] + begin * grad_size, end - begin);
  return QCA_OK;
}
