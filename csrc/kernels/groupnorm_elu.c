/* CPU kernels of the fused GroupNorm + ELU (see include/qca_lowmem/groupnorm_elu.h).
 * Each (sample, group) pair is independent. Accumulation is in double whatever the data type:
 * the statistics use two passes over the group (mean, then squared deviations), which stays
 * accurate when the mean is large next to the spread. */
#include "qca_lowmem/groupnorm_elu.h"

#include <math.h>

#include "qca_scalar.h"

/* Where one group's elements live: element (channel c, pixel p) of the group is at
 * base + c * channel_stride + p * pixel_stride. */
typedef struct group_view {
  int64_t sample, first_channel, channels, pixels;
  int64_t base, channel_stride, pixel_stride;
} group_view;

static group_view view_of(const qca_groupnorm_elu_shape* s, int64_t pair) {
  group_view v;
  const int64_t hw = s->height * s->width;
  v.sample = pair / s->groups;
  v.channels = s->channels / s->groups;
  v.first_channel = (pair % s->groups) * v.channels;
  v.pixels = hw;
  if (s->channels_last) {
    v.base = v.sample * hw * s->channels + v.first_channel;
    v.channel_stride = 1;
    v.pixel_stride = s->channels;
  } else {
    v.base = (v.sample * s->channels + v.first_channel) * hw;
    v.channel_stride = hw;
    v.pixel_stride = 1;
  }
  return v;
}

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

static inline double elu(double z) { return z > 0 ? z : expm1(z); }

/* d ELU / dz, from z itself so nothing of the forward output has to be kept. */
static inline double elu_grad(double z) { return z > 0 ? 1.0 : exp(z); }

qca_status qca_groupnorm_elu_forward_cpu(const qca_groupnorm_elu_params* p, int64_t pair_begin,
                                         int64_t pair_end) {
  const qca_status status =
      check_args(&p->shape, p->x_dtype, p->affine_dtype, p->stat_dtype, pair_begin, pair_end);
  if (status != QCA_OK) return status;
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    const group_view v = view_of(&p->shape, pair);
    const int64_t count = v.channels * v.pixels;
    double mean, rstd;
    if (p->mean_in) {
      mean = qca_load_f64(p->mean_in, p->stat_dtype, pair);
      rstd = qca_load_f64(p->rstd_in, p->stat_dtype, pair);
    } else {
      double sum = 0;
      for (int64_t c = 0; c < v.channels; ++c)
        for (int64_t px = 0; px < v.pixels; ++px)
          sum += qca_load_f64(p->x, p->x_dtype, v.base + c * v.channel_stride + px * v.pixel_stride);
      mean = count > 0 ? sum / (double)count : 0.0;
      double squares = 0;
      for (int64_t c = 0; c < v.channels; ++c)
        for (int64_t px = 0; px < v.pixels; ++px) {
          const double d =
              qca_load_f64(p->x, p->x_dtype, v.base + c * v.channel_stride + px * v.pixel_stride) - mean;
          squares += d * d;
        }
      const double var = count > 0 ? squares / (double)count : 0.0;
      rstd = 1.0 / sqrt(var + p->eps);
      /* Store what was computed, rounded as the stored statistics will be read back. */
      qca_store_f64(p->mean_out, p->stat_dtype, pair, mean);
      qca_store_f64(p->rstd_out, p->stat_dtype, pair, rstd);
      mean = qca_load_f64(p->mean_out, p->stat_dtype, pair);
      rstd = qca_load_f64(p->rstd_out, p->stat_dtype, pair);
    }
    for (int64_t c = 0; c < v.channels; ++c) {
      const double scale = qca_load_f64(p->weight, p->affine_dtype, v.first_channel + c) * rstd;
      const double shift = qca_load_f64(p->bias, p->affine_dtype, v.first_channel + c);
      for (int64_t px = 0; px < v.pixels; ++px) {
        const int64_t i = v.base + c * v.channel_stride + px * v.pixel_stride;
        const double z = (qca_load_f64(p->x, p->x_dtype, i) - mean) * scale + shift;
        qca_store_f64(p->y, p->x_dtype, i, elu(z));
      }
    }
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
    const group_view v = view_of(&p->shape, pair);
    const int64_t count = v.channels * v.pixels;
    const double mean = qca_load_f64(p->mean, p->stat_dtype, pair);
    const double rstd = qca_load_f64(p->rstd, p->stat_dtype, pair);
    double weighted_bias_grad = 0, weighted_weight_grad = 0;
    for (int64_t c = 0; c < v.channels; ++c) {
      const double w = qca_load_f64(p->weight, p->affine_dtype, v.first_channel + c);
      const double b = qca_load_f64(p->bias, p->affine_dtype, v.first_channel + c);
      double grad_bias = 0, grad_weight = 0;
      for (int64_t px = 0; px < v.pixels; ++px) {
        const int64_t i = v.base + c * v.channel_stride + px * v.pixel_stride;
        const double xhat = (qca_load_f64(p->x, p->x_dtype, i) - mean) * rstd;
        const double g = qca_load_f64(p->grad_y, p->x_dtype, i) * elu_grad(w * xhat + b);
        grad_bias += g;
        grad_weight += g * xhat;
      }
      const int64_t out = v.sample * p->shape.channels + v.first_channel + c;
      qca_store_f64(p->grad_weight_per_sample, p->stat_dtype, out, grad_weight);
      qca_store_f64(p->grad_bias_per_sample, p->stat_dtype, out, grad_bias);
      weighted_bias_grad += w * grad_bias;
      weighted_weight_grad += w * grad_weight;
    }
    const double mean_dxhat = count > 0 ? weighted_bias_grad / (double)count : 0.0;
    const double mean_dxhat_xhat = count > 0 ? weighted_weight_grad / (double)count : 0.0;
    for (int64_t c = 0; c < v.channels; ++c) {
      const double w = qca_load_f64(p->weight, p->affine_dtype, v.first_channel + c);
      const double b = qca_load_f64(p->bias, p->affine_dtype, v.first_channel + c);
      for (int64_t px = 0; px < v.pixels; ++px) {
        const int64_t i = v.base + c * v.channel_stride + px * v.pixel_stride;
        const double xhat = (qca_load_f64(p->x, p->x_dtype, i) - mean) * rstd;
        const double g = qca_load_f64(p->grad_y, p->x_dtype, i) * elu_grad(w * xhat + b);
        qca_store_f64(p->grad_x, p->x_dtype, i,
                      rstd * (w * g - mean_dxhat - xhat * mean_dxhat_xhat));
      }
    }
  }
  return QCA_OK;
}
