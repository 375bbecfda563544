// Staged runs (qpipe/staged.h): order, settle steps, divergence and failures.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/staged.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

void expectContains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << text;
}

TEST(Staged, TasksRunInOrderAndEachPointSettlesOnceAfterEveryArrival) {
  std::vector<std::string> trace;
  int a = 0, b = 0;
  runStaged(3, [&](int64_t task) {
    trace.push_back("t" + std::to_string(task) + " a");
    settlePoint(&a, [&] { trace.push_back("settle a"); });
    trace.push_back("t" + std::to_string(task) + " b");
    settlePoint(&b, [&] { trace.push_back("settle b"); });
    trace.push_back("t" + std::to_string(task) + " end");
  });
  EXPECT_EQ(trace, (std::vector<std::string>{"t0 a", "t1 a", "t2 a", "settle a", "t0 b", "t1 b", "t2 b", "settle b",
                                             "t0 end", "t1 end", "t2 end"}));
}

TEST(Staged, TasksWithoutSettlePointsRunToCompletionInOrder) {
  std::vector<int64_t> order;
  runStaged(4, [&](int64_t task) { order.push_back(task); });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3}));
  runStaged(0, [&](int64_t) { ADD_FAILURE() << "no task to run"; });
}

TEST(Staged, TasksKeepTheirStateAcrossSettlePointsAndRunAtenOps) {
  // Each task holds a tensor on its own stack across the wait; at::parallel_for and an sgemm run
  // inside the tasks as on the caller's thread.
  std::vector<at::Tensor> results(5);
  int point = 0;
  runStaged(5, [&](int64_t task) {
    const at::Tensor x = at::full({64, 64}, static_cast<double>(task + 1));
    const at::Tensor y = at::matmul(x, x);
    settlePoint(&point, [] {});
    results[static_cast<size_t>(task)] = y.sum() + x.sum();
  });
  for (int64_t task = 0; task < 5; ++task) {
    const double v = static_cast<double>(task + 1);
    EXPECT_DOUBLE_EQ(results[static_cast<size_t>(task)].item<double>(), 64 * 64 * 64 * v * v + 64 * 64 * v);
  }
}

TEST(Staged, ATaskThatFinishesWhileOthersWaitIsAnError) {
  int point = 0;
  expectContains(test::errorOf(
                     [&] {
                       runStaged(2, [&](int64_t task) {
                         if (task == 0) settlePoint(&point, [] {});
                       });
                     },
                     ErrorCode::kInternal),
                 ("staged run: task 1 finished while task 0 waits at a settle point"));
}

TEST(Staged, TasksWaitingAtDifferentPointsAreAnError) {
  int a = 0, b = 0;
  expectContains(test::errorOf([&] { runStaged(2, [&](int64_t task) { settlePoint(task == 0 ? &a : &b, [] {}); }); },
                               ErrorCode::kInternal),
                 ("staged run: tasks 0 and 1 wait at different settle points"));
}

// Counts live instances: the waiting tasks of a failed run must be unwound.
struct Live {
  static inline int count = 0;
  Live() { ++count; }
  ~Live() { --count; }
};

TEST(Staged, ATaskErrorUnwindsTheWaitingTasksAndIsRethrown) {
  int point = 0;
  bool settled = false;
  expectContains(test::errorOf(
                     [&] {
                       runStaged(3, [&](int64_t task) {
                         const Live live;
                         if (task == 1) throw Error(ErrorCode::kInput, "sample 1 is bad");
                         settlePoint(&point, [&] { settled = true; });
                       });
                     },
                     ErrorCode::kInput),
                 ("sample 1 is bad"));
  EXPECT_FALSE(settled);
  EXPECT_EQ(Live::count, 0);
}

TEST(Staged, ASettleStepErrorUnwindsEveryTaskAndIsRethrown) {
  int point = 0;
  bool after = false;
  expectContains(test::errorOf(
                     [&] {
                       runStaged(2, [&](int64_t) {
                         const Live live;
                         settlePoint(&point, [] { throw Error(ErrorCode::kDistributed, "the sync failed"); });
                         after = true;
                       });
                     },
                     ErrorCode::kDistributed),
                 ("the sync failed"));
  EXPECT_FALSE(after);
  EXPECT_EQ(Live::count, 0);
}

TEST(Staged, SettlePointOutsideAStagedRunIsAnInternalError) {
  EXPECT_FALSE(inStagedRun());
  int point = 0;
  expectContains(test::errorOf([&] { settlePoint(&point, [] {}); }, ErrorCode::kInternal),
                 ("settlePoint outside a staged run"));
  bool inside = false;
  runStaged(1, [&](int64_t) { inside = inStagedRun(); });
  EXPECT_TRUE(inside);
  EXPECT_FALSE(inStagedRun());
}

TEST(Staged, RunsDoNotNest) {
  expectContains(
      test::errorOf([&] { runStaged(1, [&](int64_t) { runStaged(1, [](int64_t) {}); }); }, ErrorCode::kInternal),
      ("runStaged does not nest"));
  // The failed run left nothing behind.
  std::vector<int64_t> order;
  runStaged(2, [&](int64_t task) { order.push_back(task); });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1}));
}

}  // namespace
TEST(Staged, StagedTaskIsTheIndexOfTheRunningTask) {
  EXPECT_EQ(stagedTask(), -1);
  std::vector<int64_t> seen;
  int point = 0;
  runStaged(3, [&](int64_t task) {
    seen.push_back(stagedTask());
    settlePoint(&point, [] {});
    seen.push_back(stagedTask() + 10);
    EXPECT_EQ(stagedTask(), task);
  });
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 10, 11, 12}));
  EXPECT_EQ(stagedTask(), -1);
}

}  // namespace qpipe
