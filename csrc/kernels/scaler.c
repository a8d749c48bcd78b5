/* CPU kernels of the loss scaler (see include/qca_lowmem/scaler.h). */
#include "qca_lowmem/scaler.h"

#include <math.h>

#include "qca_scalar.h"

#define QCA_HD
#include "scaler_rule.h"

int64_t qca_unscale_chunk_count(const int64_t* numel, int64_t n_tensors) {
  int64_t chunks = 0;
  for (int64_t t = 0; t < n_tensors; ++t) chunks += (numel[t] + QCA_SCALER_CHUNK - 1) / QCA_SCALER_CHUNK;
  return chunks;
}

int64_t qca_unscale_workspace_size(const qca_unscale_params* p) {
  return p->sumsq ? qca_unscale_chunk_count(p->numel, p->n_tensors) : 0;
}

/* Separate loops per type keep the float and double bodies vectorizable. Matching torch: the
 * check is on the stored value, fp16/bf16 multiply in float and round once, float64 multiplies
 * by the float factor widened to double, and a factor of exactly 1 stores nothing. */
#define QCA_UNSCALE_LOOP(TYPE, LOAD, STORE)                                     \
  do {                                                                          \
    TYPE* v = (TYPE*)data;                                                      \
    for (int64_t i = begin; i < end; ++i) {                                     \
      const LOAD##_t x = LOAD(v[i]);                                            \
      if (check) nonfinite |= !isfinite(x);                                     \
      if (!identity) {                                                          \
        v[i] = STORE(x * (LOAD##_t)factor);                                     \
      }                                                                         \
      if (want_sumsq) {                                                         \
        const double stored = (double)LOAD(v[i]);                               \
        sumsq += stored * stored;                                               \
      }                                                                         \
    }                                                                           \
  } while (0)

typedef float load_f32_t;
typedef double load_f64_t;
typedef float load_f16_t;
typedef float load_bf16_t;
static inline float load_f32(float x) { return x; }
static inline double load_f64(double x) { return x; }
static inline float load_f16(uint16_t x) { return qca_f16_to_f32(x); }
static inline float load_bf16(uint16_t x) { return qca_bf16_to_f32(x); }
static inline float store_f32(float x) { return x; }
static inline double store_f64(double x) { return x; }
static inline uint16_t store_f16(float x) { return qca_f32_to_f16(x); }
static inline uint16_t store_bf16(float x) { return qca_f32_to_bf16(x); }

qca_status qca_unscale_range_cpu(const qca_unscale_params* p, int64_t tensor, int64_t begin,
                                 int64_t end, qca_chunk_result* out) {
  if (!p || tensor < 0 || tensor >= p->n_tensors || begin < 0 || end < begin ||
      end > p->numel[tensor] || !p->factor || (p->sumsq && !p->found_inf))
    return QCA_ERR_INVALID_ARGUMENT;
  if (!qca_dtype_is_valid(p->dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  const float factor = *p->factor;
  const int identity = factor == 1.0f;
  const int check = p->found_inf != NULL;
  const int want_sumsq = p->sumsq != NULL && out != NULL;
  void* data = p->tensors[tensor];
  int nonfinite = 0;
  double sumsq = 0.0;
  if (begin < end && (check || want_sumsq || !identity)) {
    switch (p->dtype) {
      case QCA_F32: QCA_UNSCALE_LOOP(float, load_f32, store_f32); break;
      case QCA_F64: QCA_UNSCALE_LOOP(double, load_f64, store_f64); break;
      case QCA_F16: QCA_UNSCALE_LOOP(uint16_t, load_f16, store_f16); break;
      case QCA_BF16: QCA_UNSCALE_LOOP(uint16_t, load_bf16, store_bf16); break;
    }
  }
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
