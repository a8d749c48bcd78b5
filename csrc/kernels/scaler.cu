// CUDA kernels of the loss scaler (see include/qca_lowmem/scaler.h).
//
// Multi-tensor launch (plan in scaler_batches.h): the host walks the list once, mapping chunks
// of QCA_SCALER_CHUNK reals to entries of a (tensor, chunk) table, and packs the addresses and
// the table of up to 64 tensors / 320 chunks into a struct passed by value as a kernel argument.
// Every launch is checked, and a tensor cut across batches continues in the next one. Each chunk is
// split over QCA_SCALER_CUDA_SPLIT thread blocks, so a batch fills the GPU with little metadata.
// Sums of squares are written per block and added per tensor by a second, deterministic pass, so
// the result does not depend on scheduling. Gradient accumulation runs on the same plan, with a
// pair of tensors and their element types in each slot, so one launch adds a step's gradients
// of every dtype into their accumulators.
#include <math.h>

#include <type_traits>

#include "qca_cuda_common.cuh"
#include "qca_lowmem/scaler.h"
#include "scaler_batches.h"

#include "scaler_rule.h"

namespace {

constexpr int kThreads = 512;
constexpr int kVecBytes = 16;  // one 128-bit load or store per thread per iteration
constexpr int kSplit = QCA_SCALER_CUDA_SPLIT;
constexpr int64_t kPart = QCA_SCALER_CHUNK / kSplit;  // reals per thread block
static_assert(kPart % (kVecBytes / 2) == 0, "parts must start at whole vectors of any type");

using qca_scaler_batches::AccumulateBatch;
using qca_scaler_batches::ChunkBatch;
// Kernel arguments stay within the 4 KiB that toolkits before 12.1 allow.
static_assert(sizeof(ChunkBatch) + 3 * sizeof(void*) <= 4096, "unscale arguments over 4 KiB");
static_assert(sizeof(AccumulateBatch) <= 4096, "accumulate arguments over 4 KiB");

template <typename T>
struct Real;
template <>
struct Real<float> {
  using math = float;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
template <>
struct Real<double> {
  using math = double;
  static __device__ __forceinline__ double load(double x) { return x; }
  static __device__ __forceinline__ double store(double x) { return x; }
};
template <>
struct Real<__half> {
  using math = float;
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};
template <>
struct Real<__nv_bfloat16> {
  using math = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

template <typename T>
struct alignas(kVecBytes) VecOf {
  static constexpr int kWidth = kVecBytes / sizeof(T);
  T v[kWidth];
};

// One real: check (before the multiply), multiply, accumulate the square of the stored value.
template <typename T, bool kCheck, bool kSumsq>
__device__ __forceinline__ T process(T raw, typename Real<T>::math factor, bool identity,
                                     bool& nonfinite, double& acc) {
  using R = Real<T>;
  const typename R::math x = R::load(raw);
  if (kCheck && !isfinite(x)) nonfinite = true;
  const T out = identity ? raw : R::store(x * factor);
  if (kSumsq) {
    const double stored = (double)R::load(out);
    acc += stored * stored;
  }
  return out;
}

__device__ __forceinline__ double block_sum(double v, double* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += shared[w];
  return total;  // valid in thread 0
}

template <typename T, bool kCheck, bool kSumsq>
__global__ void __launch_bounds__(kThreads)
    unscale_chunks_kernel(const ChunkBatch batch, const float* factor_ptr, float* found_inf,
                          double* partials) {
  using math = typename Real<T>::math;
  const float factor_f = *factor_ptr;
  const bool identity = factor_f == 1.0f;
  if (!kCheck && !kSumsq && identity) return;  // a plain multiply by one touches nothing
  const math factor = (math)factor_f;

  const int entry = blockIdx.x / kSplit;
  const int slot = batch.entry_tensor[entry];
  T* data = static_cast<T*>(batch.data[slot]);
  const int64_t part = (int64_t)batch.entry_chunk[entry] * kSplit + blockIdx.x % kSplit;
  const int64_t begin = part * kPart;
  const int64_t end = min(batch.numel[slot], begin + kPart);

  bool nonfinite = false;
  double acc = 0.0;
  const bool aligned = (reinterpret_cast<uintptr_t>(data) % sizeof(VecOf<T>)) == 0;
  int64_t i = begin;
  constexpr int kVec = VecOf<T>::kWidth;
  // Two vectors in flight per thread, and the scalar loop not unrolled: unrolled further, ptxas
  // spilled (sm_75, sm_86, sm_89) to fit the registers it allows a 512-thread block.
  if (aligned && begin < end) {  // parts start at whole vectors, so they stay aligned
    VecOf<T>* vec = reinterpret_cast<VecOf<T>*>(data);
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
#pragma unroll 2
    for (int64_t j = begin / kVec + threadIdx.x; j < vec_end / kVec; j += blockDim.x) {
      VecOf<T> x = vec[j];
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        x.v[k] = process<T, kCheck, kSumsq>(x.v[k], factor, identity, nonfinite, acc);
      if (!identity) vec[j] = x;
    }
    i = vec_end;
  }
#pragma unroll 1
  for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
    const T out = process<T, kCheck, kSumsq>(data[j], factor, identity, nonfinite, acc);
    if (!identity) data[j] = out;
  }

  if (!kCheck) return;
  const bool part_nonfinite = __syncthreads_or(nonfinite);
  if (part_nonfinite && threadIdx.x == 0) *found_inf = 1.0f;
  if (kSumsq) {
    QCA_SHARED(double, shared, kThreads / 32);
    const double total = block_sum(acc, shared);
    if (threadIdx.x == 0)
      partials[batch.first_partial[slot] + part] = part_nonfinite ? (double)NAN : total;
  }
}

constexpr int kMaxReduceTensors = 200;

struct ReduceBatch {
  int64_t first_partial[kMaxReduceTensors];
  int64_t n_parts[kMaxReduceTensors];
  int64_t first_tensor;
};
static_assert(sizeof(ReduceBatch) + 2 * sizeof(void*) <= 4096, "reduce arguments over 4 KiB");

// One warp per tensor adds its partial sums in a fixed order.
__global__ void __launch_bounds__(32)
    sum_partials_kernel(const ReduceBatch batch, const double* partials, double* sumsq) {
  const int t = blockIdx.x;
  const double* p = partials + batch.first_partial[t];
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < batch.n_parts[t]; c += 32) acc += p[c];
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (threadIdx.x == 0) sumsq[batch.first_tensor + t] = acc;
}

template <typename T, bool kCheck, bool kSumsq>
qca_status run_batches(const qca_unscale_params* p, cudaStream_t stream, qca_cuda_error* err) {
  const qca_status s = qca_scaler_batches::for_each_batch(
      p->tensors, p->numel, p->n_tensors, kSplit, [&](const ChunkBatch& batch, int entries) {
        return qca_lowmem_cuda::finish_launch(
            qca_lowmem_cuda::launch_kernel(unscale_chunks_kernel<T, kCheck, kSumsq>,
                                           entries * kSplit, kThreads, 0, stream, batch, p->factor,
                                           p->found_inf, p->workspace),
            err);
      });
  if (s != QCA_OK) return s;
  if (!kSumsq) return QCA_OK;

  // Every tensor's partials are written; add them up, empty tensors included (sum 0).
  ReduceBatch reduce;
  int64_t first_partial = 0;
  int count = 0;
  for (int64_t t = 0; t < p->n_tensors; ++t) {
    if (count == 0) reduce.first_tensor = t;
    const int64_t chunks = (p->numel[t] + QCA_SCALER_CHUNK - 1) / QCA_SCALER_CHUNK;
    reduce.first_partial[count] = first_partial;
    reduce.n_parts[count] = chunks * kSplit;
    first_partial += chunks * kSplit;
    ++count;
    if (count == kMaxReduceTensors || t == p->n_tensors - 1) {
      const qca_status s = qca_lowmem_cuda::finish_launch(
          qca_lowmem_cuda::launch_kernel(sum_partials_kernel, count, 32, 0, stream, reduce,
                                         p->workspace, p->sumsq),
          err);
      if (s != QCA_OK) return s;
      count = 0;
    }
  }
  return QCA_OK;
}

template <typename T>
qca_status dispatch_mode(const qca_unscale_params* p, cudaStream_t stream, qca_cuda_error* err) {
  if (p->sumsq) return run_batches<T, true, true>(p, stream, err);
  if (p->found_inf) return run_batches<T, true, false>(p, stream, err);
  return run_batches<T, false, false>(p, stream, err);
}

__global__ void __launch_bounds__(1) scale_update_kernel(const qca_scale_update_params p) {
  qca_scale_update_rule(p.scale, p.growth_tracker, p.found_inf, p.growth_factor, p.backoff_factor,
                        p.growth_interval);
}

// Gradient accumulation. A step's list is one gradient a parameter (28M reals at the default
// U-Net), so the pass is bound by memory: four reals a thread per iteration, in 8- to 32-byte loads
// and stores where both tensors are aligned to them (a part starts at a multiple of four reals).
template <typename T, int N>
struct alignas(sizeof(T) * N) Reals {
  T v[N];
};

// x of type T as math_t (exact), and a math_t rounded once into T (a narrow T through float, as
// torch's double -> half cast).
template <typename math_t, typename T>
__device__ __forceinline__ math_t widen(T x) {
  return (math_t)Real<T>::load(x);
}
template <typename T, typename math_t>
__device__ __forceinline__ T narrow(math_t x) {
  return Real<T>::store((typename Real<T>::math)x);
}

template <typename A, typename G>
__device__ __forceinline__ void accumulate_typed(void* acc_data, const void* grad_data,
                                                 int64_t begin, int64_t end) {
  using math_t =
      typename std::conditional<std::is_same<A, double>::value || std::is_same<G, double>::value,
                                double, float>::type;
  constexpr int kVec = 4;
  A* acc = static_cast<A*>(acc_data);
  const G* grad = static_cast<const G*>(grad_data);
  int64_t i = begin;
  if (reinterpret_cast<uintptr_t>(acc) % sizeof(Reals<A, kVec>) == 0 &&
      reinterpret_cast<uintptr_t>(grad) % sizeof(Reals<G, kVec>) == 0) {
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    Reals<A, kVec>* acc_vec = reinterpret_cast<Reals<A, kVec>*>(acc);
    const Reals<G, kVec>* grad_vec = reinterpret_cast<const Reals<G, kVec>*>(grad);
    for (int64_t j = begin / kVec + threadIdx.x; j < vec_end / kVec; j += blockDim.x) {
      Reals<A, kVec> a = acc_vec[j];
      const Reals<G, kVec> g =
          grad_vec[j];  // read before the write: a gradient may be its accumulator
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        a.v[k] = narrow<A, math_t>(widen<math_t>(a.v[k]) + widen<math_t>(g.v[k]));
      acc_vec[j] = a;
    }
    i = vec_end;
  }
  for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x)
    acc[j] = narrow<A, math_t>(widen<math_t>(acc[j]) + widen<math_t>(grad[j]));
}

template <typename A>
__device__ __forceinline__ void accumulate_from(void* acc, const void* grad, qca_dtype grad_dtype,
                                                int64_t begin, int64_t end) {
  switch (grad_dtype) {
    case QCA_F32: accumulate_typed<A, float>(acc, grad, begin, end); return;
    case QCA_F64: accumulate_typed<A, double>(acc, grad, begin, end); return;
    case QCA_F16: accumulate_typed<A, __half>(acc, grad, begin, end); return;
    case QCA_BF16: accumulate_typed<A, __nv_bfloat16>(acc, grad, begin, end); return;
  }
}

__global__ void __launch_bounds__(kThreads) accumulate_chunks_kernel(const AccumulateBatch batch) {
  const int entry = blockIdx.x / kSplit;
  const int slot = batch.entry_tensor[entry];
  const int64_t part = (int64_t)batch.entry_chunk[entry] * kSplit + blockIdx.x % kSplit;
  const int64_t begin = part * kPart;
  const int64_t end = min(batch.numel[slot], begin + kPart);
  void* acc = batch.accumulator[slot];
  const void* grad = batch.grad[slot];
  const qca_dtype grad_dtype = (qca_dtype)batch.grad_dtype[slot];
  switch ((qca_dtype)batch.accumulator_dtype[slot]) {
    case QCA_F32: accumulate_from<float>(acc, grad, grad_dtype, begin, end); return;
    case QCA_F64: accumulate_from<double>(acc, grad, grad_dtype, begin, end); return;
    case QCA_F16: accumulate_from<__half>(acc, grad, grad_dtype, begin, end); return;
    case QCA_BF16: accumulate_from<__nv_bfloat16>(acc, grad, grad_dtype, begin, end); return;
  }
}

bool valid_dtype(qca_dtype d) {
  return d == QCA_F32 || d == QCA_F64 || d == QCA_F16 || d == QCA_BF16;
}

}  // namespace

extern "C" qca_status qca_unscale_cuda(const qca_unscale_params* p, void* stream,
                                       qca_cuda_error* err) {
  if (!p || p->n_tensors < 0 || !p->factor || (p->sumsq && (!p->found_inf || !p->workspace)))
    return QCA_ERR_INVALID_ARGUMENT;
  for (int64_t t = 0; t < p->n_tensors; ++t)
    if (p->numel[t] < 0 || (p->numel[t] > 0 && !p->tensors[t])) return QCA_ERR_INVALID_ARGUMENT;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case QCA_F32: return dispatch_mode<float>(p, s, err);
    case QCA_F64: return dispatch_mode<double>(p, s, err);
    case QCA_F16: return dispatch_mode<__half>(p, s, err);
    case QCA_BF16: return dispatch_mode<__nv_bfloat16>(p, s, err);
  }
  return QCA_ERR_UNSUPPORTED_DTYPE;
}

extern "C" qca_status qca_scale_update_cuda(const qca_scale_update_params* p, void* stream,
                                            qca_cuda_error* err) {
  if (!p || !p->scale || !p->growth_tracker || !p->found_inf) return QCA_ERR_INVALID_ARGUMENT;
  return qca_lowmem_cuda::finish_launch(
      qca_lowmem_cuda::launch_kernel(scale_update_kernel, 1, 1, 0,
                                     static_cast<cudaStream_t>(stream), *p),
      err);
}

extern "C" qca_status qca_accumulate_cuda(const qca_accumulate_params* p, void* stream,
                                          qca_cuda_error* err) {
  if (!p || p->n_tensors < 0) return QCA_ERR_INVALID_ARGUMENT;
  for (int64_t t = 0; t < p->n_tensors; ++t) {
    if (p->numel[t] < 0 || (p->numel[t] > 0 && (!p->accumulators[t] || !p->grads[t])))
      return QCA_ERR_INVALID_ARGUMENT;
    if (!valid_dtype(p->accumulator_dtype[t]) || !valid_dtype(p->grad_dtype[t]))
      return QCA_ERR_UNSUPPORTED_DTYPE;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return qca_scaler_batches::plan_batches<AccumulateBatch>(
      p->numel, p->n_tensors, kSplit,
      [&](AccumulateBatch& batch, int slot, int64_t t, int64_t) {
        batch.accumulator[slot] = p->accumulators[t];
        batch.grad[slot] = p->grads[t];
        batch.numel[slot] = p->numel[t];
        batch.accumulator_dtype[slot] = (uint8_t)p->accumulator_dtype[t];
        batch.grad_dtype[slot] = (uint8_t)p->grad_dtype[t];
      },
      [&](const AccumulateBatch& batch, int entries) {
        return qca_lowmem_cuda::finish_launch(
            qca_lowmem_cuda::launch_kernel(accumulate_chunks_kernel, entries * kSplit, kThreads, 0,
                                           s, batch),
            err);
      });
}
