// The tail of a backpropagation-clipping layer's backward (op layer_tail_): the weight's and the
// bias' noise, the bias gradient's sum over the rows and the input clipping's VJP in one launch.
// What the CPU kernel and the CUDA kernel must agree on, bit for bit.
#pragma once

#include <stdint.h>

namespace bpclip {

// The bias gradient b_j = sum_r rows[r, j] is summed in double in kTailSlices interleaved slices
// (slice k: rows k, k + kTailSlices, ..., ascending), the slices then added in order 0..kTailSlices-1,
// and rounded once to b's dtype: on a GPU the slices are the warps of one block (a block per 32
// columns, each warp's loads one coalesced row segment), on the CPU the same order, so both give
// the same bits.
constexpr int kTailSlices = 8;

// Above this many rows the layer sums the bias with ATen instead (csrc/layers.cpp): a block per 32
// columns would leave each warp rows / kTailSlices dependent loads, where a reduction over more
// blocks finishes sooner than the launch it saves.
constexpr int64_t kTailBiasRowsMax = 2048;
constexpr bool tail_sums_bias(int64_t rows) { return rows <= kTailBiasRowsMax; }

}  // namespace bpclip
