/* What the C kernels and the CUDA kernels share besides the maths itself, included by every
 * kernel file and shared body: the qualifier of functions both compile, the name suffixing of
 * bodies included once per precision, and the cell numbering. */
#ifndef QCA_LOWMEM_SHARED_H
#define QCA_LOWMEM_SHARED_H

#include <stdint.h>

/* Functions compiled for both: device functions in CUDA (nvcc, or g++ under the emulator, where
 * qca_cuda_common.cuh defines __device__), plain functions in C. */
#if defined(__CUDACC__) || defined(QCA_CUDA_EMULATION)
#define QCA_HD __device__
#else
#define QCA_HD
#endif

/* QCA_FN(name_) is name_ followed by the includer's SUFFIX (f32, f64; empty in C++, where
 * overloads need none): one name per precision of a body included once per precision. */
#define QCA_CAT_(a, b) a##b
#define QCA_CAT(a, b) QCA_CAT_(a, b)
#define QCA_FN(name) QCA_CAT(name, SUFFIX)

/* Where cell `cell` of a (batch, height, width) grid, numbered row-major, lies in a tensor of
 * strides (batch, row, column). */
static inline QCA_HD int64_t qca_cell_offset(int64_t cell, int64_t height, int64_t width,
                                             int64_t stride_b, int64_t stride_h, int64_t stride_w) {
  const int64_t w = cell % width, h = (cell / width) % height, b = cell / (width * height);
  return b * stride_b + h * stride_h + w * stride_w;
}

#endif
