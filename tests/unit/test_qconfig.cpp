// qconfig blocks: the msmodelslim spelling, defaults, and every combination linear_quant refuses,
// each with file:line:col and the field.
#include <gtest/gtest.h>

#include "qpipe/config_node.h"
#include "qpipe/qconfig.h"
#include "qpipe/schema.h"
#include "test_helpers.h"

namespace qpipe::quant {
namespace {

LinearQConfig parse(const std::string& yaml) {
  const ConfigNode node = ConfigNode::parseYaml(yaml, "q.yaml");
  return parseLinearQConfig(linearQConfigSchema().validate(node, "qconfig"), "qconfig");
}

std::string parseError(const std::string& yaml) {
  return test::errorOf([&] { parse(yaml); }, ErrorCode::kConfig);
}

// As a processor parses it: `ext` keys without effect go to `ignored`.
LinearQConfig parseLenient(const std::string& yaml, std::vector<std::string>& ignored) {
  const ConfigNode node = ConfigNode::parseYaml(yaml, "q.yaml");
  return parseLinearQConfig(linearQConfigSchema().validate(node, "qconfig"), "qconfig", &ignored);
}

TEST(QConfig, ActDefaultsToFloatAndWeightToInt8PerChannel) {
  const LinearQConfig config = parse("weight: {}\n");
  EXPECT_FALSE(config.act.enabled());
  EXPECT_TRUE(config.isDataFree());
  EXPECT_EQ(config.weight.scheme.dtype, QDtype::kInt8);
  EXPECT_EQ(config.weight.scheme.scope, QScope::kPerChannel);
  EXPECT_TRUE(config.weight.scheme.symmetric);
  EXPECT_EQ(config.describe(), "w int8 per_channel sym minmax, a float");
}

TEST(QConfig, DynamicW8A8IsDataFreeAndStaticIsNot) {
  const LinearQConfig dynamic = parse(
      "act: {dtype: int8, scope: per_token, symmetric: True, method: minmax}\n"
      "weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}\n");
  EXPECT_TRUE(dynamic.isDataFree());
  EXPECT_EQ(dynamic.describe(), "w int8 per_channel sym minmax, a int8 per_token sym dynamic");
  const LinearQConfig staticAct = parse(
      "act: {dtype: int8, scope: per_tensor, symmetric: False, method: minmax, ext: {aggregation_type: mean}}\n"
      "weight: {dtype: int8, scope: per_channel}\n");
  EXPECT_FALSE(staticAct.isDataFree());
  EXPECT_EQ(staticAct.act.aggregation, Aggregation::kMean);
  EXPECT_FALSE(staticAct.act.scheme.symmetric);
}

TEST(QConfig, ExtOptions) {
  EXPECT_EQ(parse("weight: {dtype: int4, scope: per_group}\n").weight.scheme.groupSize, 128);
  EXPECT_EQ(parse("weight: {dtype: int4, scope: per_group, ext: {group_size: 32}}\n").weight.scheme.groupSize, 32);
  EXPECT_EQ(parse("weight: {dtype: int4, method: ssz, ext: {step: 10}}\n").weight.sszSteps, 10);
  EXPECT_EQ(parse("weight: {dtype: int4, method: ssz}\n").weight.sszSteps, 50);
  const LinearQConfig histogram =
      parse("act: {dtype: int8, method: histogram, ext: {search_method: kl_divergence}}\nweight: {}\n");
  EXPECT_EQ(histogram.act.method, QMethod::kHistogram);
  EXPECT_EQ(histogram.act.search, HistogramObserver::Search::kKlDivergence);
}

TEST(QConfig, Fp8PairsWithFp8OrFloatActivations) {
  const LinearQConfig fp8 = parse("act: {dtype: fp8_e4m3, scope: per_token}\nweight: {dtype: fp8_e4m3}\n");
  EXPECT_EQ(fp8.describe(), "w fp8_e4m3 per_channel sym minmax, a fp8_e4m3 per_token sym dynamic");
  EXPECT_EQ(parseError("act: {dtype: int8, scope: per_token}\nweight: {dtype: fp8_e4m3}\n"),
            "q.yaml:1:14: qconfig.act.dtype: fp8_e4m3 weights run with fp8_e4m3 or float activations, int weights "
            "with int8 or float, and int4 weights also with fp8_e4m3 (W4AFP8)");
  EXPECT_EQ(parseError("act: {dtype: fp8_e4m3, scope: per_token}\nweight: {dtype: int8}\n"),
            "q.yaml:1:14: qconfig.act.dtype: fp8_e4m3 weights run with fp8_e4m3 or float activations, int weights "
            "with int8 or float, and int4 weights also with fp8_e4m3 (W4AFP8)");
}

TEST(QConfig, W4afp8IsInt4WeightsWithFp8Activations) {
  const LinearQConfig w4afp8 = parse(
      "act: {dtype: fp8_e4m3, scope: per_token}\n"
      "weight: {dtype: int4, scope: per_group, ext: {group_size: 128}}\n");
  EXPECT_EQ(w4afp8.describe(), "w int4 per_group128 sym minmax, a fp8_e4m3 per_token sym dynamic");
  EXPECT_TRUE(w4afp8.isDataFree());
}

TEST(QConfig, Mxfp4IsBlocksOf32WithMxfp4OrFloatActivations) {
  const LinearQConfig w4a4 = parse(
      "act: {dtype: mxfp4, scope: per_group}\n"
      "weight: {dtype: mxfp4, scope: per_group}\n");
  EXPECT_EQ(w4a4.weight.scheme.groupSize, kMxfp4GroupSize);
  EXPECT_EQ(w4a4.act.scheme.groupSize, kMxfp4GroupSize);
  EXPECT_TRUE(w4a4.isDataFree()) << "every activation block scale is computed from its input";
  EXPECT_EQ(w4a4.describe(), "w mxfp4 per_group32 sym minmax, a mxfp4 per_group32 sym dynamic");
  EXPECT_EQ(parseError("weight: {dtype: mxfp4, scope: per_channel}\n"),
            "q.yaml:1:31: qconfig.weight.scope: mxfp4 weights are per_group (blocks of 32 with E8M0 scales)");
  EXPECT_EQ(parseError("weight: {dtype: mxfp4, scope: per_group, ext: {group_size: 16}}\n"),
            "q.yaml:1:60: qconfig.weight.ext.group_size: mxfp4 blocks are 32 wide (the OCP MX block)");
  EXPECT_EQ(parseError("weight: {dtype: mxfp4, scope: per_group, symmetric: False}\n"),
            "q.yaml:1:53: qconfig.weight.symmetric: mxfp4 is symmetric only; set symmetric: True");
  EXPECT_EQ(parseError("act: {dtype: mxfp4, scope: per_tensor}\nweight: {dtype: mxfp4, scope: per_group}\n"),
            "q.yaml:1:28: qconfig.act.scope: mxfp4 activations are per_group (blocks of 32 scaled per input)");
  EXPECT_EQ(parseError("act: {dtype: nvfp4, scope: per_group}\nweight: {dtype: mxfp4, scope: per_group}\n"),
            "q.yaml:1:14: qconfig.act.dtype: mxfp4 weights run with mxfp4 (W4A4) or float (W4A16) activations, and "
            "mxfp4 activations with mxfp4 weights");
}

TEST(QConfig, Nvfp4IsBlocksOf16WithNvfp4OrFloatActivations) {
  const LinearQConfig w4a4 = parse(
      "act: {dtype: nvfp4, scope: per_group}\n"
      "weight: {dtype: nvfp4, scope: per_group}\n");
  EXPECT_EQ(w4a4.weight.scheme.groupSize, kNvfp4GroupSize);
  EXPECT_EQ(w4a4.act.scheme.groupSize, kNvfp4GroupSize);
  EXPECT_FALSE(w4a4.isDataFree()) << "the activations' global scale is calibrated";
  EXPECT_EQ(w4a4.describe(), "w nvfp4 per_group16 sym minmax, a nvfp4 per_group16 sym minmax");
  EXPECT_TRUE(parse("weight: {dtype: nvfp4, scope: per_group, ext: {group_size: 16}}\n").isDataFree());
  EXPECT_EQ(parseError("weight: {dtype: nvfp4, scope: per_channel}\n"),
            "q.yaml:1:31: qconfig.weight.scope: nvfp4 weights are per_group (blocks of 16 with E4M3 scales and one "
            "global scale)");
  EXPECT_EQ(parseError("weight: {dtype: nvfp4, scope: per_group, ext: {group_size: 32}}\n"),
            "q.yaml:1:60: qconfig.weight.ext.group_size: nvfp4 blocks are 16 wide (what vLLM's NVFP4 kernels take)");
  EXPECT_EQ(parseError("weight: {dtype: nvfp4, scope: per_group, symmetric: False}\n"),
            "q.yaml:1:53: qconfig.weight.symmetric: nvfp4 is symmetric only; set symmetric: True");
  EXPECT_EQ(parseError("act: {dtype: nvfp4, scope: per_token}\nweight: {dtype: nvfp4, scope: per_group}\n"),
            "q.yaml:1:28: qconfig.act.scope: nvfp4 activations are per_group (blocks of 16 scaled per input, one "
            "calibrated global scale)");
  EXPECT_EQ(parseError("act: {dtype: int8, scope: per_token}\nweight: {dtype: nvfp4, scope: per_group}\n"),
            "q.yaml:1:14: qconfig.act.dtype: nvfp4 weights run with nvfp4 (W4A4) or float (W4A16) activations, and "
            "nvfp4 activations with nvfp4 weights");
  EXPECT_EQ(parseError("act: {dtype: nvfp4, scope: per_group}\nweight: {dtype: int4, scope: per_group}\n"),
            "q.yaml:1:14: qconfig.act.dtype: nvfp4 weights run with nvfp4 (W4A4) or float (W4A16) activations, and "
            "nvfp4 activations with nvfp4 weights");
}

TEST(QConfig, UnknownDtypeNamesFileLineAndField) {
  EXPECT_EQ(parseError("weight:\n  dtype: int5\n"),
            "q.yaml:2:10: qconfig.weight.dtype: 'int5' is not one of: int8, int4, fp8_e4m3, nvfp4, mxfp4, float");
}

TEST(QConfig, RefusedCombinations) {
  EXPECT_EQ(
      parseError("act: {dtype: int4, scope: per_token}\nweight: {}\n"),
      "q.yaml:1:14: qconfig.act.dtype: int4 activations (W4A4) are not supported; use int8, fp8_e4m3, nvfp4 or mxfp4");
  EXPECT_EQ(parseError("act: {dtype: int8, scope: per_channel}\nweight: {}\n"),
            "q.yaml:1:27: qconfig.act.scope: linear activations are per_tensor (static, calibrated) or per_token "
            "(dynamic)");
  EXPECT_EQ(parseError("act: {dtype: int8, scope: per_token, method: histogram}\nweight: {}\n"),
            "q.yaml:1:46: qconfig.act.method: histogram calibrates int8 per_tensor activations only");
  EXPECT_EQ(parseError("act: {dtype: int8, method: ssz}\nweight: {}\n"),
            "q.yaml:1:28: qconfig.act.method: ssz searches weight scales; activations take minmax or histogram");
  EXPECT_EQ(parseError("weight: {dtype: int8, method: none}\n"),
            "q.yaml:1:31: qconfig.weight.method: 'none' quantizes nothing; use minmax, or dtype: float to leave this "
            "side unquantized");
  EXPECT_EQ(parseError("weight: {dtype: float}\n"),
            "q.yaml:1:17: qconfig.weight.dtype: float leaves the weight unquantized; use int8, int4 or fp8_e4m3");
  EXPECT_EQ(parseError("weight: {scope: per_token}\n"),
            "q.yaml:1:17: qconfig.weight.scope: weights are per_tensor, per_channel or per_group");
  EXPECT_EQ(parseError("weight: {dtype: int4, scope: per_group, method: ssz}\n"),
            "q.yaml:1:49: qconfig.weight.method: ssz searches int8/int4 per_channel symmetric weights only");
  EXPECT_EQ(parseError("weight: {dtype: fp8_e4m3, symmetric: False}\n"),
            "q.yaml:1:38: qconfig.weight.symmetric: fp8_e4m3 is symmetric only; set symmetric: True");
  EXPECT_EQ(parseError("weight: {dtype: fp8_e4m3, scope: per_group}\n"),
            "q.yaml:1:34: qconfig.weight.scope: per_group applies to int8/int4 weights; fp8_e4m3 takes per_tensor "
            "or per_channel");
  EXPECT_EQ(parseError("weight: {method: histogram}\n"),
            "q.yaml:1:18: qconfig.weight.method: histogram calibrates activations; weights take minmax or ssz");
}

TEST(QConfig, ExtKeysOnlyWhereTheyApply) {
  EXPECT_EQ(parseError("weight: {ext: {step: 10}}\n"),
            "q.yaml:1:22: qconfig.weight.ext.step: applies to method ssz only");
  EXPECT_EQ(parseError("weight: {scope: per_channel, ext: {group_size: 64}}\n"),
            "q.yaml:1:48: qconfig.weight.ext.group_size: applies to scope per_group only");
  EXPECT_EQ(parseError("weight: {dtype: int4, scope: per_group, ext: {group_size: 0}}\n"),
            "q.yaml:1:59: qconfig.weight.ext.group_size: must be >= 1");
  EXPECT_EQ(parseError("act: {dtype: int8, scope: per_token, ext: {aggregation_type: mean}}\nweight: {}\n"),
            "q.yaml:1:62: qconfig.act.ext.aggregation_type: applies to static minmax activations only");
  EXPECT_EQ(parseError("act: {ext: {step: 3}}\nweight: {}\n"),
            "q.yaml:1:19: qconfig.act.ext.step: has no effect when dtype is float");
  EXPECT_EQ(parseError("weight: {ext: {setp: 3}}\n"),
            "q.yaml:1:22: qconfig.weight.ext.setp: unknown field; did you mean 'step'?; expected one of: "
            "aggregation_type, search_method, step, group_size");
  EXPECT_EQ(parseError("act: {dtype: int8}\n"),
            "q.yaml:1:1: qconfig: missing required field 'weight' (a mapping: weight)");
}

// msmodelslim's quantizers pass over `ext` keys they do not read (its Qwen3-MoE W4A8 practice sets
// group_size beside per_channel SSZ): a processor gets them as warnings; bad values stay errors.
TEST(QConfig, ExtKeysWithoutEffectAreIgnoredWhereTheCallerCollectsThem) {
  std::vector<std::string> ignored;
  const LinearQConfig config = parseLenient(
      "act: {dtype: int8, scope: per_token, ext: {aggregation_type: mean}}\n"
      "weight: {dtype: int4, scope: per_channel, method: ssz, ext: {group_size: 64, step: 7}}\n",
      ignored);
  EXPECT_EQ(config.weight.scheme.scope, QScope::kPerChannel);
  EXPECT_EQ(config.weight.scheme.groupSize, 0);
  EXPECT_EQ(config.weight.sszSteps, 7);
  EXPECT_EQ(ignored, (std::vector<std::string>{
                         "q.yaml:1:62: qconfig.act.ext.aggregation_type: applies to static minmax activations only; "
                         "ignored",
                         "q.yaml:2:74: qconfig.weight.ext.group_size: applies to scope per_group only; ignored"}));
  ignored.clear();
  EXPECT_EQ(
      test::errorOf([&] { parseLenient("weight: {method: ssz, ext: {step: 0}}\n", ignored); }, ErrorCode::kConfig),
      "q.yaml:1:35: qconfig.weight.ext.step: must be >= 1");
}

// msmodelslim spells the MX formats' scope per_block (mxfp4_per_block_sym).
TEST(QConfig, PerBlockIsTheFp4FormatsBlocks) {
  const LinearQConfig mx = parse(
      "act: {dtype: mxfp4, scope: per_block, symmetric: True, method: minmax}\n"
      "weight: {dtype: mxfp4, scope: per_block, symmetric: True, method: minmax}\n");
  EXPECT_EQ(mx.weight.scheme.scope, QScope::kPerGroup);
  EXPECT_EQ(mx.weight.scheme.groupSize, kMxfp4GroupSize);
  EXPECT_EQ(mx.act.scheme.scope, QScope::kPerGroup);
  EXPECT_EQ(mx.describe(),
            parse("act: {dtype: mxfp4, scope: per_group}\nweight: {dtype: mxfp4, scope: per_group}\n").describe());
  EXPECT_EQ(parse("weight: {dtype: nvfp4, scope: per_block}\n").weight.scheme.groupSize, kNvfp4GroupSize);
  EXPECT_EQ(parseError("weight: {dtype: int4, scope: per_block}\n"),
            "q.yaml:1:30: qconfig.weight.scope: per_block is msmodelslim's scope of the 4-bit block formats (mxfp4, "
            "nvfp4), not of int4");
  EXPECT_EQ(parseError("act: {dtype: int8, scope: per_block}\nweight: {}\n"),
            "q.yaml:1:27: qconfig.act.scope: per_block is msmodelslim's scope of the 4-bit block formats (mxfp4, "
            "nvfp4), not of int8");
}

}  // namespace
}  // namespace qpipe::quant
