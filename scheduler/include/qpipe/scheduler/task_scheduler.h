// The distributed task scheduler (docs/scheduler.md; msmodelslim's DistributedTaskScheduler,
// utils/distributed/task_scheduler): a processor submits its independent sub-tasks (one
// subgraph's search, one module's weight solve) with the modules each one changes; run() spreads
// them over the ranks and then brings every rank to the state of "every rank ran every task in
// submit order".
//
//   submit()  resolves the dependencies below the root (Error(kPlugin) naming a path that is not
//             a module) and puts the task in the current wave, or opens a new one when a
//             dependency overlaps one of the wave's (the same path, an ancestor or a descendant)
//             or the task's parallel flag differs from the wave's
//   run()     runs the waves in order. A local wave (parallel = false, one rank, parallel
//             disabled, or a scheduler inside another's parallel task) runs every task on every
//             rank, with no collective. Before the first wave, on more than one rank and outside
//             another scheduler's task, the ranks agree on every parallel wave at once (task
//             counts and semantic hash: name, arguments, dependencies, sync name; one gather,
//             also where this rank has no parallel wave), else Error(kDistributed) on every rank
//             naming the first task that differs. A parallel wave then:
//               1. each task runs once, on the rank that claims it from a counter in the c10d
//                  store (dynamic: guided chunks of a 4W-th of what is left, by cost, per claim),
//                  or on rank index mod W (round-robin), the tasks in descending Task::cost
//                  (submit order among equals); a collective inside it is Error(kPlugin) naming
//                  the task and the call; a task that throws fails the run on every rank, naming
//                  the task and its rank;
//               2. on every rank, in submit order, exactly one sync level per task or module: the
//                  task's sync (a task with syncTensors: its tensors in the exchange below, and its
//                  sync after that exchange and the syncDone() calls), else for every module below
//                  its dependencies the tensors of its
//                  own DistributedSync (qpipe/distributed_sync.h), else the default, the
//                  executor's parameters and buffers (names, dtypes and shapes come with step 1's
//                  outcomes; new tensors on the other ranks). The tensors of levels 2 and 3,
//                  and the tasks' own, of every executor go in one exchange
//                  (ProcessGroup::exchangeInPlace).
//             A parallel wave costs one collective for its outcomes (two when they outgrow the
//             slot the last wave's set) and two more when its tasks sync tensors (the parts'
//             sizes and layouts, then the tensors point to point).
//
// Arguments are ConfigNode values (numbers, strings, lists, maps; tensorMeta() for a tensor),
// never pointers: the task function reaches its objects through what it captured, and the
// arguments say which one, so that the ranks can compare their waves.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/distributed_sync.h"
#include "qpipe/log.h"
#include "qpipe/process_group.h"

namespace qpipe {
class Module;
}

namespace qpipe::scheduler {

struct Task {
  std::string name;                                      // stable: in the hash and every message
  std::function<ConfigNode(const ConfigNode& args)> fn;  // its result goes to the executor's record
  ConfigNode args = ConfigNode::map();
  std::vector<std::string> dependencies;  // module paths below the root that the task changes
  // Level 1: brings every rank to the executor's state (collectives allowed); with neither this
  // nor syncTensors, levels 2/3.
  std::function<void(const TaskRecord& record, SyncContext& context)> sync;
  // Level 1 by tensors: what the task made that every rank needs (a product it computed), on its
  // executor the values (taken right after the task, their size announced with its outcome), on
  // the other ranks tensors of the same dtypes and shapes that the wave's one exchange fills;
  // `sync`, if any, runs after that exchange. No collectives.
  std::function<std::vector<at::Tensor>(const TaskRecord& record, SyncContext& context)> syncTensors;
  std::string syncName;  // required with `sync` or `syncTensors`: in the hash
  bool parallel = true;
  // An estimate of the task's time relative to the other tasks of its wave (its multiply-adds,
  // say; 0: none, as cheap as any). A parallel wave hands its tasks out most costly first, in
  // submit order among equals (longest processing time first), so that the cheap ones even out
  // the ranks at the wave's end. In the hash: every rank must hand them out in the same order.
  double cost = 0;
};

enum class Assignment { kDynamic, kRoundRobin };

struct SchedulerOptions {
  std::string name = "scheduler";  // the submitter, in messages and the summary line
  bool disableParallel = false;    // every wave local
  Assignment assignment = Assignment::kDynamic;
  // The most tasks one dynamic claim takes; 0: guided chunks (task_scheduler.cpp). 1 where a task
  // waits for the task before it (the runner's split layers pass the probe on): a chunk would
  // make the next rank's first task wait for the whole chunk.
  int64_t claimLimit = 0;
};

// What one run() (or several, added up) cost.
struct RunSummary {
  std::string name;  // the scheduler's (SchedulerOptions::name)
  int64_t tasks = 0;
  int64_t myTasks = 0;  // tasks this rank executed
  int64_t waves = 0;
  int64_t parallelWaves = 0;
  int worldSize = 1;
  int rank = 0;
  double execSeconds = 0;    // Σ over tasks of their time on their executor
  double myExecSeconds = 0;  // this rank's share of it
  double syncSeconds = 0;    // this rank's time in agreement, record exchange and sync
  double agreeSeconds = 0;   // of it, in the agreement: one collective per run() on several ranks
  // The tensor exchanges of the parallel waves: the ranks enter them together from the outcomes'
  // gather just before, so they time collectives themselves, without a wait for a slower rank
  // (tools/bench/dts_simulate.py); an exchange is one collective, two when a part outgrew its slot.
  double settledCollectiveSeconds = 0;
  int64_t settledCollectives = 0;
  double wallSeconds = 0;    // this rank's time in run()
  // Σexec / wall: how much faster than one rank running every task, for the same work.
  double speedup() const { return wallSeconds > 0 ? execSeconds / wallSeconds : 1.0; }
  // Syncing cost this rank more than the tasks the other ranks ran for it: splitting lost time.
  bool notWorthSplitting() const { return parallelWaves > 0 && syncSeconds > execSeconds - myExecSeconds; }
  RunSummary& operator+=(const RunSummary& other);
  // "tasks=… waves=… world_size=… rank=… my_tasks=… exec_s=… my_exec_s=… sync_s=… wall_s=… speedup=…"
  std::string line() const;
  // For the quant report: "dts:<name>:tasks", ":parallel_waves", ":exec_seconds", ":sync_seconds",
  // ":agree_seconds", ":settled_collective_seconds", ":settled_collectives", ":wall_seconds".
  std::vector<std::pair<std::string, double>> reportValues() const;
};

class DistributedTaskScheduler {
 public:
  // `root` and `group` must outlive the scheduler.
  DistributedTaskScheduler(Module& root, ProcessGroup& group, SchedulerOptions options = {});
  ~DistributedTaskScheduler();
  DistributedTaskScheduler(const DistributedTaskScheduler&) = delete;
  DistributedTaskScheduler& operator=(const DistributedTaskScheduler&) = delete;

  void submit(Task task);
  // Every submitted task, run and synced; records in submit order. The scheduler is empty again
  // afterwards, also after an error. Logs the summary at debug level (the per-wave detail too),
  // with a note when syncing cost more than the tasks saved.
  std::vector<TaskRecord> run();
  const RunSummary& summary() const;

  // Every scheduler's waves local (tests, and models whose modules the default sync cannot
  // reproduce).
  static void setGlobalDisableParallel(bool disabled);
  static bool globalDisableParallel();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Where a task was submitted in its scheduler run (from its taskId).
int64_t submitIndex(const TaskRecord& record);

// A task's cost for the quant report and tools/bench/dts_simulate.py, as
// request.report(module, key, value) calls with keys "dts:<task name>:seconds" (on its
// executor), ":wave", ":submit_index" (in its scheduler run), ":executor_rank", ":parallel" (1:
// ran once, 0: in a local wave, on every rank), ":sync_bytes" and ":sync_seconds" (this rank's);
// "dts:<task name>#<instance>:…" where one module has several tasks of a name (a search's
// candidates).
template <typename Request>
void reportTask(Request& request, const std::string& module, const TaskRecord& record,
                const std::string& instance = "") {
  const std::string key = "dts:" + record.name + (instance.empty() ? "" : "#" + instance) + ":";
  request.report(module, key + "seconds", record.execSeconds);
  request.report(module, key + "wave", static_cast<double>(record.wave));
  request.report(module, key + "submit_index", static_cast<double>(submitIndex(record)));
  request.report(module, key + "executor_rank", static_cast<double>(record.executorRank));
  request.report(module, key + "parallel", record.parallel ? 1.0 : 0.0);
  request.report(module, key + "sync_bytes", static_cast<double>(record.syncBytes));
  request.report(module, key + "sync_seconds", record.syncSeconds);
  if (record.cost > 0) request.report(module, key + "cost", record.cost);
}

// A tensor as a task argument: {shape, dtype, device} (no values).
ConfigNode tensorMeta(const at::Tensor& tensor);

// The wave rule's test: module paths a and b overlap when they are the same path or one is an
// ancestor of the other ('.'-separated; "" is the root, an ancestor of every path).
bool pathsOverlap(const std::string& a, const std::string& b);

// How many tasks a dynamic claim takes, `left` the weights of the wave's unclaimed tasks (as the
// rank last saw the counter) in the order they are handed out: a guided chunk, the fewest tasks
// whose weights reach 1 / (4 · worldSize) of left's, at least 1, at most claimLimit unless that
// is 0. A task's weight is its Task::cost where every task of the wave has one, else 1: the
// chunk is then ceil(size / (4 · worldSize)) tasks.
int64_t claimSize(std::span<const double> left, int worldSize, int64_t claimLimit);
// The weights claimSize measures a wave by, given its tasks' costs in hand-out order: the costs
// where every one is positive, else 1 each.
std::vector<double> claimWeights(std::span<const double> costs);

}  // namespace qpipe::scheduler
