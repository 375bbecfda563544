// tools/check_equivalence.sh with lm_head quantized: the non-layer unit runs in lock-step on every
// rank, and lm_head's static activation observers are synchronised like a layer's, so 1, 2 and 3
// ranks (5 samples: 5, 3+2 and 2+2+1) write byte-identical checkpoints of a tiny Qwen3.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "test_helpers.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;

// Static activations of both observer kinds: min/max over every sample for the layers and a
// histogram search for lm_head, the one Linear of the non-layer unit.
const char* const kPipeline = R"(apiversion: modelslim_v1
spec:
  process:
    - type: group
      configs:
        - type: linear_quant
          qconfig:
            act: {dtype: int8, scope: per_tensor, symmetric: False, method: minmax}
            weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
          exclude: ["lm_head"]
        - type: linear_quant
          qconfig:
            act: {dtype: int8, scope: per_tensor, symmetric: False, method: histogram}
            weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
          include: ["lm_head"]
)";

TEST(HeadEquivalence, QuantizedLmHeadIsTheSameOnOneTwoAndThreeRanks) {
  const fs::path model = qpipe::test::tinyQwen3("head-equivalence");
  const fs::path dir = qpipe::test::testDir();
  const fs::path pipeline = qpipe::test::writeTempFile("head.yaml", kPipeline);
  std::string command = "QPIPE_BINARY=";
  command += QPIPE_BINARY;
  command += " " + (fs::path(QPIPE_SOURCE_DIR) / "tools" / "check_equivalence.sh").string();
  command += " --model_path '" + model.string() + "' --config_path '" + pipeline.string() + "'";
  command += " --calib_samples 5 --seq_len 32 --threads_per_rank 1 --dist_timeout 20";
  command += " >" + (dir / "out").string() + " 2>" + (dir / "err").string() + " </dev/null";
  const int status = std::system(command.c_str());
  const std::string out = qpipe::test::slurp(dir / "out");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out << qpipe::test::slurp(dir / "err");
  EXPECT_NE(out.find("(reference)"), std::string::npos) << out;
  for (const char* ranks : {"\n2 ", "\n3 "}) {
    const size_t row = out.find(ranks);
    ASSERT_NE(row, std::string::npos) << out;
    const std::string line = out.substr(row + 1, out.find('\n', row + 1) - row - 1);
    // 2 layers × (7 Linears × weight, weight_scale, input_scale, input_zero_point + 4 norms), the
    // embedding, the final norm and lm_head's 4 tensors: lm_head was quantized.
    EXPECT_NE(line.find("70 tensors: 70 byte-identical, 0 within --tolerance 0, 0 different"), std::string::npos)
        << line;
  }
}

}  // namespace
