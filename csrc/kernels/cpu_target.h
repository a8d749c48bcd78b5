/* What the C kernels ask of the CPU and the compiler beyond C11, in one place: SIMD clones of
 * their entry points and forced inlining into them. C kernels only (the CUDA kernels never
 * include it). */
#ifndef QCA_LOWMEM_CPU_TARGET_H
#define QCA_LOWMEM_CPU_TARGET_H

/* QCA_SIMD_CLONES compiles a function three times: for AVX-512F (16 floats a vector; the
 * GroupNorm+ELU float kernels, bound by the exponential's dependency chains, took 0.7x the AVX2
 * clone's time), for AVX2 (8 floats) and for the baseline (SSE2). At load time an ifunc picks the
 * one the CPU runs: no -march flag, one binary. Every clone gives the same bits: the same IEEE
 * operations lane by lane in the same order, and C11 mode never contracts a * b + c into an FMA
 * (AVX-512F has them; tests/ops/test_c_api.py checks the library holds none). Only where the
 * build is tried, GCC on x86-64 Linux (an ifunc needs a loader that resolves it, as glibc's
 * does); elsewhere the baseline alone. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define QCA_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define QCA_SIMD_CLONES
#endif

/* A helper compiled into each caller, so into each clone of it: called, it would run its own
 * (baseline) code from every clone. Also what lets constant flag arguments fold away. */
#if defined(__GNUC__)
#define QCA_ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define QCA_ALWAYS_INLINE static inline
#endif

#endif
