// CUDA side of the glue helpers: the current stream, and a C launcher called on it with its
// failure raised as a Python exception. Callers hold a device guard for the tensors' device.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "glue.h"

namespace qca_lowmem {

// The current stream of the current device, as the C launchers take it (a cudaStream_t).
inline void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_cuda_status(qca_status status, const qca_cuda_error& err, const char* op) {
  TORCH_CHECK(status != QCA_ERR_CUDA, op, ": CUDA error ", err.code, " (",
              cudaGetErrorString(static_cast<cudaError_t>(err.code)), ")");
  check_status(status, op);
}

// Every C API CUDA launcher has this shape: parameters, stream, error slot.
template <typename Params>
using cuda_launcher = qca_status (*)(const Params*, void*, qca_cuda_error*);

template <typename Params>
void launch_cuda(cuda_launcher<Params> launcher, const Params& p, const char* op) {
  qca_cuda_error err{};
  check_cuda_status(launcher(&p, current_stream(), &err), err, op);
}

}  // namespace qca_lowmem
