// CUDA kernels of the training noise (see include/qca_lowmem/noise.h): one thread per cell,
// the same per-cell maths and random numbers as the C kernels (noise_cells.inc, philox.h).
#include <math.h>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/noise.h"
#include "qca_shared.h"

#define QCA_MUL(a, b) qca_lowmem_cuda::mul_rn((a), (b))  // bit for bit as C: no FMA
#include "noise_random.h"

#define SINCOS(x, s, c) sincos((x), (s), (c))

#define QCA_PER_PRECISION "noise_cells.inc"
#include "qca_per_precision.inc"

namespace {

// A grid of 64 x 64 is 4,096 cells: blocks of 64 threads spread them over 64 multiprocessors
// where 256 took 16.
constexpr int kThreads = 64;
// Blocks per multiprocessor asked of ptxas: half an sm_80 / sm_90 (1,024 threads), which caps the
// registers at 64: a full one (32) spilled 8-128 bytes once a copy held a chunk's loads, and,
// before that, around sincos' call where ptxas chose for itself.
constexpr int kBlocksPerSM = 16;

template <void (*cells)(const qca_noise_params*, int64_t, int64_t)>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM)
    noise_kernel(const qca_noise_params params, int64_t n_cells) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t cell = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; cell < n_cells;
       cell += stride) {
    cells(&params, cell, cell + 1);
  }
}

bool params_are_valid(const qca_noise_params& p) {
  const qca_grid& g = p.grid;
  if (g.batch < 0 || g.height < 0 || g.width < 0 || g.d < 1 || g.d > QCA_NOISE_MAX_D) return false;
  if (g.batch * g.height * g.width > QCA_NOISE_MAX_CELLS) return false;
  return p.rate >= 0.0 && p.rate <= 1.0;
}

template <void (*cells_f32)(const qca_noise_params*, int64_t, int64_t),
          void (*cells_f64)(const qca_noise_params*, int64_t, int64_t)>
qca_status launch(const qca_noise_params* p, void* stream, qca_cuda_error* err) {
  if (!params_are_valid(*p)) return QCA_ERR_INVALID_ARGUMENT;
  if (p->state_dtype != QCA_F32 && p->state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  const int64_t n = p->grid.batch * p->grid.height * p->grid.width;
  if (n == 0) return QCA_OK;
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(n, kThreads);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e =
      p->state_dtype == QCA_F32
          ? qca_lowmem_cuda::launch_kernel(noise_kernel<cells_f32>, blocks, kThreads, 0, s, *p, n)
          : qca_lowmem_cuda::launch_kernel(noise_kernel<cells_f64>, blocks, kThreads, 0, s, *p, n);
  return qca_lowmem_cuda::finish_launch(e, err);
}

}  // namespace

extern "C" qca_status qca_phase_flip_cuda(const qca_noise_params* p, void* stream,
                                          qca_cuda_error* err) {
  return launch<phase_flip_cells_f32, phase_flip_cells_f64>(p, stream, err);
}

extern "C" qca_status qca_bit_flip_cuda(const qca_noise_params* p, void* stream,
                                        qca_cuda_error* err) {
  return launch<bit_flip_cells_f32, bit_flip_cells_f64>(p, stream, err);
}
