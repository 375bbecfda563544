// Static calibration on several ranks: `qpipe quant` with every observer (minmax with aggregation
// max and mean, histogram with the l2 and the KL search), as separate steps and in a `group`,
// writes on 2 and 3 ranks the checkpoint it writes on 1, tensor for tensor and bit for bit. Five
// samples, so the ranks hold different numbers of them (3+2, 2+2+1).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;

const std::string kArgs = " --calib_samples 5 --seq_len 24 --threads_per_rank 1 --dist_timeout 20";

std::string qconfig(const std::string& act) {
  return "qconfig: {act: " + act + ", weight: {dtype: int8, scope: per_channel}}";
}

// Every observer, one step each; the histogram steps on the MLP inputs.
const std::string kSteps = "    - {type: linear_quant, " + qconfig("{dtype: int8, symmetric: False}") +
                           ", include: ['*q_proj', '*k_proj', '*v_proj']}\n"
                           "    - {type: linear_quant, " +
                           qconfig("{dtype: int8, ext: {aggregation_type: mean}}") +
                           ", include: ['*o_proj']}\n"
                           "    - {type: linear_quant, " +
                           qconfig("{dtype: int8, symmetric: False, method: histogram}") +
                           ", include: ['*gate_proj', '*up_proj']}\n"
                           "    - {type: linear_quant, " +
                           qconfig("{dtype: int8, method: histogram, ext: {search_method: kl_divergence}}") +
                           ", include: ['*down_proj']}\n";

// The same observers as children of one group: one observing forward, every sync, one
// propagating forward.
const std::string kGroup =
    "    - type: group\n      configs:\n"
    "        - {type: linear_quant, " +
    qconfig("{dtype: int8, symmetric: False}") +
    ", include: ['*self_attn*']}\n"
    "        - {type: linear_quant, " +
    qconfig("{dtype: int8, ext: {aggregation_type: mean}}") +
    ", include: ['*gate_proj', '*up_proj']}\n"
    "        - {type: linear_quant, " +
    qconfig("{dtype: int8, symmetric: False, method: histogram}") + ", include: ['*down_proj']}\n";

void expectSameTensors(const fs::path& expected, const fs::path& actual, const std::string& what) {
  const auto a = qpipe::safetensors::Checkpoint::open(expected);
  const auto b = qpipe::safetensors::Checkpoint::open(actual);
  ASSERT_EQ(a.names(), b.names()) << what;
  ASSERT_FALSE(a.names().empty()) << what;
  int inputScales = 0;
  for (const std::string& name : a.names()) {
    const at::Tensor x = a.tensor(name).contiguous();
    const at::Tensor y = b.tensor(name).contiguous();
    ASSERT_EQ(x.scalar_type(), y.scalar_type()) << what << ": " << name;
    ASSERT_EQ(x.sizes(), y.sizes()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << what << ": " << name;
    inputScales += name.ends_with("input_scale") ? 1 : 0;
  }
  EXPECT_EQ(inputScales, 7 * qpipe::test::kTinyLayers) << what;
  EXPECT_EQ(qpipe::test::slurp(expected / "config.json"), qpipe::test::slurp(actual / "config.json")) << what;
}

void expectRanksAgree(const std::string& name, const std::string& process) {
  const fs::path dir = qpipe::test::testDir();
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path pipeline =
      qpipe::test::writeTempFile(name + ".yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process);
  const auto run = [&](const std::string& devices) {
    const fs::path out = dir / (name + "-" + std::to_string(devices.size()));
    fs::remove_all(out);
    const auto r = qpipe::test::runQpipe("quant --model_path '" + model.string() + "' --save_path '" + out.string() +
                                         "' --config_path '" + pipeline.string() + "' --device " + devices + kArgs);
    EXPECT_EQ(r.exitCode, 0) << devices << "\n" << r.err;
    return out;
  };
  const fs::path one = run("cpu:0");
  const fs::path two = run("cpu:0,1");
  const fs::path three = run("cpu:0,1,2");
  expectSameTensors(one, two, name + " 2 ranks");
  expectSameTensors(one, three, name + " 3 ranks");
}

TEST(ObserverSync, EveryObserverOnTwoAndThreeRanksGivesTheOneRankCheckpoint) {
  expectRanksAgree("steps", kSteps);
}

TEST(ObserverSync, GroupOnTwoAndThreeRanksGivesTheOneRankCheckpoint) {
  expectRanksAgree("group", kGroup);
}

}  // namespace
