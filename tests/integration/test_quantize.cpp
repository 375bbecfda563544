// qpipe::quantize() in-process, as a library user calls it: the second example plugin
// (module_stats, docs/plugins.md) before linear_quant on the tiny Llama; its report values are
// checked against the float model computed here, independently of the runner.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "qpipe/dataset.h"
#include "qpipe/host/quantize.h"
#include "qpipe/model.h"
#include "qpipe/tokenizer.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

const fs::path kSource = QPIPE_SOURCE_DIR;
const fs::path kExamplePlugins = fs::path(QPIPE_TEST_PLUGIN_DIR) / "example";

double reported(const QuantReport& report, const std::string& module, const std::string& key) {
  for (const LayerReport& layer : report.layers) {
    for (const ReportValue& value : layer.values) {
      if (value.module == module && value.key == key) return value.value;
    }
  }
  ADD_FAILURE() << "no " << key << " for " << module;
  return -1;
}

TEST(Quantize, InProcessWithTheStatsExampleBeforeLinearQuant) {
  const fs::path model = test::tinyLlama("quantize-lib");
  const fs::path out = test::testDir() / "quantized";
  fs::remove_all(out);
  const fs::path pipeline = test::writeTempFile("stats.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - {type: module_stats, include: ["*mlp.up_proj"]}
    - type: linear_quant
      qconfig: {weight: {dtype: int8}, act: {dtype: int8, scope: per_token}}
      exclude: ["lm_head"]
)");
  const QuantizeOptions options{.modelPath = model,
                                .savePath = out,
                                .configPath = pipeline,
                                .calibData = kSource / "data" / "calib.jsonl",
                                .calibSamples = 3,
                                .seqLen = 16,
                                .pluginPath = PluginLoader::searchPath(kExamplePlugins, PluginLoader::builtinDir())};
  const QuantizeResult result = quantize(options);
  EXPECT_TRUE(result.saved);
  EXPECT_EQ(result.saver, "compressed_tensors");
  EXPECT_TRUE(fs::exists(out / "quant_report.json"));
  EXPECT_NE(test::slurp(out / "quant_report.json").find("\"input_absmax\""), std::string::npos);

  // The float model over the same windows, hooked where the plugin hooks.
  c10::InferenceMode inference;
  auto lm = CausalLM::open(model);
  const Tokenizer tokenizer = Tokenizer::fromFile(model / "tokenizer.json");
  const auto windows = calibrationWindows(encodeDataset(options.calibData, tokenizer), "calib", 3, 16);
  for (int64_t layer = 0; layer < lm->config().numLayers; ++layer) {
    Linear& upProj = lm->layer(layer).getSubmodule("mlp.up_proj").as<Linear>("up_proj");
    double inputAbsmax = 0;
    upProj.addForwardHook([&](Module&, const at::Tensor& x, const at::Tensor&) {
      inputAbsmax = std::max(inputAbsmax, x.abs().max().item<double>());
      return at::Tensor();
    });
    const std::string name = lm->layerName(layer) + ".mlp.up_proj";
    EXPECT_EQ(reported(result.report, name, "weight_absmax"), upProj.weight().abs().max().item<double>()) << name;
    for (const at::Tensor& window : windows) lm->forward(window);
    EXPECT_NEAR(reported(result.report, name, "input_absmax"), inputAbsmax, 1e-6 * inputAbsmax) << name;
  }
}

TEST(Quantize, CheckRefusesABadPipelineWithoutTouchingTheModel) {
  const fs::path pipeline = test::writeTempFile("bad.yaml", "apiversion: modelslim_v1\nspec:\n  process: []\n");
  const QuantizeOptions options{.modelPath = test::testDir(), .configPath = pipeline};
  EXPECT_EQ(test::errorOf([&] { checkQuantize(options); }, ErrorCode::kConfig),
            pipeline.string() + ":3:12: spec.process: the list of processors is empty");
}

}  // namespace
}  // namespace qpipe
