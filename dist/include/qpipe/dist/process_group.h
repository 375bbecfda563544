// The process group facade (DESIGN.md §5): the one place qpipe reaches c10d. Rendezvous goes
// through a TCPStore hosted by rank 0; collectives run on ProcessGroupGloo for CPU tensors and
// on ProcessGroupNCCL for CUDA tensors (when LibTorch has NCCL), chosen by the tensor's device.
//
// Every rank must call the collectives in the same order with tensors of the same dtype.
// Failures (a peer gone, a timeout, a bad rendezvous) are Error(kDistributed) with one line that
// names the rank at fault where it is known (peers publish their failures in the store).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace qpipe::dist {

enum class ReduceOp { kMin, kMax, kSum, kProd };

struct GroupOptions {
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  int rank = 0;
  int worldSize = 1;
  // Bounds the rendezvous and every collective: a rank that stops answering fails its peers
  // within this time.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// From the torchrun variables MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and
// QPIPE_DIST_TIMEOUT_S); nullopt when RANK and WORLD_SIZE are unset. A malformed or
// inconsistent value is Error(kDistributed) naming the variable.
std::optional<GroupOptions> optionsFromEnvironment();

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  // Joins the group (a real one even for a world of one). One-line Error(kDistributed) for: the
  // port in use (rank 0), the master unreachable within the timeout, ranks that disagree on the
  // world size (rank 0's counts), a rank that does not join within the timeout.
  static std::shared_ptr<ProcessGroup> connect(const GroupOptions& options);
  // The group of one process: every collective is the identity.
  static std::shared_ptr<ProcessGroup> single();

  virtual int rank() const = 0;
  virtual int worldSize() const = 0;

  virtual void allReduce(at::Tensor& tensor, ReduceOp op) = 0;
  // Every rank's tensor, in rank order. Shapes may differ between ranks; dtypes may not.
  virtual std::vector<at::Tensor> allGather(const at::Tensor& tensor) = 0;
  virtual void broadcast(at::Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;
  // Every rank's bytes, in rank order (names, serialized records).
  virtual std::vector<std::string> allGatherBytes(const std::string& bytes) = 0;

  // Tells the peers this rank failed and why, so their errors name it; never throws. For the
  // top-level error handler: it closes this rank's connections (the peers' pending collectives
  // fail at once), and rank 0, which hosts the store, waits briefly for the peers to read it.
  virtual void reportFailure(const std::string& message) noexcept = 0;

  // What this rank's collectives have cost so far: calls, the bytes this rank put in (payload,
  // before padding and headers), and the wall time spent in them, waiting for peers included.
  struct Traffic {
    int64_t collectives = 0;
    int64_t bytes = 0;
    double seconds = 0;
  };
  Traffic traffic() const { return traffic_; }

 protected:
  void account(int64_t bytes, double seconds) {
    ++traffic_.collectives;
    traffic_.bytes += bytes;
    traffic_.seconds += seconds;
  }

 private:
  Traffic traffic_;
};

// The group the process quantizes in: single() until setWorld() is called (by `qpipe quant`
// when it runs as one of several ranks); setWorld(nullptr) goes back to single().
ProcessGroup& world();
void setWorld(std::shared_ptr<ProcessGroup> group);

}  // namespace qpipe::dist
