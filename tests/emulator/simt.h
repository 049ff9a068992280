// A SIMT emulator for tests: the host compiler builds unmodified CUDA device code against this
// header and runs it on the CPU with CUDA's execution model. Test-only; not part of the package.
//
// Model (see docs/design.md, "The SIMT emulator"):
// - A launch runs its blocks one after another (in a scheduled order); the threads of a block are
//   fibers (ucontext) on one OS thread. A fiber runs until it reaches a synchronisation point
//   (__syncthreads*, a warp collective) or returns; the scheduler then picks the next ready fiber
//   by the launch policy: in order, reversed, or seeded-random. Lanes of a warp are NOT run in
//   lockstep (Volta's independent thread scheduling): code that relies on implicit warp
//   synchrony is as wrong here as on a GPU.
// - __shared__ variables are thread_local statics of the kernel library: all of them (static, and
//   the storage behind `extern __shared__`) live in its TLS block, which is poisoned (0xFF bytes:
//   NaN, -1) before every block, so a read before the write that a barrier should order sees
//   garbage. Indexing a statically sized __shared__ array out of range is caught by
//   -fsanitize=bounds, whose handler (simt.cpp) reports it as a launch error.
// - Warp collectives rendezvous the lanes named in their mask. Reading a lane outside the mask, a
//   mask that does not name the caller, a lane of the mask that exits or meets a different
//   collective, a barrier reached at different places, and deadlocks are launch errors.
// - Atomics are atomic because fibers only switch at synchronisation points.
// Errors are sticky, like CUDA's: the failing launch stops and later launches are skipped until
// simt::take_error() is called.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cstddef>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers -------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Block-scope thread_local has static storage (shared by the fibers of the running block) and is
// valid after `extern` too, unlike `static`.
#define __shared__ thread_local
#define __constant__
#define __grid_constant__
#define warpSize 32

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace simt {

constexpr int kWarp = 32;

struct ThreadIds {
  uint3 thread_idx;
  int linear, warp, lane;
};
struct BlockIds {
  uint3 block_idx;
  dim3 block_dim, grid_dim;
};
extern ThreadIds* g_thread;  // the running fiber's ids
extern BlockIds g_block;     // the running block's ids

// ---- errors and statistics --------------------------------------------------------------------
[[noreturn]] void fail(const std::string& message);  // inside a fiber: abandons the launch
bool has_error();
std::string take_error();  // returns and clears the sticky error ("" if none)

enum class Policy : int { kInOrder = 0, kReverse = 1, kRandom = 2 };
void set_schedule(Policy policy, uint64_t seed);
std::string stats_json();  // {"<demangled kernel>": [launches, blocks, threads], ...}
void reset_stats();

// ---- launches ---------------------------------------------------------------------------------
struct Launch {
  void (*invoke)(void* closure);
  void* closure;
  const void* kernel;  // for the kernel's name (dladdr)
  dim3 grid, block;
  size_t dynamic_shared;
};
void run(const Launch& launch);

// `extern __shared__ T name[]` needs storage: one SIMT_DYNAMIC_SHARED(namespace, name) per name, in a
// source file of its own (a different type there than in the kernel's declaration is fine for the
// linker, not for one translation unit). Kernels that use the same name share the storage.
constexpr size_t kDynamicSharedBytes = 48 * 1024;
size_t dynamic_shared_capacity();
#define SIMT_DYNAMIC_SHARED(ns, name) \
  namespace ns {                      \
  thread_local __attribute__((aligned(16))) unsigned char name[::simt::kDynamicSharedBytes]; \
  }

// kernel<<<grid, block, dynamic_shared>>>(args...): arguments are converted to the kernel's
// parameter types once, and every thread receives its own copy (a by-value call), as on a GPU.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t dynamic_shared, Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "simt::launch: wrong number of kernel arguments");
  std::tuple<std::decay_t<KArgs>...> params(std::forward<Args>(args)...);
  auto body = [&] { std::apply(kernel, params); };
  const Launch l{[](void* c) { (*static_cast<decltype(body)*>(c))(); }, &body,
                 reinterpret_cast<const void*>(kernel), grid, block, dynamic_shared};
  run(l);
}

// ---- synchronisation --------------------------------------------------------------------------
enum class Collective : int { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncwarp };
uint64_t warp_collective(Collective op, unsigned mask, uint64_t value, int arg, int width,
                         const std::source_location& where);
enum class BarrierOp : int { kPlain, kCount, kAnd, kOr };
int block_barrier(BarrierOp op, int predicate, const std::source_location& where);

template <typename T>
T shuffle(Collective op, unsigned mask, T var, int arg, int width, const std::source_location& where) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "simt: shuffles move at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &var, sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width, where);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace simt

#define threadIdx (::simt::g_thread->thread_idx)
#define blockIdx (::simt::g_block.block_idx)
#define blockDim (::simt::g_block.block_dim)
#define gridDim (::simt::g_block.grid_dim)

// ---- intrinsics -------------------------------------------------------------------------------
using simt_where = std::source_location;

inline void __syncthreads(simt_where w = simt_where::current()) {
  simt::block_barrier(simt::BarrierOp::kPlain, 0, w);
}
inline int __syncthreads_count(int p, simt_where w = simt_where::current()) {
  return simt::block_barrier(simt::BarrierOp::kCount, p != 0, w);
}
inline int __syncthreads_and(int p, simt_where w = simt_where::current()) {
  return simt::block_barrier(simt::BarrierOp::kAnd, p != 0, w);
}
inline int __syncthreads_or(int p, simt_where w = simt_where::current()) {
  return simt::block_barrier(simt::BarrierOp::kOr, p != 0, w);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, simt_where w = simt_where::current()) {
  simt::warp_collective(simt::Collective::kSyncwarp, mask, 0, 0, warpSize, w);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src, int width = warpSize, simt_where w = simt_where::current()) {
  return simt::shuffle(simt::Collective::kShflIdx, mask, var, src, width, w);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, simt_where w = simt_where::current()) {
  return simt::shuffle(simt::Collective::kShflUp, mask, var, static_cast<int>(delta), width, w);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   simt_where w = simt_where::current()) {
  return simt::shuffle(simt::Collective::kShflDown, mask, var, static_cast<int>(delta), width, w);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, simt_where w = simt_where::current()) {
  return simt::shuffle(simt::Collective::kShflXor, mask, var, lane_mask, width, w);
}
inline unsigned __ballot_sync(unsigned mask, int p, simt_where w = simt_where::current()) {
  return static_cast<unsigned>(simt::warp_collective(simt::Collective::kBallot, mask, p != 0, 0, warpSize, w));
}
inline int __any_sync(unsigned mask, int p, simt_where w = simt_where::current()) {
  return static_cast<int>(simt::warp_collective(simt::Collective::kAny, mask, p != 0, 0, warpSize, w));
}
inline int __all_sync(unsigned mask, int p, simt_where w = simt_where::current()) {
  return static_cast<int>(simt::warp_collective(simt::Collective::kAll, mask, p != 0, 0, warpSize, w));
}

// Atomics: fibers switch only at synchronisation points, so a plain read-modify-write is atomic.
namespace simt {
template <typename T, typename F>
T atomic_update(T* p, F new_value) {
  const T old = *p;
  *p = new_value(old);
  return old;
}
}  // namespace simt
template <typename T>
T atomicAdd(T* p, std::type_identity_t<T> v) {
  return simt::atomic_update(p, [v](T old) -> T { return old + v; });
}
template <typename T>
T atomicSub(T* p, std::type_identity_t<T> v) {
  return simt::atomic_update(p, [v](T old) -> T { return old - v; });
}
template <typename T>
T atomicExch(T* p, std::type_identity_t<T> v) {
  return simt::atomic_update(p, [v](T) -> T { return v; });
}
template <typename T>
T atomicMin(T* p, std::type_identity_t<T> v) {
  return simt::atomic_update(p, [v](T old) -> T { return v < old ? v : old; });
}
template <typename T>
T atomicMax(T* p, std::type_identity_t<T> v) {
  return simt::atomic_update(p, [v](T old) -> T { return v > old ? v : old; });
}
template <typename T>
T atomicCAS(T* p, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
  const T old = *p;
  if (old == compare) *p = v;
  return old;
}
template <typename T>
T atomicOr(T* p, std::type_identity_t<T> v) {
  const T old = *p;
  *p = old | v;
  return old;
}
template <typename T>
T atomicAnd(T* p, std::type_identity_t<T> v) {
  const T old = *p;
  *p = old & v;
  return old;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <typename T>
T __ldg(const T* p) {
  return *p;
}

// Math intrinsics: the correctly rounded ones are the IEEE operations; the fast approximations
// (__expf, __logf, ...) are emulated by the accurate functions, so a kernel that depends on their
// exact error is not reproduced bit-for-bit.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline double rsqrt(double a) { return 1.0 / sqrt(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }
inline float __sinf(float a) { return sinf(a); }
inline float __cosf(float a) { return cosf(a); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : (a == a ? a : 0.0f)); }
// Bit casts (memcpy: defined behaviour, compiled to a register move).
namespace simt {
template <typename To, typename From>
inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}
}  // namespace simt
inline unsigned __float_as_uint(float a) { return simt::bit_cast<unsigned>(a); }
inline int __float_as_int(float a) { return simt::bit_cast<int>(a); }
inline float __uint_as_float(unsigned u) { return simt::bit_cast<float>(u); }
inline float __int_as_float(int u) { return simt::bit_cast<float>(u); }
inline long long __double_as_longlong(double a) { return simt::bit_cast<long long>(a); }
inline double __longlong_as_double(long long u) { return simt::bit_cast<double>(u); }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(unsigned v) { return v == 0 ? 32 : __builtin_clz(v); }
inline int __clzll(unsigned long long v) { return v == 0 ? 64 : __builtin_clzll(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __ffsll(unsigned long long v) { return __builtin_ffsll(static_cast<long long>(v)); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
