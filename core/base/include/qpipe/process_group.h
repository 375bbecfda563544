// The process group a run computes in, as core and processors see it: rank, world size and the
// collectives processors use (docs/multirank.md). Core declares it; dist/ implements it over
// c10d (qpipe/dist/process_group.h: Gloo for CPU tensors, NCCL for CUDA tensors).
//
// Every rank must call the collectives in the same order with tensors of the same dtype.
// Failures (a peer gone, a timeout) are Error(kDistributed) with one line that names the rank
// at fault where it is known.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace qpipe {

enum class ReduceOp { kMin, kMax, kSum, kProd };

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

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
  // fail at once).
  virtual void reportFailure(const std::string& message) noexcept = 0;

  // What this rank's collectives have cost so far: calls, the bytes this rank put in (payload,
  // before padding and headers), and the wall time spent in them, waiting for peers included.
  struct Traffic {
    int64_t collectives = 0;
    int64_t bytes = 0;
    double seconds = 0;
  };
  virtual Traffic traffic() const = 0;
};

}  // namespace qpipe
