// Launch planning of the GroupNorm+ELU CUDA kernels (groupnorm_elu.cu, its one includer): how a
// (sample, group) pair's pixels are cut into chunks and over how many blocks, from the shape and
// the device's size alone, and the checks a launch makes first. Host code; the kernels read the
// Plan it fills.
#ifndef QCA_LOWMEM_GROUPNORM_ELU_PLAN_CUH
#define QCA_LOWMEM_GROUPNORM_ELU_PLAN_CUH

#include <stdint.h>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/groupnorm_elu.h"

namespace {

constexpr int kThreads = 512;
constexpr int kBlocksPerSm = 2;  // what choose_splits aims for, and __launch_bounds__ promises
constexpr int64_t kMaxSplits = 64;
// A chunk is pixels_per_lane pixels for each pixel lane: 16, or 8 or 4 where a sample would
// otherwise be fewer than kSampleChunks chunks (two blocks on each SM of a 128-SM GPU at batch
// 1: a 64x64 group of 8 channels is 16 chunks, not 1). Never below 4, one forward batch, and
// never smaller than a pair spreads over (kMaxSplits chunks), where the extra chunks would only
// add block reductions.
constexpr int64_t kMaxPixelsPerLane = 16;
constexpr int64_t kMinPixelsPerLane = 4;
constexpr int64_t kSampleChunks = 256;
constexpr int kMinNchwPixelLanes = 32;  // NCHW: a warp reads 32 consecutive pixels of a channel

// How a pair's work is cut, from the shape alone (splits aside, which change no result).
struct Plan {
  int64_t channels;  // of a group
  int64_t pixels;  // H * W
  int64_t chunk_pixels;  // pixels of one chunk (all channels of the group)
  int64_t chunks;  // of a pair; at least 1, so an empty group still has its (empty) chunk
  int64_t splits;  // blocks per pair; each takes a run of whole chunks
  int channel_lanes, pixel_lanes;  // channel_lanes * pixel_lanes <= kThreads
  int pixel_lane_step;  // threads between neighbouring pixel lanes: channel_lanes, or 1 in NCHW
};

qca_status check_shape(const qca_groupnorm_elu_shape& s) {
  if (s.batch < 0 || s.channels < 1 || s.height < 0 || s.width < 0 || s.groups < 1 ||
      s.channels % s.groups != 0)
    return QCA_ERR_INVALID_ARGUMENT;
  if (s.batch * s.groups > 0x7fffffffLL) return QCA_ERR_INVALID_ARGUMENT;  // grid x limit
  return QCA_OK;
}

bool is_real(qca_dtype t) { return t == QCA_F32 || t == QCA_F64 || t == QCA_F16 || t == QCA_BF16; }

// The statistics dtype is the accumulator: double for double data, float for the others.
qca_status check_dtypes(qca_dtype x, qca_dtype affine, qca_dtype stat) {
  if (!is_real(x) || !is_real(affine)) return QCA_ERR_UNSUPPORTED_DTYPE;
  return stat == (x == QCA_F64 ? QCA_F64 : QCA_F32) ? QCA_OK : QCA_ERR_UNSUPPORTED_DTYPE;
}

// Blocks per pair: 1 when the pairs alone fill the GPU (kBlocksPerSm per SM), more for small
// batches, at most one per chunk. 0 when the device cannot be asked its size (`*query` says why).
int64_t choose_splits(int64_t pairs, int64_t chunks, cudaError_t* query) {
  *query = cudaSuccess;
  if (pairs == 0 || chunks == 1) return 1;
  int sms = 0;
  *query = qca_lowmem_cuda::multiprocessor_count(&sms);
  if (*query != cudaSuccess) return 0;
  const int64_t target_blocks = kBlocksPerSm * (int64_t)sms;
  if (pairs >= target_blocks) return 1;
  int64_t splits = (target_blocks + pairs - 1) / pairs;
  if (splits > chunks) splits = chunks;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits;
}

// Channel lanes: channels_last one per channel of the group (up to kThreads), so a warp reads
// the group's channels of consecutive pixels; NCHW the largest power of two up to the group's
// channels that leaves kMinNchwPixelLanes pixel lanes, warp-aligned rows of one channel.
int channel_lanes_for(const qca_groupnorm_elu_shape& s, int64_t channels) {
  if (s.channels_last) return (int)(channels < kThreads ? channels : kThreads);
  int lanes = 1;
  while (2 * lanes <= channels && 2 * lanes <= kThreads / kMinNchwPixelLanes) lanes *= 2;
  return lanes;
}

int64_t chunks_of(int64_t pixels, int64_t chunk_pixels) {
  return pixels > 0 ? (pixels + chunk_pixels - 1) / chunk_pixels : 1;
}

// The cut of a pair into chunks (all of the plan but `splits`), from the shape of one sample
// alone.
void cut_pair(const qca_groupnorm_elu_shape& s, Plan* plan) {
  plan->channels = s.channels / s.groups;
  plan->pixels = s.height * s.width;
  plan->channel_lanes = channel_lanes_for(s, plan->channels);
  plan->pixel_lanes = kThreads / plan->channel_lanes;
  plan->pixel_lane_step = s.channels_last ? plan->channel_lanes : 1;
  int64_t pixels_per_lane = kMaxPixelsPerLane;
  while (pixels_per_lane > kMinPixelsPerLane) {
    const int64_t chunks = chunks_of(plan->pixels, plan->pixel_lanes * pixels_per_lane);
    if (chunks >= kMaxSplits || s.groups * chunks >= kSampleChunks) break;
    pixels_per_lane /= 2;
  }
  plan->chunk_pixels = plan->pixel_lanes * pixels_per_lane;
  plan->chunks = chunks_of(plan->pixels, plan->chunk_pixels);
}

// The plan for `s` (checked) on the current device; false when the device query failed.
bool make_plan(const qca_groupnorm_elu_shape& s, Plan* plan, cudaError_t* query) {
  cut_pair(s, plan);
  plan->splits = choose_splits(s.batch * s.groups, plan->chunks, query);
  return plan->splits > 0;
}

}  // namespace

#endif
