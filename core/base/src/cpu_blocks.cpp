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
#include <vector>

namespace qpipe {
namespace {

constexpr size_t kPage = 4096;

struct Cached {
  void* data;
  size_t bytes;
  std::multimap<size_t, uint64_t>::iterator bySize;
};

// The allocator's bookkeeping: one per process, reached from the static deleter LibTorch calls.
// Evicted blocks are unmapped after the lock is released where that is safe, so evict() returns them.
struct Blocks {
  std::mutex mutex;
  std::unordered_map<void*, size_t> live;
  std::map<uint64_t, Cached> cached;       // by the order they were freed: the first is evicted first
  std::multimap<size_t, uint64_t> bySize;  // the cached blocks' sizes → their keys in `cached`
  uint64_t frees = 0;
  CpuBlockStats stats;

  // The smallest cached block of at least `bytes` and at most 1/8 more, of those the last freed
  // (its pages are the likeliest still in cache), made live; nullptr if none.
  void* takeCached(size_t bytes) {
    const auto first = bySize.lower_bound(bytes);
    if (first == bySize.end() || first->first > bytes + bytes / 8) return nullptr;
    auto last = bySize.upper_bound(first->first);
    --last;  // equal sizes keep their insertion order
    const auto block = cached.find(last->second);
    const Cached taken = block->second;
    live.emplace(taken.data, taken.bytes);  // may throw: nothing has changed yet
    stats.cachedBytes -= taken.bytes;
    cached.erase(block);
    bySize.erase(last);
    ++stats.reused;
    countLive(taken.bytes);
    return taken.data;
  }

  // Caches a freed block; false if the bookkeeping cannot grow (a deleter must not throw: the
  // caller unmaps the block instead).
  bool keep(void* data, size_t bytes) noexcept {
    try {
      const uint64_t key = frees++;
      const auto size = bySize.emplace(bytes, key);
      try {
        cached.emplace(key, Cached{data, bytes, size});
      } catch (...) {
        bySize.erase(size);
        throw;
      }
    } catch (...) {
      return false;
    }
    stats.cachedBytes += bytes;
    return true;
  }

  // Counts a fresh mapping as live; false if the bookkeeping cannot grow.
  bool adopt(void* data, size_t bytes) noexcept {
    try {
      live.emplace(data, bytes);
    } catch (...) {
      return false;
    }
    countLive(bytes);
    ++stats.mapped;
    return true;
  }

  void countLive(size_t bytes) {
    stats.liveBytes += bytes;
    stats.peakLiveBytes = std::max(stats.peakLiveBytes, stats.liveBytes);
  }

  // Takes the longest-cached blocks out until live + cached + `incoming` is within a third above
  // the peak of live bytes so far, or the cache is empty (a request that sets a new peak past
  // that bound: the cache gives way to the larger working set, such as a model's head after its
  // layers). Replaying a static calibration's allocations, a bound of the peak itself still
  // faulted 1.2 million pages (blocks of one size evicted for another's), a third above it 80
  // thousand, no bound 79 thousand. Returns the blocks for the caller to unmap.
  std::vector<Cached> evict(size_t incoming, bool all) {
    const uint64_t bound = stats.peakLiveBytes + stats.peakLiveBytes / 3;
    std::vector<Cached> out;
    while (!cached.empty() && (all || stats.liveBytes + stats.cachedBytes + incoming > bound)) {
      const auto oldest = cached.begin();
      out.push_back(oldest->second);
      bySize.erase(oldest->second.bySize);
      stats.cachedBytes -= oldest->second.bytes;
      ++stats.evicted;
      cached.erase(oldest);
    }
    return out;
  }
};

Blocks& blocks() {
  static auto* const state = new Blocks;  // never destroyed: tensors may outlive static destructors
  return *state;
}

void unmap(const std::vector<Cached>& evicted) {
  for (const Cached& block : evicted) ::munmap(block.data, block.bytes);
}

void* mapFresh(size_t bytes) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return data == MAP_FAILED ? nullptr : data;
}

void* allocateBlock(size_t n) {
  if (n < CpuBlockAllocator::kMinBytes) return c10::alloc_cpu(n);
  // c10's out-of-memory error type, naming the size: the CLI prints its first line.
  TORCH_CHECK_WITH(OutOfMemoryError, n <= SIZE_MAX - kPage, "CPU out of memory: cannot allocate ", n, " bytes");
  const size_t bytes = (n + kPage - 1) / kPage * kPage;
  Blocks& b = blocks();
  std::vector<Cached> evicted;
  void* data = nullptr;
  int error = 0;
  {
    // The mapping is made and counted under the lock: two requests that each evicted enough for
    // themselves would pass the bound together.
    std::lock_guard<std::mutex> lock(b.mutex);
    if (void* reused = b.takeCached(bytes)) return reused;
    evicted = b.evict(bytes, false);
    data = mapFresh(bytes);
    if (data == nullptr) {  // the cache's memory may be what the system lacks
      unmap(evicted);
      evicted = b.evict(bytes, true);
      unmap(evicted);
      evicted.clear();
      data = mapFresh(bytes);
    }
    error = errno;
    if (data != nullptr && !b.adopt(data, bytes)) {
      ::munmap(data, bytes);
      data = nullptr;
      error = ENOMEM;
    }
  }
  unmap(evicted);
  TORCH_CHECK_WITH(OutOfMemoryError, data != nullptr, "CPU out of memory: cannot allocate ", n,
                   " bytes (mmap: ", std::strerror(error), ")");
  return data;
}

void freeBlock(void* data) {
  // Large blocks are whole pages; LibTorch's own small allocations rarely are, and skip the lock.
  if (data == nullptr || reinterpret_cast<uintptr_t>(data) % kPage != 0) {
    c10::free_cpu(data);
    return;
  }
  Blocks& b = blocks();
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    const auto it = b.live.find(data);
    if (it != b.live.end()) {
      bytes = it->second;
      b.live.erase(it);
      b.stats.liveBytes -= bytes;
      if (b.keep(data, bytes)) return;
    }
  }
  if (bytes != 0) {
    ::munmap(data, bytes);
  } else {
    c10::free_cpu(data);  // a small allocation that happened to start a page
  }
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

void CpuBlockAllocator::releaseCached() {
  Blocks& b = blocks();
  std::vector<Cached> evicted;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    evicted = b.evict(0, true);
    b.stats.peakLiveBytes = b.stats.liveBytes;
  }
  unmap(evicted);
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
