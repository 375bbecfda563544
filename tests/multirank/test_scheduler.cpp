// The distributed task scheduler on real ranks over Gloo (scheduler/, docs/scheduler.md): every
// sync level, dynamic and round-robin assignment, parallel disabled and one rank all end in the
// same state, worked out by hand; and the three ways a parallel wave fails, on every rank at once.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "rank_launcher.h"

namespace qpipe::test {
namespace {

// What schedulerLevels() (dist_worker.cpp) leaves: a gets +1, +2, then ×2; b's w becomes
// arange(6)·2 as [2, 3] doubles with a new int64 buffer; c is 8; d is −2 and d.e is 5.
const std::string kFinalState =
    "state a.w: Float 4 6 6 6 6\n"
    "state b.w: Double 2x3 0 2 4 6 8 10\n"
    "state d.w: Float 4 -2 -2 -2 -2\n"
    "state d.e.w: Float 2 5 5\n"
    "state c.value: Float 3 8 8 8\n"
    "state b.extra: Long 1 1\n";

std::string stateOf(const std::string& out) {
  std::istringstream in(out);
  std::string state;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("state ", 0) == 0) state += line + "\n";
  }
  return state;
}

bool has(const std::string& out, const std::string& line) {
  return out.find(line + "\n") != std::string::npos;
}

class Scheduler : public ::testing::TestWithParam<int> {};

TEST_P(Scheduler, EverySyncLevelEndsInTheOneRankStateWithEitherAssignment) {
  const int w = GetParam();
  for (const char* scenario : {"dts_dynamic", "dts_round_robin"}) {
    SCOPED_TRACE(scenario);
    const auto results = run(world(scenario, w));
    for (int r = 0; r < w; ++r) {
      const std::string& out = results[r].out;
      ASSERT_EQ(results[r].exitCode, 0) << "rank " << r << ": " << out;
      EXPECT_EQ(stateOf(out), kFinalState) << "rank " << r;
      EXPECT_TRUE(has(out, "waves: 3 parallel 2")) << out;
      // c's own sync ran once per parallel task on c; d's tasks were synced by their own function.
      EXPECT_TRUE(has(out, "level 2 syncs: 2 done 2")) << out;
      EXPECT_TRUE(has(out, "level 1 sync of w0_t3") && has(out, "level 1 sync of w1_t7")) << out;
      EXPECT_TRUE(has(out, "record w2_t10 local_a parallel 0 executor " + std::to_string(r))) << out;
      // Tasks' own tensors reach every rank in the exchange, before their sync runs.
      EXPECT_TRUE(has(out, "tensor sync of w1_t8: 0 1") && has(out, "tensor sync of w1_t9: 0 2 4")) << out;
      EXPECT_TRUE(has(out, "carried: 0 1 | 0 2 4")) << out;
      // Results longer than the outcomes' first slot arrive whole on every rank.
      EXPECT_TRUE(has(out, " result 6000 chars of p") && has(out, " result 6001 chars of q")) << out;
      if (std::string(scenario) == "dts_round_robin") {
        // Task i of a wave of four runs on rank i mod W; every rank has its result.
        EXPECT_TRUE(has(out, "record w0_t3 set_d parallel 1 executor " + std::to_string(3 % w))) << out;
        EXPECT_TRUE(
            has(out, "record w0_t1 reshape_b parallel 1 executor " + std::to_string(1 % w) + " result 6000 chars of p"))
            << out;
        EXPECT_TRUE(has(out, "record w0_t0 fill_a parallel 1 executor 0 result 0")) << out;
        EXPECT_TRUE(has(out, "record w1_t4 fill_a parallel 1 executor 0 result 10")) << out;
      }
    }
  }
}

TEST_P(Scheduler, ParallelDisabledRunsEveryTaskEverywhereWithTheSameResult) {
  const int w = GetParam();
  const auto results = run(world("dts_disabled", w));
  for (int r = 0; r < w; ++r) {
    ASSERT_EQ(results[r].exitCode, 0) << results[r].out;
    EXPECT_EQ(stateOf(results[r].out), kFinalState);
    EXPECT_TRUE(has(results[r].out, "waves: 3 parallel 0")) << results[r].out;
    EXPECT_TRUE(has(results[r].out, "level 2 syncs: 0 done 0")) << results[r].out;
    EXPECT_TRUE(has(results[r].out, "carried: 0 1 | 0 2 4")) << results[r].out;
    EXPECT_TRUE(has(results[r].out, "record w0_t0 fill_a parallel 0 executor " + std::to_string(r) + " result 0"))
        << results[r].out;
  }
}

// Inside a parallel task a scheduler runs its waves locally, and tasks hand values on through the
// store (the runner's split layers, docs/scheduler.md).
TEST_P(Scheduler, NestedSchedulersRunLocallyAndTasksChainThroughTheStore) {
  const int w = GetParam();
  const auto results = run(world("dts_nested_chain", w));
  for (int r = 0; r < w; ++r) {
    const std::string& out = results[r].out;
    ASSERT_EQ(results[r].exitCode, 0) << "rank " << r << ": " << out;
    EXPECT_TRUE(has(out, "outer parallel waves: 1")) << out;
    EXPECT_TRUE(has(out, "inner parallel tasks: 0")) << out;
    EXPECT_TRUE(has(out, "chain: 100")) << out;
  }
}

// Longest processing time first: the costliest tasks are handed out first, equal ones in submit
// order; records stay in submit order.
TEST_P(Scheduler, TasksAreHandedOutMostCostlyFirst) {
  const int w = GetParam();
  const auto results = run(world("dts_costs", w));
  for (int r = 0; r < w; ++r) {
    const std::string& out = results[r].out;
    ASSERT_EQ(results[r].exitCode, 0) << "rank " << r << ": " << out;
    const std::string expected = "record w0_t0 executor " + std::to_string(2 % w) + " cost 1\n" +
                                 "record w0_t1 executor 0 cost 4\n" + "record w0_t2 executor " + std::to_string(3 % w) +
                                 " cost 0\n" + "record w0_t3 executor 1 cost 4\n";
    EXPECT_NE(out.find(expected), std::string::npos) << out;
  }
}

// NaN and the infinities, which JSON has no numbers for, reach every rank as the executor has them.
TEST_P(Scheduler, ResultsThatJsonCannotHoldArriveAsTheyWere) {
  const int w = GetParam();
  const auto results = run(world("dts_special_results", w));
  for (int r = 0; r < w; ++r) {
    const std::string& out = results[r].out;
    ASSERT_EQ(results[r].exitCode, 0) << "rank " << r << ": " << out;
    EXPECT_TRUE(has(out, "result w0_t0 executor 0: .nan")) << out;
    EXPECT_TRUE(has(out, "result w0_t1 executor 1: .inf")) << out;
    EXPECT_TRUE(has(out, "result w0_t2 executor " + std::to_string(2 % w) + ": -.inf")) << out;
    EXPECT_TRUE(has(out, "result w0_t3 executor " + std::to_string(3 % w) + ": loss: .nan\ngrid: [0.25, -.inf]"))
        << out;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, Scheduler, ::testing::Values(2, 3));

TEST(SchedulerOneRank, EndsInTheSameState) {
  const auto results = run(world("dts_dynamic", 1));
  ASSERT_EQ(results[0].exitCode, 0) << results[0].out;
  EXPECT_EQ(stateOf(results[0].out), kFinalState);
  EXPECT_TRUE(has(results[0].out, "waves: 3 parallel 0")) << results[0].out;
  EXPECT_TRUE(has(results[0].out, "carried: 0 1 | 0 2 4")) << results[0].out;
}

// Every rank of `scenario` exits with `code` and prints `message` alone, long before the timeout.
void expectEveryRankFails(const std::string& scenario, int ranks, int code, const std::string& message) {
  const auto results = run(world(scenario, ranks));
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(results[r].exitCode, code) << results[r].out;
    EXPECT_EQ(results[r].out, connected(r, ranks) + "error: " + message + "\n");
    EXPECT_LT(results[r].seconds, 10.0);
  }
}

TEST(SchedulerErrors, RanksThatSubmitDifferentTasksFailTogetherNamingTheFirstDifference) {
  expectEveryRankFails("dts_disagree", 3, 7,
                       "scheduler 'test': the ranks disagree on parallel wave 0 (rank 0 has 2 tasks, rank 2 has 2): "
                       "task 1 is 'noop {k: 1} on [b]' on rank 0 and 'noop {k: 2} on [b]' on rank 2; every rank must "
                       "submit the same parallel tasks");
}

// A rank whose waves are all local still meets the others in the agreement.
TEST(SchedulerErrors, ARankWithNothingParallelFailsWithTheOthers) {
  expectEveryRankFails("dts_nothing_parallel_on_one_rank", 3, 7,
                       "scheduler 'test': the ranks disagree on parallel wave 0 (rank 0 has 1 tasks, rank 2 has 0): "
                       "task 0 is 'noop {} on [a]' on rank 0 and none on rank 2; every rank must submit the same "
                       "parallel tasks");
}

// A module's own sync that returns its tensors on the executor only: the other ranks still meet it
// in the exchange, which fails on every rank.
TEST(SchedulerErrors, AnOwnSyncThatDiffersBetweenRanksFailsOnEveryRank) {
  expectEveryRankFails("dts_own_sync_on_executor_only", 2, 7,
                       "exchangeInPlace: rank 0 sends 12 bytes of tensors, rank 1 expects 0; every rank must give "
                       "each part the same tensors (dtypes and shapes)");
}

TEST(SchedulerErrors, AResultThatIsNotUtf8FailsItsTask) {
  expectEveryRankFails("dts_result_not_utf8", 2, 4,
                       "scheduler 'test': task latin1 {} failed on rank 0: its result holds a string that is not UTF-8 "
                       "(results travel as JSON)");
}

TEST(SchedulerErrors, RanksAgreeOnEveryParallelWaveBeforeAnyTaskRuns) {
  expectEveryRankFails("dts_disagree_later", 2, 7,
                       "scheduler 'test': the ranks disagree on parallel wave 2 (rank 0 has 1 tasks, rank 1 has 1): "
                       "task 0 is 'noop {} on [b]' on rank 0 and 'other {} on [b]' on rank 1; every rank must submit "
                       "the same parallel tasks");
}

TEST(SchedulerErrors, RanksThatGiveATaskAnotherCostFailTogether) {
  expectEveryRankFails("dts_costs_disagree", 2, 7,
                       "scheduler 'test': the ranks disagree on parallel wave 0 (rank 0 has 4 tasks, rank 1 has 4): "
                       "task 2 is 'noop {k: 2} on []' on rank 0 and 'noop {k: 2} on [] cost 2' on rank 1; every rank "
                       "must submit the same parallel tasks");
}

TEST(SchedulerErrors, ACollectiveInsideAParallelTaskIsAnErrorNotAHang) {
  expectEveryRankFails("dts_collective", 2, 4,
                       "scheduler 'test': task reduce {} on rank 0 called allReduce inside a parallel task, where the "
                       "other ranks run other tasks and would never join "
                       "it; submit it with parallel = false or move the collective into its sync");
}

TEST(SchedulerErrors, AFailingTaskFailsEveryRankNamingTheTaskAndItsRank) {
  expectEveryRankFails("dts_task_fails", 2, 5,
                       "scheduler 'test': task maybe_fail {module: c} failed on rank 0: module c: "
                       "weights are NaN");
}

}  // namespace
}  // namespace qpipe::test
