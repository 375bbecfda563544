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
  // The same for exchanges whose size the ranks can bound alike: one collective where no rank
  // passes more than `slot` bytes, two where one does (the overflow follows), against
  // allGatherBytes' two always (the sizes, then the bytes). Every rank passes the same slot, and
  // every rank sends slot bytes: a slot far above what the ranks pass wastes bandwidth.
  virtual std::vector<std::string> allGatherBytesWithin(const std::string& bytes, int64_t /*slot*/) {
    return allGatherBytes(bytes);
  }
  // Every rank's tensors to every other rank, received in place: parts[r] holds rank r's
  // tensors, on rank r the values to send, on the others tensors of the same dtypes and sizes to
  // fill. Point to point where the group can (Gloo, CPU tensors): no padding, no staging copy of
  // a large tensor, about twice an all-gather's bandwidth on one host (docs/scheduler.md). Every
  // rank first sees every rank's view of each part's size: where two views differ, every rank
  // fails with the same message. Returns false, on every rank alike and before any tensor moved,
  // where the group cannot (another backend, a CUDA tensor): the caller then packs the tensors
  // into allGatherBytesWithin.
  virtual bool exchangeInPlace(const std::vector<std::vector<at::Tensor>>& /*parts*/) { return false; }

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

  // Adds `delta` to the group's counter `key` (in the c10d store: one counter for every rank, on
  // any node) and returns its new value; a counter starts at 0. Not a collective: a rank calls it
  // whenever it wants, so it is allowed inside a parallel task. The scheduler's dynamic assignment
  // takes task indices from it.
  virtual int64_t counterAdd(const std::string& key, int64_t delta) = 0;

  // A value in the same store, for handing bytes from one rank to another outside collectives:
  // storeSet writes `key`; storeGet waits until some rank has set it (up to the group's timeout;
  // a failed peer's report ends the wait at once) and returns it. Not collectives either, so both
  // are allowed inside a parallel task, where a rank that waits must know that the setter gets
  // there without waiting on it (the runner's probe chain over split layers, docs/scheduler.md).
  virtual void storeSet(const std::string& key, const std::string& value) = 0;
  virtual std::string storeGet(const std::string& key) = 0;
};

// This thread runs one task of a parallel wave of the scheduler (scheduler/, docs/scheduler.md):
// the ranks run different tasks there, so a collective would wait for peers that never call it.
// Every ProcessGroup implementation calls check() first in each collective.
class ParallelTaskScope {
 public:
  explicit ParallelTaskScope(std::string task);
  ~ParallelTaskScope();
  ParallelTaskScope(const ParallelTaskScope&) = delete;
  ParallelTaskScope& operator=(const ParallelTaskScope&) = delete;

  // Error(kPlugin) naming the task and `collective` when called inside a scope.
  static void check(const char* collective);
  // Whether this thread runs inside a parallel task (a scheduler there runs its waves locally).
  static bool active();

 private:
  std::string task_;
  const std::string* outer_;
};

}  // namespace qpipe
