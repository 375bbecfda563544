// The group of one process (every collective the identity, the dist ops and DistHelper on it)
// and the environment variables that make a rank; no other process is started.
#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "qpipe/dist/dist_helper.h"
#include "qpipe/dist/ops.h"
#include "qpipe/dist/process_group.h"
#include "qpipe/module.h"
#include "test_helpers.h"

namespace qpipe::test {
namespace {

using namespace qpipe::dist;

TEST(SingleGroup, CollectivesAreTheIdentity) {
  const auto group = ProcessGroup::single();
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->worldSize(), 1);
  at::Tensor t = at::tensor({1.5f, -2.0f});
  group->allReduce(t, ReduceOp::kProd);
  EXPECT_TRUE(t.equal(at::tensor({1.5f, -2.0f})));
  group->broadcast(t, 0);
  EXPECT_TRUE(t.equal(at::tensor({1.5f, -2.0f})));
  const auto gathered = group->allGather(t);
  ASSERT_EQ(gathered.size(), 1u);
  EXPECT_TRUE(gathered[0].equal(t));
  EXPECT_EQ(group->allGatherBytes(std::string("a\0b", 3)), std::vector<std::string>{std::string("a\0b", 3)});
  EXPECT_EQ(group->allGatherBytesWithin(std::string("a\0b", 3), 1), std::vector<std::string>{std::string("a\0b", 3)});
  group->barrier();
  group->reportFailure("ignored");
}

TEST(SingleGroup, DistOpsReturnTheirInput) {
  const auto group = ProcessGroup::single();
  at::Tensor t = at::tensor({1.0f, 4.0f});
  for (SyncOp op : {SyncOp::kMin, SyncOp::kMax, SyncOp::kSum, SyncOp::kMean, SyncOp::kProd}) {
    syncBaseOperation(*group, t, op);
    EXPECT_TRUE(t.equal(at::tensor({1.0f, 4.0f})));
  }
  EXPECT_EQ(syncGatherTensors(*group, t, true, true).size(), 1u);
  const std::vector<at::Tensor> items{at::ones({2}), at::zeros({3})};
  const auto lists = syncGatherTensorLists(*group, items);
  ASSERT_EQ(lists.size(), 2u);
  EXPECT_TRUE(lists[1].equal(at::zeros({3})));
  const auto ordered = gatherInSampleOrder(*group, items);
  ASSERT_EQ(ordered.size(), 2u);
  EXPECT_TRUE(ordered[0].equal(at::ones({2})));
}

TEST(SingleGroup, DistHelperSharesEverything) {
  Module layer("Layer");
  layer.addChild("q_proj", std::make_shared<Module>("Linear"));
  layer.addChild("k_proj", std::make_shared<Module>("Linear"));
  const DistHelper helper(*ProcessGroup::single(), layer, "model.layers.0");
  EXPECT_TRUE(helper.isShared("model.layers.0.q_proj"));
  EXPECT_FALSE(helper.isLocalOnly("model.layers.0.q_proj"));
  EXPECT_FALSE(helper.isLocal("model.layers.1.q_proj"));
  EXPECT_EQ(helper.sharedModulesSlice("model.layers.0."),
            (std::vector<std::string>{"model.layers.0.k_proj", "model.layers.0.q_proj"}));
}

class DistEnvironment : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kNames) ::unsetenv(name);
  }
  void TearDown() override {
    for (const char* name : kNames) ::unsetenv(name);
  }
  static std::string errorWith(const std::vector<std::pair<const char*, const char*>>& variables) {
    for (const auto& [name, value] : variables) ::setenv(name, value, 1);
    return errorOf([] { optionsFromEnvironment(); }, ErrorCode::kDistributed);
  }
  static constexpr const char* kNames[] = {"RANK",       "WORLD_SIZE",       "MASTER_ADDR",          "MASTER_PORT",
                                           "LOCAL_RANK", "LOCAL_WORLD_SIZE", "QPIPE_DIST_TIMEOUT_S", "QPIPE_DIST_SHM"};
};

TEST_F(DistEnvironment, UnsetMeansOneProcess) {
  EXPECT_FALSE(optionsFromEnvironment().has_value());
}

TEST_F(DistEnvironment, ReadsTheTorchrunVariables) {
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("MASTER_ADDR", "node0", 1);
  ::setenv("MASTER_PORT", "29511", 1);
  ::setenv("QPIPE_DIST_TIMEOUT_S", "2.5", 1);
  const auto options = optionsFromEnvironment();
  ASSERT_TRUE(options.has_value());
  EXPECT_EQ(options->rank, 2);
  EXPECT_EQ(options->worldSize, 4);
  EXPECT_EQ(options->masterAddr, "node0");
  EXPECT_EQ(options->masterPort, 29511);
  EXPECT_EQ(options->timeout.count(), 2500);
}

TEST_F(DistEnvironment, DefaultsForTheMaster) {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  const auto options = optionsFromEnvironment();
  ASSERT_TRUE(options.has_value());
  EXPECT_EQ(options->masterAddr, "127.0.0.1");
  EXPECT_EQ(options->masterPort, 29500);
  EXPECT_EQ(options->timeout.count(), 60000);
}

TEST_F(DistEnvironment, ErrorsNameTheVariable) {
  EXPECT_EQ(errorWith({{"RANK", "0"}}), "RANK is set but WORLD_SIZE is not; set both or neither");
  SetUp();
  EXPECT_EQ(errorWith({{"WORLD_SIZE", "2"}}), "WORLD_SIZE is set but RANK is not; set both or neither");
  EXPECT_EQ(errorWith({{"RANK", "one"}}), "RANK='one' is not an integer in [0, 1048576]");
  EXPECT_EQ(errorWith({{"RANK", "2"}}), "RANK=2 is not below WORLD_SIZE=2");
  EXPECT_EQ(errorWith({{"RANK", "1"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE='0' is not an integer in [1, 1048576]");
  EXPECT_EQ(errorWith({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
            "MASTER_PORT='70000' is not an integer in [1, 65535]");
  EXPECT_EQ(errorWith({{"MASTER_PORT", "29500"}, {"MASTER_ADDR", ""}}),
            "MASTER_ADDR is empty; set it to rank 0's host");
  SetUp();
  EXPECT_EQ(errorWith({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}}),
            "LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2");
  SetUp();
  EXPECT_EQ(errorWith({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}}),
            "LOCAL_WORLD_SIZE=4 is above WORLD_SIZE=2: one host cannot hold more ranks than the world");
  SetUp();
  EXPECT_EQ(errorWith({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}}),
            "LOCAL_RANK=2 is not below WORLD_SIZE=2");
}

// QPIPE_DIST_TIMEOUT_S stands in for --dist_timeout: a bad value is a usage error, as a bad option
// is, and a --dist_timeout given beside it wins without reading it.
TEST_F(DistEnvironment, ATimeoutVariableGivesWayToTheOption) {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  for (const char* value : {"soon", "0"}) {
    ::setenv("QPIPE_DIST_TIMEOUT_S", value, 1);
    EXPECT_EQ(errorOf([] { optionsFromEnvironment(); }, ErrorCode::kUsage),
              std::string("QPIPE_DIST_TIMEOUT_S='") + value +
                  "' is not a number of seconds in (0, 604800]; fix it, unset it or pass --dist_timeout");
    EXPECT_EQ(optionsFromEnvironment(std::chrono::milliseconds(5000))->timeout.count(), 5000);
  }
}

TEST_F(DistEnvironment, SharedMemoryIsOnUnlessTurnedOff) {
  EXPECT_TRUE(sharedMemoryAllowed());
  ::setenv("QPIPE_DIST_SHM", "1", 1);
  EXPECT_TRUE(sharedMemoryAllowed());
  ::setenv("QPIPE_DIST_SHM", "0", 1);
  EXPECT_FALSE(sharedMemoryAllowed());
  for (const char* value : {"false", "2", ""}) {
    ::setenv("QPIPE_DIST_SHM", value, 1);
    EXPECT_EQ(errorOf([] { sharedMemoryAllowed(); }, ErrorCode::kUsage),
              std::string("QPIPE_DIST_SHM='") + value +
                  "' is neither 0 (ranks on one host talk over Gloo) nor 1 (through shared memory, the default)");
  }
}

TEST(ConnectOptions, RankOutsideTheWorld) {
  GroupOptions options;
  options.rank = 3;
  options.worldSize = 2;
  EXPECT_EQ(errorOf([&] { connect(options); }, ErrorCode::kDistributed), "rank 3 is not in a world of 2");
}

}  // namespace
}  // namespace qpipe::test
