/* Shared C types of the qca_lowmem kernels: the contract between kernels and the ATen glue.
 * Plain C: no ATen, no Python. Sizes and strides are int64 and counted in elements. */
#ifndef QCA_LOWMEM_COMMON_H
#define QCA_LOWMEM_COMMON_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of a real tensor. Complex tensors are described by the type of their parts. */
typedef enum qca_dtype { QCA_F32 = 0, QCA_F64 = 1, QCA_F16 = 2, QCA_BF16 = 3 } qca_dtype;

/* Launchers return a status; the glue turns anything but QCA_OK into a Python exception. */
typedef enum qca_status {
  QCA_OK = 0,
  QCA_ERR_INVALID_ARGUMENT = 1,
  QCA_ERR_UNSUPPORTED_DTYPE = 2,
  QCA_ERR_CUDA = 3,
  QCA_ERR_OUT_OF_MEMORY = 4 /* a CPU kernel could not allocate its scratch */
} qca_status;

/* A CUDA launcher that returns QCA_ERR_CUDA leaves the cudaError_t here for the glue to report. */
typedef struct qca_cuda_error {
  int code;
} qca_cuda_error;

#ifdef __cplusplus
}
#endif

#endif
