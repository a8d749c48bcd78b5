/* What the C and CUDA kernels of the 2x2 max pooling share (include/qca_lowmem/max_pool.h): where
 * an element and its window lie, and a window's pick. */
#ifndef QCA_LOWMEM_MAX_POOL_WINDOWS_H
#define QCA_LOWMEM_MAX_POOL_WINDOWS_H

#include <math.h>
#include <stdint.h>

#include "qca_lowmem/max_pool.h"
#include "qca_shared.h"

/* The arguments every launch checks first: a shape of at least one window a plane and a dtype of
 * the four. Host code, for the C and CUDA launchers alike. */
static inline int qca_pool_arguments_ok(const qca_max_pool_shape* s, qca_dtype dtype) {
  return s->batch >= 0 && s->channels >= 0 && s->height >= 2 && s->width >= 2 &&
         (dtype == QCA_F32 || dtype == QCA_F64 || dtype == QCA_F16 || dtype == QCA_BF16);
}

/* A window or element's place: sample, channel, row, column. */
typedef struct qca_pool_place {
  int64_t n, c, h, w;
} qca_pool_place;

/* The place of element `i`, in memory order, of a (batch, channels, height, width) tensor. */
static inline QCA_HD qca_pool_place qca_pool_place_of(int64_t i, int64_t channels, int64_t height,
                                                      int64_t width, int channels_last) {
  qca_pool_place p;
  if (channels_last) {
    p.c = i % channels;
    i /= channels;
    p.w = i % width;
    i /= width;
    p.h = i % height;
    p.n = i / height;
  } else {
    p.w = i % width;
    i /= width;
    p.h = i % height;
    i /= height;
    p.c = i % channels;
    p.n = i / channels;
  }
  return p;
}

/* The place after `p` in memory order: element i + 1 from element i's place, without divisions. */
static inline QCA_HD void qca_pool_advance(qca_pool_place* p, int64_t channels, int64_t height,
                                           int64_t width, int channels_last) {
  if (channels_last) {
    if (++p->c < channels) return;
    p->c = 0;
    if (++p->w < width) return;
    p->w = 0;
    if (++p->h < height) return;
    p->h = 0;
    ++p->n;
  } else {
    if (++p->w < width) return;
    p->w = 0;
    if (++p->h < height) return;
    p->h = 0;
    if (++p->c < channels) return;
    p->c = 0;
    ++p->n;
  }
}

/* The memory index of place `p` in such a tensor. */
static inline QCA_HD int64_t qca_pool_index_of(qca_pool_place p, int64_t channels, int64_t height,
                                               int64_t width, int channels_last) {
  return channels_last ? ((p.n * height + p.h) * width + p.w) * channels + p.c
                       : ((p.n * channels + p.c) * height + p.h) * width + p.w;
}

/* The memory indices in x of window `win`'s four elements (its row and column in y), row by
 * row. */
static inline QCA_HD void qca_pool_window(const qca_max_pool_shape* s, qca_pool_place win,
                                          int64_t elements[4]) {
  const qca_pool_place first = {win.n, win.c, 2 * win.h, 2 * win.w};
  const int64_t base = qca_pool_index_of(first, s->channels, s->height, s->width, s->channels_last);
  const int64_t column = s->channels_last ? s->channels : 1;
  const int64_t row = s->width * column;
  elements[0] = base;
  elements[1] = base + column;
  elements[2] = base + row;
  elements[3] = base + row + column;
}

/* The pick of a window's values (row by row): torch's rule, 0-3, or -1 where none is greater
 * than -infinity nor NaN. Float for float, half and bfloat16 values, double for double ones: the
 * widening is exact, so the comparisons are the data's own. */
#define QCA_DEFINE_WINDOW_PICK(SUFFIX_, REAL_)                                \
  static inline QCA_HD int qca_window_pick_##SUFFIX_(const REAL_ values[4]) { \
    REAL_ best = -(REAL_)INFINITY;                                            \
    int pick = -1;                                                            \
    for (int k = 0; k < 4; ++k) {                                             \
      if (values[k] > best || isnan(values[k])) {                             \
        best = values[k];                                                     \
        pick = k;                                                             \
      }                                                                       \
    }                                                                         \
    return pick;                                                              \
  }
QCA_DEFINE_WINDOW_PICK(f32, float)
QCA_DEFINE_WINDOW_PICK(f64, double)
#undef QCA_DEFINE_WINDOW_PICK

/* The elements of x beside window `win` that no window holds, where it is the last of its row or
 * column of windows and x's height or width is odd: five places' memory indices to `out` (below
 * it, right of it, and the corner), and a mask of those that exist (bit k for out[k]). Every
 * element of x is in one window or beside one, once. Fixed indices: in registers on a GPU. */
static inline QCA_HD int qca_pool_leftovers(const qca_max_pool_shape* s, qca_pool_place win,
                                            int64_t out[5]) {
  const int64_t out_h = s->height / 2, out_w = s->width / 2;
  const int last_row = win.h == out_h - 1 && s->height % 2 == 1;
  const int last_column = win.w == out_w - 1 && s->width % 2 == 1;
  const int64_t rows[5] = {2 * out_h, 2 * out_h, 2 * win.h, 2 * win.h + 1, 2 * out_h};
  const int64_t columns[5] = {2 * win.w, 2 * win.w + 1, 2 * out_w, 2 * out_w, 2 * out_w};
  for (int k = 0; k < 5; ++k) {
    const qca_pool_place at = {win.n, win.c, rows[k], columns[k]};
    out[k] = qca_pool_index_of(at, s->channels, s->height, s->width, s->channels_last);
  }
  return (last_row ? 3 : 0) | (last_column ? 12 : 0) | (last_row && last_column ? 16 : 0);
}

/* The element of a window (0-3) whose gradient it sends, or -1: its pick, else (four
 * -infinities) its first element, or with `unpicked_to_origin` the plane's first pixel where
 * this is the plane's first window. */
static inline QCA_HD int qca_window_gradient_element(int pick, qca_pool_place win,
                                                     int unpicked_to_origin) {
  if (pick >= 0) return pick;
  if (!unpicked_to_origin) return 0;
  return win.h == 0 && win.w == 0 ? 0 : -1;
}

#endif
