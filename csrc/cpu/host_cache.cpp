// The CPU storage cache behind host_empty (csrc/host_cache.h says why it exists).
//
// Why reuse cannot expose a tensor's bytes: a storage is handed out only while the cache holds its
// only strong reference and no weak one (intrusive_ptr use_count 1, weak_use_count 1). A tensor
// made from it, or a view of that tensor, or anything sharing the storage holds a strong reference;
// a weak reference (StorageWeakRef) is refused too, since it could be promoted later. Nothing but
// the cache can create a reference to a storage only the cache holds, and it does so under its
// mutex, so the check and the hand-out are one step. A caller that keeps an old gradient (`old =
// p.grad`, a view of it, a numpy array of it) keeps its storage out of reuse.
// A storage Python has seen as a storage (t.untyped_storage(), torch.save, copy.deepcopy, a
// StorageWeakRef, pickling for torch.multiprocessing, share_memory_; until review 15 the library's
// own overlap check ran untyped_storage() on every banded release) has a Python object that holds
// it strongly for as long as any C++ reference does (PyTorch's PyObject preservation,
// c10/util/intrusive_ptr.h). With the cache's own reference that is forever: never idle, never
// evicted, never freed (review 15 found a banded run pinning one released gradient a step). The
// cache lets go of such a storage at its next look, so the storage lives and dies as at::empty's
// would; and one that Python moved into shared memory, which another process may map, is never
// written again by a later op.
// What a handed-out storage contains is whatever its last user wrote, as arbitrary as at::empty's
// (whose heap blocks hold freed data too): every caller of host_empty writes each entry it reads.
#include "../host_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/safe_numerics.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <list>
#include <mutex>
#include <vector>

namespace bpclip {
namespace {

constexpr int64_t kHostCacheMinBytes = 1 << 20;  // smaller blocks come from glibc's heap, already touched
constexpr int64_t kDefaultLimit = int64_t{1} << 30;

struct HostCache {
  struct Held {
    c10::intrusive_ptr<c10::StorageImpl> storage;
    bool scratch;  // host_empty's `scratch`: reused by scratch requests only, at any larger size
  };
  using Storages = std::vector<c10::intrusive_ptr<c10::StorageImpl>>;

  std::mutex mu;
  int64_t limit = kDefaultLimit;
  std::list<Held> held;  // most recently handed out first

  static bool idle(const Held& h) { return h.storage.use_count() == 1 && h.storage.weak_use_count() == 1; }
  static int64_t bytes_of(const Held& h) { return static_cast<int64_t>(h.storage->nbytes()); }

  // Moves out of the cache, into `out`, the storages Python has seen and those a resize emptied; the
  // caller destroys `out` after the mutex is released: dropping what may be the last C++ reference
  // decrefs the Python object, which takes the GIL, and a thread holding the GIL may be waiting for
  // the mutex.
  void let_go(Storages& out) {
    for (auto it = held.begin(); it != held.end();) {
      if (it->storage->pyobj_slot()->load_pyobj() != nullptr || it->storage->nbytes() == 0) {
        out.push_back(std::move(it->storage));
        it = held.erase(it);
      } else {
        ++it;
      }
    }
  }

  int64_t held_bytes() const {
    int64_t total = 0;
    for (const auto& h : held) total += bytes_of(h);
    return total;
  }

  // Drops idle storages, least recently handed out first, until the cache holds at most `target`.
  void shrink_to(int64_t target) {
    int64_t total = held_bytes();
    for (auto it = held.end(); total > target && it != held.begin();) {
      --it;
      if (!idle(*it)) continue;
      total -= bytes_of(*it);
      it = held.erase(it);
    }
  }

  // An output: the idle output storage with the fewest bytes >= nbytes, at most 1.5x nbytes (a
  // Poisson batch's tensors differ by a few percent step to step; a much larger one, such as a
  // weight gradient idle between zero_grad and its release, is left to its own size). Scratch: the
  // smallest idle scratch storage >= nbytes at any size, and a new one replaces the idle scratch
  // storages (all smaller), so an op's chunks and the layers' patches of a step share one.
  c10::intrusive_ptr<c10::StorageImpl> take(int64_t nbytes, bool scratch, Storages& seen) {
    std::lock_guard<std::mutex> lock(mu);
    let_go(seen);
    auto best = held.end();
    for (auto it = held.begin(); it != held.end(); ++it) {
      const int64_t have = bytes_of(*it);
      if (it->scratch != scratch || have < nbytes || (!scratch && have > nbytes + nbytes / 2) || !idle(*it)) continue;
      if (best == held.end() || have < bytes_of(*best)) best = it;
    }
    if (best != held.end()) {
      // The last user's writes (another thread's, its decrement a release) before ours.
      std::atomic_thread_fence(std::memory_order_acquire);
      held.splice(held.begin(), held, best);
      return held.front().storage;
    }
    if (scratch) held.remove_if([](const Held& h) { return h.scratch && idle(h); });
    shrink_to(limit - nbytes);
    if (held_bytes() + nbytes > limit) return {};
    held.push_front({c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                           c10::GetCPUAllocator(), /*resizable=*/true),
                     scratch});
    return held.front().storage;
  }
};

HostCache& cache() {
  static HostCache* c = [] {
    auto* made = new HostCache();  // never destroyed: no exit-order dependence on the allocator
    // A fork while another thread holds the mutex would leave the child's copy locked for good (a
    // DataLoader worker that runs an op would hang): the forking thread holds it across the fork.
    pthread_atfork([] { cache().mu.lock(); }, [] { cache().mu.unlock(); }, [] { cache().mu.unlock(); });
    return made;
  }();
  return *c;
}

}  // namespace

at::Tensor host_empty(at::IntArrayRef sizes, const at::TensorOptions& options, bool scratch) {
  const bool plain = options.device().is_cpu() && !options.pinned_memory() && options.layout() == at::kStrided &&
                     (!options.has_memory_format() || *options.memory_format_opt() == at::MemoryFormat::Contiguous);
  uint64_t bytes = 0;  // at::empty checks the sizes and raises on an overflow; an overflow here goes to it
  const bool overflow = std::any_of(sizes.begin(), sizes.end(), [](int64_t n) { return n < 0; }) ||
                        c10::safe_multiplies_u64(sizes, &bytes) ||
                        c10::mul_overflows(bytes, static_cast<uint64_t>(c10::elementSize(
                                                      c10::typeMetaToScalarType(options.dtype()))), &bytes) ||
                        bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  const int64_t nbytes = static_cast<int64_t>(bytes);
  if (!plain || overflow || nbytes < kHostCacheMinBytes) return at::empty(sizes, options);
  HostCache::Storages seen;  // destroyed after take's lock is released
  c10::intrusive_ptr<c10::StorageImpl> storage = cache().take(nbytes, scratch, seen);
  if (!storage) return at::empty(sizes, options);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(storage)),
                                                          c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

std::vector<int64_t> host_cache_op(int64_t limit, bool poison) {
  HostCache& c = cache();
  HostCache::Storages seen;  // declared first: destroyed after the lock is released
  std::lock_guard<std::mutex> lock(c.mu);
  c.let_go(seen);
  if (limit >= 0) {
    c.limit = limit;
    c.shrink_to(limit);
  }
  int64_t idle_bytes = 0;
  for (auto& h : c.held) {
    if (!HostCache::idle(h)) continue;
    idle_bytes += HostCache::bytes_of(h);
    if (poison) std::memset(h.storage->mutable_data(), 0xFF, h.storage->nbytes());
  }
  return {c.limit, c.held_bytes(), idle_bytes, static_cast<int64_t>(c.held.size())};
}

}  // namespace bpclip
