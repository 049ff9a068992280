// CPU kernel of word_checksum (bpclip_fast/checksum.h): one pass over the words, split across
// threads; the partial sums add up modulo 2^64 to the same bits in any order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <functional>

#include "../checksum_args.h"
#include "bpclip_fast/checksum.h"

namespace bpclip {
namespace {

at::Tensor word_checksum_cpu(const at::Tensor& words) {
  const at::Tensor w = checked_words(words);
  const int64_t* p = w.const_data_ptr<int64_t>();
  const uint64_t sum = at::parallel_reduce(
      0, w.numel(), 1 << 16, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t acc) {
        for (int64_t i = begin; i < end; ++i) acc += checksum_term(p[i]);
        return acc;
      },
      std::plus<uint64_t>());
  at::Tensor out = at::empty({}, w.options());
  out.mutable_data_ptr<int64_t>()[0] = static_cast<int64_t>(sum);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("word_checksum", &word_checksum_cpu); }

}  // namespace bpclip
