/* CPU kernels of the training noise (see include/qca_lowmem/noise.h). */
#include "qca_lowmem/noise.h"

#include <math.h>
#include <stddef.h>

#include "noise_random.h"
#include "qca_shared.h"

#define SINCOS(x, s, c) (*(s) = sin(x), *(c) = cos(x))

#define QCA_PER_PRECISION "noise_cells.inc"
#include "qca_per_precision.inc"

static qca_status check_params(const qca_noise_params* p, int64_t cell_begin, int64_t cell_end) {
  const qca_grid* g = &p->grid;
  if (g->batch < 0 || g->height < 0 || g->width < 0 || g->d < 1 || g->d > QCA_NOISE_MAX_D)
    return QCA_ERR_INVALID_ARGUMENT;
  const int64_t cells = g->batch * g->height * g->width;
  if (cells > QCA_NOISE_MAX_CELLS) return QCA_ERR_INVALID_ARGUMENT;
  if (cell_begin < 0 || cell_end < cell_begin || cell_end > cells) return QCA_ERR_INVALID_ARGUMENT;
  if (!(p->rate >= 0.0 && p->rate <= 1.0)) return QCA_ERR_INVALID_ARGUMENT;
  if (p->state_dtype != QCA_F32 && p->state_dtype != QCA_F64) return QCA_ERR_UNSUPPORTED_DTYPE;
  return QCA_OK;
}

qca_status qca_phase_flip_cpu(const qca_noise_params* p, int64_t cell_begin, int64_t cell_end) {
  const qca_status status = check_params(p, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (p->state_dtype == QCA_F32)
    phase_flip_cells_f32(p, cell_begin, cell_end);
  else
    phase_flip_cells_f64(p, cell_begin, cell_end);
  return QCA_OK;
}

qca_status qca_bit_flip_cpu(const qca_noise_params* p, int64_t cell_begin, int64_t cell_end) {
  const qca_status status = check_params(p, cell_begin, cell_end);
  if (status != QCA_OK) return status;
  if (p->state_dtype == QCA_F32)
    bit_flip_cells_f32(p, cell_begin, cell_end);
  else
    bit_flip_cells_f64(p, cell_begin, cell_end);
  return QCA_OK;
}

double qca_noise_coin(uint64_t seed, uint64_t step) {
  return qca_philox_unit(qca_noise_block(seed, step, 0, QCA_NOISE_STREAM_COIN, 0).v[0]);
}
