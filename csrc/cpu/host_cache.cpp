// The CPU storage cache behind host_empty (csrc/host_cache.h says why it exists).
//
// Why reuse cannot expose a tensor's bytes: a storage is handed out only while the cache holds its
// only strong reference and no weak one (intrusive_ptr use_count 1, weak_use_count 1). A tensor
// made from it, or a view of that tensor, or anything sharing the storage holds a strong reference;
// a weak reference (StorageWeakRef) is refused too, since it could be promoted later. Nothing but
// the cache can create a reference to a storage only the cache holds, and it does so under its
// mutex, so the check and the hand-out are one step. A caller that keeps an old gradient
// (`old = p.grad`, a view of it, a numpy array of it) keeps its storage out of reuse.
// What a handed-out storage contains is whatever its last user wrote, as arbitrary as at::empty's
// (whose heap blocks hold freed data too): every caller of host_empty writes each entry it reads.
#include "../host_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <cstring>
#include <list>
#include <mutex>

namespace bpclip {
namespace {

constexpr int64_t kHostCacheMinBytes = 1 << 20;  // smaller blocks come from glibc's heap, already touched
constexpr int64_t kDefaultLimit = int64_t{1} << 30;

struct HostCache {
  std::mutex mu;
  int64_t limit = kDefaultLimit;
  std::list<c10::intrusive_ptr<c10::StorageImpl>> held;  // most recently handed out first

  static bool idle(const c10::intrusive_ptr<c10::StorageImpl>& s) {
    return s.use_count() == 1 && s.weak_use_count() == 1;
  }

  int64_t held_bytes() const {
    int64_t total = 0;
    for (const auto& s : held) total += static_cast<int64_t>(s->nbytes());
    return total;
  }

  // Drops idle storages, least recently handed out first, until the cache holds at most `target`.
  void shrink_to(int64_t target) {
    int64_t total = held_bytes();
    for (auto it = held.end(); total > target && it != held.begin();) {
      --it;
      if (!idle(*it)) continue;
      total -= static_cast<int64_t>((*it)->nbytes());
      it = held.erase(it);
    }
  }

  // The idle storage with the fewest bytes >= nbytes, at most 1.5x nbytes (a Poisson batch's
  // tensors differ by a few percent step to step; a much larger one is left to its own size).
  c10::intrusive_ptr<c10::StorageImpl> take(int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu);
    auto best = held.end();
    for (auto it = held.begin(); it != held.end(); ++it) {
      const int64_t have = static_cast<int64_t>((*it)->nbytes());
      if (have < nbytes || have > nbytes + nbytes / 2 || !idle(*it)) continue;
      if (best == held.end() || have < static_cast<int64_t>((*best)->nbytes())) best = it;
    }
    if (best != held.end()) {
      held.splice(held.begin(), held, best);
      return held.front();
    }
    shrink_to(limit - nbytes);
    if (held_bytes() + nbytes > limit) return {};
    held.push_front(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                          c10::GetCPUAllocator(), /*resizable=*/true));
    return held.front();
  }
};

HostCache& cache() {
  static HostCache* c = new HostCache();  // never destroyed: no exit-order dependence on the allocator
  return *c;
}

}  // namespace

at::Tensor host_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const bool plain = options.device().is_cpu() && !options.pinned_memory() && options.layout() == at::kStrided &&
                     (!options.has_memory_format() || *options.memory_format_opt() == at::MemoryFormat::Contiguous);
  const int64_t numel = c10::multiply_integers(sizes);
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  if (!plain || nbytes < kHostCacheMinBytes) return at::empty(sizes, options);
  c10::intrusive_ptr<c10::StorageImpl> storage = cache().take(nbytes);
  if (!storage) return at::empty(sizes, options);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(storage)),
                                                          c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

std::vector<int64_t> host_cache_op(int64_t limit, bool poison) {
  HostCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (limit >= 0) {
    c.limit = limit;
    c.shrink_to(limit);
  }
  int64_t idle_bytes = 0;
  for (auto& s : c.held) {
    if (!HostCache::idle(s)) continue;
    idle_bytes += static_cast<int64_t>(s->nbytes());
    if (poison) std::memset(s->mutable_data(), 0xFF, s->nbytes());
  }
  return {c.limit, c.held_bytes(), idle_bytes, static_cast<int64_t>(c.held.size())};
}

}  // namespace bpclip
