// Multi-rank `qpipe quant` (docs/multirank.md): the --device list, the local launcher that runs
// one rank per listed device (a fork of the launcher, or qpipe executed again), and what a rank
// does when it fails.
//
// A process is a rank when RANK and WORLD_SIZE are in its environment (set by our launcher or by
// any other: torchrun, SLURM). Our launcher also names, in QPIPE_RANK_ERROR_FILE, a file where
// the rank leaves its one-line error, so that the parent can say which rank failed and why.
#pragma once

#include <c10/core/DeviceType.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/process_group.h"

namespace qpipe::cli {

// Keeps argv: the launcher runs the same command line in every rank.
void setCommandLine(int argc, char** argv);

// --device: cpu | cuda | cpu:0,1,… | cuda:N | cuda:0,1,…
struct DeviceList {
  std::string text;
  c10::DeviceType type = c10::DeviceType::CPU;
  std::vector<int> indices;  // as listed; empty when none was given

  // Processes the list asks for on this host: one per index (1 without an index).
  int ranks() const { return indices.empty() ? 1 : static_cast<int>(indices.size()); }
};

// Error(kUsage) naming the value for anything else, a repeated index, or a CUDA device that is
// not there.
DeviceList parseDeviceList(const std::string& text);

struct LaunchOptions {
  int worldSize = 1;
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // On failure the saver's hidden partial folder beside it is removed.
  std::filesystem::path savePath;
  // Start each rank as a fork of this process rather than a new copy of the binary, when this
  // process has a single thread (CPU ranks: no CUDA context to inherit).
  bool fork = false;
};

// The parent of a local multi-rank run: picks the rendezvous port (MASTER_PORT, else a free one),
// starts `worldSize` copies of this process with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT set, and waits for them. When one fails the others get a grace
// period (5 s at most, bounded by the timeout) and are then killed. Returns false when every rank
// exited 0; otherwise throws Error("rank R failed: <its message>" with that rank's code, or
// "rank R was killed by signal N (SIGX)") or Error(kInterrupted). Returns true in a forked rank,
// whose environment is then the rank's: it goes on as that rank.
[[nodiscard]] bool launchRanks(const LaunchOptions& options);

// What the rank flow of `qpipe quant` tells the error handler once it knows its place, and once
// it has joined its group.
void markRank(int rank, int worldSize);
void markGroup(std::shared_ptr<ProcessGroup> group);

// The top-level error handler of qpipe: reports `message` (shortened) and returns the exit code. A rank
// also writes it to its error file (under our launcher), tells its peers
// (ProcessGroup::reportFailure on the group of markGroup) and, under our launcher, leaves the final `qpipe:` line to
// the parent.
int reportFailure(ErrorCode code, const std::string& message);

}  // namespace qpipe::cli
