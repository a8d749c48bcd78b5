// CUDA side of the glue helpers: raise a Python exception for a failed launch.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "glue.h"

namespace qca_lowmem {

inline void check_cuda_status(qca_status status, const qca_cuda_error& err, const char* op) {
  TORCH_CHECK(status != QCA_ERR_CUDA, op, ": CUDA error ", err.code, " (",
              cudaGetErrorString(static_cast<cudaError_t>(err.code)), ")");
  check_status(status, op);
}

}  // namespace qca_lowmem
