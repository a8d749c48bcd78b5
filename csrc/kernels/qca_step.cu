// CUDA kernels of the fused QCA step (see include/qca_lowmem/qca_step.h): one thread per cell,
// running the same per-cell maths as the C kernels (qca_step_cells.inc).
#include <math.h>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/qca_step.h"
#include "qca_shared.h"

#define QCA_MUL(a, b) qca_lowmem_cuda::mul_rn((a), (b))  // bit for bit as C: no FMA

// One set of overloads (residual_, dot_term_, ...) per precision: C++ needs no suffix.
#define SUFFIX
#define REAL float
#include "qca_step_cells.inc"
#undef REAL
#define REAL double
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX

namespace {

using qca_lowmem_cuda::load_as;
using qca_lowmem_cuda::store_as;

// Where a cell starts in psi (complex elements, strides b, h, w) and in a planar (B, 2d, H, W)
// tensor (at channel 0, strides b, c, h, w).
__device__ int64_t psi_offset(const qca_grid& g, const int64_t* stride, int64_t cell) {
  return qca_cell_offset(cell, g.height, g.width, stride[0], stride[1], stride[2]);
}

__device__ int64_t planar_offset(const qca_grid& g, const int64_t* stride, int64_t cell) {
  return qca_cell_offset(cell, g.height, g.width, stride[0], stride[2], stride[3]);
}

struct CellOffsets {
  int64_t psi, planar;
};

__device__ CellOffsets cell_offsets(const qca_grid& g, const int64_t* psi_stride,
                                    const int64_t* planar_stride, int64_t cell) {
  return {psi_offset(g, psi_stride, cell), planar_offset(g, planar_stride, cell)};
}

template <typename REAL>
__device__ void pack_cell(const qca_pack_params* p, int64_t cell) {
  const REAL* psi = static_cast<const REAL*>(p->psi);
  const int64_t d = p->grid.d;
  const CellOffsets at = cell_offsets(p->grid, p->psi_stride, p->x_stride, cell);
  for (int64_t k = 0; k < d; ++k) {
    const REAL* psi_k = psi + 2 * (at.psi + k * p->psi_stride[3]);
    store_as<REAL>(p->x, p->x_dtype, at.planar + k * p->x_stride[1], psi_k[0]);
    store_as<REAL>(p->x, p->x_dtype, at.planar + (d + k) * p->x_stride[1], psi_k[1]);
  }
}

template <typename REAL>
__device__ void pack_backward_cell(const qca_pack_backward_params* p, int64_t cell) {
  REAL* psi_cell = static_cast<REAL*>(p->psi) + 2 * cell * p->grid.d;
  const int64_t d = p->grid.d;
  const int64_t x = planar_offset(p->grid, p->x_stride, cell);
  for (int64_t k = 0; k < d; ++k) {
    psi_cell[2 * k] = load_as<REAL>(p->x, p->x_dtype, x + k * p->x_stride[1]);
    psi_cell[2 * k + 1] = load_as<REAL>(p->x, p->x_dtype, x + (d + k) * p->x_stride[1]);
  }
}

// n_k of one cell from the saved inputs.
template <typename REAL>
__device__ void cell_residual(const qca_update_params* p, const CellOffsets& at, int64_t k,
                              REAL* ar, REAL* ai, REAL* nr, REAL* ni) {
  const REAL* psi_k = static_cast<const REAL*>(p->psi) + 2 * (at.psi + k * p->psi_stride[3]);
  *ar = load_as<REAL>(p->delta, p->delta_dtype, at.planar + k * p->delta_stride[1]);
  *ai = load_as<REAL>(p->delta, p->delta_dtype, at.planar + (p->grid.d + k) * p->delta_stride[1]);
  residual_(psi_k[0], psi_k[1], *ar, *ai, p->multiplicative, p->gamma > 0, (REAL)p->gamma, nr, ni);
}

// Two passes over the cell's inputs (its norm, then the outputs), recomputing n in the second
// rather than writing it and reading it back: the re-read inputs sit in L1.
template <typename REAL>
__device__ void update_cell(const qca_update_params* p, int64_t cell) {
  const CellOffsets at = cell_offsets(p->grid, p->psi_stride, p->delta_stride, cell);
  REAL norm_sq = 0, ar, ai, nr, ni;
  for (int64_t k = 0; k < p->grid.d; ++k) {
    cell_residual(p, at, k, &ar, &ai, &nr, &ni);
    norm_sq += dot_term_(nr, ni, nr, ni);
  }
  const REAL denominator = norm_(norm_sq) + (REAL)p->eps;
  REAL* out = static_cast<REAL*>(p->out) + 2 * cell * p->grid.d;
  for (int64_t k = 0; k < p->grid.d; ++k) {
    cell_residual(p, at, k, &ar, &ai, &nr, &ni);
    out[2 * k] = nr / denominator;
    out[2 * k + 1] = ni / denominator;
  }
}

template <typename REAL>
__device__ void update_backward_cell(const qca_update_backward_params* bp, int64_t cell) {
  const qca_update_params* p = &bp->fwd;
  const int64_t H = p->grid.height, W = p->grid.width, d = p->grid.d;
  const CellOffsets at = cell_offsets(p->grid, p->psi_stride, p->delta_stride, cell);
  const int64_t delta_plane = H * W;  // grad_delta is contiguous (B, 2d, H, W)
  const int64_t grad_delta_cell = (cell / delta_plane) * 2 * d * delta_plane + cell % delta_plane;
  const int64_t* gs = bp->grad_out_stride;
  const REAL* g_cell = static_cast<const REAL*>(bp->grad_out) + 2 * psi_offset(p->grid, gs, cell);
  const int decay = p->gamma > 0;
  REAL norm_sq = 0, n_dot_g = 0, ar, ai, nr, ni;
  for (int64_t k = 0; k < d; ++k) {
    cell_residual(p, at, k, &ar, &ai, &nr, &ni);
    norm_sq += dot_term_(nr, ni, nr, ni);
    n_dot_g += dot_term_(nr, ni, g_cell[2 * k * gs[3]], g_cell[2 * k * gs[3] + 1]);
  }
  const REAL norm = norm_(norm_sq);
  const REAL s = norm + (REAL)p->eps;
  const REAL radial = radial_(norm, s, n_dot_g);
  const REAL* psi = static_cast<const REAL*>(p->psi);
  REAL* grad_psi = static_cast<REAL*>(bp->grad_psi);
  for (int64_t k = 0; k < d; ++k) {
    cell_residual(p, at, k, &ar, &ai, &nr, &ni);
    const REAL* psi_k = psi + 2 * (at.psi + k * p->psi_stride[3]);
    REAL gar, gai, gpr, gpi;
    residual_backward_(psi_k[0], psi_k[1], ar, ai, nr, ni, g_cell[2 * k * gs[3]],
                       g_cell[2 * k * gs[3] + 1], s, radial, p->multiplicative, decay,
                       (REAL)p->gamma, &gar, &gai, &gpr, &gpi);
    if (bp->grad_delta) {
      store_as<REAL>(bp->grad_delta, p->delta_dtype, grad_delta_cell + k * delta_plane, gar);
      store_as<REAL>(bp->grad_delta, p->delta_dtype, grad_delta_cell + (d + k) * delta_plane, gai);
    }
    if (grad_psi) {
      grad_psi[2 * (cell * d + k)] = gpr;
      grad_psi[2 * (cell * d + k) + 1] = gpi;
    }
  }
}

constexpr int kThreads = 256;

// occupancy: the complex128 update backward (gradcheck's precision, not a training path) holds
// 73-78 registers, 38% of an sm_80/sm_90 at 256 threads; the complex64 kernels stay at 50-100%.
template <typename Params, void (*cell_fn)(const Params*, int64_t)>
__global__ void __launch_bounds__(kThreads) per_cell_kernel(const Params params, int64_t n_cells) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t cell = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; cell < n_cells;
       cell += stride) {
    cell_fn(&params, cell);
  }
}

int64_t cell_count(const qca_grid& g) { return g.batch * g.height * g.width; }

bool grid_is_valid(const qca_grid& g) {
  return g.batch >= 0 && g.height >= 0 && g.width >= 0 && g.d >= 1;
}

// The real tensor's type is only used inside the kernel, where an unknown one would read zeros
// and write nothing; reject it up front, as the C kernels do.
bool real_dtype_is_valid(qca_dtype t) {
  return t == QCA_F32 || t == QCA_F64 || t == QCA_F16 || t == QCA_BF16;
}

template <typename Params, void (*cell_f32)(const Params*, int64_t),
          void (*cell_f64)(const Params*, int64_t)>
qca_status launch(const Params* p, const qca_grid& grid, qca_dtype state_dtype,
                  qca_dtype real_dtype, void* stream, qca_cuda_error* err) {
  if (!grid_is_valid(grid)) return QCA_ERR_INVALID_ARGUMENT;
  if (!real_dtype_is_valid(real_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (state_dtype != QCA_F32 && state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  const int64_t n = cell_count(grid);
  if (n == 0) return QCA_OK;
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(n, kThreads);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = state_dtype == QCA_F32
                            ? qca_lowmem_cuda::launch_kernel(per_cell_kernel<Params, cell_f32>,
                                                             blocks, kThreads, 0, s, *p, n)
                            : qca_lowmem_cuda::launch_kernel(per_cell_kernel<Params, cell_f64>,
                                                             blocks, kThreads, 0, s, *p, n);
  return qca_lowmem_cuda::finish_launch(e, err);
}

}  // namespace

extern "C" qca_status qca_pack_cuda(const qca_pack_params* p, void* stream, qca_cuda_error* err) {
  return launch<qca_pack_params, pack_cell<float>, pack_cell<double>>(p, p->grid, p->state_dtype,
                                                                      p->x_dtype, stream, err);
}

extern "C" qca_status qca_pack_backward_cuda(const qca_pack_backward_params* p, void* stream,
                                             qca_cuda_error* err) {
  return launch<qca_pack_backward_params, pack_backward_cell<float>, pack_backward_cell<double>>(
      p, p->grid, p->state_dtype, p->x_dtype, stream, err);
}

extern "C" qca_status qca_update_cuda(const qca_update_params* p, void* stream,
                                      qca_cuda_error* err) {
  return launch<qca_update_params, update_cell<float>, update_cell<double>>(
      p, p->grid, p->state_dtype, p->delta_dtype, stream, err);
}

extern "C" qca_status qca_update_backward_cuda(const qca_update_backward_params* p, void* stream,
                                               qca_cuda_error* err) {
  return launch<qca_update_backward_params, update_backward_cell<float>,
                update_backward_cell<double>>(p, p->fwd.grid, p->fwd.state_dtype,
                                              p->fwd.delta_dtype, stream, err);
}
