// Qualifiers for code shared by the CPU and CUDA backends (and the test-only emulator).
#pragma once

#if defined(__CUDACC__)
#define BPCLIP_HD __host__ __device__
#else
#define BPCLIP_HD
#endif
