// The CUDA subset the kernels use, implemented on the host so that csrc/kernels/*.cu compile as
// C++ (g++ -x c++ -DQCA_CUDA_EMULATION) and run on the CPU: each block's threads as cooperative
// fibers, checked as they run (runtime.cpp). What a kernel author may use, and what is checked:
// docs/cuda_emulation.md. Test-only code; the library never includes it.
#ifndef QCA_CUDA_EMU_H
#define QCA_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Shared memory is declared with QCA_SHARED / QCA_DYNAMIC_SHARED (docs/cuda_emulation.md).
#define __shared__ shared_memory_is_declared_with_QCA_SHARED

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Set by the scheduler before it resumes a thread.
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;

typedef struct qca_emu_stream* cudaStream_t;

enum cudaError_t {  // values as in CUDA's driver_types.h
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
};
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  void* attrs;
  unsigned int numAttrs;
};

cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);

namespace qca_emu {

// Kinds of block- and warp-wide operations (the scheduler's rendezvous points).
enum Op {
  kSyncThreads, kSyncThreadsOr, kSyncThreadsAnd, kSyncThreadsCount,
  kSyncWarp, kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll,
};

int block_op(Op op, int predicate, const char* file, int line);
uint64_t warp_op(Op op, unsigned mask, uint64_t value, int lane_arg, int width, const char* file,
                 int line);
void* shared_array(const void* key, size_t bytes, size_t align, const char* name,
                   const char* function);
void* dynamic_shared();
void atomic_access(const void* address, size_t bytes);
cudaError_t launch(const void* kernel, const cudaLaunchConfig_t& config, void (*run)(void*),
                   void* context);
cudaError_t set_max_dynamic_shared(const void* kernel, int bytes);

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "4- or 8-byte values");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T from_bits(uint64_t bits) {
  T v;
  memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace qca_emu

#define QCA_SHARED(type, name, count)                                                  \
  static_assert((count) > 0, "QCA_SHARED needs a constant, positive count");          \
  static char qca_emu_key_##name;                                                      \
  type(&name)[count] = *static_cast<type(*)[count]>(                                   \
      ::qca_emu::shared_array(&qca_emu_key_##name, sizeof(type[count]), alignof(type), #name, __func__))
#define QCA_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::qca_emu::dynamic_shared())

// ---- launches ----

template <typename... ExpTypes, typename... ActTypes>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(ExpTypes...),
                               ActTypes&&... args) {
  // The arguments are converted to the kernel's parameter types as CUDA's own template does,
  // copied once, and every thread gets its own copy of them by value.
  return [&](ExpTypes... coerced) {
    struct Context {
      void (*kernel)(ExpTypes...);
      std::tuple<std::decay_t<ExpTypes>...> args;
    } context{kernel, {coerced...}};
    return qca_emu::launch(
        reinterpret_cast<const void*>(kernel), *config,
        [](void* c) {
          Context* k = static_cast<Context*>(c);
          std::apply(k->kernel, k->args);
        },
        &context);
  }(std::forward<ActTypes>(args)...);
}

template <typename... Params>
cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return qca_emu::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), value);
}

// ---- barriers, warp operations ----

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  qca_emu::block_op(qca_emu::kSyncThreads, 0, file, line);
}
inline int __syncthreads_or(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::block_op(qca_emu::kSyncThreadsOr, p, file, line);
}
inline int __syncthreads_and(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::block_op(qca_emu::kSyncThreadsAnd, p, file, line);
}
inline int __syncthreads_count(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::block_op(qca_emu::kSyncThreadsCount, p, file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  qca_emu::warp_op(qca_emu::kSyncWarp, mask, 0, 0, warpSize, file, line);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::from_bits<T>(
      qca_emu::warp_op(qca_emu::kShfl, mask, qca_emu::to_bits(var), src_lane, width, file, line));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::from_bits<T>(qca_emu::warp_op(qca_emu::kShflUp, mask, qca_emu::to_bits(var),
                                                (int)delta, width, file, line));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::from_bits<T>(qca_emu::warp_op(qca_emu::kShflDown, mask, qca_emu::to_bits(var),
                                                (int)delta, width, file, line));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return qca_emu::from_bits<T>(qca_emu::warp_op(qca_emu::kShflXor, mask, qca_emu::to_bits(var),
                                                lane_mask, width, file, line));
}
inline unsigned __ballot_sync(unsigned mask, int p, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return (unsigned)qca_emu::warp_op(qca_emu::kBallot, mask, p != 0, 0, warpSize, file, line);
}
inline int __any_sync(unsigned mask, int p, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return (int)qca_emu::warp_op(qca_emu::kAny, mask, p != 0, 0, warpSize, file, line);
}
inline int __all_sync(unsigned mask, int p, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return (int)qca_emu::warp_op(qca_emu::kAll, mask, p != 0, 0, warpSize, file, line);
}

// ---- atomics ----
// Threads are cooperative fibers, so a read-modify-write is never interrupted; the race detector
// is told the access is atomic, and the plain access itself is not instrumented.

namespace qca_emu {
template <typename T, typename Update>
__attribute__((no_sanitize_thread, noinline)) T atomic_update(T* address, Update update) {
  atomic_access(address, sizeof(T));
  const T old = *address;
  *address = update(old);
  return old;
}
}  // namespace qca_emu

#define QCA_EMU_ATOMIC(name, T, expression)                                              \
  inline T name(T* address, T val) {                                                     \
    return qca_emu::atomic_update(address, [val](T old) { (void)old; return (T)(expression); });  \
  }
#define QCA_EMU_INTEGER_ATOMICS(T)                  \
  QCA_EMU_ATOMIC(atomicAdd, T, old + val)           \
  QCA_EMU_ATOMIC(atomicSub, T, old - val)           \
  QCA_EMU_ATOMIC(atomicExch, T, val)                \
  QCA_EMU_ATOMIC(atomicMin, T, val < old ? val : old) \
  QCA_EMU_ATOMIC(atomicMax, T, val > old ? val : old) \
  QCA_EMU_ATOMIC(atomicAnd, T, old & val)           \
  QCA_EMU_ATOMIC(atomicOr, T, old | val)            \
  QCA_EMU_ATOMIC(atomicXor, T, old ^ val)           \
  inline T atomicCAS(T* address, T compare, T val) {                                      \
    return qca_emu::atomic_update(address, [=](T old) { return old == compare ? val : old; }); \
  }
QCA_EMU_INTEGER_ATOMICS(int)
QCA_EMU_INTEGER_ATOMICS(unsigned int)
QCA_EMU_INTEGER_ATOMICS(unsigned long long)
QCA_EMU_ATOMIC(atomicAdd, float, old + val)
QCA_EMU_ATOMIC(atomicAdd, double, old + val)
QCA_EMU_ATOMIC(atomicExch, float, val)
#undef QCA_EMU_INTEGER_ATOMICS
#undef QCA_EMU_ATOMIC

// ---- arithmetic ----
// The emulated build is compiled with -ffp-contract=off: every product and sum is rounded, as
// the _rn intrinsics promise.

inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
template <typename T>
T __ldg(const T* p) {
  return *p;
}

#define QCA_EMU_MINMAX(T)                            \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
QCA_EMU_MINMAX(int)
QCA_EMU_MINMAX(unsigned int)
QCA_EMU_MINMAX(long)
QCA_EMU_MINMAX(unsigned long)
QCA_EMU_MINMAX(long long)
QCA_EMU_MINMAX(unsigned long long)
#undef QCA_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---- half and bfloat16 ----
// Derived here from the formats' definitions (a value is sign * q * 2^e with an integer q of
// 11 or 8 significant bits, rounded by nearbyint in the default round-to-nearest-even mode),
// not from the C kernels' bit tricks, so that comparing the two checks both. NaN converts to
// 0x7fff, the canonical NaN CUDA's cvt instructions write.

struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};

namespace qca_emu {

// A 16-bit binary format: sign bit 15, then the exponent field, then `mantissa_bits` bits.
inline unsigned short narrow_float(float f, int mantissa_bits, int bias) {
  if (isnan(f)) return 0x7fff;
  const unsigned int sign = signbit(f) ? 0x8000u : 0u;
  const unsigned int max_field = (1u << (15 - mantissa_bits)) - 1;  // all ones: inf and NaN
  const unsigned int infinity = max_field << mantissa_bits;
  const double m = fabs((double)f);
  if (isinf(m)) return (unsigned short)(sign | infinity);
  const int min_exponent = 1 - bias;  // of the smallest normal number
  int e;
  frexp(m, &e);  // m = r * 2^e, r in [0.5, 1)
  e -= 1;        // now r in [1, 2)
  if (m == 0 || e < min_exponent) {  // subnormal: q * 2^(min_exponent - mantissa_bits)
    const double q = nearbyint(ldexp(m, mantissa_bits - min_exponent));
    return (unsigned short)(sign | (unsigned int)q);  // q = 2^mantissa_bits: the smallest normal
  }
  double q = nearbyint(ldexp(m, mantissa_bits - e));  // in [2^mb, 2^(mb + 1)]
  if (q == ldexp(1.0, mantissa_bits + 1)) {
    q /= 2;
    e += 1;
  }
  const unsigned int field = (unsigned int)(e + bias);
  if (field >= max_field) return (unsigned short)(sign | infinity);
  return (unsigned short)(sign | (field << mantissa_bits) | ((unsigned int)q - (1u << mantissa_bits)));
}

inline float widen_float(unsigned short bits, int mantissa_bits, int bias) {
  const unsigned int max_field = (1u << (15 - mantissa_bits)) - 1;
  const unsigned int field = (bits >> mantissa_bits) & max_field;
  const unsigned int q = bits & ((1u << mantissa_bits) - 1);
  double m;
  if (field == max_field) {
    m = q ? NAN : INFINITY;
  } else if (field == 0) {
    m = ldexp((double)q, 1 - bias - mantissa_bits);
  } else {
    m = ldexp((double)(q + (1u << mantissa_bits)), (int)field - bias - mantissa_bits);
  }
  return (float)((bits & 0x8000u) ? -m : m);
}

}  // namespace qca_emu

inline float __half2float(__half h) { return qca_emu::widen_float(h.x, 10, 15); }
inline __half __float2half_rn(float f) { return __half{qca_emu::narrow_float(f, 10, 15)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return qca_emu::widen_float(h.x, 7, 127); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{qca_emu::narrow_float(f, 7, 127)}; }

#endif
