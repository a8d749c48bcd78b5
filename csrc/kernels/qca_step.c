/* CPU kernels of the fused QCA step (see include/qca_lowmem/qca_step.h).
 *
 * A range of cells is cut into runs, consecutive cells at a constant stride in every tensor
 * (a row, a sample or the whole range, as the layouts allow), and each run into tiles of cells
 * whose components fit a small buffer. Data moves between a tensor and a tile in strided 2-D
 * copies that convert the type (one switch on the layout and the dtypes per copy, none per
 * element); the maths of qca_step_cells.inc runs on the tile's component planes, across its
 * cells, in one loop per (multiplicative, decay) pair that the compiler vectorises. A planar
 * tensor already in the state's type with unit cell stride (NCHW float delta) is used in
 * place. The float update and its backward on such a delta and psi with unit component stride
 * skip the tiles: blocks of 16 cells go from rows to planes in registers, through the same
 * maths on vectors, and back, in one pass over memory (qca_step_vectors.inc). */
#include "qca_lowmem/qca_step.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "cpu_target.h"
#include "qca_scalar.h"
#include "qca_shared.h"

/* Components per tile (1,024 cells at d = 14): its planes stay in L2, and each plane of a tensor
 * is read or written in runs of 4 KiB. Tiles of 512 components (36 cells) cut the 28 planes of
 * delta or x into runs of 144 bytes, and the update spent most of its time waiting on them. */
#define QCA_TILE_COMPONENTS 14336
/* Components per tile of a pack of a range that fits in L2 (128 cells at d = 14). */
#define QCA_L1_TILE_COMPONENTS 1792

#define QCA_PER_PRECISION "qca_step_cells.inc"
#include "qca_per_precision.inc"

/* ---- strided 2-D copies with conversion: dst[i dc + k dk] = (DST)src[i sc + k sk] ---- */

/* The loop body once; the dispatcher calls it with literal unit strides where they hold, so that
 * each common layout gets a loop with contiguous accesses the compiler can vectorise. */
#define QCA_DEFINE_COPY(name, SRC_T, DST_T, CONVERT)                                             \
  QCA_ALWAYS_INLINE void name##_cells_inner(const SRC_T* restrict src, int64_t sc, int64_t sk,   \
                                            DST_T* restrict dst, int64_t dc, int64_t dk,         \
                                            int64_t n, int64_t m) {                              \
    for (int64_t k = 0; k < m; ++k)                                                              \
      for (int64_t i = 0; i < n; ++i) dst[i * dc + k * dk] = CONVERT(src[i * sc + k * sk]);      \
  }                                                                                              \
  QCA_ALWAYS_INLINE void name##_components_inner(const SRC_T* restrict src, int64_t sc,          \
                                                 int64_t sk, DST_T* restrict dst, int64_t dc,    \
                                                 int64_t dk, int64_t n, int64_t m) {             \
    for (int64_t i = 0; i < n; ++i)                                                              \
      for (int64_t k = 0; k < m; ++k) dst[i * dc + k * dk] = CONVERT(src[i * sc + k * sk]);      \
  }                                                                                              \
  static void name(const void* src_, int64_t sc, int64_t sk, void* dst_, int64_t dc, int64_t dk, \
                   int64_t n, int64_t m) {                                                       \
    const SRC_T* src = (const SRC_T*)src_;                                                       \
    DST_T* dst = (DST_T*)dst_;                                                                   \
    if (sc == 1 && dc == 1)                                                                      \
      name##_cells_inner(src, 1, sk, dst, 1, dk, n, m);                                          \
    else if (dc == 1)                                                                            \
      name##_cells_inner(src, sc, sk, dst, 1, dk, n, m);                                         \
    else if (sc == 1)                                                                            \
      name##_cells_inner(src, 1, sk, dst, dc, dk, n, m);                                         \
    else if (sk == 1 && dk == 1)                                                                 \
      name##_components_inner(src, sc, 1, dst, dc, 1, n, m);                                     \
    else if (dk == 1)                                                                            \
      name##_components_inner(src, sc, sk, dst, dc, 1, n, m);                                    \
    else if (sk == 1)                                                                            \
      name##_components_inner(src, sc, 1, dst, dc, dk, n, m);                                    \
    else                                                                                         \
      name##_cells_inner(src, sc, sk, dst, dc, dk, n, m);                                        \
  }

#define QCA_SAME(x) (x)
#define QCA_TO_F32(x) ((float)(x))
#define QCA_TO_F64(x) ((double)(x))
#define QCA_F16_TO_F64(x) ((double)qca_f16_to_f32(x))
#define QCA_BF16_TO_F64(x) ((double)qca_bf16_to_f32(x))
#define QCA_F64_TO_F16(x) qca_f32_to_f16((float)(x))
#define QCA_F64_TO_BF16(x) qca_f32_to_bf16((float)(x))
/* Narrow types go through float both ways, as qca_scalar.h's loads and stores (and torch's
 * double <-> half casts) do. */
QCA_DEFINE_COPY(copy_f32_f32, float, float, QCA_SAME)
QCA_DEFINE_COPY(copy_f32_f64, float, double, QCA_TO_F64)
QCA_DEFINE_COPY(copy_f32_f16, float, uint16_t, qca_f32_to_f16)
QCA_DEFINE_COPY(copy_f32_bf16, float, uint16_t, qca_f32_to_bf16)
QCA_DEFINE_COPY(copy_f64_f32, double, float, QCA_TO_F32)
QCA_DEFINE_COPY(copy_f64_f64, double, double, QCA_SAME)
QCA_DEFINE_COPY(copy_f64_f16, double, uint16_t, QCA_F64_TO_F16)
QCA_DEFINE_COPY(copy_f64_bf16, double, uint16_t, QCA_F64_TO_BF16)
QCA_DEFINE_COPY(copy_f16_f32, uint16_t, float, qca_f16_to_f32)
QCA_DEFINE_COPY(copy_f16_f64, uint16_t, double, QCA_F16_TO_F64)
QCA_DEFINE_COPY(copy_bf16_f32, uint16_t, float, qca_bf16_to_f32)
QCA_DEFINE_COPY(copy_bf16_f64, uint16_t, double, QCA_BF16_TO_F64)

/* ---- transposes between cells' (re, im) rows and component planes, in the state's type ---- */

/* Row i (a cell: 2d values, its (re, im) pairs, `row_stride` after row i-1) against planes:
 * value 2k + part of a row is element i of the plane at k k_stride + part part_stride. Blocks of
 * 4 x 4 with constant bounds, which the compiler's SLP vectoriser turns into vector loads and
 * stores with shuffles between them; the edges element by element. Two components (four planes)
 * at a time over all the cells, so that each plane is written (or read) in one run: planes a
 * power of two apart would otherwise evict each other's lines. */
#define QCA_DEFINE_TRANSPOSES(T, SUF, WIDE_ROWS_TO_PLANES, WIDE_PLANES_TO_ROWS)                    \
  static void rows_to_planes_##SUF(const T* restrict rows, int64_t row_stride, T* restrict planes, \
                                   int64_t k_stride, int64_t part_stride, int64_t n, int64_t d) {  \
    const int64_t blocked = n - n % 4;                                                             \
    int64_t k0 = WIDE_ROWS_TO_PLANES(rows, row_stride, planes, k_stride, part_stride, n, d);       \
    for (; k0 + 2 <= d; k0 += 2) {                                                                 \
      for (int64_t i0 = 0; i0 < blocked; i0 += 4) {                                                \
        T block[4][4];                                                                             \
        for (int a = 0; a < 4; ++a)                                                                \
          for (int c = 0; c < 4; ++c) block[a][c] = rows[(i0 + a) * row_stride + 2 * k0 + c];      \
        for (int c = 0; c < 4; ++c)                                                                \
          for (int a = 0; a < 4; ++a)                                                              \
            planes[(k0 + c / 2) * k_stride + (c % 2) * part_stride + i0 + a] = block[a][c];        \
      }                                                                                            \
      for (int64_t i = blocked; i < n; ++i)                                                        \
        for (int c = 0; c < 4; ++c)                                                                \
          planes[(k0 + c / 2) * k_stride + (c % 2) * part_stride + i] =                            \
              rows[i * row_stride + 2 * k0 + c];                                                   \
    }                                                                                              \
    for (; k0 < d; ++k0)                                                                           \
      for (int part = 0; part < 2; ++part)                                                         \
        for (int64_t i = 0; i < n; ++i)                                                            \
          planes[k0 * k_stride + part * part_stride + i] = rows[i * row_stride + 2 * k0 + part];   \
  }                                                                                                \
  static void planes_to_rows_##SUF(const T* restrict planes, int64_t k_stride,                     \
                                   int64_t part_stride, T* restrict rows, int64_t row_stride,      \
                                   int64_t n, int64_t d) {                                         \
    const int64_t blocked = n - n % 4;                                                             \
    int64_t k0 = WIDE_PLANES_TO_ROWS(planes, k_stride, part_stride, rows, row_stride, n, d);       \
    for (; k0 + 2 <= d; k0 += 2) {                                                                 \
      for (int64_t i0 = 0; i0 < blocked; i0 += 4) {                                                \
        T block[4][4];                                                                             \
        for (int c = 0; c < 4; ++c)                                                                \
          for (int a = 0; a < 4; ++a)                                                              \
            block[a][c] = planes[(k0 + c / 2) * k_stride + (c % 2) * part_stride + i0 + a];        \
        for (int a = 0; a < 4; ++a)                                                                \
          for (int c = 0; c < 4; ++c) rows[(i0 + a) * row_stride + 2 * k0 + c] = block[a][c];      \
      }                                                                                            \
      for (int64_t i = blocked; i < n; ++i)                                                        \
        for (int c = 0; c < 4; ++c)                                                                \
          rows[i * row_stride + 2 * k0 + c] =                                                      \
              planes[(k0 + c / 2) * k_stride + (c % 2) * part_stride + i];                         \
    }                                                                                              \
    for (; k0 < d; ++k0)                                                                           \
      for (int part = 0; part < 2; ++part)                                                         \
        for (int64_t i = 0; i < n; ++i)                                                            \
          rows[i * row_stride + 2 * k0 + part] = planes[k0 * k_stride + part * part_stride + i];   \
  }

/* The float path on GCC vectors of 8 floats (GCC >= 12 and Clang): 8 x 8 transposes for the
 * tiles' rows and planes, and the update and its backward on blocks of 16 cells. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define QCA_HAVE_SHUFFLEVECTOR 1
#endif
#endif

#ifdef QCA_HAVE_SHUFFLEVECTOR
#include "qca_step_vectors.inc"
#define QCA_WIDE_ROWS_TO_PLANES_F32 rows_to_planes_wide_f32
#define QCA_WIDE_PLANES_TO_ROWS_F32 planes_to_rows_wide_f32
#else
#define QCA_WIDE_ROWS_TO_PLANES_F32(...) 0
#define QCA_WIDE_PLANES_TO_ROWS_F32(...) 0
#endif
#define QCA_NO_WIDE(...) 0

QCA_DEFINE_TRANSPOSES(float, f32, QCA_WIDE_ROWS_TO_PLANES_F32, QCA_WIDE_PLANES_TO_ROWS_F32)
QCA_DEFINE_TRANSPOSES(double, f64, QCA_NO_WIDE, QCA_NO_WIDE)

typedef void (*qca_copy_fn)(const void*, int64_t, int64_t, void*, int64_t, int64_t, int64_t,
                            int64_t);

/* The copy from `from` to `to`, one of them the state's type (float or double); NULL otherwise. */
static qca_copy_fn copy_fn(qca_dtype from, qca_dtype to) {
  static const qca_copy_fn table[4][4] = {
      /* from F32 */ {copy_f32_f32, copy_f32_f64, copy_f32_f16, copy_f32_bf16},
      /* from F64 */ {copy_f64_f32, copy_f64_f64, copy_f64_f16, copy_f64_bf16},
      /* from F16 */ {copy_f16_f32, copy_f16_f64, NULL, NULL},
      /* from BF16 */ {copy_bf16_f32, copy_bf16_f64, NULL, NULL},
  };
  return qca_dtype_is_valid(from) && qca_dtype_is_valid(to) ? table[from][to] : NULL;
}

static size_t dtype_size(qca_dtype t) { return t == QCA_F64 ? 8 : t == QCA_F32 ? 4 : 2; }

/* ---- runs of cells ---- */

/* Where the cells of a tensor lie: offsets of cell (b, h, w) are b sb + h sh + w sw, and from
 * any multiple of `period` on, `period` consecutive cells are `step` apart. */
typedef struct cell_layout {
  int64_t sb, sh, sw, period, step;
} cell_layout;

static cell_layout layout_of(const qca_grid* g, int64_t sb, int64_t sh, int64_t sw) {
  const int64_t sizes[3] = {g->width, g->height, g->batch}, strides[3] = {sw, sh, sb};
  cell_layout l = {sb, sh, sw, 1, 0};
  int started = 0;
  for (int i = 0; i < 3; ++i) {
    if (sizes[i] == 1) continue; /* never advances: no constraint */
    if (!started) {
      l.period = sizes[i];
      l.step = strides[i];
      started = 1;
    } else if (strides[i] == l.period * l.step) {
      l.period *= sizes[i];
    } else {
      break;
    }
  }
  return l;
}

static int64_t offset_of(const qca_grid* g, const cell_layout* l, int64_t cell) {
  return qca_cell_offset(cell, g->height, g->width, l->sb, l->sh, l->sw);
}

/* Cells from `cell` on (at most `left`) that stay on one stride in a tensor laid out as `l`. */
static int64_t run_within(const cell_layout* l, int64_t cell, int64_t left) {
  const int64_t in_period = l->period - cell % l->period;
  return in_period < left ? in_period : left;
}

/* A multiple of 8 cells (whole vectors) but not of 16, so that a tile's planes, n floats apart,
 * do not all fall on the same cache sets (1,024 cells: 4 KiB apart, and the 28 planes of a cell
 * evicted each other from L1). */
static int64_t tile_cells(int64_t d) {
  const int64_t n = QCA_TILE_COMPONENTS / d;
  return n >= 16 ? n - n % 16 - 8 : n > 0 ? n : 1;
}

static qca_status check_grid(const qca_grid* g, int64_t cell_begin, int64_t cell_end) {
  if (g->batch < 0 || g->height < 0 || g->width < 0 || g->d < 1) return QCA_ERR_INVALID_ARGUMENT;
  if (cell_begin < 0 || cell_end < cell_begin || cell_end > g->batch * g->height * g->width)
    return QCA_ERR_INVALID_ARGUMENT;
  return QCA_OK;
}

/* ---- pack and its backward: copies between psi's parts and the 2d planes ---- */

/* psi's parts <-> the 2d planes for the n cells of a tile; `to_planar` picks the direction.
 * psi points at the tile's first cell (part 0), x at its channel 0. */
static void move_tile(int to_planar, int64_t d, qca_dtype state, char* psi, int64_t psi_step,
                      int64_t psi_k, qca_dtype x_dtype, char* x, int64_t x_step, int64_t x_c,
                      int64_t n) {
  if (psi_k == 1 && x_dtype == state && x_step == 1) { /* contiguous cells and planes */
    if (state == QCA_F32) {
      if (to_planar)
        rows_to_planes_f32((const float*)psi, 2 * psi_step, (float*)x, x_c, d * x_c, n, d);
      else
        planes_to_rows_f32((const float*)x, x_c, d * x_c, (float*)psi, 2 * psi_step, n, d);
    } else {
      if (to_planar)
        rows_to_planes_f64((const double*)psi, 2 * psi_step, (double*)x, x_c, d * x_c, n, d);
      else
        planes_to_rows_f64((const double*)x, x_c, d * x_c, (double*)psi, 2 * psi_step, n, d);
    }
    return;
  }
  const qca_copy_fn copy = to_planar ? copy_fn(state, x_dtype) : copy_fn(x_dtype, state);
  const int64_t psi_size = (int64_t)dtype_size(state), x_size = (int64_t)dtype_size(x_dtype);
  for (int part = 0; part < 2; ++part) {
    char* psi_part = psi + part * psi_size;
    char* x_part = x + part * d * x_c * x_size;
    if (to_planar)
      copy(psi_part, 2 * psi_step, 2 * psi_k, x_part, x_step, x_c, n, d);
    else
      copy(x_part, x_step, x_c, psi_part, 2 * psi_step, 2 * psi_k, n, d);
  }
}

static void move_range(int to_planar, const qca_grid* g, qca_dtype state, void* psi,
                       const int64_t* psi_stride, qca_dtype x_dtype, void* x,
                       const int64_t* x_stride, int64_t begin, int64_t end) {
  const cell_layout pl = layout_of(g, psi_stride[0], psi_stride[1], psi_stride[2]);
  const cell_layout xl = layout_of(g, x_stride[0], x_stride[2], x_stride[3]);
  const int64_t psi_size = (int64_t)dtype_size(state), x_size = (int64_t)dtype_size(x_dtype);
  /* A range of up to 2 MiB (in L2, or nearly) in tiles whose rows stay in L1 over the passes of
   * two components each, a larger one in the update's tiles, in long runs a plane: at 64 x 64 x
   * 14, 0.41 ns a component (B = 1) and 1.2 (B = 16), where one size for both lost a quarter. */
  const int64_t bytes = (end - begin) * g->d * 2 * (psi_size + x_size);
  const int64_t small = QCA_L1_TILE_COMPONENTS / g->d > 0 ? QCA_L1_TILE_COMPONENTS / g->d : 1;
  const int64_t tile = bytes <= (2 << 20) ? small : tile_cells(g->d);
  for (int64_t cell = begin; cell < end;) {
    const int64_t run = run_within(&xl, cell, run_within(&pl, cell, end - cell));
    const int64_t psi_run = 2 * offset_of(g, &pl, cell), x_run = offset_of(g, &xl, cell);
    for (int64_t i0 = 0; i0 < run; i0 += tile) {
      const int64_t n = run - i0 < tile ? run - i0 : tile;
      move_tile(to_planar, g->d, state, (char*)psi + (psi_run + 2 * i0 * pl.step) * psi_size,
                pl.step, psi_stride[3], x_dtype, (char*)x + (x_run + i0 * xl.step) * x_size,
                xl.step, x_stride[1], n);
    }
    cell += run;
  }
}

qca_status qca_pack_cpu(const qca_pack_params* p, int64_t cell_begin, int64_t cell_end) {
  qca_status status = check_grid(&p->grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (p->state_dtype != QCA_F32 && p->state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (!qca_dtype_is_valid(p->x_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  /* psi is only read */
  move_range(1, &p->grid, p->state_dtype, (void*)p->psi, p->psi_stride, p->x_dtype, p->x,
             p->x_stride, cell_begin, cell_end);
  return QCA_OK;
}

qca_status qca_pack_backward_cpu(const qca_pack_backward_params* p, int64_t cell_begin,
                                 int64_t cell_end) {
  qca_status status = check_grid(&p->grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (p->state_dtype != QCA_F32 && p->state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (!qca_dtype_is_valid(p->x_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  const qca_grid* g = &p->grid;
  const int64_t psi_stride[4] = {g->height * g->width * g->d, g->width * g->d, g->d, 1};
  /* x is only read */
  move_range(0, g, p->state_dtype, p->psi, psi_stride, p->x_dtype, (void*)p->x, p->x_stride,
             cell_begin, cell_end);
  return QCA_OK;
}

/* ---- update and its backward: the maths on tiles, per state precision ---- */

#define REAL float
#define SUFFIX f32
#define QCA_REAL_DTYPE QCA_F32
#ifdef QCA_HAVE_SHUFFLEVECTOR
#define QCA_UPDATE_BLOCKS update_blocks_f32
#define QCA_BACKWARD_BLOCKS backward_blocks_f32
#endif
#include "qca_step_tiles.inc"
#undef REAL
#undef SUFFIX
#undef QCA_REAL_DTYPE
#undef QCA_UPDATE_BLOCKS
#undef QCA_BACKWARD_BLOCKS
#define REAL double
#define SUFFIX f64
#define QCA_REAL_DTYPE QCA_F64
#include "qca_step_tiles.inc"
#undef REAL
#undef SUFFIX
#undef QCA_REAL_DTYPE

qca_status qca_update_cpu(const qca_update_params* p, int64_t cell_begin, int64_t cell_end) {
  qca_status status = check_grid(&p->grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (!qca_dtype_is_valid(p->delta_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (p->state_dtype == QCA_F32) return update_range_f32(p, cell_begin, cell_end);
  if (p->state_dtype == QCA_F64) return update_range_f64(p, cell_begin, cell_end);
  return QCA_ERR_UNSUPPORTED_DTYPE;
}

qca_status qca_update_backward_cpu(const qca_update_backward_params* p, int64_t cell_begin,
                                   int64_t cell_end) {
  qca_status status = check_grid(&p->fwd.grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (!qca_dtype_is_valid(p->fwd.delta_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (p->fwd.state_dtype == QCA_F32) return update_backward_range_f32(p, cell_begin, cell_end);
  if (p->fwd.state_dtype == QCA_F64) return update_backward_range_f64(p, cell_begin, cell_end);
  return QCA_ERR_UNSUPPORTED_DTYPE;
}
