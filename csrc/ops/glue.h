// Helpers of the ATen glue: argument checks whose messages show what was received, dtype
// mapping to the C API, and turning kernel status codes into Python exceptions.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

#include "qca_lowmem/common.h"

namespace qca_lowmem {

// "Tensor(dtype=Float, shape=[1, 28, 8, 8], device=cpu, strides=[1792, 64, 8, 1])"
inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream s;
  s << "Tensor(dtype=" << t.scalar_type() << ", shape=" << t.sizes() << ", device=" << t.device()
    << ", strides=" << t.strides() << ")";
  return s.str();
}

inline bool is_real_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline qca_dtype to_qca_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return QCA_F32;
    case at::kDouble: return QCA_F64;
    case at::kHalf: return QCA_F16;
    case at::kBFloat16: return QCA_BF16;
    case at::kComplexFloat: return QCA_F32;
    case at::kComplexDouble: return QCA_F64;
    default: TORCH_CHECK(false, "qca_lowmem: no kernel for dtype ", t);
  }
}

inline void check_status(qca_status status, const char* op) {
  TORCH_CHECK(status != QCA_ERR_INVALID_ARGUMENT, op, ": the kernel rejected its arguments");
  TORCH_CHECK(status != QCA_ERR_UNSUPPORTED_DTYPE, op, ": the kernel has no variant for this dtype");
  TORCH_CHECK(status == QCA_OK, op, ": kernel failed with status ", static_cast<int>(status));
}

// psi, the complex state (B, H, W, d) that every QCA op takes.
inline void check_state(const at::Tensor& psi, const char* op) {
  TORCH_CHECK(psi.defined(), op, ": psi is undefined");
  TORCH_CHECK(psi.scalar_type() == at::kComplexFloat || psi.scalar_type() == at::kComplexDouble,
              op, ": psi must be complex64 or complex128 with shape (B, H, W, d), got ",
              describe(psi));
  TORCH_CHECK(psi.dim() == 4, op, ": psi must have 4 dimensions (B, H, W, d), got ",
              describe(psi));
  TORCH_CHECK(psi.size(3) >= 1, op, ": psi's last dimension d must be at least 1, got ",
              describe(psi));
}

inline void check_same_device(const at::Tensor& ref, const char* ref_name, const at::Tensor& t,
                              const char* name, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ",
              ref_name, " (", ref.device(), "), got ", describe(t));
}

}  // namespace qca_lowmem
