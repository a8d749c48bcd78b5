// CUDA kernels of the fused QCA step (see include/qca_lowmem/qca_step.h): one thread per cell,
// running the same per-cell maths as the C kernels (qca_step_cells.inc).
#include <math.h>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/qca_step.h"

#define QCA_HD __device__
#define QCA_MUL(a, b) qca_lowmem_cuda::mul_rn((a), (b))  // bit for bit as C: no FMA
#define QCA_CELL_TILE 1  // one thread per cell

#define REAL float
#define SUFFIX f32
#define LOAD qca_lowmem_cuda::load_as<float>
#define STORE qca_lowmem_cuda::store_as<float>
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX
#undef LOAD
#undef STORE

#define REAL double
#define SUFFIX f64
#define LOAD qca_lowmem_cuda::load_as<double>
#define STORE qca_lowmem_cuda::store_as<double>
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX
#undef LOAD
#undef STORE

namespace {

constexpr int kThreads = 256;

template <typename Params, void (*cells)(const Params*, int64_t, int64_t)>
__global__ void __launch_bounds__(kThreads) per_cell_kernel(const Params params, int64_t n_cells) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t cell = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; cell < n_cells;
       cell += stride) {
    cells(&params, cell, cell + 1);
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

template <typename Params, void (*cells_f32)(const Params*, int64_t, int64_t),
          void (*cells_f64)(const Params*, int64_t, int64_t)>
qca_status launch(const Params* p, const qca_grid& grid, qca_dtype state_dtype,
                  qca_dtype real_dtype, void* stream, qca_cuda_error* err) {
  if (!grid_is_valid(grid)) return QCA_ERR_INVALID_ARGUMENT;
  if (!real_dtype_is_valid(real_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (state_dtype != QCA_F32 && state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  const int64_t n = cell_count(grid);
  if (n == 0) return QCA_OK;
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(n, kThreads);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e =
      state_dtype == QCA_F32
          ? qca_lowmem_cuda::launch_kernel(per_cell_kernel<Params, cells_f32>, blocks, kThreads, 0, s, *p, n)
          : qca_lowmem_cuda::launch_kernel(per_cell_kernel<Params, cells_f64>, blocks, kThreads, 0, s, *p, n);
  return qca_lowmem_cuda::finish_launch(e, err);
}

}  // namespace

extern "C" qca_status qca_pack_cuda(const qca_pack_params* p, void* stream, qca_cuda_error* err) {
  return launch<qca_pack_params, pack_cells_f32, pack_cells_f64>(p, p->grid, p->state_dtype,
                                                                  p->x_dtype, stream, err);
}

extern "C" qca_status qca_pack_backward_cuda(const qca_pack_backward_params* p, void* stream,
                                      qca_cuda_error* err) {
  return launch<qca_pack_backward_params, pack_backward_cells_f32, pack_backward_cells_f64>(p, p->grid, p->state_dtype,
                                                                        p->x_dtype, stream, err);
}

extern "C" qca_status qca_update_cuda(const qca_update_params* p, void* stream,
                                      qca_cuda_error* err) {
  return launch<qca_update_params, update_cells_f32, update_cells_f64>(
      p, p->grid, p->state_dtype, p->delta_dtype, stream, err);
}

extern "C" qca_status qca_update_backward_cuda(const qca_update_backward_params* p, void* stream,
                                               qca_cuda_error* err) {
  return launch<qca_update_backward_params, update_backward_cells_f32, update_backward_cells_f64>(
      p, p->fwd.grid, p->fwd.state_dtype, p->fwd.delta_dtype, stream, err);
}
