// The argument check of word_checksum, shared by its CPU and CUDA launchers.
#pragma once

#include <ATen/ATen.h>

namespace bpclip {

// words: int64 of any shape; summed in their logical order (a non-contiguous view is copied).
inline at::Tensor checked_words(const at::Tensor& words) {
  TORCH_CHECK(words.scalar_type() == at::kLong, "bpclip_fast.word_checksum: words must be int64 (a tensor's bytes "
              "viewed as 64-bit words), got ", words.scalar_type());
  return words.contiguous();
}

}  // namespace bpclip
