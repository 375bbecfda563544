// Every model family against transformers: a tiny random fp32 checkpoint made by transformers,
// the same ids through both, logits within max|diff| / max|ref| <= 1e-4, for batch 1 and for a
// left-padded batch of 2.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qpipe/model.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

fs::path save(const fs::path& path, const std::string& name, const at::Tensor& tensor) {
  safetensors::Writer writer(path.parent_path(), {.filePrefix = path.stem().string()});
  writer.add(name, tensor);
  writer.finish();
  return path;
}

double relativeError(const at::Tensor& ours, const at::Tensor& reference) {
  return (ours - reference).abs().max().item<double>() / reference.abs().max().item<double>();
}

class ModelOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelOracle, LogitsMatchTransformers) {
  const std::string family = GetParam();
  const fs::path dir = test::writeTempFile("x", "").parent_path() / family;
  const fs::path work = test::writeTempFile("x", "").parent_path() / (family + "-io");
  fs::remove_all(dir);
  fs::create_directories(work);
  const int64_t seq = 40;
  at::manual_seed(5);
  const at::Tensor ids = at::randint(211, {2, seq}, at::kLong);  // the oracle's vocabulary size
  at::Tensor mask = at::ones({2, seq}, at::kLong);
  mask[1].slice(0, 0, 7).zero_();  // left padding on the second row
  save(work / "ids.safetensors", "ids", ids);
  save(work / "mask.safetensors", "mask", mask);
  test::runOracle("model_oracle.py", "both " + family + " " + dir.string() + " " + (work / "ids.safetensors").string() +
                                         " " + (work / "mask.safetensors").string() + " " +
                                         (work / "ref.safetensors").string());
  const auto reference = safetensors::File::open(work / "ref.safetensors");

  auto model = CausalLM::open(dir);
  const at::Tensor single = model->forward(ids.slice(0, 0, 1));
  const at::Tensor singleRef = reference->tensor("single");
  EXPECT_LE(relativeError(single, singleRef), 1e-4) << family << " batch 1";

  const at::Tensor batch = model->forward(ids, mask);
  const at::Tensor batchRef = reference->tensor("logits");
  EXPECT_LE(relativeError(batch[0], batchRef[0]), 1e-4) << family << " padded batch, full row";
  EXPECT_LE(relativeError(batch[1].slice(0, 7), batchRef[1].slice(0, 7)), 1e-4)
      << family << " padded batch, padded row";
}

INSTANTIATE_TEST_SUITE_P(Families, ModelOracle,
                         ::testing::Values("llama", "smollm", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_fused"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace qpipe
