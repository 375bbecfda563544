#include <gtest/gtest.h>

#include <fstream>

#include "qpipe/host/practice.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

void practice(const fs::path& file, const std::string& id, double score, const std::string& label,
              const std::string& verified = "[]") {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << "apiversion: modelslim_v1\nmetadata:\n  config_id: " << id << "\n  score: " << score
                      << "\n  label: " << label << "\n  verified_model_types: " << verified
                      << "\nspec:\n  process: [{type: anything}]\n";
}

TEST(QuantType, ParsesMsmodelslimFormsAndQpipesSuffixes) {
  const QuantType a = parseQuantType("w4a8c8");
  EXPECT_EQ(a.wBit, 4);
  EXPECT_EQ(a.aBit, 8);
  EXPECT_TRUE(a.kvCache);
  EXPECT_EQ(parseQuantType("w8a8f8").faBit, 8);
  EXPECT_TRUE(parseQuantType("w8a8s").sparse);
  EXPECT_TRUE(parseQuantType("w8a8_fp8").fp8);
  EXPECT_TRUE(parseQuantType("w8a8_static").isStatic);
  EXPECT_FALSE(parseQuantType("w8a8_fp8").isStatic);
  const QuantType fp8Static = parseQuantType("w8a8_fp8_static");
  EXPECT_TRUE(fp8Static.fp8 && fp8Static.isStatic);
  EXPECT_EQ(test::errorOf([] { parseQuantType("int8"); }, ErrorCode::kUsage),
            "--quant_type 'int8' is not of the form w<bits>a<bits>[c8|f4|f8][s][_fp8|_nvfp4|_mxfp4][_static], e.g. "
            "w8a8, w4a16, w8a8c8, w8a8_fp8, w4a4_nvfp4, w8a8_static");
  const std::string misordered = test::errorOf([] { parseQuantType("w8a8_static_fp8"); }, ErrorCode::kUsage);
  EXPECT_EQ(misordered.rfind("--quant_type 'w8a8_static_fp8' is not of the form", 0), 0u) << misordered;
  EXPECT_EQ(test::errorOf([] { parseQuantType("w8a16_static"); }, ErrorCode::kUsage),
            "--quant_type 'w8a16_static': _static needs quantized activations (a_bit below 16, e.g. w8a8_static)");
  EXPECT_EQ(test::errorOf([] { parseQuantType("w4a16_fp8"); }, ErrorCode::kUsage),
            "--quant_type 'w4a16_fp8': _fp8 needs 8-bit weights (w8a8_fp8 or w8a16_fp8) or is W4AFP8 (w4a8_fp8)");
  const QuantType w4afp8 = parseQuantType("w4a8_fp8");
  EXPECT_TRUE(w4afp8.fp8 && w4afp8.wBit == 4 && w4afp8.aBit == 8);
  EXPECT_TRUE(parseQuantType("w4a4_mxfp4").mxfp4);
  EXPECT_FALSE(parseQuantType("w4a4_mxfp4").nvfp4);
  EXPECT_TRUE(parseQuantType("w4a16_mxfp4").mxfp4);
  EXPECT_EQ(test::errorOf([] { parseQuantType("w4a8_mxfp4"); }, ErrorCode::kUsage),
            "--quant_type 'w4a8_mxfp4': _mxfp4 is w4a4_mxfp4 or w4a16_mxfp4");
  EXPECT_TRUE(parseQuantType("w4a4_nvfp4").nvfp4);
  EXPECT_FALSE(parseQuantType("w4a4_nvfp4").fp8);
  EXPECT_TRUE(parseQuantType("w4a16_nvfp4").nvfp4);
  EXPECT_EQ(test::errorOf([] { parseQuantType("w8a8_nvfp4"); }, ErrorCode::kUsage),
            "--quant_type 'w8a8_nvfp4': _nvfp4 is w4a4_nvfp4 or w4a16_nvfp4");
}

TEST(Practice, ModelFolderFirstThenDefaultHighestScoreThenConfigId) {
  const fs::path lib = test::testDir() / "configs";
  fs::remove_all(lib);
  practice(lib / "default/w8a8.yaml", "default-w8a8", 50, "{w_bit: 8, a_bit: 8}");
  practice(lib / "default/w8a8-static.yaml", "default-w8a8-static", 40, "{w_bit: 8, a_bit: 8, static: true}");
  practice(lib / "default/w8a8-static-best.yaml", "default-w8a8-static-best", 60, "{w_bit: 8, a_bit: 8, static: true}");
  practice(lib / "default/w4a16.yaml", "default-w4a16", 50, "{w_bit: 4, a_bit: 16}");
  practice(lib / "default/fp8.yaml", "default-fp8", 50, "{w_bit: 8, a_bit: 8, fp8: true}");
  practice(lib / "qwen3/b.yaml", "qwen3-w8a8-b", 90, "{w_bit: 8, a_bit: 8}", "[Qwen3]");
  practice(lib / "qwen3/a.yaml", "qwen3-w8a8-a", 90, "{w_bit: 8, a_bit: 8}", "[Qwen3]");
  practice(lib / "qwen3/other.yaml", "qwen3-w8a8-other", 99, "{w_bit: 8, a_bit: 8}", "[Qwen3-MoE]");

  EXPECT_EQ(findPractice(lib, "qwen3", parseQuantType("w8a8")).metadata.configId, "qwen3-w8a8-a");
  EXPECT_EQ(findPractice(lib, "llama", parseQuantType("w8a8")).metadata.configId, "default-w8a8");
  EXPECT_EQ(findPractice(lib, "qwen3", parseQuantType("w4a16")).metadata.configId, "default-w4a16");
  EXPECT_EQ(findPractice(lib, "llama", parseQuantType("w8a8_fp8")).metadata.configId, "default-fp8");
  // A static practice never answers the dynamic label, whatever its score, nor the reverse.
  EXPECT_EQ(findPractice(lib, "llama", parseQuantType("w8a8_static")).metadata.configId, "default-w8a8-static-best");
  EXPECT_EQ(test::errorOf([&] { findPractice(lib, "llama", parseQuantType("w4a4")); }, ErrorCode::kUsage),
            "no practice in " + lib.string() +
                " for --quant_type w4a4 and model type llama; available: w4a16, w8a8, w8a8_fp8, w8a8_static (or pass "
                "--config_path)");
}

}  // namespace
}  // namespace qpipe
