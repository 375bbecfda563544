// The task scheduler in one process (scheduler/, docs/scheduler.md): how submits group into
// waves, records in submit order, dependency errors, the collective guard, the summary line and
// the scheduled weight solves of linear_quant equal to the direct ones. The multirank behaviour is
// in tests/multirank/test_scheduler.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "qpipe/hash.h"
#include "qpipe/linear_quantizer.h"
#include "qpipe/module.h"
#include "qpipe/qconfig.h"
#include "qpipe/scheduler/task_scheduler.h"
#include "qpipe/schema.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

using scheduler::DistributedTaskScheduler;
using scheduler::Task;

std::shared_ptr<Module> tree() {
  auto root = std::make_shared<Module>("Root");
  for (const char* name : {"a", "b"}) {
    auto child = std::make_shared<Module>("Node");
    child->addChild("x", std::make_shared<Module>("Leaf"));
    child->addChild("y", std::make_shared<Module>("Leaf"));
    root->addChild(name, child);
  }
  root->addChild("ab", std::make_shared<Module>("Leaf"));
  return root;
}

Task noop(const std::string& dependency, std::vector<std::string>* ran, bool parallel = true) {
  return {.name = "noop",
          .fn =
              [ran, dependency](const ConfigNode&) {
                ran->push_back(dependency);
                return ConfigNode::string(dependency);
              },
          .args = ConfigNode::map({{"on", ConfigNode::string(dependency)}}),
          .dependencies = {dependency},
          .parallel = parallel};
}

// A path overlaps the same path, its ancestors and its descendants ("a" and "ab" do not).
// The agreement's hash (qpipe/hash.h) against FNV-1a's published 64-bit vectors.
TEST(Scheduler, TheAgreementHashIsFnv1a) {
  EXPECT_EQ(qpipe::fnv1a(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(qpipe::fnv1a("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(qpipe::fnv1a("foobar"), 0x85944171f73967e8ULL);
  EXPECT_EQ(qpipe::fnv1a("bar", qpipe::fnv1a("foo")), qpipe::fnv1a("foobar"));
  const char bytes[] = {'f', 'o', 'o', 'b', 'a', 'r'};
  EXPECT_EQ(qpipe::fnv1aBytes(bytes, sizeof bytes), qpipe::fnv1a("foobar"));
}

TEST(Scheduler, AWaveEndsWhereADependencyOverlapsOrTheParallelFlagChanges) {
  auto root = tree();
  const auto group = ProcessGroup::single();
  DistributedTaskScheduler s(*root, *group);
  std::vector<std::string> ran;
  for (const char* d : {"a.x", "a.y", "b", "ab"}) s.submit(noop(d, &ran));  // wave 0
  s.submit(noop("a", &ran));                                                // the ancestor of a.x: wave 1
  s.submit(noop("b.y", &ran));                                              // b is in wave 0 only: wave 1
  s.submit(noop("b.x", &ran, false));  // not parallel, but on one rank every wave is local: wave 1
  s.submit(noop("a.x", &ran));         // a descendant of a: wave 2
  const std::vector<TaskRecord> records = s.run();
  EXPECT_EQ(s.summary().waves, 3);
  EXPECT_EQ(s.summary().parallelWaves, 0);
  ASSERT_EQ(records.size(), 8u);
  EXPECT_EQ(ran, (std::vector<std::string>{"a.x", "a.y", "b", "ab", "a", "b.y", "b.x", "a.x"}));
  const std::vector<std::string> ids{"w0_t0", "w0_t1", "w0_t2", "w0_t3", "w1_t4", "w1_t5", "w1_t6", "w2_t7"};
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i].taskId, ids[i]);
    EXPECT_EQ(scheduler::submitIndex(records[i]), static_cast<int64_t>(i));
    EXPECT_EQ(records[i].result.asString(), ran[i]);
    EXPECT_EQ(records[i].executorRank, 0);
    EXPECT_FALSE(records[i].parallel);
  }
  // The scheduler is empty again.
  EXPECT_TRUE(s.run().empty());
}

// A task that throws ends run() with its error, and the scheduler is empty afterwards all the same.
TEST(Scheduler, ARunThatFailsLeavesTheSchedulerEmpty) {
  auto root = tree();
  const auto group = ProcessGroup::single();
  DistributedTaskScheduler s(*root, *group);
  std::vector<std::string> ran;
  s.submit(noop("a", &ran));
  s.submit({.name = "fails",
            .fn = [](const ConfigNode&) -> ConfigNode { throw Error(ErrorCode::kInput, "weights are NaN"); },
            .dependencies = {"b"}});
  EXPECT_EQ(test::errorOf([&] { s.run(); }, ErrorCode::kInput), "weights are NaN");
  EXPECT_TRUE(s.run().empty());
  EXPECT_EQ(ran, std::vector<std::string>{"a"});
}

TEST(Scheduler, SubmitErrorsNameTheTaskAndThePath) {
  auto root = tree();
  const auto group = ProcessGroup::single();
  DistributedTaskScheduler s(*root, *group, {.name = "flex_smooth_quant"});
  std::vector<std::string> ran;
  EXPECT_EQ(test::errorOf([&] { s.submit(noop("a.z", &ran)); }, ErrorCode::kPlugin),
            "scheduler 'flex_smooth_quant': task 'noop' depends on 'a.z', which is not a module below the scheduler's "
            "root (no module 'a.z' (no child 'z' in Node))");
  EXPECT_EQ(test::errorOf([&] { s.submit(noop("", &ran)); }, ErrorCode::kPlugin),
            "scheduler 'flex_smooth_quant': task 'noop' has an empty dependency; name the modules the task changes");
  Task unnamed = noop("a", &ran);
  unnamed.name.clear();
  EXPECT_EQ(test::errorOf([&] { s.submit(unnamed); }, ErrorCode::kPlugin),
            "scheduler 'flex_smooth_quant': a task needs a name");
  Task syncWithoutName = noop("a", &ran);
  syncWithoutName.sync = [](const TaskRecord&, SyncContext&) {};
  EXPECT_EQ(test::errorOf([&] { s.submit(syncWithoutName); }, ErrorCode::kPlugin),
            "scheduler 'flex_smooth_quant': task 'noop' has a sync function but no syncName");
  Task tensorsWithoutName = noop("a", &ran);
  tensorsWithoutName.syncTensors = [](const TaskRecord&, SyncContext&) { return std::vector<at::Tensor>{}; };
  EXPECT_EQ(test::errorOf([&] { s.submit(tensorsWithoutName); }, ErrorCode::kPlugin),
            "scheduler 'flex_smooth_quant': task 'noop' has a sync function but no syncName");
  for (const double cost : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    Task badCost = noop("a", &ran);
    badCost.cost = cost;
    EXPECT_EQ(test::errorOf([&] { s.submit(badCost); }, ErrorCode::kPlugin),
              "scheduler 'flex_smooth_quant': task 'noop' has cost " + std::string(cost < 0 ? "-1" : "nan") +
                  "; a cost is a finite estimate, 0 or more");
  }
}

// Guided chunks of a 4W-th of what is left: ceil(left / 4W) tasks without costs, shrinking to 1;
// by cost where every task has one; claimLimit caps them.
TEST(Scheduler, DynamicClaimsAreGuidedChunksUnderTheLimit) {
  const auto units = [](size_t n) { return std::vector<double>(n, 1.0); };
  EXPECT_EQ(scheduler::claimSize(units(30), 2, 0), 4);
  EXPECT_EQ(scheduler::claimSize(units(26), 2, 0), 4);
  EXPECT_EQ(scheduler::claimSize(units(8), 2, 0), 1);
  EXPECT_EQ(scheduler::claimSize(units(9), 2, 0), 2);
  EXPECT_EQ(scheduler::claimSize(units(1), 2, 0), 1);
  EXPECT_EQ(scheduler::claimSize(units(0), 2, 0), 1);
  EXPECT_EQ(scheduler::claimSize(units(300), 3, 0), 25);
  EXPECT_EQ(scheduler::claimSize(units(30), 2, 1), 1);
  EXPECT_EQ(scheduler::claimSize(units(300), 3, 10), 10);
  EXPECT_EQ(scheduler::claimSize(units(3), 3, 10), 1);
  // A smoothing wave on 8 ranks, costliest first: 21 candidates of 9 units, then 21 of 3. A
  // counted chunk would be 2 of the large ones (42 / 32); by cost a claim is 252 / 32 = 7.9
  // units, one large candidate, and one small one at the end. 84 small ones alone: 3 a claim, as
  // counted.
  std::vector<double> wave(21, 9.0);
  wave.resize(42, 3.0);
  EXPECT_EQ(scheduler::claimSize(wave, 8, 0), 1);
  EXPECT_EQ(scheduler::claimSize(std::span(wave).subspan(20), 8, 0), 1);
  EXPECT_EQ(scheduler::claimSize(std::span(wave).subspan(21), 8, 0), 1);
  EXPECT_EQ(scheduler::claimSize(std::vector<double>(84, 3.0), 8, 0), 3);
  EXPECT_EQ(scheduler::claimSize(std::vector<double>{100.0, 1.0, 1.0, 1.0}, 1, 0), 1);
  EXPECT_EQ(scheduler::claimSize(std::vector<double>{1.0, 1.0, 1.0, 100.0}, 1, 0), 4);
  // Equal costs claim as counted, also fractional ones (32 of 0.1 on 2 ranks: 4, as 32 of 1).
  EXPECT_EQ(scheduler::claimSize(std::vector<double>(32, 0.1), 2, 0), 4);
  // A wave is weighed by its costs only where every task has one.
  EXPECT_EQ(scheduler::claimWeights(std::vector<double>{9, 3, 3}), (std::vector<double>{9, 3, 3}));
  EXPECT_EQ(scheduler::claimWeights(std::vector<double>{9, 3, 0}), (std::vector<double>{1, 1, 1}));
  EXPECT_TRUE(scheduler::claimWeights(std::vector<double>{}).empty());

  auto root = tree();
  const auto group = ProcessGroup::single();
  EXPECT_EQ(test::errorOf([&] { DistributedTaskScheduler(*root, *group, {.name = "runner", .claimLimit = -1}); },
                          ErrorCode::kPlugin),
            "scheduler 'runner': claimLimit -1 is negative (0 takes guided chunks)");
}

TEST(Scheduler, ACollectiveInsideAParallelTaskScopeIsRefused) {
  at::Tensor t = at::ones({1});
  const auto single = ProcessGroup::single();
  ProcessGroup& group = *single;
  group.allReduce(t, ReduceOp::kSum);  // fine outside
  const ParallelTaskScope scope("flex_smooth_quant.candidate {round: 0}");
  EXPECT_EQ(
      test::errorOf([&] { group.barrier(); }, ErrorCode::kPlugin),
      "task flex_smooth_quant.candidate {round: 0} called barrier inside a parallel task, where the other ranks run "
      "other tasks and would never join it; submit it with parallel = false or move the collective into its "
      "sync");
  EXPECT_EQ(group.counterAdd("k", 2), 2);  // the store counter is not a collective
  EXPECT_EQ(group.counterAdd("k", 1), 3);
  EXPECT_TRUE(ParallelTaskScope::active());
  group.storeSet("probe", "bytes");  // nor are the store's values
  EXPECT_EQ(group.storeGet("probe"), "bytes");
  EXPECT_NE(test::errorOf([&] { group.storeGet("unset"); }, ErrorCode::kInternal)
                .find("storeGet('unset') on one rank before any storeSet: it would wait forever"),
            std::string::npos);
}

TEST(Scheduler, GlobalSwitchAndTensorMeta) {
  EXPECT_FALSE(DistributedTaskScheduler::globalDisableParallel());
  DistributedTaskScheduler::setGlobalDisableParallel(true);
  EXPECT_TRUE(DistributedTaskScheduler::globalDisableParallel());
  DistributedTaskScheduler::setGlobalDisableParallel(false);
  EXPECT_EQ(scheduler::tensorMeta(at::zeros({2, 3}, at::kHalf)).toYaml(),
            ConfigNode::map({{"shape", ConfigNode::list({ConfigNode::integer(2), ConfigNode::integer(3)})},
                             {"dtype", ConfigNode::string("Half")},
                             {"device", ConfigNode::string("cpu")}})
                .toYaml());
  scheduler::RunSummary a{.tasks = 4,
                          .myTasks = 2,
                          .waves = 1,
                          .parallelWaves = 1,
                          .worldSize = 2,
                          .execSeconds = 4,
                          .myExecSeconds = 2,
                          .syncSeconds = 0.5,
                          .wallSeconds = 2.5};
  a += a;
  EXPECT_EQ(a.line(),
            "tasks=8 waves=2 parallel_waves=2 world_size=2 rank=0 my_tasks=4 exec_s=8.000 my_exec_s=4.000 "
            "sync_s=1.000 wall_s=5.000 speedup=1.60");
}

// A quantizer whose weights a task solves equals one that solved them at construction, and a
// second solve (the sync of a minmax quantizer on the executor) changes nothing.
TEST(Scheduler, DeferredWeightSolvesEqualDirectOnes) {
  const at::Tensor weight = at::randn({8, 32}, at::TensorOptions().dtype(at::kFloat));
  Linear linear(weight, at::Tensor());
  for (const char* method : {"minmax", "ssz"}) {
    SCOPED_TRACE(method);
    const ConfigNode node = ConfigNode::parseYaml(
        std::string("act: {dtype: int8, scope: per_token}\nweight: {dtype: int4, scope: per_channel, method: ") +
            method + (std::string(method) == "ssz" ? ", ext: {step: 5}}\n" : "}\n"),
        "q.yaml");
    const quant::LinearQConfig config =
        quant::parseLinearQConfig(quant::linearQConfigSchema().validate(node, "qconfig"), "qconfig");
    const auto direct = LinearQuantizer(linear, config).deploy("direct");
    LinearQuantizer deferred(linear, config, LinearQuantizer::Weights::kDeferred);
    EXPECT_FALSE(deferred.weightsSolved());
    deferred.solveWeights();
    deferred.solveWeights();
    const auto scheduled = deferred.deploy("deferred");
    EXPECT_TRUE(at::equal(direct->parameter("weight"), scheduled->parameter("weight")));
    EXPECT_TRUE(at::equal(direct->parameter("weight_scale"), scheduled->parameter("weight_scale")));
  }
}

}  // namespace
}  // namespace qpipe
