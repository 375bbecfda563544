#include "qpipe/cpu_blocks.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

namespace qpipe {
namespace {

constexpr size_t kPage = 4096;

struct Cached {
  void* data;
  size_t bytes;
};

// The allocator's bookkeeping: one per process, reached from the static deleter LibTorch calls.
struct Blocks {
  std::mutex mutex;
  std::unordered_map<void*, size_t> live;
  std::map<uint64_t, Cached> cached;       // by the order they were freed: the first is evicted first
  std::multimap<size_t, uint64_t> bySize;  // the cached blocks' sizes → their keys in `cached`
  uint64_t frees = 0;
  CpuBlockStats stats;

  // Under the lock: the smallest cached block of at least `bytes` and at most 1/8 more, of those
  // the last freed (its pages are the likeliest still in cache); nullptr if none.
  void* takeCached(size_t bytes) {
    const auto first = bySize.lower_bound(bytes);
    if (first == bySize.end() || first->first > bytes + bytes / 8) return nullptr;
    auto last = bySize.upper_bound(first->first);
    --last;  // equal sizes keep their insertion order
    const auto block = cached.find(last->second);
    void* data = block->second.data;
    const size_t size = block->second.bytes;
    stats.cachedBytes -= size;
    cached.erase(block);
    bySize.erase(last);
    ++stats.reused;
    adopt(data, size);
    return data;
  }

  void adopt(void* data, size_t bytes) {
    live.emplace(data, bytes);
    stats.liveBytes += bytes;
    stats.peakLiveBytes = std::max(stats.peakLiveBytes, stats.liveBytes);
  }

  // Under the lock: evicts the longest-cached blocks until live + cached + `incoming` fits within
  // the bound: a third above the peak of live bytes so far, or, for a request that sets a new
  // peak past that, the new live bytes themselves (the cache gives way to a larger working set,
  // such as a model's head after its layers). Replaying a static calibration's allocations, a
  // bound of the peak itself still faulted 1.2 million pages (blocks of one size evicted for
  // another's), a third above it 80 thousand, no bound 79 thousand.
  void makeRoom(size_t incoming) {
    const uint64_t bound = std::max(stats.peakLiveBytes + stats.peakLiveBytes / 3, stats.liveBytes + incoming);
    while (!cached.empty() && stats.liveBytes + stats.cachedBytes + incoming > bound) {
      const auto oldest = cached.begin();
      const auto [from, to] = bySize.equal_range(oldest->second.bytes);
      bySize.erase(std::find_if(from, to, [&](const auto& entry) { return entry.second == oldest->first; }));
      ::munmap(oldest->second.data, oldest->second.bytes);
      stats.cachedBytes -= oldest->second.bytes;
      ++stats.evicted;
      cached.erase(oldest);
    }
  }
};

Blocks& blocks() {
  static auto* const state = new Blocks;  // never destroyed: tensors may outlive static destructors
  return *state;
}

void* allocateBlock(size_t n) {
  if (n < CpuBlockAllocator::kMinBytes) return c10::alloc_cpu(n);
  // c10's out-of-memory error type, naming the size: the CLI prints its first line.
  TORCH_CHECK_WITH(OutOfMemoryError, n <= SIZE_MAX - kPage, "CPU out of memory: cannot allocate ", n, " bytes");
  const size_t bytes = (n + kPage - 1) / kPage * kPage;
  Blocks& b = blocks();
  std::lock_guard<std::mutex> lock(b.mutex);
  if (void* data = b.takeCached(bytes)) return data;
  b.makeRoom(bytes);
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, data != MAP_FAILED, "CPU out of memory: cannot allocate ", n,
                   " bytes (mmap: ", std::strerror(errno), ")");
  b.adopt(data, bytes);
  ++b.stats.mapped;
  return data;
}

void freeBlock(void* data) {
  if (data == nullptr) return;
  Blocks& b = blocks();
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    const auto it = b.live.find(data);
    if (it != b.live.end()) {
      const uint64_t key = b.frees++;
      b.cached.emplace(key, Cached{data, it->second});
      b.bySize.emplace(it->second, key);
      b.stats.liveBytes -= it->second;
      b.stats.cachedBytes += it->second;
      b.live.erase(it);
      return;
    }
  }
  c10::free_cpu(data);
}

}  // namespace

c10::DataPtr CpuBlockAllocator::allocate(size_t n) {
  void* data = allocateBlock(n);
  return {data, data, &freeBlock, c10::Device(c10::DeviceType::CPU)};
}

c10::DeleterFnPtr CpuBlockAllocator::raw_deleter() const {
  return &freeBlock;
}

void CpuBlockAllocator::copy_data(void* dest, const void* src, size_t count) const {
  default_copy_data(dest, src, count);
}

CpuBlockStats CpuBlockAllocator::stats() const {
  Blocks& b = blocks();
  std::lock_guard<std::mutex> lock(b.mutex);
  return b.stats;
}

CpuBlockAllocator& cpuBlockAllocator() {
  static auto* const allocator = new CpuBlockAllocator;
  return *allocator;
}

void reuseLargeCpuBlocks() {
  // Above LibTorch's own registration (priority 0). The allocator is never deleted.
  static const bool installed = [] {
    c10::SetCPUAllocator(&cpuBlockAllocator(), 1);
    return true;
  }();
  (void)installed;
}

}  // namespace qpipe
