// CUDA kernels of the fused GroupNorm + ELU (see include/qca_lowmem/groupnorm_elu.h): one thread
// block per (sample, group) pair, statistics and sums accumulated in acc_t (float, or double for
// float64 data) with warp-shuffle and shared-memory reductions.
//
// When there are too few pairs to fill the GPU (small batches), each pair's pixels are split over
// several blocks: a first kernel writes per-block partial statistics (or per-channel sums) to a
// workspace, a second merges the pair's partials in a fixed order (deterministic) and writes its
// share of the output.
//
// Threads are laid out as (pixel lane, channel lane): with NCHW one channel lane, so a warp reads
// consecutive pixels of one channel; with channels_last up to one lane per channel of the group,
// so a warp reads the group's consecutive channels of consecutive pixels. Either way each thread
// keeps one channel at a time, so per-channel sums stay in registers.
#include <math.h>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/groupnorm_elu.h"

namespace {

using qca_lowmem_cuda::load_as;
using qca_lowmem_cuda::store_as;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

constexpr int64_t kMinSplitElements = 4096;  // below this a block's share is not worth a block
constexpr int64_t kMaxSplits = 64;

// This block's share of its pair: all channels of the group, pixels [pixel_begin, pixel_end).
struct GroupLayout {
  int64_t pair, split, sample, first_channel, channels, pixels, pixel_begin, pixel_end;
  int64_t base, channel_stride, pixel_stride;
  int channel_lanes, pixel_lanes;  // channel_lanes * pixel_lanes <= kThreads
  int channel_lane, pixel_lane;
  bool active;

  __device__ GroupLayout(const qca_groupnorm_elu_shape& s, int64_t splits) {
    const int64_t hw = s.height * s.width;
    pair = (int64_t)blockIdx.x / splits;
    split = (int64_t)blockIdx.x % splits;
    sample = pair / s.groups;
    channels = s.channels / s.groups;
    first_channel = (pair % s.groups) * channels;
    pixels = hw;
    pixel_begin = hw * split / splits;
    pixel_end = hw * (split + 1) / splits;
    if (s.channels_last) {
      base = sample * hw * s.channels + first_channel;
      channel_stride = 1;
      pixel_stride = s.channels;
      channel_lanes = channels < kThreads ? (int)channels : kThreads;
    } else {
      base = (sample * s.channels + first_channel) * hw;
      channel_stride = hw;
      pixel_stride = 1;
      channel_lanes = 1;
    }
    pixel_lanes = kThreads / channel_lanes;
    channel_lane = (int)threadIdx.x % channel_lanes;
    pixel_lane = (int)threadIdx.x / channel_lanes;
    active = pixel_lane < pixel_lanes;
  }

  __device__ int64_t offset(int64_t c, int64_t px) const {
    return base + c * channel_stride + px * pixel_stride;
  }
};

template <typename acc_t>
struct Welford {
  acc_t mean, m2;
  int64_t count;
};

template <typename acc_t>
__device__ Welford<acc_t> merge(const Welford<acc_t>& a, const Welford<acc_t>& b) {
  if (b.count == 0) return a;
  if (a.count == 0) return b;
  Welford<acc_t> r;
  r.count = a.count + b.count;
  const acc_t delta = b.mean - a.mean;
  const acc_t b_share = (acc_t)b.count / (acc_t)r.count;
  r.mean = a.mean + delta * b_share;
  r.m2 = a.m2 + b.m2 + delta * delta * (acc_t)a.count * b_share;
  return r;
}

// Merges every thread's Welford state; the result is returned to all threads.
template <typename acc_t>
__device__ Welford<acc_t> block_merge(Welford<acc_t> w) {
  QCA_SHARED(acc_t, s_mean, kWarps);
  QCA_SHARED(acc_t, s_m2, kWarps);
  QCA_SHARED(int64_t, s_count, kWarps);
  for (int offset = 16; offset > 0; offset >>= 1) {
    Welford<acc_t> other;
    other.mean = __shfl_down_sync(0xffffffffu, w.mean, offset);
    other.m2 = __shfl_down_sync(0xffffffffu, w.m2, offset);
    other.count = __shfl_down_sync(0xffffffffu, (long long)w.count, offset);
    w = merge(w, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_mean[warp] = w.mean;
    s_m2[warp] = w.m2;
    s_count[warp] = w.count;
  }
  __syncthreads();
  if (warp == 0) {
    Welford<acc_t> v{acc_t(0), acc_t(0), 0};
    if (lane < kWarps) v = Welford<acc_t>{s_mean[lane], s_m2[lane], s_count[lane]};
    for (int offset = 16; offset > 0; offset >>= 1) {
      Welford<acc_t> other;
      other.mean = __shfl_down_sync(0xffffffffu, v.mean, offset);
      other.m2 = __shfl_down_sync(0xffffffffu, v.m2, offset);
      other.count = __shfl_down_sync(0xffffffffu, (long long)v.count, offset);
      v = merge(v, other);
    }
    if (lane == 0) {
      s_mean[0] = v.mean;
      s_m2[0] = v.m2;
      s_count[0] = v.count;
    }
  }
  __syncthreads();
  const Welford<acc_t> result{s_mean[0], s_m2[0], s_count[0]};
  __syncthreads();  // the shared slots may be reused by a later call
  return result;
}

// Sums two values over the block; the results are returned to all threads.
template <typename acc_t>
__device__ void block_sum2(acc_t& a, acc_t& b) {
  QCA_SHARED(acc_t, s_a, kWarps);
  QCA_SHARED(acc_t, s_b, kWarps);
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_a[warp] = a;
    s_b[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    acc_t va = lane < kWarps ? s_a[lane] : acc_t(0);
    acc_t vb = lane < kWarps ? s_b[lane] : acc_t(0);
    for (int offset = 16; offset > 0; offset >>= 1) {
      va += __shfl_down_sync(0xffffffffu, va, offset);
      vb += __shfl_down_sync(0xffffffffu, vb, offset);
    }
    if (lane == 0) {
      s_a[0] = va;
      s_b[0] = vb;
    }
  }
  __syncthreads();
  a = s_a[0];
  b = s_b[0];
  __syncthreads();
}

__device__ __forceinline__ float elu(float z) { return z > 0.0f ? z : expm1f(z); }
__device__ __forceinline__ double elu(double z) { return z > 0.0 ? z : expm1(z); }
__device__ __forceinline__ float elu_grad(float z) { return z > 0.0f ? 1.0f : expf(z); }
__device__ __forceinline__ double elu_grad(double z) { return z > 0.0 ? 1.0 : exp(z); }

// Element access with the data type known at compile time (the inner loops are memory bound;
// the affine parameters and statistics, read once per channel, go through load_as instead).
template <typename acc_t> __device__ __forceinline__ acc_t to_acc(float v) { return (acc_t)v; }
template <typename acc_t> __device__ __forceinline__ acc_t to_acc(double v) { return (acc_t)v; }
template <typename acc_t> __device__ __forceinline__ acc_t to_acc(__half v) { return (acc_t)__half2float(v); }
template <typename acc_t> __device__ __forceinline__ acc_t to_acc(__nv_bfloat16 v) { return (acc_t)__bfloat162float(v); }

template <typename acc_t> __device__ __forceinline__ void put(float* p, int64_t i, acc_t v) { p[i] = (float)v; }
template <typename acc_t> __device__ __forceinline__ void put(double* p, int64_t i, acc_t v) { p[i] = (double)v; }
template <typename acc_t> __device__ __forceinline__ void put(__half* p, int64_t i, acc_t v) { p[i] = __float2half_rn((float)v); }
template <typename acc_t> __device__ __forceinline__ void put(__nv_bfloat16* p, int64_t i, acc_t v) { p[i] = __float2bfloat16_rn((float)v); }

// Visits this thread's pixels of channel c in the block's share, kBatch at a time: a batch's loads are all issued
// before any value is used, so each warp keeps several requests in flight (one at a time leaves
// these loops latency bound). `load(i)` reads element i, `use(i, value)` consumes it.
constexpr int kBatch = 4;

template <typename Load, typename Use>
__device__ __forceinline__ void for_pixels(const GroupLayout& g, int64_t c, Load load, Use use) {
  using value_t = decltype(load(int64_t(0)));
  const int64_t step = (int64_t)g.pixel_lanes;
  for (int64_t first = g.pixel_begin + g.pixel_lane; first < g.pixel_end; first += kBatch * step) {
    value_t values[kBatch] = {};
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t px = first + k * step;
      if (px < g.pixel_end) values[k] = load(g.offset(c, px));
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t px = first + k * step;
      if (px < g.pixel_end) use(g.offset(c, px), values[k]);
    }
  }
}

template <typename acc_t>
struct XAndGrad {
  acc_t x, grad;
};

// Welford statistics of the block's share, merged over the block (returned to all threads).
template <typename scalar_t, typename acc_t>
__device__ Welford<acc_t> share_statistics(const GroupLayout& g, const scalar_t* x) {
  // Welford's update: stable in one pass, without a second read of the group.
  Welford<acc_t> w{acc_t(0), acc_t(0), 0};
  if (g.active) {
    for (int64_t c = g.channel_lane; c < g.channels; c += g.channel_lanes) {
      for_pixels(
          g, c, [&](int64_t i) { return to_acc<acc_t>(x[i]); },
          [&](int64_t, acc_t v) {
            w.count += 1;
            const acc_t delta = v - w.mean;
            w.mean += delta / (acc_t)w.count;
            w.m2 += delta * (v - w.mean);
          });
    }
  }
  return block_merge(w);
}

template <typename acc_t>
__device__ acc_t rstd_of(const Welford<acc_t>& w, double eps) {
  const acc_t var = w.count > 0 ? w.m2 / (acc_t)w.count : acc_t(0);
  return acc_t(1) / sqrt(var + (acc_t)eps);
}

// y = ELU((x - mean) * rstd * weight + bias) over the block's share.
template <typename scalar_t, typename acc_t>
__device__ void apply_share(const GroupLayout& g, const qca_groupnorm_elu_params& p, acc_t mean, acc_t rstd) {
  if (!g.active) return;
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  scalar_t* y = static_cast<scalar_t*>(p.y);
  for (int64_t c = g.channel_lane; c < g.channels; c += g.channel_lanes) {
    const acc_t scale = load_as<acc_t>(p.weight, p.affine_dtype, g.first_channel + c) * rstd;
    const acc_t shift = load_as<acc_t>(p.bias, p.affine_dtype, g.first_channel + c);
    for_pixels(
        g, c, [&](int64_t i) { return to_acc<acc_t>(x[i]); },
        [&](int64_t i, acc_t v) { put<acc_t>(y, i, elu((v - mean) * scale + shift)); });
  }
}

// One block per pair: statistics (unless given) and output.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) forward_kernel(const qca_groupnorm_elu_params p) {
  const GroupLayout g(p.shape, 1);
  QCA_SHARED(acc_t, s_stats, 2);
  if (p.mean_in) {
    if (threadIdx.x == 0) {
      s_stats[0] = load_as<acc_t>(p.mean_in, p.stat_dtype, g.pair);
      s_stats[1] = load_as<acc_t>(p.rstd_in, p.stat_dtype, g.pair);
    }
  } else {
    const Welford<acc_t> w = share_statistics<scalar_t, acc_t>(g, static_cast<const scalar_t*>(p.x));
    if (threadIdx.x == 0) {
      s_stats[0] = w.mean;
      s_stats[1] = rstd_of(w, p.eps);
      store_as<acc_t>(p.mean_out, p.stat_dtype, g.pair, s_stats[0]);
      store_as<acc_t>(p.rstd_out, p.stat_dtype, g.pair, s_stats[1]);
    }
  }
  __syncthreads();
  apply_share<scalar_t, acc_t>(g, p, s_stats[0], s_stats[1]);
}

// Split pairs, first kernel: each block's partial statistics to the workspace.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) forward_partial_kernel(const qca_groupnorm_elu_params p, int64_t splits) {
  const GroupLayout g(p.shape, splits);
  const Welford<acc_t> w = share_statistics<scalar_t, acc_t>(g, static_cast<const scalar_t*>(p.x));
  if (threadIdx.x == 0) static_cast<Welford<acc_t>*>(p.workspace)[blockIdx.x] = w;
}

// Split pairs, second kernel: merge the pair's partials (in split order), then the output.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) forward_apply_kernel(const qca_groupnorm_elu_params p, int64_t splits) {
  const GroupLayout g(p.shape, splits);
  QCA_SHARED(acc_t, s_stats, 2);
  if (threadIdx.x == 0) {
    if (p.mean_in) {
      s_stats[0] = load_as<acc_t>(p.mean_in, p.stat_dtype, g.pair);
      s_stats[1] = load_as<acc_t>(p.rstd_in, p.stat_dtype, g.pair);
    } else {
      const Welford<acc_t>* partials = static_cast<const Welford<acc_t>*>(p.workspace) + g.pair * splits;
      Welford<acc_t> w = partials[0];
      for (int64_t s = 1; s < splits; ++s) w = merge(w, partials[s]);
      s_stats[0] = w.mean;
      s_stats[1] = rstd_of(w, p.eps);
      if (g.split == 0) {
        store_as<acc_t>(p.mean_out, p.stat_dtype, g.pair, s_stats[0]);
        store_as<acc_t>(p.rstd_out, p.stat_dtype, g.pair, s_stats[1]);
      }
    }
  }
  __syncthreads();
  apply_share<scalar_t, acc_t>(g, p, s_stats[0], s_stats[1]);
}

// Per-channel sums of g = grad_y * ELU'(z) and g * xhat over the block's share; `emit(c, sum_g,
// sum_g_xhat)` is called once per channel, by the thread of pixel lane 0.
template <typename scalar_t, typename acc_t, typename Emit>
__device__ void share_channel_sums(const GroupLayout& g, const qca_groupnorm_elu_backward_params& p, acc_t mean,
                                   acc_t rstd, Emit emit) {
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* grad_y = static_cast<const scalar_t*>(p.grad_y);
  QCA_SHARED(acc_t, s_bias_grad, kThreads);
  QCA_SHARED(acc_t, s_weight_grad, kThreads);
  int pixel_lanes_pow2 = 1;
  while (pixel_lanes_pow2 < g.pixel_lanes) pixel_lanes_pow2 <<= 1;
  // Channel chunks are uniform across the block, so the __syncthreads below are reached by all.
  for (int64_t chunk = 0; chunk < g.channels; chunk += g.channel_lanes) {
    const int64_t c = chunk + g.channel_lane;
    const bool has_channel = g.active && c < g.channels;
    acc_t bias_grad = 0, weight_grad = 0;
    if (has_channel) {
      const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, g.first_channel + c);
      const acc_t b = load_as<acc_t>(p.bias, p.affine_dtype, g.first_channel + c);
      for_pixels(
          g, c,
          [&](int64_t i) { return XAndGrad<acc_t>{to_acc<acc_t>(x[i]), to_acc<acc_t>(grad_y[i])}; },
          [&](int64_t, XAndGrad<acc_t> v) {
            const acc_t xhat = (v.x - mean) * rstd;
            const acc_t grad = v.grad * elu_grad(w * xhat + b);
            bias_grad += grad;
            weight_grad += grad * xhat;
          });
    }
    s_bias_grad[threadIdx.x] = bias_grad;
    s_weight_grad[threadIdx.x] = weight_grad;
    __syncthreads();
    // Tree sum over the pixel lanes of each channel lane.
    for (int stride = pixel_lanes_pow2 / 2; stride > 0; stride >>= 1) {
      if (g.active && g.pixel_lane < stride && g.pixel_lane + stride < g.pixel_lanes) {
        const int other = threadIdx.x + stride * g.channel_lanes;
        s_bias_grad[threadIdx.x] += s_bias_grad[other];
        s_weight_grad[threadIdx.x] += s_weight_grad[other];
      }
      __syncthreads();
    }
    if (has_channel && g.pixel_lane == 0) emit(c, s_bias_grad[threadIdx.x], s_weight_grad[threadIdx.x]);
    __syncthreads();
  }
}

// grad_x = rstd * (w * g - mean(dxhat) - xhat * mean(dxhat * xhat)) over the block's share, given
// each thread's part of sum_c w_c grad_bias[c] and sum_c w_c grad_weight[c] (summed here over the
// block, so every thread of the block must call it).
template <typename scalar_t, typename acc_t>
__device__ void grad_x_share(const GroupLayout& g, const qca_groupnorm_elu_backward_params& p, acc_t mean,
                             acc_t rstd, acc_t weighted_bias_grad, acc_t weighted_weight_grad) {
  block_sum2(weighted_bias_grad, weighted_weight_grad);
  const acc_t count = (acc_t)(g.channels * g.pixels);
  const acc_t mean_dxhat = count > 0 ? weighted_bias_grad / count : acc_t(0);
  const acc_t mean_dxhat_xhat = count > 0 ? weighted_weight_grad / count : acc_t(0);
  if (!g.active) return;
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* grad_y = static_cast<const scalar_t*>(p.grad_y);
  scalar_t* grad_x = static_cast<scalar_t*>(p.grad_x);
  for (int64_t c = g.channel_lane; c < g.channels; c += g.channel_lanes) {
    const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, g.first_channel + c);
    const acc_t b = load_as<acc_t>(p.bias, p.affine_dtype, g.first_channel + c);
    for_pixels(
        g, c,
        [&](int64_t i) { return XAndGrad<acc_t>{to_acc<acc_t>(x[i]), to_acc<acc_t>(grad_y[i])}; },
        [&](int64_t i, XAndGrad<acc_t> v) {
          const acc_t xhat = (v.x - mean) * rstd;
          const acc_t grad = v.grad * elu_grad(w * xhat + b);
          put<acc_t>(grad_x, i, rstd * (w * grad - mean_dxhat - xhat * mean_dxhat_xhat));
        });
  }
}

// Same maths as the C kernel (groupnorm_elu.c): per-channel sums of g and g * xhat, then grad_x
// from the two weighted group means. One block per pair.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) backward_kernel(const qca_groupnorm_elu_backward_params p) {
  const GroupLayout g(p.shape, 1);
  const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, g.pair);
  const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, g.pair);
  acc_t weighted_bias_grad = 0, weighted_weight_grad = 0;
  share_channel_sums<scalar_t, acc_t>(g, p, mean, rstd, [&](int64_t c, acc_t bias_grad, acc_t weight_grad) {
    const int64_t out = g.sample * p.shape.channels + g.first_channel + c;
    store_as<acc_t>(p.grad_weight_per_sample, p.stat_dtype, out, weight_grad);
    store_as<acc_t>(p.grad_bias_per_sample, p.stat_dtype, out, bias_grad);
    const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, g.first_channel + c);
    weighted_bias_grad += w * bias_grad;
    weighted_weight_grad += w * weight_grad;
  });
  grad_x_share<scalar_t, acc_t>(g, p, mean, rstd, weighted_bias_grad, weighted_weight_grad);
}

// Split pairs, first kernel: each block's per-channel sums to the workspace, laid out
// [block][channel of the group][sum of g, sum of g * xhat].
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) backward_partial_kernel(const qca_groupnorm_elu_backward_params p,
                                                                    int64_t splits) {
  const GroupLayout g(p.shape, splits);
  const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, g.pair);
  const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, g.pair);
  acc_t* sums = static_cast<acc_t*>(p.workspace) + (int64_t)blockIdx.x * g.channels * 2;
  share_channel_sums<scalar_t, acc_t>(g, p, mean, rstd, [&](int64_t c, acc_t bias_grad, acc_t weight_grad) {
    sums[2 * c] = bias_grad;
    sums[2 * c + 1] = weight_grad;
  });
}

// Split pairs, second kernel: totals of the pair's per-channel sums (in split order), then grad_x.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) backward_apply_kernel(const qca_groupnorm_elu_backward_params p,
                                                                  int64_t splits) {
  const GroupLayout g(p.shape, splits);
  const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, g.pair);
  const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, g.pair);
  const acc_t* sums = static_cast<const acc_t*>(p.workspace) + g.pair * splits * g.channels * 2;
  acc_t weighted_bias_grad = 0, weighted_weight_grad = 0;
  for (int64_t c = threadIdx.x; c < g.channels; c += kThreads) {
    acc_t bias_grad = 0, weight_grad = 0;
    for (int64_t s = 0; s < splits; ++s) {
      bias_grad += sums[(s * g.channels + c) * 2];
      weight_grad += sums[(s * g.channels + c) * 2 + 1];
    }
    if (g.split == 0) {
      const int64_t out = g.sample * p.shape.channels + g.first_channel + c;
      store_as<acc_t>(p.grad_weight_per_sample, p.stat_dtype, out, weight_grad);
      store_as<acc_t>(p.grad_bias_per_sample, p.stat_dtype, out, bias_grad);
    }
    const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, g.first_channel + c);
    weighted_bias_grad += w * bias_grad;
    weighted_weight_grad += w * weight_grad;
  }
  grad_x_share<scalar_t, acc_t>(g, p, mean, rstd, weighted_bias_grad, weighted_weight_grad);
}

bool dtype_ok(qca_dtype t) { return t == QCA_F32 || t == QCA_F64 || t == QCA_F16 || t == QCA_BF16; }

qca_status check(const qca_groupnorm_elu_shape& s, qca_dtype x, qca_dtype affine, qca_dtype stat) {
  if (s.batch < 0 || s.channels < 1 || s.height < 0 || s.width < 0 || s.groups < 1 ||
      s.channels % s.groups != 0)
    return QCA_ERR_INVALID_ARGUMENT;
  if (s.batch * s.groups > 0x7fffffffLL) return QCA_ERR_INVALID_ARGUMENT;  // grid x limit
  if (!dtype_ok(x) || !dtype_ok(affine) || (stat != QCA_F32 && stat != QCA_F64))
    return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}

// Blocks per pair: 1 when the pairs alone fill the GPU (two blocks per SM), more for small
// batches, as long as each block keeps at least kMinSplitElements elements. 0 when the device
// cannot be asked its size (`*query` says why).
int64_t choose_splits(const qca_groupnorm_elu_shape& s, cudaError_t* query) {
  const int64_t pairs = s.batch * s.groups, hw = s.height * s.width;
  *query = cudaSuccess;
  if (pairs == 0 || hw == 0) return 1;
  int sms = 0;
  *query = qca_lowmem_cuda::multiprocessor_count(&sms);
  if (*query != cudaSuccess) return 0;
  const int64_t target_blocks = 2 * (int64_t)sms;
  if (pairs >= target_blocks) return 1;
  int64_t splits = (target_blocks + pairs - 1) / pairs;
  const int64_t elements = s.channels / s.groups * hw;
  if (splits > elements / kMinSplitElements) splits = elements / kMinSplitElements;
  if (splits > hw) splits = hw;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits < 1 ? 1 : splits;
}

int64_t workspace_bytes(const qca_groupnorm_elu_shape& s, qca_dtype stat_dtype, int backward, int64_t splits) {
  if (splits <= 1) return 0;
  const int64_t blocks = s.batch * s.groups * splits;
  const bool wide = stat_dtype == QCA_F64;
  if (backward) return blocks * (s.channels / s.groups) * 2 * (wide ? 8 : 4);
  return blocks * (int64_t)(wide ? sizeof(Welford<double>) : sizeof(Welford<float>));
}

// Instantiates `launch.template run<scalar_t, acc_t>()` for the data and statistics types.
template <typename Launch>
cudaError_t dispatch(qca_dtype x_dtype, qca_dtype stat_dtype, const Launch& launch) {
  const bool wide = stat_dtype == QCA_F64;
  switch (x_dtype) {
    case QCA_F32: return wide ? launch.template run<float, double>() : launch.template run<float, float>();
    case QCA_F64: return wide ? launch.template run<double, double>() : launch.template run<double, float>();
    case QCA_F16: return wide ? launch.template run<__half, double>() : launch.template run<__half, float>();
    case QCA_BF16:
      return wide ? launch.template run<__nv_bfloat16, double>() : launch.template run<__nv_bfloat16, float>();
  }
  return cudaErrorInvalidValue;  // not reached: check() accepted the dtype
}

struct ForwardLaunch {
  const qca_groupnorm_elu_params* p;
  int64_t pairs, splits;
  cudaStream_t stream;
  template <typename scalar_t, typename acc_t>
  cudaError_t run() const {
    using qca_lowmem_cuda::launch_kernel;
    if (splits == 1)
      return launch_kernel(forward_kernel<scalar_t, acc_t>, (unsigned int)pairs, kThreads, 0, stream, *p);
    const unsigned int blocks = (unsigned int)(pairs * splits);
    if (!p->mean_in) {
      const cudaError_t e =
          launch_kernel(forward_partial_kernel<scalar_t, acc_t>, blocks, kThreads, 0, stream, *p, splits);
      if (e != cudaSuccess) return e;
    }
    return launch_kernel(forward_apply_kernel<scalar_t, acc_t>, blocks, kThreads, 0, stream, *p, splits);
  }
};

struct BackwardLaunch {
  const qca_groupnorm_elu_backward_params* p;
  int64_t pairs, splits;
  cudaStream_t stream;
  template <typename scalar_t, typename acc_t>
  cudaError_t run() const {
    using qca_lowmem_cuda::launch_kernel;
    if (splits == 1)
      return launch_kernel(backward_kernel<scalar_t, acc_t>, (unsigned int)pairs, kThreads, 0, stream, *p);
    const unsigned int blocks = (unsigned int)(pairs * splits);
    const cudaError_t e =
        launch_kernel(backward_partial_kernel<scalar_t, acc_t>, blocks, kThreads, 0, stream, *p, splits);
    if (e != cudaSuccess) return e;
    return launch_kernel(backward_apply_kernel<scalar_t, acc_t>, blocks, kThreads, 0, stream, *p, splits);
  }
};

template <typename Launch, typename Params>
qca_status launch(const Params* p, int backward, void* stream, qca_cuda_error* err) {
  const qca_status status = check(p->shape, p->x_dtype, p->affine_dtype, p->stat_dtype);
  if (status != QCA_OK) return status;
  const int64_t pairs = p->shape.batch * p->shape.groups;
  if (pairs == 0) return QCA_OK;
  cudaError_t query;
  const int64_t splits = choose_splits(p->shape, &query);
  if (query != cudaSuccess) return qca_lowmem_cuda::finish_launch(query, err);
  if (p->workspace_bytes < workspace_bytes(p->shape, p->stat_dtype, backward, splits) ||
      (splits > 1 && p->workspace == nullptr))
    return QCA_ERR_INVALID_ARGUMENT;
  return qca_lowmem_cuda::finish_launch(
      dispatch(p->x_dtype, p->stat_dtype, Launch{p, pairs, splits, static_cast<cudaStream_t>(stream)}), err);
}

}  // namespace

extern "C" int64_t qca_groupnorm_elu_cuda_workspace_bytes(const qca_groupnorm_elu_shape* shape, qca_dtype stat_dtype,
                                                   int backward) {
  if (check(*shape, QCA_F32, QCA_F32, stat_dtype) != QCA_OK) return 0;
  cudaError_t query;  // a failed query fails the launch that follows, which reports it
  const int64_t splits = choose_splits(*shape, &query);
  return query == cudaSuccess ? workspace_bytes(*shape, stat_dtype, backward, splits) : 0;
}

extern "C" qca_status qca_groupnorm_elu_forward_cuda(const qca_groupnorm_elu_params* p, void* stream,
                                              qca_cuda_error* err) {
  return launch<ForwardLaunch>(p, 0, stream, err);
}

extern "C" qca_status qca_groupnorm_elu_backward_cuda(const qca_groupnorm_elu_backward_params* p, void* stream,
                                               qca_cuda_error* err) {
  return launch<BackwardLaunch>(p, 1, stream, err);
}
