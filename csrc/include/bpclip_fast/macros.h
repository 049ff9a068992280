// Qualifiers for code shared by the CPU and CUDA backends (and the test-only emulator).
#pragma once

#if defined(__CUDACC__)
#define BPCLIP_HD __host__ __device__
#else
#define BPCLIP_HD
#endif

// For the small functions of the noise's inner loop (Box-Muller and its parts): inlined everywhere.
// The CPU kernel's AVX-512/AVX2 clones vectorise only with them inlined, and GCC's inliner gave up
// on plain `inline` once a further caller appeared (a 7x slower philox_noise_ on the CPU, seen in
// bench.launches' host times, 2026-11-27). Forcing it changes no rounding (-ffp-contract=off).
#if defined(__CUDACC__)
#define BPCLIP_HD_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define BPCLIP_HD_INLINE inline __attribute__((always_inline))
#else
#define BPCLIP_HD_INLINE inline
#endif
