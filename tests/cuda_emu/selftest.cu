// Small kernels that exercise the emulator itself: correct ones whose results the tests know, and
// broken ones each check must report (tests/ops/test_cuda_emulator.py). Built like the kernel files.
#include "qca_cuda_common.cuh"

using qca_lowmem_cuda::launch_kernel;

namespace {

// Sums each block's slice of `in` through a shared-memory tree; without the barriers inside the
// loop, threads read partial sums other threads are still writing.
template <bool kBarrier>
__global__ void tree_sum_kernel(const float* in, float* out) {
  QCA_SHARED(float, partial, 1024);
  const int t = threadIdx.x;
  partial[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (t < stride) partial[t] += partial[t + stride];
    if (kBarrier) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

__global__ void warp_ops_kernel(int* out, int width) {
  const int t = threadIdx.x;
  const int v = t * 10 + 1;
  int* o = out + 8 * t;
  o[0] = __shfl_sync(0xffffffffu, v, 3, width);
  o[1] = __shfl_up_sync(0xffffffffu, v, 2, width);
  o[2] = __shfl_down_sync(0xffffffffu, v, 5, width);
  o[3] = __shfl_xor_sync(0xffffffffu, v, 6, width);
  o[4] = (int)__ballot_sync(0xffffffffu, t % 3 == 0);
  o[5] = __any_sync(0xffffffffu, t == 37);
  o[6] = __all_sync(0xffffffffu, t < 60);
  o[7] = __syncthreads_count(t % 5 == 0) * 10000 + __syncthreads_or(t == 40) * 100 +
         __syncthreads_and(t < 1000);
}

__global__ void shuffle_double_kernel(double* out) {
  const double v = 1.0 + threadIdx.x / 3.0;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, v, 1);
}

// kind 0: different barriers on the two halves of the block; 1: half the block returns first;
// 2: a shuffle whose mask leaves out lanes that call it; 3: a shuffle whose mask names lanes that
// never call it; 4: lanes of one warp split between a shuffle and a barrier.
__global__ void broken_sync_kernel(int kind, int* out) {
  const int t = threadIdx.x, lane = t % 32;
  int v = t;
  switch (kind) {
    case 0:
      if (t < (int)blockDim.x / 2) __syncthreads();
      else __syncthreads();
      break;
    case 1:
      if (t >= (int)blockDim.x / 2) return;
      __syncthreads();
      break;
    case 2: v = __shfl_down_sync(0x0000ffffu, v, 1); break;
    case 3:
      if (lane < 8) v = __shfl_sync(0x0000ffffu, v, 0);
      break;
    case 4:
      if (lane < 16) v = __shfl_down_sync(0xffffffffu, v, 1);
      else __syncthreads();
      break;
  }
  out[t] = v;
}

// Every thread adds one to a shared counter, atomically or not.
template <bool kAtomic>
__global__ void shared_count_kernel(int* out) {
  QCA_SHARED(int, count, 1);
  if (threadIdx.x == 0) count[0] = 0;
  __syncthreads();
  if (kAtomic) atomicAdd(&count[0], 1);
  else count[0] += 1;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = count[0];
}

// Lanes of one warp swap values through shared memory, ordered by __syncwarp or not at all.
template <bool kSyncWarp>
__global__ void warp_exchange_kernel(int* out) {
  QCA_SHARED(int, slots, 32);
  slots[threadIdx.x] = (int)threadIdx.x;
  if (kSyncWarp) __syncwarp();
  out[threadIdx.x] = slots[31 - threadIdx.x];
}

__global__ void uninitialized_read_kernel(float* out) {
  QCA_SHARED(float, never_written, 32);
  out[threadIdx.x] = never_written[threadIdx.x];
}

// Each thread appends its global index to `log` as it runs.
__global__ void order_kernel(int* log, unsigned int* next) {
  log[atomicAdd(next, 1u)] = (int)(blockIdx.x * blockDim.x + threadIdx.x);
}

__global__ void empty_kernel() {}

__global__ void big_static_shared_kernel(double* out) {
  QCA_SHARED(double, big, 7000);  // 56,000 bytes: over the 48 KiB of static shared memory
  big[threadIdx.x] = 1.0;
  __syncthreads();
  out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x];
}

// Reverses `in` within each block through dynamic shared memory.
__global__ void dynamic_reverse_kernel(const float* in, float* out) {
  QCA_DYNAMIC_SHARED(float, buffer);
  const int t = threadIdx.x, n = blockDim.x;
  buffer[t] = in[blockIdx.x * n + t];
  __syncthreads();
  out[blockIdx.x * n + t] = buffer[n - 1 - t];
}

// Many barriers and little else: the cost of switching between threads.
__global__ void barrier_loop_kernel(int iterations, int* out) {
  int sum = 0;
  for (int i = 0; i < iterations; ++i) {
    sum += i;
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

}  // namespace

extern "C" {

int selftest_tree_sum(int barrier, const float* in, float* out, int blocks, int threads) {
  return barrier ? launch_kernel(tree_sum_kernel<true>, blocks, threads, 0, nullptr, in, out)
                 : launch_kernel(tree_sum_kernel<false>, blocks, threads, 0, nullptr, in, out);
}

int selftest_warp_ops(int* out, int threads, int width) {
  return launch_kernel(warp_ops_kernel, 1, threads, 0, nullptr, out, width);
}

int selftest_shuffle_double(double* out) {
  return launch_kernel(shuffle_double_kernel, 1, 32, 0, nullptr, out);
}

int selftest_broken_sync(int kind, int* out, int threads) {
  return launch_kernel(broken_sync_kernel, 1, threads, 0, nullptr, kind, out);
}

int selftest_shared_count(int atomic, int* out, int blocks, int threads) {
  return atomic ? launch_kernel(shared_count_kernel<true>, blocks, threads, 0, nullptr, out)
                : launch_kernel(shared_count_kernel<false>, blocks, threads, 0, nullptr, out);
}

int selftest_warp_exchange(int syncwarp, int* out) {
  return syncwarp ? launch_kernel(warp_exchange_kernel<true>, 1, 32, 0, nullptr, out)
                  : launch_kernel(warp_exchange_kernel<false>, 1, 32, 0, nullptr, out);
}

int selftest_uninitialized_read(float* out) {
  return launch_kernel(uninitialized_read_kernel, 1, 32, 0, nullptr, out);
}

int selftest_order(int* log, unsigned int* next, int blocks, int threads) {
  return launch_kernel(order_kernel, blocks, threads, 0, nullptr, log, next);
}

int selftest_empty(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   int64_t smem) {
  return launch_kernel(empty_kernel, dim3(gx, gy, gz), dim3(bx, by, bz), (size_t)smem, nullptr);
}

int selftest_big_static_shared(double* out) {
  return launch_kernel(big_static_shared_kernel, 1, 64, 0, nullptr, out);
}

// opt_in > 0: cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, opt_in) first.
int selftest_dynamic_reverse(const float* in, float* out, int blocks, int threads, int64_t smem,
                             int opt_in) {
  if (opt_in > 0) {
    const cudaError_t e =
        cudaFuncSetAttribute(dynamic_reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, opt_in);
    if (e != cudaSuccess) return e;
  }
  return launch_kernel(dynamic_reverse_kernel, blocks, threads, (size_t)smem, nullptr, in, out);
}

int selftest_barrier_loop(int iterations, int* out, int blocks, int threads) {
  return launch_kernel(barrier_loop_kernel, blocks, threads, 0, nullptr, iterations, out);
}

int selftest_multiprocessor_count(int* sms) { return qca_lowmem_cuda::multiprocessor_count(sms); }

unsigned short selftest_float_to_half(float f) { return __float2half_rn(f).x; }
unsigned short selftest_float_to_bfloat16(float f) { return __float2bfloat16_rn(f).x; }
float selftest_half_to_float(unsigned short h) { return __half2float(__half{h}); }
float selftest_bfloat16_to_float(unsigned short h) { return __bfloat162float(__nv_bfloat16{h}); }

}  // extern "C"
