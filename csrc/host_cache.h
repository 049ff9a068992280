// CPU output and scratch tensors of the library's ops from storages kept for reuse (csrc/cpu/host_cache.cpp).
// glibc serves a block above its mmap threshold (at most 32 MB) by a fresh mapping and returns it
// to the kernel at free, so every step faults the pages of the released gradient, the kept
// per-example gradients and the patches back in, zeroed by the kernel: on the CIFAR-10 net at batch
// 32 the noise write into the 118 MB weight gradient took 56 ms a step against 28 into touched pages.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace bpclip {

// at::empty(sizes, options), contiguous, whose bytes are as arbitrary as at::empty's: every caller
// writes each entry before reading it. A CPU tensor of at least 1 MB comes from a kept storage that
// nothing else references; anything else is at::empty's. `scratch`: a buffer its op drops before it
// returns, in the usual case (the patches), which may take any larger idle scratch storage.
at::Tensor host_empty(at::IntArrayRef sizes, const at::TensorOptions& options, bool scratch = false);

// The op _host_cache(limit, poison): limit >= 0 sets the bytes the cache may hold (0 empties it);
// poison fills every storage no tensor holds with 0xFF bytes (NaN in every float dtype), so that the
// tests can show no op reads an entry it did not write. Returns [limit, held bytes, idle bytes, storages].
std::vector<int64_t> host_cache_op(int64_t limit, bool poison);

}  // namespace bpclip
