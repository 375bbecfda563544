// The c10d process group (docs/multirank.md): the one place qpipe reaches c10d, implementing
// core's ProcessGroup (qpipe/process_group.h). Rendezvous goes
// through a TCPStore hosted by rank 0; collectives run on ProcessGroupGloo for CPU tensors and
// on ProcessGroupNCCL for CUDA tensors (when LibTorch has NCCL), chosen by the tensor's device.
//
// Every rank must call the collectives in the same order with tensors of the same dtype.
// Failures (a peer gone, a timeout, a bad rendezvous) are Error(kDistributed) with one line that
// names the rank at fault where it is known (peers publish their failures in the store).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/process_group.h"

namespace qpipe::dist {

struct GroupOptions {
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  int rank = 0;
  int worldSize = 1;
  // Bounds the rendezvous and every collective: a rank that stops answering fails its peers
  // within this time.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // This rank's place among the ranks on its host (LOCAL_RANK; LOCAL_WORLD_SIZE when set).
  int localRank = 0;
  std::optional<int> localWorldSize;
};

// QPIPE_DIST_TIMEOUT_S as a duration; nullopt when unset. A malformed value is Error(kUsage)
// naming the variable.
std::optional<std::chrono::milliseconds> timeoutFromEnvironment();

// From the torchrun variables MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE: the one place they are parsed; nullopt when RANK and WORLD_SIZE are unset. A
// malformed or inconsistent value is Error(kDistributed) naming the variable. The timeout is
// `timeout` (--dist_timeout) where given, else QPIPE_DIST_TIMEOUT_S, else the default.
std::optional<GroupOptions> optionsFromEnvironment(std::optional<std::chrono::milliseconds> timeout = std::nullopt);

// Whether ranks on one host may share memory (QPIPE_DIST_SHM: unset or 1, yes; 0, no); any other
// value is Error(kUsage) naming the variable.
bool sharedMemoryAllowed();

// Joins the group (a real one even for a world of one). One-line Error(kDistributed) for: the
// port in use (rank 0), the master unreachable within the timeout, ranks that disagree on the
// world size (rank 0's counts), a rank that does not join within the timeout. Sets SIGPIPE to
// be ignored in this process, so that writing to a failed peer's socket is an error, not death.
std::shared_ptr<ProcessGroup> connect(const GroupOptions& options);

// Whether `group` (from connect) carries its small gathers and counters through memory shared by
// its ranks, all on this host (QPIPE_DIST_SHM=0 turns that off; docs/multirank.md).
bool sharesHostMemory(const ProcessGroup& group);

}  // namespace qpipe::dist
