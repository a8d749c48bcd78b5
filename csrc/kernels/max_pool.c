/* C kernels of the 2x2 max pooling (see include/qca_lowmem/max_pool.h). */
#include "qca_lowmem/max_pool.h"

#include <string.h>

#include "max_pool_windows.h"
#include "qca_scalar.h"

static size_t element_bytes(qca_dtype dtype) {
  return dtype == QCA_F64 ? 8 : dtype == QCA_F32 ? 4 : 2;
}

/* The pick of the window whose elements in x are `elements`. */
static int window_pick(const void* x, qca_dtype dtype, const int64_t elements[4]) {
  if (dtype == QCA_F64) {
    double values[4];
    for (int k = 0; k < 4; ++k) values[k] = qca_load_f64(x, dtype, elements[k]);
    return qca_window_pick_f64(values);
  }
  float values[4];
  for (int k = 0; k < 4; ++k) values[k] = qca_load_f32(x, dtype, elements[k]);
  return qca_window_pick_f32(values);
}

static qca_status check(const qca_max_pool_shape* s, qca_dtype dtype, int64_t begin, int64_t end) {
  const int64_t windows = s->batch * s->channels * (s->height / 2) * (s->width / 2);
  if (!qca_pool_arguments_ok(s, dtype) || begin < 0 || end < begin || end > windows)
    return QCA_ERR_INVALID_ARGUMENT;
  return QCA_OK;
}

qca_status qca_max_pool2x2_forward_cpu(const qca_max_pool_params* p, int64_t begin, int64_t end) {
  const qca_max_pool_shape* s = &p->shape;
  const qca_status status = check(s, p->dtype, begin, end);
  if (status != QCA_OK || begin == end) return status;
  const int64_t out_h = s->height / 2, out_w = s->width / 2;
  const size_t bytes = element_bytes(p->dtype);
  qca_pool_place win = qca_pool_place_of(begin, s->channels, out_h, out_w, s->channels_last);
  for (int64_t o = begin; o < end; ++o) {
    int64_t elements[4];
    qca_pool_window(s, win, elements);
    const int pick = window_pick(p->x, p->dtype, elements);
    memcpy((char*)p->y + o * bytes, (const char*)p->x + elements[pick < 0 ? 0 : pick] * bytes,
           bytes);
    qca_pool_advance(&win, s->channels, out_h, out_w, s->channels_last);
  }
  return QCA_OK;
}

/* grad_x[i] = 0 + grad (as torch's kernels sum it: -0 becomes +0) or +0. */
static void put_gradient(const qca_max_pool_backward_params* p, int64_t i, int sent, int64_t o) {
  if (p->dtype == QCA_F64)
    ((double*)p->grad_x)[i] = sent ? 0.0 + ((const double*)p->grad_y)[o] : 0.0;
  else
    qca_store_f32(p->grad_x, p->dtype, i,
                  sent ? 0.0f + qca_load_f32(p->grad_y, p->dtype, o) : 0.0f);
}

qca_status qca_max_pool2x2_backward_cpu(const qca_max_pool_backward_params* p, int64_t begin,
                                        int64_t end) {
  const qca_max_pool_shape* s = &p->shape;
  const qca_status status = check(s, p->dtype, begin, end);
  if (status != QCA_OK || begin == end) return status;
  const int64_t out_h = s->height / 2, out_w = s->width / 2;
  qca_pool_place win = qca_pool_place_of(begin, s->channels, out_h, out_w, s->channels_last);
  for (int64_t o = begin; o < end; ++o) {
    int64_t elements[4], leftovers[5];
    qca_pool_window(s, win, elements);
    const int sends = qca_window_gradient_element(window_pick(p->x, p->dtype, elements), win,
                                                  p->unpicked_to_origin);
    for (int k = 0; k < 4; ++k) put_gradient(p, elements[k], k == sends, o);
    const int beside = qca_pool_leftovers(s, win, leftovers);
    for (int k = 0; k < 5; ++k)
      if (beside & (1 << k)) put_gradient(p, leftovers[k], 0, o);
    qca_pool_advance(&win, s->channels, out_h, out_w, s->channels_last);
  }
  return QCA_OK;
}
