// tools/check_equivalence.sh with lm_head quantized: the non-layer unit runs in lock-step on every
// rank, and lm_head's static activation observers are synchronised like a layer's, so 1, 2 and 3
// ranks (5 samples: 5, 3+2 and 2+2+1) write byte-identical checkpoints of a tiny Qwen3.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "equivalence.h"
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
  const fs::path pipeline = qpipe::test::writeTempFile("head.yaml", kPipeline);
  // 2 layers × (7 Linears × weight, weight_scale, input_scale, input_zero_point + 4 norms), the
  // embedding, the final norm and lm_head's 4 tensors: lm_head was quantized.
  for (const std::string& row : qpipe::test::equivalenceRows(model, pipeline)) {
    EXPECT_NE(row.find("70 tensors: 70 byte-identical, 0 within --tolerance 0, 0 different"), std::string::npos) << row;
  }
}

}  // namespace
