// Hot CPU loops are compiled for AVX-512 and AVX2 as well as the x86-64 baseline (SSE2) and the
// best clone is chosen at load time (GCC function multi-versioning); no -march=native, so one
// binary runs everywhere. The build passes -ffp-contract=off, so no clone fuses a*b+c: together
// with explicit accumulators (never a reassociated sum) every clone rounds exactly like the
// others, and the noise stream is the same on every machine.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BPCLIP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BPCLIP_VECTOR_CLONES
#endif
