// The reusing CPU allocator (qpipe/cpu_blocks.h): reuse, its bound, LibTorch's use of it, threads.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "qpipe/cpu_blocks.h"

namespace qpipe {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

void expectWithinBound(const CpuBlockStats& s) {
  EXPECT_LE(s.liveBytes + s.cachedBytes, s.peakLiveBytes + s.peakLiveBytes / 3)
      << "live " << s.liveBytes << " cached " << s.cachedBytes << " peak " << s.peakLiveBytes;
}

TEST(CpuBlocks, AFreedBlockServesTheNextRequestOfItsSizeOrOfUpToANinthLess) {
  CpuBlockAllocator& allocator = cpuBlockAllocator();
  allocator.releaseCached();
  // From an empty cache: a block of 3 MiB + 5 pages, then requests of its size and 1/9 less.
  const size_t bytes = 3 * kMiB + 5 * 4096;
  void* first = nullptr;
  {
    c10::DataPtr block = allocator.allocate(bytes);
    first = block.get();
    std::memset(first, 7, bytes);
  }
  const CpuBlockStats before = allocator.stats();
  {
    c10::DataPtr same = allocator.allocate(bytes);
    EXPECT_EQ(same.get(), first);
  }
  {
    c10::DataPtr smaller = allocator.allocate(bytes - bytes / 9);
    EXPECT_EQ(smaller.get(), first);
  }
  const CpuBlockStats after = allocator.stats();
  EXPECT_EQ(after.reused - before.reused, 2u);
  EXPECT_EQ(after.mapped, before.mapped);

  // Far smaller is no fit: a cached 3 MiB block does not serve 1 MiB, which is mapped afresh.
  {
    c10::DataPtr small = allocator.allocate(kMiB);
    EXPECT_NE(small.get(), first);
    EXPECT_EQ(allocator.stats().mapped - after.mapped, 1u);
  }
  // Nor does a block serve a larger request.
  {
    c10::DataPtr larger = allocator.allocate(bytes + 4096);
    EXPECT_NE(larger.get(), first);
    EXPECT_EQ(allocator.stats().mapped - after.mapped, 2u);
  }
  expectWithinBound(allocator.stats());
}

TEST(CpuBlocks, SmallRequestsGoToLibTorchsAllocation) {
  CpuBlockAllocator& allocator = cpuBlockAllocator();
  const CpuBlockStats before = allocator.stats();
  {
    c10::DataPtr block = allocator.allocate(CpuBlockAllocator::kMinBytes - 1);
    ASSERT_NE(block.get(), nullptr);
    std::memset(block.get(), 1, CpuBlockAllocator::kMinBytes - 1);
    c10::DataPtr empty = allocator.allocate(0);
  }
  const CpuBlockStats after = allocator.stats();
  EXPECT_EQ(after.mapped, before.mapped);
  EXPECT_EQ(after.reused, before.reused);
  EXPECT_EQ(after.liveBytes, before.liveBytes);
  EXPECT_EQ(after.cachedBytes, before.cachedBytes);
}

TEST(CpuBlocks, HeldBytesStayWithinAThirdAboveThePeakOfLiveBytes) {
  CpuBlockAllocator& allocator = cpuBlockAllocator();
  // Live blocks of one size up to a new peak P, freed, then blocks of another size up to 0.6 P:
  // the cached ones are evicted as the new ones would pass the bound.
  const size_t first = 2 * kMiB + 4096, second = kMiB + 3 * 4096;
  const size_t count = 10 + allocator.stats().peakLiveBytes / first;
  std::vector<c10::DataPtr> blocks;
  for (size_t i = 0; i < count; ++i) blocks.push_back(allocator.allocate(first));
  const uint64_t peak = allocator.stats().peakLiveBytes;
  blocks.clear();
  const CpuBlockStats cachedAll = allocator.stats();
  EXPECT_GE(cachedAll.cachedBytes, count * first);
  for (size_t i = 0; i * second < peak * 6 / 10; ++i) {
    blocks.push_back(allocator.allocate(kMiB + 3 * 4096));
    expectWithinBound(allocator.stats());
  }
  const CpuBlockStats s = allocator.stats();
  EXPECT_GT(s.evicted, cachedAll.evicted);
  EXPECT_EQ(s.peakLiveBytes, std::max<uint64_t>(peak, s.liveBytes));
  blocks.clear();
  expectWithinBound(allocator.stats());
}

TEST(CpuBlocks, ARequestTheSystemCannotMapIsAnOutOfMemoryErrorNamingItsSize) {
  CpuBlockAllocator& allocator = cpuBlockAllocator();
  const CpuBlockStats before = allocator.stats();
  for (const size_t bytes : {size_t{1} << 60, SIZE_MAX}) {
    try {
      allocator.allocate(bytes);
      ADD_FAILURE() << bytes << " bytes were allocated";
    } catch (const c10::OutOfMemoryError& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_EQ(message.rfind("CPU out of memory: cannot allocate " + std::to_string(bytes) + " bytes", 0), 0u)
          << message;
    }
  }
  EXPECT_EQ(allocator.stats().mapped, before.mapped);
  EXPECT_EQ(allocator.stats().liveBytes, before.liveBytes);
}

TEST(CpuBlocks, ARequestThatSetsANewPeakPastTheBoundEvictsEveryCachedBlock) {
  CpuBlockAllocator& allocator = cpuBlockAllocator();
  allocator.releaseCached();
  {
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(allocator.allocate(kMiB + 7 * 4096));
  }
  const CpuBlockStats before = allocator.stats();
  ASSERT_GT(before.cachedBytes, 0u);
  // Live bytes past 4/3 of the peak so far: the cache gives way, nothing is held beside them.
  const size_t bytes = (before.peakLiveBytes + before.peakLiveBytes / 3 - before.liveBytes) + 64 * 4096;
  c10::DataPtr head = allocator.allocate(bytes);
  const CpuBlockStats after = allocator.stats();
  EXPECT_EQ(after.cachedBytes, 0u);
  EXPECT_EQ(after.peakLiveBytes, after.liveBytes);
  EXPECT_GT(after.evicted, before.evicted);
}

TEST(CpuBlocks, LibTorchAllocatesThroughItOnceInstalledAndReusesBlocks) {
  reuseLargeCpuBlocks();
  reuseLargeCpuBlocks();  // idempotent
  ASSERT_EQ(c10::GetCPUAllocator(), &cpuBlockAllocator());
  void* first = nullptr;
  {
    const at::Tensor t = at::empty({777, 1031}, at::kFloat);
    first = t.data_ptr();
  }
  const at::Tensor again = at::empty({777, 1031}, at::kFloat);
  EXPECT_EQ(again.data_ptr(), first);
  // Results are LibTorch's, whatever memory they land in.
  const at::Tensor a = at::rand({300, 400}), b = at::rand({400, 500});
  const at::Tensor reference = at::matmul(a, b).clone();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(at::matmul(a, b), reference));
  // The raw interface (oneDNN's allocations go through it).
  void* raw = c10::GetCPUAllocator()->raw_allocate(5 * kMiB);
  std::memset(raw, 3, 5 * kMiB);
  c10::GetCPUAllocator()->raw_deallocate(raw);
  void* rawSmall = c10::GetCPUAllocator()->raw_allocate(100);
  c10::GetCPUAllocator()->raw_deallocate(rawSmall);
}

TEST(CpuBlocks, ThreadsAllocateAndFreeConcurrently) {
  CpuBlockAllocator& allocator = cpuBlockAllocator();
  const uint64_t liveBefore = allocator.stats().liveBytes;
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = (1 + (i + t) % 3) * kMiB;
        c10::DataPtr block = allocator.allocate(bytes);
        auto* data = static_cast<unsigned char*>(block.get());
        std::memset(data, t + 1, bytes);
        if (data[0] != t + 1 || data[bytes - 1] != t + 1) ++failures[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
  EXPECT_EQ(allocator.stats().liveBytes, liveBefore);
  expectWithinBound(allocator.stats());
}

}  // namespace
}  // namespace qpipe
