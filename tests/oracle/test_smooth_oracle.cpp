// Smoothing against the Python world, on tiny random models made by transformers:
// - a smoothed float checkpoint (`qpipe quant` with iter_smooth on all four subgraph types,
//   saved as compressed-tensors, which writes a plain HF checkpoint when nothing is quantized)
//   loads in transformers and gives the original model's logits to 1e-5 relative;
// - smooth_quant's scales are llm-compressor's SmoothQuantModifier's (PyPI llmcompressor in
//   .venv-bench) on the same model, calibration ids, α and mappings, to 1e-5 relative.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/runner.h"
#include "qpipe/model.h"
#include "qpipe/plugin.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

QPIPE_DECLARE_STATIC_PLUGIN(smooth);

namespace qpipe {
namespace {

namespace fs = std::filesystem;

void save(const fs::path& path, const std::string& name, const at::Tensor& tensor) {
  safetensors::Writer writer(path.parent_path(), {.filePrefix = path.stem().string()});
  writer.add(name, tensor);
  writer.finish();
}

class SmoothOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(SmoothOracle, TheSmoothedCheckpointGivesTheFloatLogitsInTransformers) {
  const std::string family = GetParam();
  const fs::path dir = test::testDir() / family, out = test::testDir() / (family + "-smoothed");
  const fs::path work = test::testDir() / (family + "-io");
  fs::remove_all(dir);
  fs::remove_all(out);
  fs::create_directories(work);
  at::manual_seed(6);
  save(work / "ids.safetensors", "ids", at::randint(test::kTinyVocab, {2, 24}, at::kLong));
  save(work / "mask.safetensors", "mask", at::ones({2, 24}, at::kLong));
  test::runOracle("model_oracle.py", "both " + family + " " + dir.string() + " " + (work / "ids.safetensors").string() +
                                         " " + (work / "mask.safetensors").string() + " " +
                                         (work / "ref.safetensors").string());
  test::writeTinyTokenizer(dir);  // ids below the tiny vocabulary, within the oracle's 211
  const fs::path pipeline = test::writeTempFile("smooth.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - {type: iter_smooth}
  save:
    - {type: compressed_tensors}
)");
  const test::CommandResult r = test::runTinyQuant(dir, out, pipeline);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  test::runOracle("model_oracle.py", "logits " + out.string() + " " + (work / "ids.safetensors").string() + " " +
                                         (work / "mask.safetensors").string() + " " +
                                         (work / "smoothed.safetensors").string());
  const at::Tensor expected = safetensors::File::open(work / "ref.safetensors")->tensor("logits");
  const at::Tensor actual = safetensors::File::open(work / "smoothed.safetensors")->tensor("logits");
  EXPECT_LE((actual - expected).abs().max().item<double>() / expected.abs().max().item<double>(), 1e-5);
  // Smoothing changed the weights it should have: the checkpoints differ.
  const auto original = safetensors::File::open(dir / "model.safetensors");
  const auto smoothed = safetensors::File::open(out / "model.safetensors");
  const std::string norm = "model.layers.0.input_layernorm.weight";
  EXPECT_FALSE(at::equal(original->tensor(norm), smoothed->tensor(norm)));
}

class SmoothQuantOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(SmoothQuantOracle, ScalesAreLlmCompressorsSmoothQuantModifiers) {
  const std::string family = GetParam();
  const fs::path dir = test::testDir() / ("sq-" + family), work = test::testDir() / ("sq-" + family + "-io");
  fs::remove_all(dir);
  fs::create_directories(work);
  test::runOracle("model_oracle.py", "make " + family + " " + dir.string());
  at::manual_seed(7);
  const at::Tensor ids = at::randint(211, {4, 24}, at::kLong);  // the oracle model's vocabulary
  save(work / "ids.safetensors", "ids", ids);
  const double alpha = 0.6;
  test::runOracleWith(QPIPE_LLMC_PYTHON, "llmcompressor_oracle.py",
                      "smooth " + dir.string() + " " + (work / "ids.safetensors").string() + " " +
                          std::to_string(alpha) + " " + (work / "llmc.safetensors").string());

  Registry registry;
  PluginLoader loader(registry);
  loader.addStatic(qpipe_plugin_descriptor_smooth());
  const Pipeline pipeline = loadPipeline(
      test::writeTempFile("sq.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n    - {type: smooth_quant, alpha: " +
                                         std::to_string(alpha) + "}\n"),
      registry);
  auto processors = buildProcessors(pipeline, registry, {});
  auto model = CausalLM::open(dir);
  std::vector<at::Tensor> samples;
  for (int64_t i = 0; i < ids.size(0); ++i) samples.push_back(ids[i].unsqueeze(0));
  LayerWiseRunner(*model, processors, {.mode = RunnerMode::kModelWise}).run(samples, {});

  const auto original = safetensors::File::open(dir / "model.safetensors");
  const auto reference = safetensors::File::open(work / "llmc.safetensors");
  for (int64_t layer = 0; layer < model->config().numLayers; ++layer) {
    for (const std::string norm : {"input_layernorm", "post_attention_layernorm"}) {
      const std::string name = model->layerName(layer) + "." + norm + ".weight";
      // s = original / smoothed norm weight, on both sides.
      const at::Tensor before = original->tensor(name);
      const at::Tensor ours = before / model->layer(layer).getSubmodule(norm).parameter("weight");
      const at::Tensor theirs = before / reference->tensor(name);
      EXPECT_LE((ours - theirs).abs().max().item<double>() / theirs.abs().max().item<double>(), 1e-5) << name;
      EXPECT_GT((theirs - 1).abs().max().item<double>(), 1e-3) << name << ": llm-compressor did not smooth it";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SmoothQuantOracle, ::testing::Values("llama", "smollm", "qwen2", "qwen3"),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Families, SmoothOracle, ::testing::Values("llama", "smollm", "qwen2", "qwen3", "qwen3_moe"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace qpipe
