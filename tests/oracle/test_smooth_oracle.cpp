// A smoothed float checkpoint in transformers: a tiny random model of every family made by
// transformers, smoothed by `qpipe quant` with iter_smooth on all four subgraph types and saved
// as compressed-tensors (which writes a plain HF checkpoint when nothing is quantized), loads in
// transformers and gives the original model's logits to 1e-5 relative.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

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
  const fs::path calib = test::writeTempFile(
      "calib.txt", "the quick brown fox jumps over the lazy dog, then the dog sleeps. he thinks the fox is there.\n");
  const test::CommandResult r =
      test::runQpipe("quant --model_path " + dir.string() + " --save_path " + out.string() + " --config_path " +
                     pipeline.string() + " --calib_data " + calib.string() + " --calib_samples 4 --seq_len 16");
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

INSTANTIATE_TEST_SUITE_P(Families, SmoothOracle, ::testing::Values("llama", "smollm", "qwen2", "qwen3", "qwen3_moe"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace qpipe
