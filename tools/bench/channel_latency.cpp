// One rank of tools/bench/channel_latency.sh: the latency of qpipe's own process group (the
// scheduler's collectives) between the ranks of this host, through the shared-memory channel or,
// with QPIPE_DIST_SHM=0, over Gloo and the TCPStore. Rank 0 prints one line a measurement:
// "<name> <median ms> <p90 ms> <mean ms>", and for the exchange its bandwidth.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "qpipe/dist/process_group.h"
#include "qpipe/error.h"

namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Busy work on this core, as a task between two waves.
void work(double ms) {
  const auto start = Clock::now();
  volatile double sink = 0;
  while (msSince(start) < ms) sink = sink + 1.0;
}

void report(const qpipe::ProcessGroup& group, const char* name, std::vector<double> ms) {
  if (group.rank() != 0) return;
  std::sort(ms.begin(), ms.end());
  const double mean = std::accumulate(ms.begin(), ms.end(), 0.0) / static_cast<double>(ms.size());
  std::printf("%s %.4f %.4f %.4f\n", name, ms[ms.size() / 2], ms[ms.size() * 9 / 10], mean);
}

template <typename Body>
std::vector<double> timed(qpipe::ProcessGroup& group, int iterations, double workMs, const Body& body) {
  std::vector<double> ms;
  for (int i = 0; i < iterations; ++i) {
    work(workMs);
    const auto start = Clock::now();
    body(i);
    ms.push_back(msSince(start));
  }
  group.barrier();
  return ms;
}

}  // namespace

int main() {
  try {
    const auto options = qpipe::dist::optionsFromEnvironment();
    QPIPE_REQUIRE(options, qpipe::ErrorCode::kUsage, "RANK and WORLD_SIZE are not set; run channel_latency.sh");
    at::set_num_threads(1);
    const auto group = qpipe::dist::connect(*options);
    if (group->rank() == 0) std::printf("shared_memory %d\n", qpipe::dist::sharesHostMemory(*group) ? 1 : 0);
    const std::string part(16, 'x');
    timed(*group, 200, 0, [&](int) { group->allGatherBytesWithin(part, 16); });  // warm-up
    report(*group, "gather_back_to_back", timed(*group, 2000, 0, [&](int) { group->allGatherBytesWithin(part, 16); }));
    report(*group, "gather_after_2ms_work",
           timed(*group, 300, 2, [&](int) { group->allGatherBytesWithin(part, 16); }));
    report(*group, "claim", timed(*group, 2000, 0, [&](int) { group->counterAdd("bench", 1); }));
    // A float-product chunk set of a smoothing search: 2.4 MB a rank.
    constexpr int64_t kFloats = 600'000;
    std::vector<std::vector<at::Tensor>> parts;
    for (int r = 0; r < group->worldSize(); ++r) parts.push_back({at::full({kFloats}, static_cast<float>(r))});
    const std::vector<double> exchange = timed(*group, 100, 0, [&](int) { group->exchangeInPlace(parts); });
    report(*group, "exchange_2.4MB", exchange);
    if (group->rank() == 0) {
      std::vector<double> sorted = exchange;
      std::sort(sorted.begin(), sorted.end());
      const double bytes = static_cast<double>(kFloats) * 4 * (group->worldSize() - 1);
      std::printf("exchange_GBps %.2f\n", bytes / (sorted[sorted.size() / 2] / 1000) / 1e9);
    }
    for (int r = 0; r < group->worldSize(); ++r) {
      QPIPE_CHECK(at::equal(parts[static_cast<size_t>(r)][0], at::full({kFloats}, static_cast<float>(r))),
                  "the exchange delivered other values from rank ", r);
    }
    return 0;
  } catch (const qpipe::Error& e) {
    std::fprintf(stderr, "channel_latency: %s\n", e.what());
    return static_cast<int>(e.code());
  }
}
