// banded_row_'s limits, shared by its CPU and CUDA kernels, the test emulator and (as numbers)
// bpclip_fast/_ops.py: the kernel takes the recursion's weights and the outs BY VALUE (one kernel
// parameter block, no device tensor to build per row), so both counts are fixed here.
#pragma once

namespace bpclip {

// Ring slots: bands - 1, and bpclip_fast.banded.MAX_BANDS is 64.
constexpr int kBandMaxSlots = 63;
// Tensors the row is added to in the same pass: a layer's weight and bias, with room for a generic
// unit's few parameters; a caller with more adds the returned row itself.
constexpr int kBandMaxOuts = 4;

}  // namespace bpclip
