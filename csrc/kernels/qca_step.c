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
 * maths on vectors, and back, in one pass over memory. */
#include "qca_lowmem/qca_step.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "qca_scalar.h"
#include "qca_shared.h"

#if defined(__GNUC__)
#define QCA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define QCA_ALWAYS_INLINE inline
#endif

/* The tiles' maths is compiled twice on x86-64 Linux, for AVX2 (8 floats a vector) and for the
 * baseline (SSE2), and the loader picks the one the CPU runs: no -march flag, one binary. AVX2
 * without FMA: the same roundings, so the same bits, either way. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define QCA_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QCA_SIMD_CLONES
#endif

/* Components per tile (1,024 cells at d = 14): its planes stay in L2, and each plane of a tensor
 * is read or written in runs of 4 KiB. Tiles of 512 components (36 cells) cut the 28 planes of
 * delta or x into runs of 144 bytes, and the update spent most of its time waiting on them. */
#define QCA_TILE_COMPONENTS 14336
/* Components per tile of a pack of a range that fits in L2 (128 cells at d = 14). */
#define QCA_L1_TILE_COMPONENTS 1792

#define REAL float
#define SUFFIX f32
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX
#define REAL double
#define SUFFIX f64
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX

/* ---- strided 2-D copies with conversion: dst[i dc + k dk] = (DST)src[i sc + k sk] ---- */

/* The loop body once; the dispatcher calls it with literal unit strides where they hold, so that
 * each common layout gets a loop with contiguous accesses the compiler can vectorise. */
#define QCA_DEFINE_COPY(name, SRC_T, DST_T, CONVERT)                                             \
  static QCA_ALWAYS_INLINE void name##_cells_inner(const SRC_T* restrict src, int64_t sc,        \
                                                   int64_t sk, DST_T* restrict dst, int64_t dc,  \
                                                   int64_t dk, int64_t n, int64_t m) {           \
    for (int64_t k = 0; k < m; ++k)                                                              \
      for (int64_t i = 0; i < n; ++i) dst[i * dc + k * dk] = CONVERT(src[i * sc + k * sk]);      \
  }                                                                                              \
  static QCA_ALWAYS_INLINE void name##_components_inner(                                         \
      const SRC_T* restrict src, int64_t sc, int64_t sk, DST_T* restrict dst, int64_t dc,        \
      int64_t dk, int64_t n, int64_t m) {                                                        \
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

/* Floats also in blocks of 8 cells x 4 components (8 x 8 values) through vector registers: the
 * 4 x 4 blocks above load element by element. Returns the components done (all cells); pure
 * data movement, the same bits as the element-wise path. GCC >= 12 and Clang. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define QCA_HAVE_SHUFFLEVECTOR 1
#endif
#endif

#ifdef QCA_HAVE_SHUFFLEVECTOR
typedef float qca_f32x8 __attribute__((vector_size(32)));
/* The same vector at any float's address. */
typedef float qca_f32x8_at __attribute__((vector_size(32), aligned(4), may_alias));

#define QCA_LO(a, b) __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13)
#define QCA_HI(a, b) __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15)
#define QCA_LO2(a, b) __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13)
#define QCA_HI2(a, b) __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15)
#define QCA_LO4(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
#define QCA_HI4(a, b) __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15)

/* The 8 x 8 block whose row a is at in + in_row[a] transposed: row c to out + out_row[c]. Unpack
 * pairs, shuffle quads, swap halves: AVX's 24-shuffle transpose. */
static QCA_ALWAYS_INLINE void qca_transpose8(const float* in, const int64_t in_row[8], float* out,
                                             const int64_t out_row[8]) {
  const qca_f32x8 r0 = *(const qca_f32x8_at*)(in + in_row[0]),
                  r1 = *(const qca_f32x8_at*)(in + in_row[1]),
                  r2 = *(const qca_f32x8_at*)(in + in_row[2]),
                  r3 = *(const qca_f32x8_at*)(in + in_row[3]),
                  r4 = *(const qca_f32x8_at*)(in + in_row[4]),
                  r5 = *(const qca_f32x8_at*)(in + in_row[5]),
                  r6 = *(const qca_f32x8_at*)(in + in_row[6]),
                  r7 = *(const qca_f32x8_at*)(in + in_row[7]);
  const qca_f32x8 t0 = QCA_LO(r0, r1), t1 = QCA_HI(r0, r1), t2 = QCA_LO(r2, r3),
                  t3 = QCA_HI(r2, r3), t4 = QCA_LO(r4, r5), t5 = QCA_HI(r4, r5),
                  t6 = QCA_LO(r6, r7), t7 = QCA_HI(r6, r7);
  const qca_f32x8 u0 = QCA_LO2(t0, t2), u1 = QCA_HI2(t0, t2), u2 = QCA_LO2(t1, t3),
                  u3 = QCA_HI2(t1, t3), u4 = QCA_LO2(t4, t6), u5 = QCA_HI2(t4, t6),
                  u6 = QCA_LO2(t5, t7), u7 = QCA_HI2(t5, t7);
  *(qca_f32x8_at*)(out + out_row[0]) = QCA_LO4(u0, u4);
  *(qca_f32x8_at*)(out + out_row[1]) = QCA_LO4(u1, u5);
  *(qca_f32x8_at*)(out + out_row[2]) = QCA_LO4(u2, u6);
  *(qca_f32x8_at*)(out + out_row[3]) = QCA_LO4(u3, u7);
  *(qca_f32x8_at*)(out + out_row[4]) = QCA_HI4(u0, u4);
  *(qca_f32x8_at*)(out + out_row[5]) = QCA_HI4(u1, u5);
  *(qca_f32x8_at*)(out + out_row[6]) = QCA_HI4(u2, u6);
  *(qca_f32x8_at*)(out + out_row[7]) = QCA_HI4(u3, u7);
}

#undef QCA_LO
#undef QCA_HI
#undef QCA_LO2
#undef QCA_HI2
#undef QCA_LO4
#undef QCA_HI4

/* Value c of a cell's 8 (components k0 .. k0 + 3, re and im) is in plane (k0 + c / 2, c % 2).
 * A tile's planes are read or written 8 cells at a time over every component, so that the rows
 * go by once, in order. Planes a multiple of 4 KiB apart (a 64 x 64 tensor's) share their cache
 * sets: eight of them written at once evict each other from L1, so writes into them take the
 * narrow path (four planes at a time) and reads go one group of eight planes at a time. */
static int planes_alias(int64_t k_stride, int64_t part_stride) {
  return k_stride % 1024 == 0 || part_stride % 1024 == 0;
}

QCA_SIMD_CLONES static int64_t rows_to_planes_wide_f32(const float* restrict rows,
                                                       int64_t row_stride, float* restrict planes,
                                                       int64_t k_stride, int64_t part_stride,
                                                       int64_t n, int64_t d) {
  if (planes_alias(k_stride, part_stride)) return 0;
  const int64_t blocked = n - n % 8;
  int64_t k0 = 0, cell_row[8], plane_row[8];
  for (int a = 0; a < 8; ++a) cell_row[a] = a * row_stride;
  for (int c = 0; c < 8; ++c) plane_row[c] = (c / 2) * k_stride + (c % 2) * part_stride;
  const int64_t wide = d - d % 4;
  for (int64_t i0 = 0; i0 < blocked; i0 += 8)
    for (k0 = 0; k0 < wide; k0 += 4)
      qca_transpose8(rows + i0 * row_stride + 2 * k0, cell_row, planes + k0 * k_stride + i0,
                     plane_row);
  for (k0 = 0; k0 < wide; k0 += 4)
    for (int64_t i = blocked; i < n; ++i)
      for (int c = 0; c < 8; ++c)
        planes[k0 * k_stride + plane_row[c] + i] = rows[i * row_stride + 2 * k0 + c];
  return wide;
}

QCA_SIMD_CLONES static int64_t planes_to_rows_wide_f32(const float* restrict planes,
                                                       int64_t k_stride, int64_t part_stride,
                                                       float* restrict rows, int64_t row_stride,
                                                       int64_t n, int64_t d) {
  const int64_t blocked = n - n % 8;
  int64_t k0 = 0, cell_row[8], plane_row[8];
  for (int a = 0; a < 8; ++a) cell_row[a] = a * row_stride;
  for (int c = 0; c < 8; ++c) plane_row[c] = (c / 2) * k_stride + (c % 2) * part_stride;
  const int64_t wide = d - d % 4;
  if (planes_alias(k_stride, part_stride))
    for (k0 = 0; k0 < wide; k0 += 4)
      for (int64_t i0 = 0; i0 < blocked; i0 += 8)
        qca_transpose8(planes + k0 * k_stride + i0, plane_row, rows + i0 * row_stride + 2 * k0,
                       cell_row);
  else
    for (int64_t i0 = 0; i0 < blocked; i0 += 8)
      for (k0 = 0; k0 < wide; k0 += 4)
        qca_transpose8(planes + k0 * k_stride + i0, plane_row, rows + i0 * row_stride + 2 * k0,
                       cell_row);
  for (k0 = 0; k0 < wide; k0 += 4)
    for (int64_t i = blocked; i < n; ++i)
      for (int c = 0; c < 8; ++c)
        rows[i * row_stride + 2 * k0 + c] = planes[k0 * k_stride + plane_row[c] + i];
  return wide;
}

/* ---- the float update and its backward on blocks of 16 cells, a vector lane a cell ---- */

/* The tiles' maths on vectors of 8 cells: the same operations in the same order as on a tile's
 * planes, lane by lane. */
#define REAL qca_f32x8
#define SUFFIX f32x8
#define QCA_LANES
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX
#undef QCA_LANES

/* Blocks for states of 4 to QCA_BLOCK_MAX_D components (their planes on the stack); tiles else. */
#define QCA_BLOCK_MAX_D 32
/* Software prefetch, cells ahead of the block: the inputs' rows and planes into L2, the outputs'
 * rows too (for writing). The hardware prefetchers did not follow 30 streams at once: the
 * update's loads and stores waited on memory, as long again as its maths. */
#define QCA_PREFETCH_READ_CELLS 128
#define QCA_PREFETCH_WRITE_CELLS 64

typedef struct qca_block_rows {
  int64_t cell[8];  /* rows of the block's cells, from its first */
  int64_t plane[8]; /* value c of a row: planes[c] */
} qca_block_rows;

static qca_block_rows block_rows(int64_t row_stride) {
  qca_block_rows r;
  for (int a = 0; a < 8; ++a) r.cell[a] = a * row_stride;
  for (int c = 0; c < 8; ++c) r.plane[c] = 8 * c;
  return r;
}

/* 8 cells' rows (d >= 4 components) to planes[2 k + part] and back, 4 components a transpose;
 * when d % 4, the last transpose takes the last 4 components, overlapping the one before. */
static QCA_ALWAYS_INLINE void block_to_planes(const float* rows, const qca_block_rows* r, int64_t d,
                                              qca_f32x8* planes) {
  for (int64_t k0 = 0; k0 < d; k0 += 4) {
    const int64_t k = k0 + 4 <= d ? k0 : d - 4;
    qca_transpose8(rows + 2 * k, r->cell, (float*)(planes + 2 * k), r->plane);
  }
}

static QCA_ALWAYS_INLINE void block_to_rows(const qca_f32x8* planes, const qca_block_rows* r,
                                            int64_t d, float* rows) {
  for (int64_t k0 = 0; k0 < d; k0 += 4) {
    const int64_t k = k0 + 4 <= d ? k0 : d - 4;
    qca_transpose8((const float*)(planes + 2 * k), r->plane, rows + 2 * k, r->cell);
  }
}

static QCA_ALWAYS_INLINE qca_f32x8 load8(const float* at) { return *(const qca_f32x8_at*)at; }
static QCA_ALWAYS_INLINE void store8(float* at, qca_f32x8 v) { *(qca_f32x8_at*)at = v; }
static QCA_ALWAYS_INLINE qca_f32x8 splat8(float x) { return (qca_f32x8){x, x, x, x, x, x, x, x}; }

/* A store around the caches (16-byte aligned `at`), where SSE has one: a block writes one line
 * of each of grad_delta's 2 d planes, lines that share their L1 set when the planes are a
 * multiple of 4 KiB apart, and stored through L1 they evicted each other before they filled. */
static QCA_ALWAYS_INLINE void stream8(float* at, qca_f32x8 v) {
#if defined(__SSE__)
  _mm_stream_ps(at, (__m128){v[0], v[1], v[2], v[3]});
  _mm_stream_ps(at + 4, (__m128){v[4], v[5], v[6], v[7]});
#else
  store8(at, v);
#endif
}

static QCA_ALWAYS_INLINE void prefetch_rows(const float* rows, int64_t floats, int write) {
  for (int64_t j = 0; j < floats; j += 16)
    write ? __builtin_prefetch(rows + j, 1, 2) : __builtin_prefetch(rows + j, 0, 2);
}

static QCA_ALWAYS_INLINE void prefetch_planes(const float* planes, int64_t plane, int64_t count,
                                              int write) {
  for (int64_t c = 0; c < count; ++c)
    write ? __builtin_prefetch(planes + c * plane, 1, 2)
          : __builtin_prefetch(planes + c * plane, 0, 2);
}

/* The update of the first n - n % 16 of n cells: psi's rows row_stride apart, delta's planes
 * (re at ar + k plane, im at ai + k plane) with unit cell stride, out's rows contiguous. The
 * state goes from rows to planes and back in registers and in the block's planes (in L1), in
 * one pass over memory: a tile's planes in L2 took half the update's time moving psi. A block
 * is two vectors of 8 cells so that it reads each of delta's lines once. */
static QCA_ALWAYS_INLINE int64_t update_blocks_body(int multiplicative, int decay, const float* psi,
                                                    int64_t row_stride, const float* ar,
                                                    const float* ai, int64_t plane, int64_t d,
                                                    int64_t n, float gamma, float eps, float* out) {
  qca_f32x8 planes[2][2 * QCA_BLOCK_MAX_D];
  const qca_block_rows in = block_rows(row_stride), to = block_rows(2 * d);
  const qca_f32x8 gammas = splat8(gamma);
  const int64_t blocked = n - n % 16;
  for (int64_t i0 = 0; i0 < blocked; i0 += 16) {
    const int64_t ahead = i0 + QCA_PREFETCH_READ_CELLS;
    if (ahead < n) {
      prefetch_rows(psi + ahead * row_stride, 16 * row_stride, 0);
      prefetch_planes(ar + ahead, plane, d, 0);
      prefetch_planes(ai + ahead, plane, d, 0);
    }
    if (i0 + QCA_PREFETCH_WRITE_CELLS < n)
      prefetch_rows(out + 2 * d * (i0 + QCA_PREFETCH_WRITE_CELLS), 32 * d, 1);
    for (int h = 0; h < 2; ++h) block_to_planes(psi + (i0 + 8 * h) * row_stride, &in, d, planes[h]);
    qca_f32x8 norm_sq[2] = {splat8(0), splat8(0)};
    for (int64_t k = 0; k < d; ++k)
      for (int h = 0; h < 2; ++h) {
        qca_f32x8 nr, ni;
        residual_f32x8(planes[h][2 * k], planes[h][2 * k + 1], load8(ar + k * plane + i0 + 8 * h),
                       load8(ai + k * plane + i0 + 8 * h), multiplicative, decay, gammas, &nr, &ni);
        planes[h][2 * k] = nr;
        planes[h][2 * k + 1] = ni;
        norm_sq[h] += dot_term_f32x8(nr, ni, nr, ni);
      }
    for (int h = 0; h < 2; ++h) {
      qca_f32x8 denominator;
      for (int a = 0; a < 8; ++a) denominator[a] = norm_f32(norm_sq[h][a]) + eps;
      for (int64_t c = 0; c < 2 * d; ++c) planes[h][c] = planes[h][c] / denominator;
      block_to_rows(planes[h], &to, d, out + 2 * d * (i0 + 8 * h));
    }
  }
  return blocked;
}

QCA_SIMD_CLONES static int64_t update_blocks_f32(const qca_update_params* p, const float* psi,
                                                 int64_t row_stride, const float* ar,
                                                 const float* ai, int64_t plane, int64_t n,
                                                 float* out) {
  const int64_t d = p->grid.d;
  const float gamma = (float)p->gamma, eps = (float)p->eps;
#define QCA_BODY(multiplicative, decay) \
  update_blocks_body(multiplicative, decay, psi, row_stride, ar, ai, plane, d, n, gamma, eps, out)
  if (p->multiplicative) return p->gamma > 0 ? QCA_BODY(1, 1) : QCA_BODY(1, 0);
  return p->gamma > 0 ? QCA_BODY(0, 1) : QCA_BODY(0, 0);
#undef QCA_BODY
}

/* The backward of the first n - n % 16 of n cells: psi's and grad_out's rows, delta's planes as
 * in the update; grad_delta's planes (re at gd + k gd_plane, im d gd_plane further) and
 * grad_psi's contiguous rows, each skipped when NULL. delta's values are kept from the first
 * pass for the second: read again, its lines had left L1 (see stream8). */
static QCA_ALWAYS_INLINE int64_t backward_blocks_body(
    int multiplicative, int decay, const float* psi, int64_t row_stride, const float* grad_out,
    int64_t grad_row_stride, const float* ar, const float* ai, int64_t plane, int64_t d, int64_t n,
    float gamma, float eps, float* gd, int64_t gd_plane, float* grad_psi) {
  qca_f32x8 psi_planes[2][2 * QCA_BLOCK_MAX_D], grad[2][2 * QCA_BLOCK_MAX_D],
      residual[2][2 * QCA_BLOCK_MAX_D], a[2][2 * QCA_BLOCK_MAX_D];
  const qca_block_rows in = block_rows(row_stride), grad_in = block_rows(grad_row_stride),
                       to = block_rows(2 * d);
  const qca_f32x8 gammas = splat8(gamma);
  const int stream = gd && (uintptr_t)gd % 16 == 0 && gd_plane % 4 == 0;
  /* grad_psi's rows too, a block at a time from the stack: without reading its lines first,
   * the backward's five streams fit memory's bandwidth better (7% at B = 16). */
  const int stream_rows = grad_psi && (uintptr_t)grad_psi % 16 == 0;
  qca_f32x8 staged[4 * QCA_BLOCK_MAX_D];
  const int64_t blocked = n - n % 16;
  for (int64_t i0 = 0; i0 < blocked; i0 += 16) {
    const int64_t ahead = i0 + QCA_PREFETCH_READ_CELLS, write_ahead = i0 + QCA_PREFETCH_WRITE_CELLS;
    if (ahead < n) {
      prefetch_rows(psi + ahead * row_stride, 16 * row_stride, 0);
      prefetch_rows(grad_out + ahead * grad_row_stride, 16 * grad_row_stride, 0);
      prefetch_planes(ar + ahead, plane, d, 0);
      prefetch_planes(ai + ahead, plane, d, 0);
    }
    if (write_ahead < n && grad_psi && !stream_rows)
      prefetch_rows(grad_psi + 2 * d * write_ahead, 32 * d, 1);
    if (write_ahead < n && gd && !stream) prefetch_planes(gd + write_ahead, gd_plane, 2 * d, 1);
    for (int h = 0; h < 2; ++h) {
      block_to_planes(psi + (i0 + 8 * h) * row_stride, &in, d, psi_planes[h]);
      block_to_planes(grad_out + (i0 + 8 * h) * grad_row_stride, &grad_in, d, grad[h]);
    }
    qca_f32x8 norm_sq[2] = {splat8(0), splat8(0)}, n_dot_g[2] = {splat8(0), splat8(0)};
    for (int64_t k = 0; k < d; ++k)
      for (int h = 0; h < 2; ++h) {
        qca_f32x8 nr, ni;
        a[h][2 * k] = load8(ar + k * plane + i0 + 8 * h);
        a[h][2 * k + 1] = load8(ai + k * plane + i0 + 8 * h);
        residual_f32x8(psi_planes[h][2 * k], psi_planes[h][2 * k + 1], a[h][2 * k], a[h][2 * k + 1],
                       multiplicative, decay, gammas, &nr, &ni);
        residual[h][2 * k] = nr;
        residual[h][2 * k + 1] = ni;
        norm_sq[h] += dot_term_f32x8(nr, ni, nr, ni);
        n_dot_g[h] += dot_term_f32x8(nr, ni, grad[h][2 * k], grad[h][2 * k + 1]);
      }
    qca_f32x8 s[2], radial[2];
    for (int h = 0; h < 2; ++h)
      for (int lane = 0; lane < 8; ++lane) {
        const float norm = norm_f32(norm_sq[h][lane]);
        s[h][lane] = norm + eps;
        radial[h][lane] = radial_f32(norm, s[h][lane], n_dot_g[h][lane]);
      }
    for (int64_t k = 0; k < d; ++k)
      for (int h = 0; h < 2; ++h) {
        qca_f32x8 gar, gai, gpr, gpi;
        residual_backward_f32x8(psi_planes[h][2 * k], psi_planes[h][2 * k + 1], a[h][2 * k],
                                a[h][2 * k + 1], residual[h][2 * k], residual[h][2 * k + 1],
                                grad[h][2 * k], grad[h][2 * k + 1], s[h], radial[h], multiplicative,
                                decay, gammas, &gar, &gai, &gpr, &gpi);
        float* const gd_re = gd + k * gd_plane + i0 + 8 * h;
        if (stream) {
          stream8(gd_re, gar);
          stream8(gd_re + d * gd_plane, gai);
        } else if (gd) {
          store8(gd_re, gar);
          store8(gd_re + d * gd_plane, gai);
        }
        grad[h][2 * k] = gpr;
        grad[h][2 * k + 1] = gpi;
      }
    if (stream_rows) {
      for (int h = 0; h < 2; ++h) block_to_rows(grad[h], &to, d, (float*)staged + 16 * d * h);
      for (int64_t j = 0; j < 4 * d; ++j) stream8(grad_psi + 2 * d * i0 + 8 * j, staged[j]);
    } else if (grad_psi) {
      for (int h = 0; h < 2; ++h) block_to_rows(grad[h], &to, d, grad_psi + 2 * d * (i0 + 8 * h));
    }
  }
#if defined(__SSE__)
  if (stream || stream_rows) _mm_sfence(); /* the streamed stores before any later one */
#endif
  return blocked;
}

QCA_SIMD_CLONES static int64_t backward_blocks_f32(const qca_update_backward_params* bp,
                                                   const float* psi, int64_t row_stride,
                                                   const float* grad_out, int64_t grad_row_stride,
                                                   const float* ar, const float* ai, int64_t plane,
                                                   int64_t n, float* gd, int64_t gd_plane,
                                                   float* grad_psi) {
  const qca_update_params* p = &bp->fwd;
  const int64_t d = p->grid.d;
  const float gamma = (float)p->gamma, eps = (float)p->eps;
#define QCA_BODY(multiplicative, decay)                                                           \
  backward_blocks_body(multiplicative, decay, psi, row_stride, grad_out, grad_row_stride, ar, ai, \
                       plane, d, n, gamma, eps, gd, gd_plane, grad_psi)
  if (p->multiplicative) return p->gamma > 0 ? QCA_BODY(1, 1) : QCA_BODY(1, 0);
  return p->gamma > 0 ? QCA_BODY(0, 1) : QCA_BODY(0, 0);
#undef QCA_BODY
}

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
