/* CPU kernels of the fused GroupNorm + ELU (see include/qca_lowmem/groupnorm_elu.h).
 * Each (sample, group) pair is independent. Elements are converted a tile at a time to float
 * (double for float64 statistics) and processed in loops the compiler vectorises; sums go into
 * per-lane accumulators of the compute type that are added to double once per tile (at most
 * GN_TILE / 16 terms each), and the statistics are shifted by an early estimate of the mean,
 * so they stay accurate when the mean is large next to the spread. */
#include "qca_lowmem/groupnorm_elu.h"

#include <math.h>
#include <string.h>

#include "qca_scalar.h"

enum {
  GN_TILE = 512,      /* elements converted and processed at a time */
  GN_LANES = 16,      /* accumulators of a contiguous (one-channel) run */
  GN_MAX_WIDTH = 256, /* channels of a channels_last group processed side by side */
  GN_MAX_COLS = GN_MAX_WIDTH > GN_LANES ? GN_MAX_WIDTH : GN_LANES
};

/* One (sample, group) pair. Element (channel c of the group, pixel p) is at
 * base + c * channel_stride + p * pixel_stride. */
typedef struct gn_group {
  int64_t sample, first_channel, channels, all_channels, pixels;
  int64_t base, channel_stride, pixel_stride;
  int64_t segments, planes; /* NCHW: `planes` whole channel planes a segment, when they are small */
  int channels_last;
} gn_group;

/* Channels of a group over all its pixels: NCHW `planes` consecutive channel planes (one, or
 * several small ones: a tile then holds them all), channels_last `width` channels side by side
 * (up to GN_MAX_WIDTH). A tile is `planes` blocks of contiguous elements, each a matrix of `cols`
 * = width * m columns: column j of block b is channel `channel + b + j % width`. */
typedef struct gn_segment {
  int64_t channel, width, planes, cols, tile_pixels, tiles;
} gn_segment;

/* `count` elements of a segment (pixel-major), read from memory as `runs` runs of `run_length`
 * elements `run_stride` apart from `offset`. */
typedef struct gn_tile {
  int64_t offset, runs, run_length, run_stride, count;
} gn_tile;

static gn_group group_of(const qca_groupnorm_elu_shape* s, int64_t pair) {
  gn_group g;
  g.sample = pair / s->groups;
  g.channels = s->channels / s->groups;
  g.first_channel = (pair % s->groups) * g.channels;
  g.all_channels = s->channels;
  g.pixels = s->height * s->width;
  g.channels_last = s->channels_last;
  if (s->channels_last) {
    g.base = g.sample * g.pixels * s->channels + g.first_channel;
    g.channel_stride = 1;
    g.pixel_stride = s->channels;
    g.planes = 1;
  } else {
    g.base = (g.sample * s->channels + g.first_channel) * g.pixels;
    g.channel_stride = g.pixels;
    g.pixel_stride = 1;
    g.planes = g.pixels > 0 && g.pixels <= GN_TILE / 2 ? GN_TILE / g.pixels : 1;
    if (g.planes > GN_MAX_WIDTH) g.planes = GN_MAX_WIDTH;
  }
  const int64_t per_segment = s->channels_last ? GN_MAX_WIDTH : g.planes;
  g.segments = (g.channels + per_segment - 1) / per_segment;
  return g;
}

static gn_segment segment_of(const gn_group* g, int64_t index) {
  gn_segment s;
  s.channel = index * (g->channels_last ? GN_MAX_WIDTH : g->planes);
  const int64_t rest = g->channels - s.channel;
  s.width = g->channels_last ? (rest < GN_MAX_WIDTH ? rest : GN_MAX_WIDTH) : 1;
  s.planes = g->channels_last ? 1 : (rest < g->planes ? rest : g->planes);
  const int64_t repeats = s.width < GN_LANES ? GN_LANES / s.width : 1;
  s.cols = s.width * repeats;
  s.tile_pixels = GN_TILE / s.cols * repeats;
  s.tiles = (g->pixels + s.tile_pixels - 1) / s.tile_pixels;
  return s;
}

static gn_tile tile_of(const gn_group* g, const gn_segment* s, int64_t index) {
  gn_tile t;
  const int64_t first_pixel = index * s->tile_pixels;
  const int64_t pixels =
      g->pixels - first_pixel < s->tile_pixels ? g->pixels - first_pixel : s->tile_pixels;
  t.offset = g->base + s->channel * g->channel_stride + first_pixel * g->pixel_stride;
  t.count = pixels * s->width * s->planes; /* planes > 1: one tile of whole planes */
  if (g->pixel_stride == s->width) { /* the tile is one contiguous run */
    t.runs = 1;
    t.run_length = t.count;
  } else {
    t.runs = pixels;
    t.run_length = s->width;
  }
  t.run_stride = g->pixel_stride;
  return t;
}

/* Elements in the matrix row of a tile that starts at `start`: cols, or fewer in the last. */
static inline int64_t row_length(const gn_segment* s, const gn_tile* t, int64_t start) {
  return t->count - start < s->cols ? t->count - start : s->cols;
}

/* A compensated (Neumaier) double sum. */
typedef struct gn_sum {
  double sum, compensation;
} gn_sum;

static inline void gn_add(gn_sum* s, double value) {
  const double t = s->sum + value;
  s->compensation += fabs(s->sum) >= fabs(value) ? (s->sum - t) + value : (value - t) + s->sum;
  s->sum = t;
}

static inline double gn_total(const gn_sum* s) { return s->sum + s->compensation; }

/* exp(z) - 1 and exp(z) for z <= 0 from one range reduction, in float and branch-free so that
 * loops over them vectorise: z = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2),
 * expm1(r) by its Taylor polynomial to r^7 (truncation below 2e-8 relative), then
 * exp(z) = 2^n (1 + expm1(r)). Within a few float ulps of the exact values; NaN stays NaN. */
typedef struct gn_exp {
  float scale, expm1_r; /* 2^n, expm1(r) */
} gn_exp;

static inline gn_exp gn_exp_reduce(float z) {
  const float rounder = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  z = z < -87.0f ? -87.0f : z;       /* exp(-87) is below float's epsilon; 2^n stays normal */
  const float shifted = z * 1.44269504088896341f + rounder;
  const float n = shifted - rounder;
  uint32_t bits;
  memcpy(&bits, &shifted, sizeof bits);
  bits = (bits - 0x4b400000u + 127u) << 23; /* the low bits of `shifted` hold n */
  gn_exp e;
  memcpy(&e.scale, &bits, sizeof e.scale);
  const float r = (z - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  e.expm1_r =
      r + r * r *
              (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 +
                                                          r * (1.0f / 720 + r * (1.0f / 5040))))));
  return e;
}

/* ELU and its slope for float: no select on computed values (which the compiler would not
 * if-convert into vector code), as z = max(z, 0) + min(z, 0) and expm1(0) = 0, exp(0) = 1
 * exactly here. The selects keep a NaN z. */
static inline float gn_elu_f32(float z) {
  const gn_exp e = gn_exp_reduce(z > 0.0f ? 0.0f : z);
  return (0.0f > z ? 0.0f : z) + (e.scale * e.expm1_r + (e.scale - 1.0f));
}

static inline float gn_elu_slope_f32(float z) {
  const gn_exp e = gn_exp_reduce(z > 0.0f ? 0.0f : z);
  return e.scale * (1.0f + e.expm1_r);
}

static inline double gn_elu_f64(double z) { return z > 0 ? z : expm1(z); }

/* d ELU / dz, from z itself so nothing of the forward output has to be kept. */
static inline double gn_elu_slope_f64(double z) { return z > 0 ? 1.0 : exp(z); }

/* The float kernels also in an AVX2 version, picked at load time where the CPU has AVX2 (twice
 * the lanes of the SSE2 baseline). The same IEEE operations in the same order either way: C11
 * mode does not contract a * b + c into an FMA. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define GN_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef GN_VECTOR_CLONES
#define GN_VECTOR_CLONES
#endif

#define REAL float
#define SUFFIX f32
#define ELU gn_elu_f32
#define ELU_SLOPE gn_elu_slope_f32
#define CLONES GN_VECTOR_CLONES
#include "groupnorm_elu_tiles.inc"
#undef REAL
#undef SUFFIX
#undef ELU
#undef ELU_SLOPE
#undef CLONES

#define REAL double
#define SUFFIX f64
#define ELU gn_elu_f64
#define ELU_SLOPE gn_elu_slope_f64
#define CLONES
#include "groupnorm_elu_tiles.inc"
#undef REAL
#undef SUFFIX
#undef ELU
#undef ELU_SLOPE
#undef CLONES

static qca_status check_args(const qca_groupnorm_elu_shape* s, qca_dtype x, qca_dtype affine,
                             qca_dtype stat, int64_t pair_begin, int64_t pair_end) {
  if (s->batch < 0 || s->channels < 1 || s->height < 0 || s->width < 0 || s->groups < 1 ||
      s->channels % s->groups != 0)
    return QCA_ERR_INVALID_ARGUMENT;
  if (pair_begin < 0 || pair_end < pair_begin || pair_end > s->batch * s->groups)
    return QCA_ERR_INVALID_ARGUMENT;
  if (!qca_dtype_is_valid(x) || !qca_dtype_is_valid(affine)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (stat != QCA_F32 && stat != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}

qca_status qca_groupnorm_elu_forward_cpu(const qca_groupnorm_elu_params* p, int64_t pair_begin,
                                         int64_t pair_end) {
  const qca_status status =
      check_args(&p->shape, p->x_dtype, p->affine_dtype, p->stat_dtype, pair_begin, pair_end);
  if (status != QCA_OK) return status;
  const int f64 = p->stat_dtype == QCA_F64;
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    const gn_group g = group_of(&p->shape, pair);
    if (!p->mean_in) {
      double mean, var;
      if (f64)
        statistics_f64(p, &g, &mean, &var);
      else
        statistics_f32(p, &g, &mean, &var);
      qca_store_f64(p->mean_out, p->stat_dtype, pair, mean);
      qca_store_f64(p->rstd_out, p->stat_dtype, pair, 1.0 / sqrt(var + p->eps));
    }
    /* The statistics as stored, so that the apply-only variant gives the same output. */
    const void* mean = p->mean_in ? p->mean_in : p->mean_out;
    const void* rstd = p->rstd_in ? p->rstd_in : p->rstd_out;
    if (f64)
      forward_f64(p, &g, ((const double*)mean)[pair], ((const double*)rstd)[pair]);
    else
      forward_f32(p, &g, ((const float*)mean)[pair], ((const float*)rstd)[pair]);
  }
  return QCA_OK;
}

/* With g = grad_y * ELU'(z) and dxhat = w * g, over the M elements of a group:
 *   grad_bias[c] = sum g,  grad_weight[c] = sum g * xhat,
 *   grad_x = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
 * where mean(dxhat) = sum_c w_c grad_bias[c] / M and mean(dxhat xhat) = sum_c w_c grad_weight[c] / M. */
qca_status qca_groupnorm_elu_backward_cpu(const qca_groupnorm_elu_backward_params* p,
                                          int64_t pair_begin, int64_t pair_end) {
  const qca_status status =
      check_args(&p->shape, p->x_dtype, p->affine_dtype, p->stat_dtype, pair_begin, pair_end);
  if (status != QCA_OK) return status;
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    const gn_group g = group_of(&p->shape, pair);
    if (p->stat_dtype == QCA_F64)
      backward_f64(p, &g, ((const double*)p->mean)[pair], ((const double*)p->rstd)[pair]);
    else
      backward_f32(p, &g, ((const float*)p->mean)[pair], ((const float*)p->rstd)[pair]);
  }
  return QCA_OK;
}
