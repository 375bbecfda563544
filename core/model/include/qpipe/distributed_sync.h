// What the distributed task scheduler (scheduler/, qpipe/scheduler/task_scheduler.h,
// docs/scheduler.md) tells a module after a parallel task changed it on one rank: the task's
// record, and the interface of the second sync level, a module that brings every rank to the
// executor's state itself (a quantizer whose state is its scale and packed weight).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/process_group.h"

namespace qpipe {

class Module;

// One task after DistributedTaskScheduler::run(), in submit order.
struct TaskRecord {
  std::string taskId;  // "w<wave>_t<index in submit order>"
  int64_t wave = 0;
  std::string name;       // the task function's stable name
  int executorRank = 0;   // the rank that ran it; in a local wave every rank ran it (this rank)
  bool parallel = false;  // ran once, in a parallel wave, and was then synced to every rank
  ConfigNode result;      // the task's return value, on every rank (sent with the outcomes: keep it small)
  std::vector<std::string> dependencies;
  double execSeconds = 0;  // on the executor
  double syncSeconds = 0;  // on this rank
  int64_t syncBytes = 0;   // the tensors its sync sent (levels 2 and 3, or its own; 0 in a local wave)
  double cost = 0;         // the submitter's estimate (scheduler::Task::cost)
};

struct SyncContext {
  Module& root;  // the scheduler's root: dependencies are paths below it
  ProcessGroup& group;
};

// Level 2 of the three-level sync: a module below a parallel task's dependencies that implements
// it gives the scheduler the tensors that carry its state, instead of the default sync of all
// its parameters and buffers (or recomputes its state and gives none). Called on every rank, in
// submit order; no collectives. The scheduler sends every executor's tensors to the other ranks
// in the wave's one exchange (ProcessGroup::exchangeInPlace), then calls syncDone().
class DistributedSync {
 public:
  virtual ~DistributedSync() = default;
  // The same tensors, in the same order, with the executor's dtypes and shapes on every rank: a
  // rank that did not run the task allocates them (their values are then overwritten).
  virtual std::vector<at::Tensor> syncTensors(const TaskRecord& record, SyncContext& context) = 0;
  // After the exchange: this rank holds the executor's values.
  virtual void syncDone(const TaskRecord& /*record*/, SyncContext& /*context*/) {}
};

}  // namespace qpipe
