// The qca_lowmem operator library: every schema lives in this one block; each device registers
// its kernels with TORCH_LIBRARY_IMPL next to its glue. Fake kernels and autograd are registered
// in Python, in the module named like the family (python/qca_lowmem/ops/qca_step.py,
// ops/groupnorm_elu.py, ops/noise.py, ops/scaler.py, ops/step_difference.py, ops/max_pool.py).
#include <Python.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

// Importing qca_lowmem._C loads this library and so registers the operators; the module itself
// is empty, so no pybind11 is needed.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C",
      "qca_lowmem native kernels; importing registers torch.ops.qca_lowmem.", -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(qca_lowmem, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};

  // QCA step: pack (stock step 1) and update (stock steps 2-5).
  m.def("qca_pack(Tensor psi, ScalarType? dtype=None, bool channels_last=False) -> Tensor", pt2);
  m.def("qca_pack_backward(Tensor grad_x, ScalarType psi_dtype) -> Tensor", pt2);
  m.def(
      "qca_update(Tensor psi, Tensor delta, float gamma=0.0, bool multiplicative=True, "
      "float eps=1e-9) -> Tensor",
      pt2);
  m.def(
      "qca_update_backward(Tensor grad_out, Tensor psi, Tensor delta, float gamma, "
      "bool multiplicative, float eps) -> (Tensor, Tensor)",
      pt2);

  // GroupNorm + ELU (fused ConvBlock).
  m.def(
      "groupnorm_elu(Tensor x, Tensor weight, Tensor bias, int groups, float eps=1e-05) "
      "-> (Tensor, Tensor, Tensor)",
      pt2);
  m.def(
      "groupnorm_elu_apply(Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd) "
      "-> Tensor",
      pt2);
  m.def(
      "groupnorm_elu_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, "
      "Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)",
      pt2);

  // Training noise.
  m.def("phase_flip(Tensor psi, float rate, int seed, int step, bool conjugate=False) -> Tensor",
        pt2);
  m.def("bit_flip(Tensor psi, float rate, int seed, int step) -> Tensor", pt2);
  m.def("noise_coin(int seed, int step) -> float", pt2);

  // Loss scaler, and gradient accumulation on its multi-tensor engine.
  m.def(
      "amp_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, "
      "bool compute_sumsq=False) -> Tensor",
      pt2);
  m.def("amp_mul_(Tensor(a!)[] tensors, Tensor factor) -> ()", pt2);
  m.def(
      "amp_update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, "
      "float growth_factor, float backoff_factor, int growth_interval) -> ()",
      pt2);
  m.def("accumulate_(Tensor(a!)[] accumulators, Tensor[] grads) -> ()", pt2);

  // The recompute check's measure of a step.
  m.def("step_difference(Tensor actual, Tensor expected, Tensor? before) -> Tensor", pt2);

  // 2x2 max pooling of stride 2 (the U-Net's), its backward finding each pick again from x.
  m.def("max_pool2x2(Tensor x) -> Tensor", pt2);
  m.def("max_pool2x2_backward(Tensor grad_y, Tensor x) -> Tensor", pt2);
}

// Ops with no derivative of their own: differentiating their output raises "the derivative for
// 'qca_lowmem::<op>' is not implemented" instead of torch's silent zero for ops without autograd.
// Their forward ops build second-order graphs from torch ops
// (python/qca_lowmem/ops/_double_backward.py).
TORCH_LIBRARY_IMPL(qca_lowmem, Autograd, m) {
  for (const char* op : {"qca_pack_backward", "qca_update_backward", "groupnorm_elu_apply",
                         "groupnorm_elu_backward", "step_difference", "max_pool2x2_backward"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}
