// Helpers every op family's ATen glue shares: argument checks whose messages show what was
// received, dtype mapping to the C API, kernel status codes turned into Python exceptions, CPU
// work spread over torch's thread pool, and the complex state psi that the QCA ops take.
//
// Each family's prepare_<op>(inputs..., outputs&..., params&) (in its *_glue.h) is the one
// place an op's arguments are checked, for its CPU and CUDA glue alike. It returns nothing,
// throws (TORCH_CHECK, naming the argument and describe()-ing what was received) on a bad one,
// allocates the outputs into its tensor references and fills the kernel parameters, its last
// argument. Parameters that point into tensors or host arrays of its own making travel with
// them in one struct, passed as that last argument (GroupNormEluForward, UnscaleList).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <string>

#include "qca_lowmem/common.h"
#include "qca_lowmem/qca_step.h"

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
  TORCH_CHECK(status != QCA_ERR_UNSUPPORTED_DTYPE, op,
              ": the kernel has no variant for this dtype");
  TORCH_CHECK(status != QCA_ERR_OUT_OF_MEMORY, op, ": out of host memory for the kernel's scratch");
  TORCH_CHECK(status == QCA_OK, op, ": kernel failed with status ", static_cast<int>(status));
}

// Runs `kernel(begin, end) -> qca_status` over [0, n) on torch's intra-op thread pool, so the C
// kernels follow torch.set_num_threads and the process keeps one OpenMP runtime; raises when any
// part failed.
template <typename Kernel>
void parallel_for_checked(int64_t n, int64_t grain, const char* op, const Kernel& kernel) {
  std::atomic<int> failure{QCA_OK};
  at::parallel_for(0, n, std::max<int64_t>(1, grain), [&](int64_t begin, int64_t end) {
    const qca_status status = kernel(begin, end);
    if (status != QCA_OK) failure.store(status);
  });
  check_status(static_cast<qca_status>(failure.load()), op);
}

inline void check_same_device(const at::Tensor& ref, const char* ref_name, const at::Tensor& t,
                              const char* name, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ",
              ref_name, " (", ref.device(), "), got ", describe(t));
}

// ---- psi, the complex state (B, H, W, d) that the QCA step and noise ops take ----
inline void check_state(const at::Tensor& psi, const char* op) {
  TORCH_CHECK(psi.defined(), op, ": psi is undefined");
  TORCH_CHECK(psi.scalar_type() == at::kComplexFloat || psi.scalar_type() == at::kComplexDouble, op,
              ": psi must be complex64 or complex128 with shape (B, H, W, d), got ", describe(psi));
  TORCH_CHECK(psi.dim() == 4, op, ": psi must have 4 dimensions (B, H, W, d), got ", describe(psi));
  TORCH_CHECK(psi.size(3) >= 1, op, ": psi's last dimension d must be at least 1, got ",
              describe(psi));
}

inline qca_grid grid_of(const at::Tensor& psi) {
  return qca_grid{psi.size(0), psi.size(1), psi.size(2), psi.size(3)};
}

inline void copy_strides(const at::Tensor& t, int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = t.stride(i);
}

inline int64_t cell_count(const qca_grid& g) { return g.batch * g.height * g.width; }

// A kernel over cells [begin, end) of the (B, H, W) grid, on the CPU: about 16K components a task.
template <typename Kernel>
void parallel_cells_cpu(const qca_grid& g, const char* op, const Kernel& kernel) {
  parallel_for_checked(cell_count(g), 16384 / std::max<int64_t>(g.d, 1), op, kernel);
}

}  // namespace qca_lowmem
