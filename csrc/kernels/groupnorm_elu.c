/* CPU kernels of the fused GroupNorm + ELU (see include/qca_lowmem/groupnorm_elu.h).
 *
 * Memory is read in the order it lies, in loops the compiler vectorises. NCHW, a group is
 * contiguous and a channel's parameters are scalars over its plane: runs of contiguous
 * elements, sums in a few float accumulators. Channels_last, the groups of one sample that a
 * call covers are processed side by side as a matrix (gn_matrix) whose row is one pixel's
 * channels of those groups, with each column's parameters in arrays and one float accumulator
 * per column for up to GN_FLUSH_ROWS rows. Float accumulators go into double after at most 32
 * terms. Data of another type than the compute type is converted a block at a time; float32
 * (float64) data is read and written in place. The statistics are taken about an early estimate
 * of the group mean, so they stay accurate when the mean is large next to the spread. */
#include "qca_lowmem/groupnorm_elu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_target.h"
#include "qca_scalar.h"
#include "qca_shared.h"

enum {
  /* NCHW: accumulators of a contiguous run, and the run's length (32 terms a lane). The
   * light statistics loop needs many independent sums to keep the pipeline full; the backward's
   * fewer, so that small planes flush few. */
  GN_STAT_LANES = 32,
  GN_STAT_RUN = 1024,
  GN_GRAD_LANES = 16,
  GN_GRAD_RUN = 256,
  GN_MAX_COLS = 512,  /* channels_last: channels processed side by side */
  GN_FLUSH_ROWS = 32, /* channels_last: rows added in the compute type before going to double */
  GN_BLOCK = 2048     /* elements converted at a time */
};

/* rows x cols elements: (r, j) at offset + r * row_stride + j. */
typedef struct gn_matrix {
  int64_t offset, rows, cols, row_stride;
} gn_matrix;

/* The groups [first_group, first_group + groups) of one sample, channels_last: channel
 * first_channel + j of pixel r at base + r * row_stride + j. One group wider than GN_MAX_COLS
 * channels is a run of its own and is walked in column segments. */
typedef struct gn_run {
  int64_t sample, first_group, groups, group_channels, first_channel, channels, pixels;
  int64_t base, row_stride;
} gn_run;

static gn_run run_of(const qca_groupnorm_elu_shape* s, int64_t pair, int64_t pair_end) {
  gn_run r;
  r.sample = pair / s->groups;
  r.first_group = pair % s->groups;
  r.group_channels = s->channels / s->groups;
  int64_t groups = s->groups - r.first_group;
  if (groups > pair_end - pair) groups = pair_end - pair;
  const int64_t fit = GN_MAX_COLS / r.group_channels;
  r.groups = groups < fit ? groups : (fit > 0 ? fit : 1);
  r.first_channel = r.first_group * r.group_channels;
  r.channels = r.groups * r.group_channels;
  r.pixels = s->height * s->width;
  r.row_stride = s->channels;
  r.base = r.sample * r.pixels * s->channels + r.first_channel;
  return r;
}

/* Columns [first, first + count) of a run, every pixel. */
static gn_matrix run_segment(const gn_run* r, int64_t first, int64_t count) {
  gn_matrix m = {r->base + first, r->pixels, count, r->row_stride};
  return m;
}

/* NCHW: elements [start, start + most) of the `count` from `offset`, fewer at the end, as a
 * one-row matrix. */
static gn_matrix contiguous_run(int64_t offset, int64_t start, int64_t count, int64_t most) {
  gn_matrix m = {offset + start, 1, count - start < most ? count - start : most, 0};
  return m;
}

/* exp(z) - 1 and exp(z) for z <= 0 from one range reduction, in float and branch-free so that
 * loops over them vectorise: z = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2),
 * expm1(r) by its Taylor polynomial to r^7 (truncation below 2e-8 relative, evaluated by Estrin's
 * scheme: short dependency chains, so independent elements overlap), then
 * exp(z) = 2^n (1 + expm1(r)). Within a few float ulps of the exact values; NaN stays NaN. Below
 * z = -87, exp(z) is taken as 0: the compiler evaluates that case for every element, and a
 * subnormal there would cost a microcode assist per vector. */
typedef struct gn_exp {
  float scale, expm1_r; /* 2^n, expm1(r) */
} gn_exp;

static inline gn_exp gn_exp_reduce(float z) {
  const float rounder = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  const float zc = z < -87.0f ? -87.0f : z; /* 2^n stays normal */
  const float shifted = zc * 1.44269504088896341f + rounder;
  const float n = shifted - rounder;
  uint32_t bits;
  memcpy(&bits, &shifted, sizeof bits);
  bits = (bits - 0x4b400000u + 127u) << 23; /* the low bits of `shifted` hold n */
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  const float r = (zc - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  const float r2 = r * r, r4 = r2 * r2;
  const float low = 0.5f + r * (1.0f / 6), mid = 1.0f / 24 + r * (1.0f / 120),
              high = 1.0f / 720 + r * (1.0f / 5040);
  gn_exp e;
  e.scale = z < -87.0f ? 0.0f : scale;
  e.expm1_r = r + r2 * ((low + r2 * mid) + r4 * high);
  return e;
}

/* z split by its sign bit into z = positive + negative (one of them 0), with integer masks:
 * compilers turn selects on z into blends of both sides computed for every element, which for
 * the slope made a subnormal per vector. A NaN stays in one of the two parts. */
typedef struct gn_split {
  float positive, negative;
} gn_split;

static inline gn_split gn_split_sign(float z) {
  uint32_t bits;
  memcpy(&bits, &z, sizeof bits);
  const uint32_t negative = (uint32_t)-(int32_t)(bits >> 31); /* all ones when the sign is set */
  const uint32_t low = bits & negative, high = bits & ~negative;
  gn_split s;
  memcpy(&s.negative, &low, sizeof low);
  memcpy(&s.positive, &high, sizeof high);
  return s;
}

/* ELU and its slope for float, branch-free: expm1(0) = 0 and exp(0) = 1 exactly here. */
static inline float gn_elu_f32(float z) {
  const gn_split s = gn_split_sign(z);
  const gn_exp e = gn_exp_reduce(s.negative);
  return s.positive + (e.scale * e.expm1_r + (e.scale - 1.0f));
}

static inline float gn_elu_slope_f32(float z) {
  const gn_exp e = gn_exp_reduce(gn_split_sign(z).negative);
  return e.scale * (1.0f + e.expm1_r);
}

static inline double gn_elu_f64(double z) { return z > 0 ? z : expm1(z); }

/* d ELU / dz, from z itself so nothing of the forward output has to be kept. */
static inline double gn_elu_slope_f64(double z) { return z > 0 ? 1.0 : exp(z); }

/* The float kernels as SIMD clones (cpu_target.h); the double ones, gradcheck's, once. */
#define REAL float
#define NATIVE QCA_F32
#define SUFFIX f32
#define ELU gn_elu_f32
#define ELU_SLOPE gn_elu_slope_f32
#define CLONES QCA_SIMD_CLONES
#include "groupnorm_elu_tiles.inc"
#undef REAL
#undef NATIVE
#undef SUFFIX
#undef ELU
#undef ELU_SLOPE
#undef CLONES

#define REAL double
#define NATIVE QCA_F64
#define SUFFIX f64
#define ELU gn_elu_f64
#define ELU_SLOPE gn_elu_slope_f64
#define CLONES
#include "groupnorm_elu_tiles.inc"
#undef REAL
#undef NATIVE
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
  if (p->shape.channels_last) {
    for (int64_t pair = pair_begin; pair < pair_end;) {
      const gn_run r = run_of(&p->shape, pair, pair_end);
      if (f64)
        forward_run_f64(p, &r);
      else
        forward_run_f32(p, &r);
      pair += r.groups;
    }
  } else {
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
      if (f64)
        forward_group_f64(p, pair);
      else
        forward_group_f32(p, pair);
    }
  }
  return QCA_OK;
}

/* With g = grad_y * ELU'(z) and dxhat = w * g, over the M elements of a group:
 *   grad_bias[c] = sum g,  grad_weight[c] = sum g * xhat,
 *   grad_x = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
 * where mean(dxhat) = sum_c w_c grad_bias[c] / M and mean(dxhat xhat) = sum_c w_c grad_weight[c] /
 * M. */
qca_status qca_groupnorm_elu_backward_cpu(const qca_groupnorm_elu_backward_params* p,
                                          int64_t pair_begin, int64_t pair_end) {
  const qca_status status =
      check_args(&p->shape, p->x_dtype, p->affine_dtype, p->stat_dtype, pair_begin, pair_end);
  if (status != QCA_OK) return status;
  const int f64 = p->stat_dtype == QCA_F64;
  if (p->shape.channels_last) {
    for (int64_t pair = pair_begin; pair < pair_end;) {
      const gn_run r = run_of(&p->shape, pair, pair_end);
      if (f64)
        backward_run_f64(p, &r);
      else
        backward_run_f32(p, &r);
      pair += r.groups;
    }
    return QCA_OK;
  }
  /* g of one group, between the two passes, unless grad_x can hold it. */
  void* scratch = NULL;
  if (p->x_dtype != (f64 ? QCA_F64 : QCA_F32) && pair_end > pair_begin) {
    const int64_t elements = p->shape.channels / p->shape.groups * p->shape.height * p->shape.width;
    scratch =
        malloc((size_t)(elements > 0 ? elements : 1) * (f64 ? sizeof(double) : sizeof(float)));
    if (!scratch) return QCA_ERR_OUT_OF_MEMORY;
  }
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    if (f64)
      backward_group_f64(p, pair, (double*)scratch);
    else
      backward_group_f32(p, pair, (float*)scratch);
  }
  free(scratch);
  return QCA_OK;
}
