// CUDA kernels of the fused GroupNorm + ELU (see include/qca_lowmem/groupnorm_elu.h), for the
// (data, accumulator) pairs the ops use: float, half and bfloat16 data with float statistics,
// double data with double statistics.
//
// Batch- and device-invariant: each (sample, group) pair's pixels are cut into chunks whose size
// depends only on the shape, each chunk is reduced by one block in a fixed order, and the
// chunks' results are combined one after another in chunk order. Whether one block walks all of
// a pair's chunks (enough pairs to fill the GPU) or the chunks are spread over several blocks
// that exchange them through a workspace (small batches: `splits` blocks per pair, a partial
// kernel then the main one), a sample gets the same bits whatever the batch size or SM count.
// Every product is rounded on its own (mul_rn): nvcc would otherwise fuse products into FMAs
// wherever it chose, perhaps differently in the one-block and split kernels. The machine code
// is the same with and without -fmad but for the float expf/expm1f of CUDA's math library,
// elementwise and the same code in every kernel. CUDA does not match the C kernels bit for bit:
// they add in another order (tests/ops/test_cuda_kernels_emulated.py states the tolerance).
//
// Threads are laid out as (pixel lane, channel lane): with NCHW pixel lanes vary fastest, at least
// 32 of them, so a warp reads consecutive pixels of one channel; with channels_last up to one
// lane per channel of the group, varying fastest, so a warp reads the group's consecutive
// channels of consecutive pixels. Either way each thread keeps one channel at a time, so
// per-channel sums stay in registers. How the work is cut and launched: groupnorm_elu_plan.cuh.
// channels_last groups of up to 256 channels take the kernels of groupnorm_elu_nhwc.cuh instead:
// tiles of a slab of groups, two launches a pass at any batch.
#include <math.h>

#include "qca_cuda_common.cuh"
#include "groupnorm_elu_elements.cuh"
#include "groupnorm_elu_nhwc.cuh"
#include "groupnorm_elu_plan.cuh"
#include "qca_lowmem/groupnorm_elu.h"

namespace {

using qca_lowmem_cuda::block_reduce;
using qca_lowmem_cuda::load_as;
using qca_lowmem_cuda::mul_rn;
using qca_lowmem_cuda::store_as;

// This thread's place: its pair, its block's run of chunks, its lanes.
struct Place {
  int64_t pair, first_channel, first_chunk, end_chunk;
  int64_t base, channel_stride, pixel_stride;
  int channel_lane, pixel_lane;
  bool active;

  __device__ Place(const qca_groupnorm_elu_shape& s, const Plan& plan) {
    pair = (int64_t)blockIdx.x / plan.splits;
    const int64_t split = (int64_t)blockIdx.x - pair * plan.splits;
    const int64_t sample = pair / s.groups;
    first_channel = (pair - sample * s.groups) * plan.channels;
    first_chunk = plan.chunks * split / plan.splits;
    end_chunk = plan.chunks * (split + 1) / plan.splits;
    if (s.channels_last) {
      base = sample * plan.pixels * s.channels + first_channel;
      channel_stride = 1;
      pixel_stride = s.channels;
    } else {
      base = (sample * s.channels + first_channel) * plan.pixels;
      channel_stride = plan.pixels;
      pixel_stride = 1;
    }
    if (s.channels_last) {
      channel_lane = (int)threadIdx.x % plan.channel_lanes;
      pixel_lane = (int)threadIdx.x / plan.channel_lanes;
    } else {
      pixel_lane = (int)threadIdx.x % plan.pixel_lanes;
      channel_lane = (int)threadIdx.x / plan.pixel_lanes;
    }
    active = pixel_lane < plan.pixel_lanes;  // channels_last: lanes that do not divide kThreads
  }

  __device__ bool first_block() const { return first_chunk == 0; }
};

// Visits this thread's pixels of channel c in chunk `chunk`, kBatch at a time: a batch's loads
// are all issued before any value is used, so each warp keeps several requests in flight (one at
// a time leaves these loops latency bound). `load(i)` reads element i, `use(i, value)` consumes it.
// Pixels per batch: four in the forward, two in the backward (which loads x and grad_y) and in
// the double forward; four there spill at the 64 registers __launch_bounds__ allows.
template <typename scalar_t>
constexpr int kForwardBatch = sizeof(scalar_t) == 8 ? 2 : 4;
constexpr int kBackwardBatch = 2;

template <int kBatch, typename Load, typename Use>
__device__ __forceinline__ void for_pixels(const Place& t, const Plan& plan, int64_t c,
                                           int64_t chunk, Load load, Use use) {
  using value_t = decltype(load(int64_t(0)));
  const int64_t begin = chunk * plan.chunk_pixels;
  const int64_t end =
      begin + plan.chunk_pixels < plan.pixels ? begin + plan.chunk_pixels : plan.pixels;
  const int64_t row = t.base + c * t.channel_stride;  // element of pixel 0 of channel c
  const int64_t step = plan.pixel_lanes * t.pixel_stride;
  int64_t i = row + (begin + t.pixel_lane) * t.pixel_stride;
  for (int64_t px = begin + t.pixel_lane; px < end;
       px += kBatch * plan.pixel_lanes, i += kBatch * step) {
    value_t values[kBatch] = {};
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (px + k * plan.pixel_lanes < end) values[k] = load(i + k * step);
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (px + k * plan.pixel_lanes < end) use(i + k * step, values[k]);
  }
}

// Calls `body(c)` for each channel of the group this thread's channel lane takes.
template <typename Body>
__device__ __forceinline__ void for_channels(const Place& t, const Plan& plan, Body body) {
  if (!t.active) return;
  for (int64_t c = t.channel_lane; c < plan.channels; c += plan.channel_lanes) body(c);
}

// ---- forward ----

// Welford statistics of one chunk, the same on every thread of the block.
template <typename scalar_t, typename acc_t>
__device__ Welford<acc_t> chunk_statistics(const Place& t, const Plan& plan, const scalar_t* x,
                                           int64_t chunk) {
  // Welford's update: stable in one pass, without a second read of the group.
  Welford<acc_t> w{acc_t(0), acc_t(0), 0};
  for_channels(t, plan, [&](int64_t c) {
    for_pixels<kForwardBatch<scalar_t>>(
        t, plan, c, chunk, [&](int64_t i) { return to_acc<acc_t>(x[i]); },
        [&](int64_t, acc_t v) {
          w.count += 1;
          const acc_t delta = v - w.mean;
          w.mean += delta / (acc_t)w.count;
          w.m2 += mul_rn(delta, v - w.mean);
        });
  });
  return block_reduce<kThreads>(
      w, [](const Welford<acc_t>& a, const Welford<acc_t>& b) { return merge(a, b); });
}

// Split pairs with statistics to compute: each chunk's statistics to the workspace, laid out
// [pair][chunk].
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    forward_partial_kernel(const qca_groupnorm_elu_params p, const Plan plan) {
  const Place t(p.shape, plan);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  Welford<acc_t>* partials = static_cast<Welford<acc_t>*>(p.workspace) + t.pair * plan.chunks;
  for (int64_t chunk = t.first_chunk; chunk < t.end_chunk; ++chunk) {
    const Welford<acc_t> w = chunk_statistics<scalar_t, acc_t>(t, plan, x, chunk);
    if (threadIdx.x == 0) partials[chunk] = w;
  }
}

// Statistics (given; or computed from the pair's chunks, here or by forward_partial_kernel when
// the pair is split), then y = ELU((x - mean) * rstd * weight + bias) over the block's chunks.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    forward_kernel(const qca_groupnorm_elu_params p, const Plan plan) {
  const Place t(p.shape, plan);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  acc_t mean, rstd;
  if (p.mean_in) {
    mean = load_as<acc_t>(p.mean_in, p.stat_dtype, t.pair);
    rstd = load_as<acc_t>(p.rstd_in, p.stat_dtype, t.pair);
  } else {
    Welford<acc_t> total{acc_t(0), acc_t(0), 0};
    if (plan.splits == 1) {
      for (int64_t chunk = 0; chunk < plan.chunks; ++chunk)
        total = merge(total, chunk_statistics<scalar_t, acc_t>(t, plan, x, chunk));
    } else {
      const Welford<acc_t>* partials =
          static_cast<const Welford<acc_t>*>(p.workspace) + t.pair * plan.chunks;
      for (int64_t chunk = 0; chunk < plan.chunks; ++chunk) total = merge(total, partials[chunk]);
    }
    mean = total.mean;
    rstd = rstd_of(total, p.eps);
    if (t.first_block() && threadIdx.x == 0) {
      store_as<acc_t>(p.mean_out, p.stat_dtype, t.pair, mean);
      store_as<acc_t>(p.rstd_out, p.stat_dtype, t.pair, rstd);
    }
  }
  scalar_t* y = static_cast<scalar_t*>(p.y);
  for_channels(t, plan, [&](int64_t c) {
    const acc_t scale = mul_rn(load_as<acc_t>(p.weight, p.affine_dtype, t.first_channel + c), rstd);
    const acc_t shift = load_as<acc_t>(p.bias, p.affine_dtype, t.first_channel + c);
    for (int64_t chunk = t.first_chunk; chunk < t.end_chunk; ++chunk)
      for_pixels<kForwardBatch<scalar_t>>(
          t, plan, c, chunk, [&](int64_t i) { return to_acc<acc_t>(x[i]); },
          [&](int64_t i, acc_t v) { put<acc_t>(y, i, elu(mul_rn(v - mean, scale) + shift)); });
  });
}

// ---- backward ----

// Per-channel sums of g = grad_y * ELU'(z) and g * xhat over one chunk; `emit(c, sum_g,
// sum_g_xhat)` is called once per channel, by the thread of pixel lane 0.
template <typename scalar_t, typename acc_t, typename Emit>
__device__ void chunk_channel_sums(const Place& t, const Plan& plan,
                                   const qca_groupnorm_elu_backward_params& p, acc_t mean,
                                   acc_t rstd, int64_t chunk, Emit emit) {
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* grad_y = static_cast<const scalar_t*>(p.grad_y);
  QCA_SHARED(acc_t, s_bias_grad, kThreads);
  QCA_SHARED(acc_t, s_weight_grad, kThreads);
  int pixel_lanes_pow2 = 1;
  while (pixel_lanes_pow2 < plan.pixel_lanes) pixel_lanes_pow2 <<= 1;
  // Channel rounds are uniform across the block, so the __syncthreads below are reached by all.
  for (int64_t round = 0; round < plan.channels; round += plan.channel_lanes) {
    const int64_t c = round + t.channel_lane;
    const bool has_channel = t.active && c < plan.channels;
    acc_t bias_grad = 0, weight_grad = 0;
    if (has_channel) {
      const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, t.first_channel + c);
      const acc_t b = load_as<acc_t>(p.bias, p.affine_dtype, t.first_channel + c);
      for_pixels<kBackwardBatch>(
          t, plan, c, chunk,
          [&](int64_t i) { return XAndGrad<acc_t>{to_acc<acc_t>(x[i]), to_acc<acc_t>(grad_y[i])}; },
          [&](int64_t, XAndGrad<acc_t> v) {
            const acc_t xhat = mul_rn(v.x - mean, rstd);
            const acc_t grad = mul_rn(v.grad, elu_grad(mul_rn(w, xhat) + b));
            bias_grad += grad;
            weight_grad += mul_rn(grad, xhat);
          });
    }
    s_bias_grad[threadIdx.x] = bias_grad;
    s_weight_grad[threadIdx.x] = weight_grad;
    __syncthreads();
    // Tree sum over the pixel lanes of each channel lane.
    for (int stride = pixel_lanes_pow2 / 2; stride > 0; stride >>= 1) {
      if (t.active && t.pixel_lane < stride && t.pixel_lane + stride < plan.pixel_lanes) {
        const int other = threadIdx.x + stride * plan.pixel_lane_step;
        s_bias_grad[threadIdx.x] += s_bias_grad[other];
        s_weight_grad[threadIdx.x] += s_weight_grad[other];
      }
      __syncthreads();
    }
    if (has_channel && t.pixel_lane == 0)
      emit(c, s_bias_grad[threadIdx.x], s_weight_grad[threadIdx.x]);
    __syncthreads();
  }
}

// Split pairs: each chunk's per-channel sums to the workspace, laid out [pair][chunk][channel of
// the group][sum of g, sum of g * xhat].
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    backward_partial_kernel(const qca_groupnorm_elu_backward_params p, const Plan plan) {
  const Place t(p.shape, plan);
  const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, t.pair);
  const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, t.pair);
  acc_t* sums = static_cast<acc_t*>(p.workspace) + t.pair * plan.chunks * plan.channels * 2;
  for (int64_t chunk = t.first_chunk; chunk < t.end_chunk; ++chunk)
    chunk_channel_sums<scalar_t, acc_t>(t, plan, p, mean, rstd, chunk,
                                        [&](int64_t c, acc_t bias_grad, acc_t weight_grad) {
                                          sums[(chunk * plan.channels + c) * 2] = bias_grad;
                                          sums[(chunk * plan.channels + c) * 2 + 1] = weight_grad;
                                        });
}

// Per-channel totals over the pair's chunks in chunk order (summed here, or by
// backward_partial_kernel when the pair is split), written per sample; then
// grad_x = rstd * (w * g - mean(w g) - xhat * mean(w g xhat)) over the block's chunks. The
// totals are accumulated in the per-sample outputs, which are in the accumulator's type.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    backward_kernel(const qca_groupnorm_elu_backward_params p, const Plan plan) {
  const Place t(p.shape, plan);
  const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, t.pair);
  const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, t.pair);
  const int64_t out =
      t.pair / p.shape.groups * p.shape.channels + t.first_channel;  // channel 0 of the group
  acc_t* out_weight = static_cast<acc_t*>(p.grad_weight_per_sample) + out;
  acc_t* out_bias = static_cast<acc_t*>(p.grad_bias_per_sample) + out;
  if (plan.splits == 1) {
    for (int64_t chunk = 0; chunk < plan.chunks; ++chunk)
      chunk_channel_sums<scalar_t, acc_t>(
          t, plan, p, mean, rstd, chunk, [&](int64_t c, acc_t bias_grad, acc_t weight_grad) {
            // the same thread emits channel c for every chunk
            out_bias[c] = chunk == 0 ? bias_grad : out_bias[c] + bias_grad;
            out_weight[c] = chunk == 0 ? weight_grad : out_weight[c] + weight_grad;
          });
    __syncthreads();  // the totals other threads wrote are read below
  }
  SumPair<acc_t> weighted{acc_t(0), acc_t(0)};  // sum_c w_c * total of g, of g * xhat
  for (int64_t c = threadIdx.x; c < plan.channels; c += kThreads) {
    acc_t bias_grad, weight_grad;
    if (plan.splits == 1) {
      bias_grad = out_bias[c];
      weight_grad = out_weight[c];
    } else {
      const acc_t* sums =
          static_cast<const acc_t*>(p.workspace) + (t.pair * plan.chunks * plan.channels + c) * 2;
      bias_grad = sums[0];
      weight_grad = sums[1];
      for (int64_t chunk = 1; chunk < plan.chunks; ++chunk) {
        bias_grad += sums[chunk * plan.channels * 2];
        weight_grad += sums[chunk * plan.channels * 2 + 1];
      }
      if (t.first_block()) {
        out_bias[c] = bias_grad;
        out_weight[c] = weight_grad;
      }
    }
    const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, t.first_channel + c);
    weighted.a += mul_rn(w, bias_grad);
    weighted.b += mul_rn(w, weight_grad);
  }
  weighted = block_reduce<kThreads>(weighted, [](const SumPair<acc_t>& u, const SumPair<acc_t>& v) {
    return SumPair<acc_t>{u.a + v.a, u.b + v.b};
  });
  const acc_t count = (acc_t)(plan.channels * plan.pixels);
  const acc_t mean_dxhat = count > 0 ? weighted.a / count : acc_t(0);
  const acc_t mean_dxhat_xhat = count > 0 ? weighted.b / count : acc_t(0);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* grad_y = static_cast<const scalar_t*>(p.grad_y);
  scalar_t* grad_x = static_cast<scalar_t*>(p.grad_x);
  for_channels(t, plan, [&](int64_t c) {
    const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, t.first_channel + c);
    const acc_t b = load_as<acc_t>(p.bias, p.affine_dtype, t.first_channel + c);
    for (int64_t chunk = t.first_chunk; chunk < t.end_chunk; ++chunk)
      for_pixels<kBackwardBatch>(
          t, plan, c, chunk,
          [&](int64_t i) { return XAndGrad<acc_t>{to_acc<acc_t>(x[i]), to_acc<acc_t>(grad_y[i])}; },
          [&](int64_t i, XAndGrad<acc_t> v) {
            const acc_t xhat = mul_rn(v.x - mean, rstd);
            const acc_t grad = mul_rn(v.grad, elu_grad(mul_rn(w, xhat) + b));
            put<acc_t>(grad_x, i,
                       mul_rn(rstd, mul_rn(w, grad) - mean_dxhat - mul_rn(xhat, mean_dxhat_xhat)));
          });
  });
}

// ---- launch ----

// Workspace of the partial kernel: per chunk, the statistics (forward) or the per-channel sums
// (backward). None when a pair is one block.
int64_t workspace_bytes(const qca_groupnorm_elu_shape& s, const Plan& plan, qca_dtype stat_dtype,
                        bool backward) {
  if (plan.splits <= 1) return 0;
  const bool wide = stat_dtype == QCA_F64;
  const int64_t per_chunk =
      backward ? plan.channels * 2 * (wide ? 8 : 4)
               : (int64_t)(wide ? sizeof(Welford<double>) : sizeof(Welford<float>));
  return s.batch * s.groups * plan.chunks * per_chunk;
}

template <typename Params>
using Kernel = void (*)(Params, Plan);

template <typename Params>
using NhwcKernel = void (*)(Params, NhwcPlan);

// The kernels of a pass: `partial` for split pairs, then `main`; the channels_last pair
// (nhwc_takes) the same way, its partial kernel always run when statistics are to be computed.
template <typename Params>
struct Kernels {
  Kernel<Params> partial, main;
  NhwcKernel<Params> nhwc_partial, nhwc_main;
};

template <typename scalar_t, typename acc_t>
struct Instances {
  static Kernels<qca_groupnorm_elu_params> of(const qca_groupnorm_elu_params&) {
    return {forward_partial_kernel<scalar_t, acc_t>, forward_kernel<scalar_t, acc_t>,
            nhwc_statistics_kernel<scalar_t, acc_t>, nhwc_forward_kernel<scalar_t, acc_t>};
  }
  static Kernels<qca_groupnorm_elu_backward_params> of(const qca_groupnorm_elu_backward_params&) {
    return {backward_partial_kernel<scalar_t, acc_t>, backward_kernel<scalar_t, acc_t>,
            nhwc_backward_sums_kernel<scalar_t, acc_t>, nhwc_backward_kernel<scalar_t, acc_t>};
  }
};

// The kernels for the data type (check_dtypes accepted it, with its statistics type).
template <typename Params>
Kernels<Params> kernels_for(const Params& p) {
  switch (p.x_dtype) {
    case QCA_F64: return Instances<double, double>::of(p);
    case QCA_F16: return Instances<__half, float>::of(p);
    case QCA_BF16: return Instances<__nv_bfloat16, float>::of(p);
    default: return Instances<float, float>::of(p);
  }
}

bool needs_partials(const qca_groupnorm_elu_params& p) { return p.mean_in == nullptr; }
bool needs_partials(const qca_groupnorm_elu_backward_params&) { return true; }

// The channels_last kernels (nhwc_takes): two launches, or the second alone with given
// statistics. No device query: the plan is the shape's.
template <typename Params>
qca_status launch_nhwc(const Params* p, bool backward, void* stream, qca_cuda_error* err) {
  const NhwcPlan plan = make_nhwc_plan(p->shape);
  const bool partials = needs_partials(*p);
  const int64_t needed = partials ? nhwc_workspace_bytes(p->shape, p->stat_dtype, backward) : 0;
  if (p->workspace_bytes < needed || (needed > 0 && p->workspace == nullptr))
    return QCA_ERR_INVALID_ARGUMENT;
  const Kernels<Params> kernels = kernels_for(*p);
  const dim3 grid = nhwc_grid(p->shape, plan);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  using qca_lowmem_cuda::launch_kernel;
  if (partials) {
    const cudaError_t e = launch_kernel(kernels.nhwc_partial, grid, kNhwcThreads, 0, s, *p, plan);
    if (e != cudaSuccess) return qca_lowmem_cuda::finish_launch(e, err);
  }
  return qca_lowmem_cuda::finish_launch(
      launch_kernel(kernels.nhwc_main, grid, kNhwcThreads, 0, s, *p, plan), err);
}

template <typename Params>
qca_status launch(const Params* p, bool backward, void* stream, qca_cuda_error* err) {
  qca_status status = check_shape(p->shape);
  if (status == QCA_OK) status = check_dtypes(p->x_dtype, p->affine_dtype, p->stat_dtype);
  if (status != QCA_OK) return status;
  const int64_t pairs = p->shape.batch * p->shape.groups;
  if (pairs == 0) return QCA_OK;
  if (nhwc_takes(p->shape)) return launch_nhwc(p, backward, stream, err);
  Plan plan;
  cudaError_t query;
  if (!make_plan(p->shape, &plan, &query)) return qca_lowmem_cuda::finish_launch(query, err);
  const bool partials = needs_partials(*p) && plan.splits > 1;
  const int64_t needed = partials ? workspace_bytes(p->shape, plan, p->stat_dtype, backward) : 0;
  if (p->workspace_bytes < needed || (needed > 0 && p->workspace == nullptr))
    return QCA_ERR_INVALID_ARGUMENT;
  const Kernels<Params> kernels = kernels_for(*p);
  const unsigned int blocks = (unsigned int)(pairs * plan.splits);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  using qca_lowmem_cuda::launch_kernel;
  if (partials) {
    const cudaError_t e = launch_kernel(kernels.partial, blocks, kThreads, 0, s, *p, plan);
    if (e != cudaSuccess) return qca_lowmem_cuda::finish_launch(e, err);
  }
  return qca_lowmem_cuda::finish_launch(
      launch_kernel(kernels.main, blocks, kThreads, 0, s, *p, plan), err);
}

}  // namespace

extern "C" int64_t qca_groupnorm_elu_cuda_workspace_bytes(const qca_groupnorm_elu_shape* shape,
                                                          qca_dtype stat_dtype, int backward) {
  if (check_shape(*shape) != QCA_OK || (stat_dtype != QCA_F32 && stat_dtype != QCA_F64)) return 0;
  if (nhwc_takes(*shape)) return nhwc_workspace_bytes(*shape, stat_dtype, backward != 0);
  Plan plan;
  cudaError_t query;  // a failed query fails the launch that follows, which reports it
  if (!make_plan(*shape, &plan, &query)) return 0;
  return workspace_bytes(*shape, plan, stat_dtype, backward != 0);
}

extern "C" qca_status qca_groupnorm_elu_forward_cuda(const qca_groupnorm_elu_params* p,
                                                     void* stream, qca_cuda_error* err) {
  return launch(p, false, stream, err);
}

extern "C" qca_status qca_groupnorm_elu_backward_cuda(const qca_groupnorm_elu_backward_params* p,
                                                      void* stream, qca_cuda_error* err) {
  return launch(p, true, stream, err);
}
