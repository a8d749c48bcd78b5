/* CPU kernels of the fused QCA step (see include/qca_lowmem/qca_step.h). */
#include "qca_lowmem/qca_step.h"

#include <math.h>
#include <stddef.h>

#include "qca_scalar.h"

#define QCA_HD
#define QCA_CELL_TILE 64

#define REAL float
#define SUFFIX f32
#define LOAD qca_load_f32
#define STORE qca_store_f32
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX
#undef LOAD
#undef STORE

#define REAL double
#define SUFFIX f64
#define LOAD qca_load_f64
#define STORE qca_store_f64
#include "qca_step_cells.inc"
#undef REAL
#undef SUFFIX
#undef LOAD
#undef STORE

static qca_status check_grid(const qca_grid* g, int64_t cell_begin, int64_t cell_end) {
  if (g->batch < 0 || g->height < 0 || g->width < 0 || g->d < 1) return QCA_ERR_INVALID_ARGUMENT;
  if (cell_begin < 0 || cell_end < cell_begin || cell_end > g->batch * g->height * g->width)
    return QCA_ERR_INVALID_ARGUMENT;
  return QCA_OK;
}

qca_status qca_pack_cpu(const qca_pack_params* p, int64_t cell_begin, int64_t cell_end) {
  qca_status status = check_grid(&p->grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (!qca_dtype_is_valid(p->x_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (p->state_dtype == QCA_F32) pack_cells_f32(p, cell_begin, cell_end);
  else if (p->state_dtype == QCA_F64) pack_cells_f64(p, cell_begin, cell_end);
  else return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}

qca_status qca_pack_backward_cpu(const qca_pack_backward_params* p, int64_t cell_begin, int64_t cell_end) {
  qca_status status = check_grid(&p->grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (!qca_dtype_is_valid(p->x_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (p->state_dtype == QCA_F32) pack_backward_cells_f32(p, cell_begin, cell_end);
  else if (p->state_dtype == QCA_F64) pack_backward_cells_f64(p, cell_begin, cell_end);
  else return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}

qca_status qca_update_cpu(const qca_update_params* p, int64_t cell_begin, int64_t cell_end) {
  qca_status status = check_grid(&p->grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (!qca_dtype_is_valid(p->delta_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (p->state_dtype == QCA_F32) update_cells_f32(p, cell_begin, cell_end);
  else if (p->state_dtype == QCA_F64) update_cells_f64(p, cell_begin, cell_end);
  else return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}

qca_status qca_update_backward_cpu(const qca_update_backward_params* p, int64_t cell_begin,
                                   int64_t cell_end) {
  qca_status status = check_grid(&p->fwd.grid, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (!qca_dtype_is_valid(p->fwd.delta_dtype)) return QCA_ERR_UNSUPPORTED_DTYPE;
  if (p->fwd.state_dtype == QCA_F32) update_backward_cells_f32(p, cell_begin, cell_end);
  else if (p->fwd.state_dtype == QCA_F64) update_backward_cells_f64(p, cell_begin, cell_end);
  else return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}
