// CUDA launcher of banded_row_: checks and dtype dispatch. The launch itself is band_launch.cuh
// (shared with the test emulator), the kernel band_kernels.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../band_args.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "band_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

void banded_row_cuda(at::Tensor& ring, at::TensorList outs, at::IntArrayRef starts, int64_t newest,
                     at::ArrayRef<double> weights, int64_t seed, int64_t offset, double stdv) {
  const int slots = check_banded_row_args(ring, outs, starts, newest, weights, stdv);
  const int64_t P = ring.size(1);
  if (P == 0) return;
  const c10::cuda::CUDAGuard guard(ring.device());
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES(ring.scalar_type(), "banded_row_cuda", [&] {
    BandRowArgs<scalar_t> a{};
    for (int k = 0; k < slots; ++k) a.weights[k] = static_cast<scalar_t>(weights[k]);
    a.n_outs = static_cast<int>(outs.size());
    for (int k = 0; k < a.n_outs; ++k) {
      a.outs[k] = outs[k].mutable_data_ptr<scalar_t>();
      a.starts[k] = starts[k];
      a.ends[k] = starts[k] + outs[k].numel();
    }
    a.stdv = static_cast<scalar_t>(stdv);
    a.slots = slots;
    a.newest = static_cast<int>(newest);
    banded_row_device<scalar_t>(ring.mutable_data_ptr<scalar_t>(), P, static_cast<uint64_t>(seed),
                                static_cast<uint64_t>(offset), a, sm_count);
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("banded_row_", &cuda::banded_row_cuda); }

}  // namespace bpclip
