// tools/check_equivalence.sh over every shipped practice (QAT ones included), and msmodelslim's own default-w8a8 as
// published (tests/fixtures/pipelines/msmodelslim): 1, 2 and 3 ranks (5 samples, so the ranks
// hold 5, 3+2 and 2+2+1) must write byte-identical checkpoints of a tiny Qwen3.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "equivalence.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;

std::vector<fs::path> pipelines() {
  std::vector<fs::path> files;
  for (const char* folder : {"configs/default", "configs/qat", "tests/fixtures/pipelines/msmodelslim"}) {
    for (const auto& entry : fs::directory_iterator(fs::path(QPIPE_SOURCE_DIR) / folder)) {
      if (entry.path().extension() == ".yaml") files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// "msmodelslim_default_w8a8" for tests/fixtures/pipelines/msmodelslim/default-w8a8.yaml.
std::string testName(const fs::path& pipeline) {
  std::string name = pipeline.stem().string();
  if (pipeline.parent_path().filename() == "msmodelslim") name = "msmodelslim_" + name;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

void expectIdentical(const fs::path& model, const fs::path& pipeline) {
  for (const std::string& row : qpipe::test::equivalenceRows(model, pipeline)) {
    EXPECT_NE(row.find("byte-identical, 0 within --tolerance 0, 0 different"), std::string::npos) << row;
  }
}

class Equivalence : public ::testing::TestWithParam<fs::path> {};

TEST_P(Equivalence, OneTwoAndThreeRanksWriteTheSameCheckpoint) {
  expectIdentical(qpipe::test::tinyQwen3("equivalence-" + testName(GetParam())), GetParam());
}

// flex_smooth_quant keeping `searchTokens` search tokens (and `more` fields), then int8
// per-channel weights and `act`.
fs::path flexSmoothPipeline(int searchTokens, const std::string& act, const std::string& more = "") {
  return qpipe::test::writeTempFile("flex.yaml",
                                    "apiversion: modelslim_v1\nspec:\n  process:\n"
                                    "    - {type: flex_smooth_quant, search_tokens: " +
                                        std::to_string(searchTokens) + more +
                                        "}\n    - type: linear_quant\n      qconfig:\n        act: " + act +
                                        "\n        weight: {dtype: int8, scope: per_channel}\n");
}

// flex_smooth_quant's search keeps 7 of the 160 calibration tokens: the same 7 whichever rank
// saw them, so the searched α and β, and the checkpoint, are those of one rank.
TEST(EquivalenceSmoothing, FlexSmoothQuantSearchesTheSameTokensOnAnyNumberOfRanks) {
  expectIdentical(qpipe::test::tinyQwen3("equivalence-flex-search"),
                  flexSmoothPipeline(7, "{dtype: int8, scope: per_tensor, symmetric: False}"));
}

// Inputs of 384 channels or more share their searches' float products: one parallel task per 64
// of the 150 search tokens, whose rows every rank receives in the wave's exchange. Each candidate
// is three pieces of its outputs (search_split), whose sums every rank adds up.
TEST(EquivalenceSmoothing, FlexSmoothQuantSharesWideProductsOnAnyNumberOfRanks) {
  qpipe::test::detail::TinySpec wide = qpipe::test::detail::tinyLlamaSpec();
  wide.hidden = wide.intermediate = 384;
  wide.headDim = wide.hidden / wide.heads;
  expectIdentical(qpipe::test::detail::writeTinyCheckpoint("equivalence-flex-wide", wide, {}),
                  flexSmoothPipeline(150, "{dtype: int8, scope: per_token}", ", search_split: 3"));
}

// flex_awq_ssz on a Qwen3-MoE: one subgraph per expert, experts that a rank routes no token to
// (their statistics and search tokens come from the others), and a norm-linear with more
// consumers than it searches on; the candidates spread over the ranks.
TEST(EquivalenceSmoothing, FlexAwqSszOnAMoeGivesTheSameCheckpointOnAnyNumberOfRanks) {
  expectIdentical(qpipe::test::tinyMoe("equivalence-moe-awq"),
                  fs::path(QPIPE_SOURCE_DIR) / "configs/default/w4a8_flex_awq.yaml");
}

// Asymmetric iter_smooth: the shifts come from the merged min/max, the new norm and projection
// biases land in an ascendv1 checkpoint.
TEST(EquivalenceSmoothing, AsymmetricIterSmoothGivesTheSameBiasesOnAnyNumberOfRanks) {
  const fs::path pipeline = qpipe::test::writeTempFile("asymmetric.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - {type: iter_smooth, symmetric: False}
    - type: linear_quant
      qconfig:
        act: {dtype: int8, scope: per_tensor, symmetric: False}
        weight: {dtype: int8, scope: per_channel}
  save: [{type: ascendv1_saver}]
)");
  expectIdentical(qpipe::test::tinyQwen3("equivalence-asymmetric"), pipeline);
}

INSTANTIATE_TEST_SUITE_P(Practices, Equivalence, ::testing::ValuesIn(pipelines()),
                         [](const auto& info) { return testName(info.param); });

}  // namespace
