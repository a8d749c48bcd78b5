// The channels_last kernels of GroupNorm+ELU (groupnorm_elu.cu, its one includer, launches them
// for channels_last groups of up to 256 channels).
//
// Built for batch 1, where one (sample, group) pair per block leaves most of a GPU idle: a block
// takes a tile of pixels and a slab of whole groups, about 32 contiguous channels, so a warp
// reads a pixel's slab in one run and a U-Net shape is 256 blocks at batch 1. Every pass is two
// launches: the first writes one partial per (tile, group) (statistics) or per (tile, channel)
// (the backward's sums), each slot by one block; the second has every block combine its groups'
// partials over the tiles itself, in a fixed order, then normalise its tile. The tiles and slabs
// depend on the shape of one sample alone, never on the batch or the GPU, so a sample's bits do
// not either; no launch waits on another block of its own grid.
#ifndef QCA_LOWMEM_GROUPNORM_ELU_NHWC_CUH
#define QCA_LOWMEM_GROUPNORM_ELU_NHWC_CUH

#include <stdint.h>

#include "groupnorm_elu_elements.cuh"
#include "groupnorm_elu_plan.cuh"
#include "qca_cuda_common.cuh"
#include "qca_lowmem/groupnorm_elu.h"

namespace {

using qca_lowmem_cuda::load_as;
using qca_lowmem_cuda::store_as;

constexpr int kNhwcThreads = 256;
constexpr int kNhwcBlocksPerSm = 4;  // 64 registers: a 256-thread block at half occupancy
constexpr int kSlabLanes = 32;  // channels of a slab: whole groups, up to a warp's width
constexpr int64_t kMaxTiles = 64;  // of a sample: what a block re-reads per group in the 2nd pass
constexpr int64_t kNhwcMaxPixelsPerLane = 8;
constexpr int64_t kNhwcSampleBlocks = 256;  // two blocks on each SM of a 128-SM GPU at batch 1
constexpr int64_t kMaxGridSamples = 65535;  // grid y; larger batches loop

// How one sample is cut: slabs of slab_channels channels (slab_groups whole groups) by tiles
// of tile_pixels pixels. Thread = (pixel lane, channel lane), channel lanes fastest.
struct NhwcPlan {
  int64_t channels;  // of the sample
  int64_t group_channels, pixels, tile_pixels, tiles;
  int slab_channels, slab_groups, slabs, pixel_lanes;
};

// Whether the channels_last kernels take the shape: a group fits a block's channel lanes, the
// grid's x (slabs * tiles, at most channels * kMaxTiles) stays within its limit, and a group is
// more than one chunk of the per-group kernels. A group of one chunk is one block and one launch
// there, where the tiles take two: on an H200 at 16 x 16 (8 channels a group) the per-group
// kernels took 7.5 us a forward call on NCHW data and the tiles 10.9 on channels_last. The
// choice is the shape's alone, so a sample's bits still depend on nothing else.
bool nhwc_takes(const qca_groupnorm_elu_shape& s) {
  if (!s.channels_last || s.channels / s.groups > kNhwcThreads || s.channels > (1 << 24))
    return false;
  Plan per_group;
  cut_pair(s, &per_group);
  return per_group.chunks > 1;
}

NhwcPlan make_nhwc_plan(const qca_groupnorm_elu_shape& s) {
  NhwcPlan plan;
  plan.channels = s.channels;
  plan.group_channels = s.channels / s.groups;
  int slab_groups = (int)(kSlabLanes / plan.group_channels);
  if (slab_groups > s.groups) slab_groups = (int)s.groups;
  if (slab_groups < 1) slab_groups = 1;
  while (s.groups % slab_groups != 0) --slab_groups;
  plan.slab_groups = slab_groups;
  plan.slab_channels = (int)(slab_groups * plan.group_channels);
  plan.slabs = (int)(s.groups / slab_groups);
  plan.pixel_lanes = kNhwcThreads / plan.slab_channels;
  plan.pixels = s.height * s.width;
  // Fewest pixels a lane that keep the tiles at kMaxTiles, more while the sample stays
  // kNhwcSampleBlocks blocks.
  int64_t per_lane = 1;
  while (chunks_of(plan.pixels, plan.pixel_lanes * per_lane) > kMaxTiles) per_lane *= 2;
  while (per_lane < kNhwcMaxPixelsPerLane &&
         plan.slabs * chunks_of(plan.pixels, plan.pixel_lanes * per_lane * 2) >= kNhwcSampleBlocks)
    per_lane *= 2;
  plan.tile_pixels = plan.pixel_lanes * per_lane;
  plan.tiles = chunks_of(plan.pixels, plan.tile_pixels);
  return plan;
}

// Workspace of the first pass: a Welford partial per (sample, group, tile), or the two sums of
// the backward per (sample, channel, tile).
int64_t nhwc_workspace_bytes(const qca_groupnorm_elu_shape& s, qca_dtype stat_dtype,
                             bool backward) {
  const NhwcPlan plan = make_nhwc_plan(s);
  const bool wide = stat_dtype == QCA_F64;
  if (backward) return s.batch * s.channels * plan.tiles * 2 * (wide ? 8 : 4);
  return s.batch * s.groups * plan.tiles *
         (int64_t)(wide ? sizeof(Welford<double>) : sizeof(Welford<float>));
}

// This thread's place in its block; the sample is the loop's.
struct NhwcPlace {
  int64_t tile, first_channel;  // the slab's first channel
  int channel_lane, pixel_lane;
  bool active;  // lanes past pixel_lanes * slab_channels have no channel

  __device__ NhwcPlace(const NhwcPlan& plan) {
    const int slab = (int)(blockIdx.x / (unsigned int)plan.tiles);
    tile = (int64_t)blockIdx.x - (int64_t)slab * plan.tiles;
    first_channel = (int64_t)slab * plan.slab_channels;
    channel_lane = (int)threadIdx.x % plan.slab_channels;
    pixel_lane = (int)threadIdx.x / plan.slab_channels;
    active = pixel_lane < plan.pixel_lanes;
  }

  __device__ int64_t channel() const { return first_channel + channel_lane; }
  // The thread's group in the sample, and its place among the group's threads.
  __device__ int64_t group(const NhwcPlan& plan) const { return channel() / plan.group_channels; }
  __device__ int group_member(const NhwcPlan& plan) const {
    return pixel_lane * (int)plan.group_channels + channel_lane % (int)plan.group_channels;
  }
};

// Visits this thread's pixels of its channel in its tile, kBatch at a time (the loads issued
// before any is used): `use(values, count, index, step)` takes the first `count` of the batch
// (an array of kBatch: for_batch walks it in registers), value k being element index + k * step.
template <int kBatch, typename Load, typename Use>
__device__ __forceinline__ void for_tile_pixels(const NhwcPlace& t, const NhwcPlan& plan,
                                                int64_t sample, Load load, Use use) {
  using value_t = decltype(load(int64_t(0)));
  const int64_t tile_end = (t.tile + 1) * plan.tile_pixels;
  const int64_t end = tile_end < plan.pixels ? tile_end : plan.pixels;
  const int64_t step = (int64_t)plan.pixel_lanes * plan.channels;  // elements between lanes' pixels
  int64_t px = t.tile * plan.tile_pixels + t.pixel_lane;
  int64_t i = (sample * plan.pixels + px) * plan.channels + t.channel();
  for (; px < end; px += kBatch * plan.pixel_lanes, i += kBatch * step) {
    const int64_t left = (end - px + plan.pixel_lanes - 1) / plan.pixel_lanes;
    const int count = left < kBatch ? (int)left : kBatch;
    value_t values[kBatch] = {};
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (k < count) values[k] = load(i + k * step);
    use(values, count, i, step);
  }
}

// body(k, v[k]) for the first `count` values of a batch, unrolled so that it stays in registers.
template <typename T, int kBatch, typename Body>
__device__ __forceinline__ void for_batch(const T (&v)[kBatch], int count, Body body) {
#pragma unroll
  for (int k = 0; k < kBatch; ++k)
    if (k < count) body(k, v[k]);
}

// Combines slots[threadIdx.x] over each set of `width` aligned channel lanes and every pixel
// lane (a group: width group_channels; a channel: width 1) in a fixed tree, leaving each set's
// result in the slot of its member 0 (pixel lane 0, first channel lane). Every thread calls it.
template <typename T, typename Combine>
__device__ void combine_over_sets(const NhwcPlace& t, const NhwcPlan& plan, int width, T* slots,
                                  Combine combine) {
  const int members = width * plan.pixel_lanes;
  const int member = t.pixel_lane * width + t.channel_lane % width;
  const int set_lane = t.channel_lane - t.channel_lane % width;
  int span = 1;
  while (span < members) span <<= 1;
  for (int stride = span / 2; stride > 0; stride >>= 1) {
    if (t.active && member < stride && member + stride < members) {
      const int other = member + stride;
      const int slot = other / width * plan.slab_channels + set_lane + other % width;
      slots[threadIdx.x] = combine(slots[threadIdx.x], slots[slot]);
    }
    __syncthreads();
  }
}

// The combinations of combine_over_sets: statistics merged, sums added.
struct MergeStatistics {
  template <typename W>
  __device__ W operator()(const W& a, const W& b) const {
    return merge(a, b);
  }
};
struct AddSums {
  template <typename S>
  __device__ S operator()(const S& u, const S& v) const {
    return S{u.a + v.a, u.b + v.b};
  }
};

template <typename scalar_t>
constexpr int kNhwcForwardBatch = sizeof(scalar_t) == 8 ? 4 : 8;
constexpr int kNhwcBackwardBatch = 4;

// First pass of the forward: the Welford statistics of each (tile, group) to the workspace,
// laid out [sample][group][tile].
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kNhwcThreads, kNhwcBlocksPerSm)
    nhwc_statistics_kernel(const qca_groupnorm_elu_params p, const NhwcPlan plan) {
  using Stats = Welford<acc_t>;
  QCA_SHARED(Stats, slots, kNhwcThreads);
  const NhwcPlace t(plan);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  Stats* partials = static_cast<Stats*>(p.workspace);
  for (int64_t sample = blockIdx.y; sample < p.shape.batch; sample += gridDim.y) {
    // The thread's sums of x - shift and its square, shift its first value (a value of the
    // group keeps the cancellation small), made statistics once: one division a thread.
    acc_t shift = 0, sum = 0, squares = 0;
    int64_t count = 0;
    if (t.active)
      for_tile_pixels<kNhwcForwardBatch<scalar_t>>(
          t, plan, sample, [&](int64_t i) { return to_acc<acc_t>(x[i]); },
          [&](const auto& v, int batch, int64_t, int64_t) {
            if (count == 0) shift = v[0];
            for_batch(v, batch, [&](int, acc_t value) {
              const acc_t deviation = value - shift;
              sum += deviation;
              squares += mul_rn(deviation, deviation);
            });
            count += batch;
          });
    Stats w{acc_t(0), acc_t(0), 0};
    if (count > 0) {
      const acc_t offset = sum / (acc_t)count;
      const acc_t m2 = squares - mul_rn(sum, offset);
      w = Stats{shift + offset, m2 < 0 ? acc_t(0) : m2, count};  // a NaN stays NaN
    }
    slots[threadIdx.x] = w;
    __syncthreads();
    combine_over_sets(t, plan, (int)plan.group_channels, slots, MergeStatistics());
    if (t.active && t.group_member(plan) == 0)
      partials[(sample * p.shape.groups + t.group(plan)) * plan.tiles + t.tile] =
          slots[threadIdx.x];
    __syncthreads();  // the slots are refilled for the next sample
  }
}

// Second pass of the forward (the only one with given statistics): each block combines its
// groups' partials over the tiles (member m of a group takes tiles m, m + members, ... in turn,
// then the tree of combine_over_sets), the first tile's block stores them, then
// y = ELU((x - mean) * rstd * weight + bias) over the block's tile.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kNhwcThreads, kNhwcBlocksPerSm)
    nhwc_forward_kernel(const qca_groupnorm_elu_params p, const NhwcPlan plan) {
  using Stats = Welford<acc_t>;
  QCA_SHARED(Stats, slots, kNhwcThreads);
  const NhwcPlace t(plan);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  scalar_t* y = static_cast<scalar_t*>(p.y);
  const Stats* partials = static_cast<const Stats*>(p.workspace);
  const int members = (int)plan.group_channels * plan.pixel_lanes;
  for (int64_t sample = blockIdx.y; sample < p.shape.batch; sample += gridDim.y) {
    const int64_t pair = sample * p.shape.groups + (t.active ? t.group(plan) : 0);
    acc_t mean = 0, rstd = 0;
    if (p.mean_in) {
      if (t.active) {
        mean = load_as<acc_t>(p.mean_in, p.stat_dtype, pair);
        rstd = load_as<acc_t>(p.rstd_in, p.stat_dtype, pair);
      }
    } else {
      Stats w{acc_t(0), acc_t(0), 0};
      if (t.active)
        for (int64_t tile = t.group_member(plan); tile < plan.tiles; tile += members)
          w = merge(w, partials[pair * plan.tiles + tile]);
      slots[threadIdx.x] = w;
      __syncthreads();
      combine_over_sets(t, plan, (int)plan.group_channels, slots, MergeStatistics());
      if (t.active) {
        const Stats total = slots[t.channel_lane - t.channel_lane % (int)plan.group_channels];
        mean = total.mean;
        rstd = rstd_of(total, p.eps);
        if (t.tile == 0 && t.group_member(plan) == 0) {
          store_as<acc_t>(p.mean_out, p.stat_dtype, pair, mean);
          store_as<acc_t>(p.rstd_out, p.stat_dtype, pair, rstd);
        }
      }
      __syncthreads();  // the slots are refilled for the next sample
    }
    if (!t.active) continue;
    const acc_t scale = mul_rn(load_as<acc_t>(p.weight, p.affine_dtype, t.channel()), rstd);
    const acc_t shift = load_as<acc_t>(p.bias, p.affine_dtype, t.channel());
    for_tile_pixels<kNhwcForwardBatch<scalar_t>>(
        t, plan, sample, [&](int64_t i) { return to_acc<acc_t>(x[i]); },
        [&](const auto& v, int count, int64_t i, int64_t step) {
          for_batch(v, count, [&](int k, acc_t value) {
            put<acc_t>(y, i + k * step, elu(mul_rn(value - mean, scale) + shift));
          });
        });
  }
}

// g = grad_y * ELU'(w xhat + b) for a batch of (x, grad_y), with xhat; `use(k, g, xhat)`.
template <typename acc_t, int kBatch, typename Use>
__device__ __forceinline__ void for_gradients(const XAndGrad<acc_t> (&v)[kBatch], int count,
                                              acc_t mean, acc_t rstd, acc_t w, acc_t b, Use use) {
  for_batch(v, count, [&](int k, const XAndGrad<acc_t>& value) {
    const acc_t xhat = mul_rn(value.x - mean, rstd);
    use(k, mul_rn(value.grad, elu_grad(mul_rn(w, xhat) + b)), xhat);
  });
}

// First pass of the backward: per channel, the sums of g and of g * xhat over the tile, to the
// workspace laid out [sample][channel][tile][sum of g, sum of g * xhat].
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kNhwcThreads, kNhwcBlocksPerSm)
    nhwc_backward_sums_kernel(const qca_groupnorm_elu_backward_params p, const NhwcPlan plan) {
  using Sums = SumPair<acc_t>;
  QCA_SHARED(Sums, slots, kNhwcThreads);
  const NhwcPlace t(plan);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* grad_y = static_cast<const scalar_t*>(p.grad_y);
  acc_t* sums = static_cast<acc_t*>(p.workspace);
  for (int64_t sample = blockIdx.y; sample < p.shape.batch; sample += gridDim.y) {
    Sums s{acc_t(0), acc_t(0)};
    if (t.active) {
      const int64_t pair = sample * p.shape.groups + t.group(plan);
      const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, pair);
      const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, pair);
      const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, t.channel());
      const acc_t b = load_as<acc_t>(p.bias, p.affine_dtype, t.channel());
      for_tile_pixels<kNhwcBackwardBatch>(
          t, plan, sample,
          [&](int64_t i) { return XAndGrad<acc_t>{to_acc<acc_t>(x[i]), to_acc<acc_t>(grad_y[i])}; },
          [&](const auto& v, int count, int64_t, int64_t) {
            for_gradients(v, count, mean, rstd, w, b, [&](int, acc_t g, acc_t xhat) {
              s.a += g;
              s.b += mul_rn(g, xhat);
            });
          });
    }
    slots[threadIdx.x] = s;
    __syncthreads();
    combine_over_sets(t, plan, 1, slots, AddSums());
    if (t.active && t.pixel_lane == 0) {
      acc_t* out = sums + ((sample * plan.channels + t.channel()) * plan.tiles + t.tile) * 2;
      out[0] = slots[threadIdx.x].a;
      out[1] = slots[threadIdx.x].b;
    }
    __syncthreads();  // the slots are refilled for the next sample
  }
}

// Second pass of the backward: each block sums its channels' partials over the tiles (pixel
// lane l takes tiles l, l + pixel_lanes, ... in turn, then the tree), the first tile's block
// writes them per sample, each thread weighs its group's channels in channel order; then
// grad_x = rstd * (w * g - mean(w g) - xhat * mean(w g xhat)) over the block's tile.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kNhwcThreads, kNhwcBlocksPerSm)
    nhwc_backward_kernel(const qca_groupnorm_elu_backward_params p, const NhwcPlan plan) {
  using Sums = SumPair<acc_t>;
  QCA_SHARED(Sums, slots, kNhwcThreads);
  const NhwcPlace t(plan);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* grad_y = static_cast<const scalar_t*>(p.grad_y);
  scalar_t* grad_x = static_cast<scalar_t*>(p.grad_x);
  const acc_t* partials = static_cast<const acc_t*>(p.workspace);
  const int group_channels = (int)plan.group_channels;
  for (int64_t sample = blockIdx.y; sample < p.shape.batch; sample += gridDim.y) {
    Sums s{acc_t(0), acc_t(0)};
    if (t.active) {
      const acc_t* own = partials + (sample * plan.channels + t.channel()) * plan.tiles * 2;
      for (int64_t tile = t.pixel_lane; tile < plan.tiles; tile += plan.pixel_lanes) {
        s.a += own[tile * 2];
        s.b += own[tile * 2 + 1];
      }
    }
    slots[threadIdx.x] = s;
    __syncthreads();
    combine_over_sets(t, plan, 1, slots, AddSums());
    Sums weighted{acc_t(0), acc_t(0)};  // sum over the group's channels of w_c * totals
    const int first_lane = t.channel_lane - t.channel_lane % group_channels;
    if (t.active) {
      if (t.tile == 0 && t.pixel_lane == 0) {
        const int64_t out = sample * plan.channels + t.channel();
        static_cast<acc_t*>(p.grad_bias_per_sample)[out] = slots[threadIdx.x].a;
        static_cast<acc_t*>(p.grad_weight_per_sample)[out] = slots[threadIdx.x].b;
      }
      for (int c = 0; c < group_channels; ++c) {
        const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, t.first_channel + first_lane + c);
        weighted.a += mul_rn(w, slots[first_lane + c].a);
        weighted.b += mul_rn(w, slots[first_lane + c].b);
      }
    }
    __syncthreads();  // the slots are refilled for the next sample
    if (!t.active) continue;
    const int64_t pair = sample * p.shape.groups + t.group(plan);
    const acc_t mean = load_as<acc_t>(p.mean, p.stat_dtype, pair);
    const acc_t rstd = load_as<acc_t>(p.rstd, p.stat_dtype, pair);
    const acc_t w = load_as<acc_t>(p.weight, p.affine_dtype, t.channel());
    const acc_t b = load_as<acc_t>(p.bias, p.affine_dtype, t.channel());
    const acc_t elements = (acc_t)(plan.group_channels * plan.pixels);
    const acc_t mean_dxhat = elements > 0 ? weighted.a / elements : acc_t(0);
    const acc_t mean_dxhat_xhat = elements > 0 ? weighted.b / elements : acc_t(0);
    for_tile_pixels<kNhwcBackwardBatch>(
        t, plan, sample,
        [&](int64_t i) { return XAndGrad<acc_t>{to_acc<acc_t>(x[i]), to_acc<acc_t>(grad_y[i])}; },
        [&](const auto& v, int count, int64_t i, int64_t step) {
          for_gradients(v, count, mean, rstd, w, b, [&](int k, acc_t g, acc_t xhat) {
            put<acc_t>(grad_x, i + k * step,
                       mul_rn(rstd, mul_rn(w, g) - mean_dxhat - mul_rn(xhat, mean_dxhat_xhat)));
          });
        });
  }
}

// The launch grid: the sample's blocks by the samples, at most kMaxGridSamples (the kernels
// loop over the rest).
dim3 nhwc_grid(const qca_groupnorm_elu_shape& s, const NhwcPlan& plan) {
  const int64_t samples = s.batch < kMaxGridSamples ? s.batch : kMaxGridSamples;
  return dim3((unsigned int)(plan.slabs * plan.tiles), (unsigned int)samples, 1);
}

}  // namespace

#endif
