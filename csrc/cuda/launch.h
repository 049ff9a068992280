// The one way our CUDA kernels are launched: on the current stream, with the launch checked.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <climits>
#include <utility>

namespace bpclip {
namespace cuda {

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), int64_t blocks, int threads, Args&&... args) {
  if (blocks <= 0) return;
  TORCH_CHECK(blocks <= INT_MAX, "bpclip_fast: tensor too large for one launch (", blocks, " blocks)");
  kernel<<<static_cast<unsigned>(blocks), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// c10's storage types -> CUDA's, for the kernels (which see only CUDA types).
template <typename T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<c10::Half> {
  using type = __half;
};
template <>
struct DeviceType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename T>
auto dev_ptr(T* p) {
  return reinterpret_cast<typename DeviceType<std::remove_const_t<T>>::type*>(p);
}
template <typename T>
auto dev_ptr(const T* p) {
  return reinterpret_cast<const typename DeviceType<T>::type*>(p);
}

}  // namespace cuda
}  // namespace bpclip
