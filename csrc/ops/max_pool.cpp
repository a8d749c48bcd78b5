// ATen glue of the 2x2 max pooling: argument checks, the outputs' allocation, CPU dispatch.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "glue.h"
#include "max_pool_glue.h"

namespace qca_lowmem {

namespace {

// channels_last where x is dense in it and not NCHW-contiguous, else NCHW
// (python/qca_lowmem/ops/max_pool.py).
at::MemoryFormat layout_of(const at::Tensor& x) {
  return x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous()
             ? at::MemoryFormat::ChannelsLast
             : at::MemoryFormat::Contiguous;
}

at::Tensor checked_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(is_real_float(x.scalar_type()), op,
              ": x must be a float16, bfloat16, float32 or float64 tensor, got ", describe(x));
  TORCH_CHECK(x.dim() == 4, op, ": x must have 4 dimensions (N, C, H, W), got ", describe(x));
  TORCH_CHECK(x.size(2) >= 2 && x.size(3) >= 2, op,
              ": x's height and width must be at least 2 (one 2x2 window), got ", describe(x));
  return x.contiguous(layout_of(x));
}

qca_max_pool_shape shape_of(const at::Tensor& x) {
  return qca_max_pool_shape{x.size(0), x.size(1), x.size(2), x.size(3),
                            layout_of(x) == at::MemoryFormat::ChannelsLast ? 1 : 0};
}

}  // namespace

void prepare_max_pool2x2(const at::Tensor& x, MaxPoolForward& f) {
  f.x = checked_input(x, "max_pool2x2");
  f.y = at::empty({x.size(0), x.size(1), x.size(2) / 2, x.size(3) / 2}, f.x.options(),
                  layout_of(f.x));
  f.params = qca_max_pool_params{};
  f.params.shape = shape_of(f.x);
  f.params.dtype = to_qca_dtype(f.x.scalar_type());
  f.params.x = f.x.const_data_ptr();
  f.params.y = f.y.mutable_data_ptr();
}

void prepare_max_pool2x2_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                  MaxPoolBackward& b) {
  const char* op = "max_pool2x2_backward";
  b.x = checked_input(x, op);
  TORCH_CHECK(grad_y.defined(), op, ": grad_y is undefined");
  check_same_device(x, "x", grad_y, "grad_y", op);
  const std::vector<int64_t> pooled = {x.size(0), x.size(1), x.size(2) / 2, x.size(3) / 2};
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(pooled) && grad_y.scalar_type() == x.scalar_type(),
              op, ": grad_y must have x's dtype and the pooled shape (", x.scalar_type(), ", ",
              at::IntArrayRef(pooled), "), got ", describe(grad_y));
  b.grad_y = grad_y.contiguous(layout_of(b.x));
  b.grad_x = at::empty(b.x.sizes(), b.x.options(), layout_of(b.x));
  b.params = qca_max_pool_backward_params{};
  b.params.shape = shape_of(b.x);
  b.params.dtype = to_qca_dtype(b.x.scalar_type());
  b.params.grad_y = b.grad_y.const_data_ptr();
  b.params.x = b.x.const_data_ptr();
  b.params.grad_x = b.grad_x.mutable_data_ptr();
}

namespace {

constexpr int64_t kGrain = 32768;

at::Tensor max_pool2x2_cpu(const at::Tensor& x) {
  MaxPoolForward f;
  prepare_max_pool2x2(x, f);
  parallel_for_checked(f.y.numel(), kGrain, "max_pool2x2", [&](int64_t lo, int64_t hi) {
    return qca_max_pool2x2_forward_cpu(&f.params, lo, hi);
  });
  return f.y;
}

at::Tensor max_pool2x2_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x) {
  MaxPoolBackward b;
  prepare_max_pool2x2_backward(grad_y, x, b);
  // torch's CPU kernels send a window of -infinities' gradient to its first element.
  b.params.unpicked_to_origin = 0;
  parallel_for_checked(
      b.grad_y.numel(), kGrain, "max_pool2x2_backward",
      [&](int64_t lo, int64_t hi) { return qca_max_pool2x2_backward_cpu(&b.params, lo, hi); });
  return b.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(qca_lowmem, CPU, m) {
  m.impl("max_pool2x2", &max_pool2x2_cpu);
  m.impl("max_pool2x2_backward", &max_pool2x2_backward_cpu);
}

}  // namespace qca_lowmem
