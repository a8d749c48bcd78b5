// CUDA kernels of the fused QCA step (see include/qca_lowmem/qca_step.h): a thread per cell for
// the update and its backward, per component for pack and its backward, running the same
// per-cell maths as the C kernels (qca_step_cells.inc).
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

// The update's first pass over a cell (its sums) has each thread issue the loads of up to
// kChunk components before it uses any: one memory round trip a chunk rather than one a
// component (the compiler does not batch them itself across a loop of unknown length). The
// second pass finds the inputs in L1 and takes them a component at a time, which keeps the
// registers live across its divisions few. The components are still taken in order, k = 0 ..
// d-1: the bits stay the C kernels'.
constexpr int kChunk = 4;

// Pack and its backward copy one component's two parts a thread: no sums, so the work is cut
// as finely as it goes (d times the threads of a thread per cell).
template <typename REAL>
__device__ void pack_component(const qca_pack_params* p, int64_t element) {
  const int64_t d = p->grid.d, cell = element / d, k = element - cell * d;
  const CellOffsets at = cell_offsets(p->grid, p->psi_stride, p->x_stride, cell);
  const REAL* psi_k = static_cast<const REAL*>(p->psi) + 2 * (at.psi + k * p->psi_stride[3]);
  const REAL re = psi_k[0], im = psi_k[1];
  store_as<REAL>(p->x, p->x_dtype, at.planar + k * p->x_stride[1], re);
  store_as<REAL>(p->x, p->x_dtype, at.planar + (d + k) * p->x_stride[1], im);
}

template <typename REAL>
__device__ void pack_backward_component(const qca_pack_backward_params* p, int64_t element) {
  const int64_t d = p->grid.d, cell = element / d, k = element - cell * d;
  const int64_t x = planar_offset(p->grid, p->x_stride, cell);
  const REAL re = load_as<REAL>(p->x, p->x_dtype, x + k * p->x_stride[1]);
  const REAL im = load_as<REAL>(p->x, p->x_dtype, x + (d + k) * p->x_stride[1]);
  REAL* psi_k = static_cast<REAL*>(p->psi) + 2 * element;
  psi_k[0] = re;
  psi_k[1] = im;
}

// The update's inputs of a chunk of components k0 .. k0 + count - 1 of one cell: psi_k and
// a_k (delta's two planes), and where the backward asks for it, its incoming gradient g_k.
template <typename REAL, int kLength>
struct ComponentChunk {
  REAL pr[kLength], pi[kLength], ar[kLength], ai[kLength], gr[kLength], gi[kLength];
  int count;
};

template <bool kWithGrad, typename REAL, int kLength>
__device__ __forceinline__ void load_chunk(const qca_update_params* p, const CellOffsets& at,
                                           const REAL* g_cell, const int64_t* gs, int64_t k0,
                                           ComponentChunk<REAL, kLength>* c) {
  const int64_t d = p->grid.d;
  c->count = d - k0 < kLength ? (int)(d - k0) : kLength;
  const REAL* psi = static_cast<const REAL*>(p->psi) + 2 * at.psi;
#pragma unroll
  for (int j = 0; j < kLength; ++j) {
    if (j >= c->count) break;
    const int64_t k = k0 + j;
    c->pr[j] = psi[2 * k * p->psi_stride[3]];
    c->pi[j] = psi[2 * k * p->psi_stride[3] + 1];
    c->ar[j] = load_as<REAL>(p->delta, p->delta_dtype, at.planar + k * p->delta_stride[1]);
    c->ai[j] = load_as<REAL>(p->delta, p->delta_dtype, at.planar + (d + k) * p->delta_stride[1]);
    if (kWithGrad) {
      c->gr[j] = g_cell[2 * k * gs[3]];
      c->gi[j] = g_cell[2 * k * gs[3] + 1];
    }
  }
}

// n_j of a loaded chunk.
template <typename REAL, int kLength>
__device__ __forceinline__ void chunk_residual(const qca_update_params* p,
                                               const ComponentChunk<REAL, kLength>& c, int j,
                                               REAL* nr, REAL* ni) {
  residual_(c.pr[j], c.pi[j], c.ar[j], c.ai[j], p->multiplicative, p->gamma > 0, (REAL)p->gamma, nr,
            ni);
}

// The first pass over a cell, its chunks' loads in flight: |n|^2 and, with the incoming
// gradient (kWithGrad), Re<n, g>, each summed over k = 0 .. d-1 in order.
template <bool kWithGrad, typename REAL>
__device__ __forceinline__ void cell_sums(const qca_update_params* p, const CellOffsets& at,
                                          const REAL* g_cell, const int64_t* gs, REAL* norm_sq,
                                          REAL* n_dot_g) {
  ComponentChunk<REAL, kChunk> c;
  REAL squares = 0, products = 0, nr, ni;
  for (int64_t k0 = 0; k0 < p->grid.d; k0 += kChunk) {
    load_chunk<kWithGrad>(p, at, g_cell, gs, k0, &c);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j >= c.count) break;
      chunk_residual(p, c, j, &nr, &ni);
      squares += dot_term_(nr, ni, nr, ni);
      if (kWithGrad) products += dot_term_(nr, ni, c.gr[j], c.gi[j]);
    }
  }
  *norm_sq = squares;
  if (kWithGrad) *n_dot_g = products;
}

// Two passes over the cell's inputs (its norm, then the outputs), recomputing n in the second
// rather than writing it and reading it back.
template <typename REAL>
__device__ void update_cell(const qca_update_params* p, int64_t cell) {
  const CellOffsets at = cell_offsets(p->grid, p->psi_stride, p->delta_stride, cell);
  const REAL* no_grad = nullptr;
  REAL norm_sq, nr, ni;
  cell_sums<false, REAL>(p, at, no_grad, nullptr, &norm_sq, nullptr);
  const REAL denominator = norm_(norm_sq) + (REAL)p->eps;
  REAL* out = static_cast<REAL*>(p->out) + 2 * cell * p->grid.d;
  ComponentChunk<REAL, 1> one;
  for (int64_t k = 0; k < p->grid.d; ++k) {
    load_chunk<false>(p, at, no_grad, nullptr, k, &one);
    chunk_residual(p, one, 0, &nr, &ni);
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
  REAL norm_sq, n_dot_g, nr, ni;
  cell_sums<true>(p, at, g_cell, gs, &norm_sq, &n_dot_g);
  const REAL norm = norm_(norm_sq);
  const REAL s = norm + (REAL)p->eps;
  const REAL radial = radial_(norm, s, n_dot_g);
  REAL* grad_psi = static_cast<REAL*>(bp->grad_psi);
  ComponentChunk<REAL, 1> one;
  for (int64_t k = 0; k < d; ++k) {
    load_chunk<true>(p, at, g_cell, gs, k, &one);
    chunk_residual(p, one, 0, &nr, &ni);
    REAL gar, gai, gpr, gpi;
    residual_backward_(one.pr[0], one.pi[0], one.ar[0], one.ai[0], nr, ni, one.gr[0], one.gi[0], s,
                       radial, p->multiplicative, decay, (REAL)p->gamma, &gar, &gai, &gpr, &gpi);
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

// A kernel's items: cells (the update and its backward: a cell's sums run in one thread) or
// components (pack and its backward), with the threads of a block for each. A grid of 64 x 64
// is 4,096 cells: blocks of 64 threads spread them over 64 multiprocessors where 256 took 16.
enum Items { kCells, kComponents };
constexpr int threads_for(Items items) { return items == kCells ? 64 : 256; }

// occupancy: the update and its backward hold 71-94 registers (128 in complex128, gradcheck's
// precision) for a chunk's loads in flight, 25-38% of an sm_80/sm_90: each thread keeps 16-24
// loads outstanding where a component at a time kept a few, and at 64 x 64 the launch is one
// 64-thread block a multiprocessor whatever the registers. Pack and its backward: 75-100%.
template <int kThreads, typename Params, void (*item_fn)(const Params*, int64_t)>
__global__ void __launch_bounds__(kThreads) per_item_kernel(const Params params, int64_t n_items) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t item = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; item < n_items;
       item += stride) {
    item_fn(&params, item);
  }
}

bool grid_is_valid(const qca_grid& g) {
  return g.batch >= 0 && g.height >= 0 && g.width >= 0 && g.d >= 1;
}

// The real tensor's type is only used inside the kernel, where an unknown one would read zeros
// and write nothing; reject it up front, as the C kernels do.
bool real_dtype_is_valid(qca_dtype t) {
  return t == QCA_F32 || t == QCA_F64 || t == QCA_F16 || t == QCA_BF16;
}

template <Items kItems, typename Params, void (*item_f32)(const Params*, int64_t),
          void (*item_f64)(const Params*, int64_t)>
qca_status launch(const Params* p, const qca_grid& grid, qca_dtype state_dtype,
                  qca_dtype real_dtype, void* stream, qca_cuda_error* err) {
  if (!grid_is_valid(grid)) return QCA_ERR_INVALID_ARGUMENT;
  if (!real_dtype_is_valid(real_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (state_dtype != QCA_F32 && state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  constexpr int kThreads = threads_for(kItems);
  const int64_t cells = grid.batch * grid.height * grid.width;
  const int64_t n = kItems == kComponents ? cells * grid.d : cells;
  if (n == 0) return QCA_OK;
  const unsigned int blocks = qca_lowmem_cuda::blocks_for(n, kThreads);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e =
      state_dtype == QCA_F32
          ? qca_lowmem_cuda::launch_kernel(per_item_kernel<kThreads, Params, item_f32>, blocks,
                                           kThreads, 0, s, *p, n)
          : qca_lowmem_cuda::launch_kernel(per_item_kernel<kThreads, Params, item_f64>, blocks,
                                           kThreads, 0, s, *p, n);
  return qca_lowmem_cuda::finish_launch(e, err);
}

}  // namespace

extern "C" qca_status qca_pack_cuda(const qca_pack_params* p, void* stream, qca_cuda_error* err) {
  return launch<kComponents, qca_pack_params, pack_component<float>, pack_component<double>>(
      p, p->grid, p->state_dtype, p->x_dtype, stream, err);
}

extern "C" qca_status qca_pack_backward_cuda(const qca_pack_backward_params* p, void* stream,
                                             qca_cuda_error* err) {
  return launch<kComponents, qca_pack_backward_params, pack_backward_component<float>,
                pack_backward_component<double>>(p, p->grid, p->state_dtype, p->x_dtype, stream,
                                                 err);
}

extern "C" qca_status qca_update_cuda(const qca_update_params* p, void* stream,
                                      qca_cuda_error* err) {
  return launch<kCells, qca_update_params, update_cell<float>, update_cell<double>>(
      p, p->grid, p->state_dtype, p->delta_dtype, stream, err);
}

extern "C" qca_status qca_update_backward_cuda(const qca_update_backward_params* p, void* stream,
                                               qca_cuda_error* err) {
  return launch<kCells, qca_update_backward_params, update_backward_cell<float>,
                update_backward_cell<double>>(p, p->fwd.grid, p->fwd.state_dtype,
                                              p->fwd.delta_dtype, stream, err);
}
