// The SIMT emulator's runtime: fibers, the block scheduler, barriers, warp collectives, shared
// memory poisoning, the bounds-check handler and launch statistics. See simt.h for the model.
#include "simt.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

namespace simt {

ThreadIds* g_thread = nullptr;
BlockIds g_block{};

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kMaxThreads = 1024;

enum class State { kReady, kAtBarrier, kInCollective, kDone };

struct Fiber {
  ucontext_t ctx;
  ThreadIds ids;
  State state = State::kDone;
  std::source_location where;  // where it waits
  uint64_t result = 0;         // a collective's or barrier's result for this thread
  char* stack = nullptr;
};

// A warp collective waiting for the rest of its mask.
struct Pending {
  Collective op;
  unsigned mask = 0, arrived = 0;
  int width = 32;
  std::source_location where;
  uint64_t value[kWarp] = {};
  int arg[kWarp] = {};
};

struct Runtime {
  std::vector<Fiber> fibers;
  std::vector<int> ready;
  std::vector<std::vector<Pending>> pending;  // per warp
  int live = 0, at_barrier = 0, block_threads = 0;
  BarrierOp barrier_op = BarrierOp::kPlain;
  int barrier_acc = 0;
  std::source_location barrier_where;
  ucontext_t scheduler;
  int current = -1;
  const Launch* launch = nullptr;
  Policy policy = Policy::kInOrder;
  uint64_t seed = 0;
  std::mt19937_64 rng;
  uint64_t launch_counter = 0;
  std::string error;
  std::map<std::string, std::vector<uint64_t>> stats;
};

Runtime& rt() {
  static Runtime r;
  return r;
}

const char* collective_name(Collective op) {
  switch (op) {
    case Collective::kShflIdx: return "__shfl_sync";
    case Collective::kShflUp: return "__shfl_up_sync";
    case Collective::kShflDown: return "__shfl_down_sync";
    case Collective::kShflXor: return "__shfl_xor_sync";
    case Collective::kBallot: return "__ballot_sync";
    case Collective::kAny: return "__any_sync";
    case Collective::kAll: return "__all_sync";
    case Collective::kSyncwarp: return "__syncwarp";
  }
  return "?";
}

std::string at(const std::source_location& w) {
  std::ostringstream s;
  const char* f = w.file_name();
  const char* slash = strrchr(f, '/');
  s << (slash ? slash + 1 : f) << ":" << w.line();
  return s.str();
}

std::string who() {
  const Runtime& r = rt();
  std::ostringstream s;
  s << "block (" << g_block.block_idx.x << "," << g_block.block_idx.y << "," << g_block.block_idx.z << ")";
  if (r.current >= 0) {
    const ThreadIds& t = r.fibers[r.current].ids;
    s << " thread (" << t.thread_idx.x << "," << t.thread_idx.y << "," << t.thread_idx.z << ") [warp " << t.warp
      << " lane " << t.lane << "]";
  }
  return s.str();
}

std::string kernel_name(const void* kernel) {
  Dl_info info;
  if (dladdr(kernel, &info) == 0 || info.dli_sname == nullptr) {
    std::ostringstream s;
    s << "<kernel at " << kernel << ">";
    return s.str();
  }
  int status = 0;
  char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = status == 0 && d ? d : info.dli_sname;
  free(d);
  return name;
}

// The TLS block of this library holds every __shared__ variable (and nothing else: the runtime
// uses no thread_local), so poisoning it gives each block uninitialised shared memory.
struct TlsBlock {
  unsigned char* data = nullptr;
  size_t size = 0;
};

int find_tls_size(dl_phdr_info* info, size_t, void* out) {
  Dl_info self;
  dladdr(reinterpret_cast<void*>(&find_tls_size), &self);
  if (reinterpret_cast<void*>(info->dlpi_addr) != self.dli_fbase) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) *static_cast<size_t*>(out) = info->dlpi_phdr[i].p_memsz;
  }
  return 1;
}

}  // namespace

// Touches a thread_local of this library, so that this thread's TLS block of it exists.
extern "C" void simt_touch_tls() {
  static thread_local unsigned char anchor;
  __atomic_store_n(&anchor, 0, __ATOMIC_RELAXED);
}

namespace {

TlsBlock tls_block() {
  static TlsBlock block = [] {
    TlsBlock b;
    simt_touch_tls();  // make sure this thread's block is allocated
    Dl_info self;
    dladdr(reinterpret_cast<void*>(&simt_touch_tls), &self);
    void* handle = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle != nullptr) {
      dlinfo(handle, RTLD_DI_TLS_DATA, &b.data);
      dlclose(handle);
    }
    dl_iterate_phdr(find_tls_size, &b.size);
    return b;
  }();
  return block;
}

void fiber_main() {
  Runtime& r = rt();
  r.launch->invoke(r.launch->closure);
  // Thread exit: lanes that others wait for in a collective can never arrive.
  Fiber& f = r.fibers[r.current];
  f.state = State::kDone;
  --r.live;
  const unsigned bit = 1u << f.ids.lane;
  for (const Pending& p : r.pending[f.ids.warp]) {
    if ((p.mask & bit) && !(p.arrived & bit)) {
      fail(who() + " exited, but lanes of its warp wait for it in " + collective_name(p.op) + " at " +
           at(p.where) + " (its mask names this lane)");
    }
  }
  // Exited threads no longer count for __syncthreads (as on sm_70 and later).
  if (r.at_barrier > 0 && r.at_barrier == r.live) {
    for (Fiber& o : r.fibers) {
      if (o.state == State::kAtBarrier) {
        o.state = State::kReady;
        r.ready.push_back(static_cast<int>(&o - r.fibers.data()));
      }
    }
    r.at_barrier = 0;
  }
  swapcontext(&f.ctx, &r.scheduler);
}

// Switch from the running fiber back to the scheduler (the fiber has recorded why it waits).
void yield_to_scheduler() {
  Runtime& r = rt();
  swapcontext(&r.fibers[r.current].ctx, &r.scheduler);
}

int pick(std::vector<int>& ready) {
  Runtime& r = rt();
  size_t k = 0;
  if (r.policy == Policy::kRandom) {
    k = std::uniform_int_distribution<size_t>(0, ready.size() - 1)(r.rng);
  } else {
    for (size_t i = 1; i < ready.size(); ++i) {
      const bool better = r.policy == Policy::kInOrder ? ready[i] < ready[k] : ready[i] > ready[k];
      if (better) k = i;
    }
  }
  const int id = ready[k];
  ready[k] = ready.back();
  ready.pop_back();
  return id;
}

std::string describe_waiters() {
  Runtime& r = rt();
  std::ostringstream s;
  int shown = 0;
  for (const Fiber& f : r.fibers) {
    if (f.state != State::kAtBarrier && f.state != State::kInCollective) continue;
    if (shown++ == 4) {
      s << "; ...";
      break;
    }
    s << (shown > 1 ? "; " : "") << "warp " << f.ids.warp << " lane " << f.ids.lane << " waits at " << at(f.where);
  }
  return s.str();
}

bool run_block(unsigned bx, unsigned by, unsigned bz) {
  Runtime& r = rt();
  g_block.block_idx = {bx, by, bz};
  const TlsBlock tls = tls_block();
  if (tls.data != nullptr) memset(tls.data, 0xff, tls.size);
  const int n = r.block_threads;
  r.ready.clear();
  for (auto& p : r.pending) p.clear();
  r.live = n;
  r.at_barrier = 0;
  for (int i = 0; i < n; ++i) {
    Fiber& f = r.fibers[i];
    f.state = State::kReady;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    r.ready.push_back(i);
  }
  while (r.live > 0) {
    if (!r.error.empty()) return false;
    if (r.ready.empty()) {
      r.error = "deadlock in " + who() + ": no thread can run (" + describe_waiters() + ")";
      return false;
    }
    r.current = pick(r.ready);
    g_thread = &r.fibers[r.current].ids;
    swapcontext(&r.scheduler, &r.fibers[r.current].ctx);
    r.current = -1;
    g_thread = nullptr;
  }
  return r.error.empty();
}

}  // namespace

void fail(const std::string& message) {
  Runtime& r = rt();
  if (r.error.empty()) r.error = message;
  if (r.current >= 0) {
    // Abandon the fiber: the scheduler sees the error and stops the launch.
    r.fibers[r.current].state = State::kDone;
    swapcontext(&r.fibers[r.current].ctx, &r.scheduler);
  }
  // Outside a launch (harness code): the error is recorded and reported by the caller; there is
  // no fiber to abandon, so stop the process rather than continue past an invalid access.
  std::fprintf(stderr, "simt: %s\n", message.c_str());
  std::abort();
}

bool has_error() { return !rt().error.empty(); }

std::string take_error() {
  std::string e;
  std::swap(e, rt().error);
  return e;
}

void set_schedule(Policy policy, uint64_t seed) {
  rt().policy = policy;
  rt().seed = seed;
}

void reset_stats() { rt().stats.clear(); }

std::string stats_json() {
  std::ostringstream s;
  s << "{";
  bool first = true;
  for (const auto& [name, v] : rt().stats) {
    s << (first ? "" : ",") << "\"";
    for (char c : name) s << (c == '"' || c == '\\' ? "\\" : "") << c;
    s << "\":[" << v[0] << "," << v[1] << "," << v[2] << "]";
    first = false;
  }
  s << "}";
  return s.str();
}

size_t dynamic_shared_capacity() { return kDynamicSharedBytes; }

void run(const Launch& l) {
  Runtime& r = rt();
  if (!r.error.empty()) return;  // sticky, like a CUDA error
  const uint64_t threads = uint64_t(l.block.x) * l.block.y * l.block.z;
  const uint64_t blocks = uint64_t(l.grid.x) * l.grid.y * l.grid.z;
  if (threads == 0 || threads > kMaxThreads || blocks == 0) {
    r.error = "invalid launch configuration: " + std::to_string(blocks) + " blocks of " + std::to_string(threads) +
              " threads (" + kernel_name(l.kernel) + ")";
    return;
  }
  if (l.dynamic_shared > dynamic_shared_capacity()) {
    r.error = "launch asks for " + std::to_string(l.dynamic_shared) + " bytes of dynamic shared memory; the emulator has " +
              std::to_string(dynamic_shared_capacity());
    return;
  }
  auto& st = r.stats[kernel_name(l.kernel)];
  if (st.empty()) st.assign(3, 0);
  st[0] += 1;
  st[1] += blocks;
  st[2] += blocks * threads;

  // Fibers as the launches need them, not kMaxThreads at once: each costs two mappings (stack, guard
  // page), and every library the mutant tests load keeps its own (kMaxThreads of them, 26 libraries
  // went past vm.max_map_count = 65530 and the process's next mmap failed).
  if (r.fibers.size() < static_cast<size_t>(threads)) {
    const size_t had = r.fibers.size();
    r.fibers.resize(static_cast<size_t>(threads));
    for (size_t i = had; i < r.fibers.size(); ++i) {
      Fiber& f = r.fibers[i];
      // A guard page below each stack turns an overflow into a crash rather than corruption.
      void* mem = mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
      if (mem == MAP_FAILED) {
        std::fprintf(stderr, "simt: cannot map fiber stacks\n");
        std::abort();
      }
      mprotect(mem, 4096, PROT_NONE);
      f.stack = static_cast<char*>(mem) + 4096;
    }
  }
  r.launch = &l;
  r.block_threads = static_cast<int>(threads);
  g_block.block_dim = l.block;
  g_block.grid_dim = l.grid;
  r.pending.assign((threads + kWarp - 1) / kWarp, {});
  for (int i = 0; i < static_cast<int>(threads); ++i) {
    ThreadIds& t = r.fibers[i].ids;
    t.linear = i;
    t.thread_idx = {static_cast<unsigned>(i % l.block.x), static_cast<unsigned>((i / l.block.x) % l.block.y),
                    static_cast<unsigned>(i / (l.block.x * l.block.y))};
    t.warp = i / kWarp;
    t.lane = i % kWarp;
  }
  r.rng.seed(r.seed * 0x9e3779b97f4a7c15ull + (++r.launch_counter));
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  if (r.policy == Policy::kReverse) std::reverse(order.begin(), order.end());
  if (r.policy == Policy::kRandom) std::shuffle(order.begin(), order.end(), r.rng);
  for (uint64_t b : order) {
    const unsigned bx = static_cast<unsigned>(b % l.grid.x);
    const unsigned by = static_cast<unsigned>((b / l.grid.x) % l.grid.y);
    const unsigned bz = static_cast<unsigned>(b / (uint64_t(l.grid.x) * l.grid.y));
    if (!run_block(bx, by, bz)) break;
  }
  r.launch = nullptr;
}

int block_barrier(BarrierOp op, int predicate, const std::source_location& where) {
  Runtime& r = rt();
  if (r.current < 0) fail("__syncthreads outside a kernel");
  Fiber& f = r.fibers[r.current];
  if (r.at_barrier == 0) {
    r.barrier_where = where;
    r.barrier_op = op;
    r.barrier_acc = op == BarrierOp::kAnd ? 1 : 0;
  } else if (where.line() != r.barrier_where.line() || strcmp(where.file_name(), r.barrier_where.file_name()) != 0 ||
             op != r.barrier_op) {
    fail("divergent barrier in " + who() + ": it waits at " + at(where) + " while other threads wait at " +
         at(r.barrier_where));
  }
  if (op == BarrierOp::kCount) r.barrier_acc += predicate;
  if (op == BarrierOp::kAnd) r.barrier_acc &= predicate;
  if (op == BarrierOp::kOr) r.barrier_acc |= predicate;
  f.state = State::kAtBarrier;
  f.where = where;
  if (++r.at_barrier == r.live) {
    for (Fiber& o : r.fibers) {
      if (o.state == State::kAtBarrier) {
        o.state = State::kReady;
        o.result = static_cast<uint64_t>(r.barrier_acc);
        if (&o != &f) r.ready.push_back(static_cast<int>(&o - r.fibers.data()));
      }
    }
    r.at_barrier = 0;
    // The last to arrive goes on only when the scheduler picks it again, like everyone else.
    r.ready.push_back(r.current);
  }
  yield_to_scheduler();
  return static_cast<int>(f.result);
}

namespace {

// Source lane of a shuffle, or -1 for "keep your own value" (CUDA's out-of-segment rule).
int source_lane(Collective op, int lane, int arg, int width) {
  const int seg = lane & ~(width - 1);
  switch (op) {
    case Collective::kShflIdx: return seg + (((arg % width) + width) % width);
    case Collective::kShflUp: return lane - arg < seg ? -1 : lane - arg;
    case Collective::kShflDown: return lane + arg >= seg + width ? -1 : lane + arg;
    case Collective::kShflXor: {
      const int src = lane ^ arg;
      return src >= seg + width || src < 0 || src >= kWarp ? -1 : src;
    }
    default: return -1;
  }
}

void complete(Pending& p, std::vector<Fiber>& fibers, int warp) {
  uint64_t ballot = 0;
  for (int lane = 0; lane < kWarp; ++lane) {
    if ((p.mask >> lane) & 1u) ballot |= uint64_t(p.value[lane] != 0) << lane;
  }
  for (int lane = 0; lane < kWarp; ++lane) {
    if (!((p.mask >> lane) & 1u)) continue;
    Fiber& f = fibers[warp * kWarp + lane];
    uint64_t out = 0;
    switch (p.op) {
      case Collective::kBallot: out = ballot; break;
      case Collective::kAny: out = ballot != 0; break;
      case Collective::kAll: out = ballot == p.mask; break;
      case Collective::kSyncwarp: out = 0; break;
      default: {
        const int src = source_lane(p.op, lane, p.arg[lane], p.width);
        if (src < 0) {
          out = p.value[lane];
        } else if (!((p.mask >> src) & 1u)) {
          // On a GPU the value read from a lane outside the mask is undefined.
          fail(std::string(collective_name(p.op)) + " at " + at(p.where) + ": lane " + std::to_string(lane) +
               " of warp " + std::to_string(warp) + " reads lane " + std::to_string(src) +
               ", which is not in the mask " + std::to_string(p.mask) + " (undefined value on a GPU)");
        } else {
          out = p.value[src];
        }
      }
    }
    f.result = out;
  }
}

}  // namespace

uint64_t warp_collective(Collective op, unsigned mask, uint64_t value, int arg, int width,
                         const std::source_location& where) {
  Runtime& r = rt();
  if (r.current < 0) fail(std::string(collective_name(op)) + " outside a kernel");
  Fiber& f = r.fibers[r.current];
  const int warp = f.ids.warp, lane = f.ids.lane;
  const unsigned bit = 1u << lane;
  const std::string name = collective_name(op);
  if (!(mask & bit)) fail(name + " at " + at(where) + " in " + who() + ": the mask does not name the calling lane");
  if (width <= 0 || width > kWarp || (width & (width - 1)) != 0) {
    fail(name + " at " + at(where) + ": width " + std::to_string(width) + " is not a power of 2 up to 32");
  }
  // Every lane the mask names must exist and not have exited.
  for (int l = 0; l < kWarp; ++l) {
    if (!((mask >> l) & 1u)) continue;
    const int t = warp * kWarp + l;
    if (t >= r.block_threads || r.fibers[t].state == State::kDone) {
      fail(name + " at " + at(where) + " in " + who() + ": the mask names lane " + std::to_string(l) +
           (t >= r.block_threads ? ", which does not exist" : ", which has exited"));
    }
  }
  auto& list = r.pending[warp];
  Pending* p = nullptr;
  for (Pending& q : list) {
    if (q.mask & mask) {
      if (q.mask != mask || q.op != op) {
        fail("lanes of warp " + std::to_string(warp) + " meet different collectives: " + name + " at " + at(where) +
             " (mask " + std::to_string(mask) + ") and " + collective_name(q.op) + " at " + at(q.where) +
             " (mask " + std::to_string(q.mask) + ")");
      }
      p = &q;
    }
  }
  if (p == nullptr) {
    list.emplace_back();
    p = &list.back();
    p->op = op;
    p->mask = mask;
    p->width = width;
    p->where = where;
  } else if (p->width != width) {
    fail(name + " at " + at(where) + ": lanes disagree on the width");
  }
  p->value[lane] = value;
  p->arg[lane] = arg;
  p->arrived |= bit;
  f.state = State::kInCollective;
  f.where = where;
  if (p->arrived == p->mask) {
    complete(*p, r.fibers, warp);
    const unsigned done = p->mask;
    list.erase(list.begin() + (p - list.data()));
    for (int l = 0; l < kWarp; ++l) {
      if ((done >> l) & 1u) {
        Fiber& o = r.fibers[warp * kWarp + l];
        o.state = State::kReady;
        r.ready.push_back(warp * kWarp + l);
      }
    }
  }
  yield_to_scheduler();
  return f.result;
}

}  // namespace simt

// ---- the bounds-check handler of -fsanitize=bounds ----------------------------------------------
// The kernels are compiled with -fsanitize=bounds but linked without the UBSan runtime: these
// definitions receive its reports (GCC's handler ABI: source location, array and index types).
namespace {
struct SourceLocation {
  const char* file;
  uint32_t line, column;
};
struct TypeDescriptor {
  uint16_t kind, info;
  char name[1];
};
struct OutOfBoundsData {
  SourceLocation loc;
  const TypeDescriptor* array_type;
  const TypeDescriptor* index_type;
};

void report_out_of_bounds(const OutOfBoundsData* d, uintptr_t index) {
  // Integer indices no wider than a pointer are passed by value; bit 0 of info says signed.
  const bool is_signed = d->index_type->kind == 0 && (d->index_type->info & 1);
  const int bits = d->index_type->kind == 0 ? 1 << (d->index_type->info >> 1) : 64;
  std::ostringstream s;
  if (is_signed && bits < 64 && ((index >> (bits - 1)) & 1)) {
    s << static_cast<int64_t>(index | (~uintptr_t(0) << bits));
  } else if (is_signed) {
    s << static_cast<int64_t>(index);
  } else {
    s << index;
  }
  const char* f = d->loc.file;
  const char* slash = strrchr(f, '/');
  simt::fail(std::string("out-of-bounds index ") + s.str() + " into " + d->array_type->name + " at " +
             (slash ? slash + 1 : f) + ":" + std::to_string(d->loc.line));
}
}  // namespace

extern "C" void __ubsan_handle_out_of_bounds(const OutOfBoundsData* d, uintptr_t index) {
  report_out_of_bounds(d, index);
}
extern "C" void __ubsan_handle_out_of_bounds_abort(const OutOfBoundsData* d, uintptr_t index) {
  report_out_of_bounds(d, index);
}

// ---- C ABI for the Python tests (ctypes) ----------------------------------------------------------
extern "C" {

void simt_set_schedule(int policy, uint64_t seed) { simt::set_schedule(static_cast<simt::Policy>(policy), seed); }

// The sticky error, cleared by the call ("" if none).
const char* simt_take_error() {
  static std::string e;
  e = simt::take_error();
  return e.c_str();
}

const char* simt_stats() {
  static std::string s;
  s = simt::stats_json();
  return s.c_str();
}

void simt_reset_stats() { simt::reset_stats(); }

}  // extern "C"
