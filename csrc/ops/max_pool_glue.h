// Argument checks and kernel parameters of the 2x2 max pooling, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/core/Tensor.h>

#include "qca_lowmem/max_pool.h"

namespace qca_lowmem {

struct MaxPoolForward {
  at::Tensor x, y;
  qca_max_pool_params params;
};

struct MaxPoolBackward {
  at::Tensor grad_y, x, grad_x;
  qca_max_pool_backward_params params;
};

// x dense in its layout (channels_last where it is that and not NCHW, else NCHW), y allocated in
// it.
void prepare_max_pool2x2(const at::Tensor& x, MaxPoolForward& f);
// grad_y in x's layout, grad_x allocated in it; `unpicked_to_origin` is the device glue's.
void prepare_max_pool2x2_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                  MaxPoolBackward& b);

}  // namespace qca_lowmem
