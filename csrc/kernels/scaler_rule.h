/* The dynamic loss-scale update rule, shared by the C and CUDA kernels so both follow
 * torch._amp_update_scale_ bit for bit. */
#ifndef QCA_LOWMEM_SCALER_RULE_H
#define QCA_LOWMEM_SCALER_RULE_H

#include <math.h>
#include <stdint.h>

#include "qca_shared.h"

static inline QCA_HD void qca_scale_update_rule(float* scale, int32_t* tracker,
                                                const float* found_inf, double growth_factor,
                                                double backoff_factor, int64_t growth_interval) {
  /* Any nonzero flag (NaN included) counts as an overflow, as in torch's `if (*found_inf)`. */
  if (*found_inf != 0.0f) {
    *scale = (float)((double)*scale * backoff_factor);
    *tracker = 0;
    return;
  }
  const int32_t successful = *tracker + 1;
  if ((int64_t)successful == growth_interval) {
    const float grown = (float)((double)*scale * growth_factor);
    if (isfinite(grown)) *scale = grown; /* never grow past float range */
    *tracker = 0;
  } else {
    *tracker = successful;
  }
}

#endif
