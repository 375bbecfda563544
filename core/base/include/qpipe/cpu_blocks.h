// LibTorch's CPU tensors of 128 KiB and more, kept for reuse instead of returned to the system.
//
// A calibration allocates the same activation-sized tensors layer after layer. glibc serves them
// from its heap, and the runner trims the heap after a layer once much of it is free, so the next
// layer faults its whole working set back in: about 3 µs and a zeroed page per 4 KiB on a 2-core
// VM, a seventh of an FP8 static calibration's CPU time (docs/benchmarks.md). Not trimming grows
// the heap by fragmentation instead (peak RSS 680 → 1044 MiB there).
//
// The allocator below maps each such block on its own and, when the block is freed, keeps it for
// the next request of the same size (up to 1/8 larger). Its bound: the bytes it holds, live and
// cached, stay within a third above the most it ever had live at once, and a request that sets a
// new peak past that first evicts every cached block; eviction takes the longest-cached first.
// So a layer that repeats the previous one's allocations faults nothing, and a larger working
// set later in the run (the model's head) finds the cache out of its way.
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>

namespace qpipe {

struct CpuBlockStats {
  uint64_t liveBytes = 0;    // mapped bytes of the blocks in use
  uint64_t cachedBytes = 0;  // mapped bytes of freed blocks kept for reuse
  uint64_t peakLiveBytes = 0;
  uint64_t reused = 0;   // requests served by a cached block
  uint64_t mapped = 0;   // requests served by a fresh mapping
  uint64_t evicted = 0;  // cached blocks returned to the system
};

// The process's allocator. Requests under kMinBytes go to LibTorch's own CPU allocation.
class CpuBlockAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kMinBytes = size_t{128} << 10;  // glibc's own default mmap threshold

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, size_t count) const override;

  CpuBlockStats stats() const;
  // Returns every cached block to the system and starts the peak afresh from the live bytes:
  // what a phase that will not see its working set again can call (the unit tests start from
  // an empty cache with it).
  void releaseCached();
};

CpuBlockAllocator& cpuBlockAllocator();

// Makes cpuBlockAllocator() LibTorch's CPU allocator for the rest of the process (idempotent).
// Tensors allocated before keep their own deleters.
void reuseLargeCpuBlocks();

}  // namespace qpipe
