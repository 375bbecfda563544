// fa3_quant's KV cache in compressed-tensors (docs/attention.md): `qpipe quant` quantizes K and V
// of a tiny transformers Llama, saves a kv_cache_scheme checkpoint, and transformers +
// compressed-tensors load it: the k_scale / v_scale it holds are ours bit for bit, and its
// KV-quantized logits match qpipe's own load of the checkpoint.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <string>

#include "qpipe/model.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

class Fa3Oracle : public ::testing::TestWithParam<std::string> {};

TEST_P(Fa3Oracle, TransformersReadsOurKvScalesAndQuantizesTheCacheAsWeDo) {
  const std::string scope = GetParam();
  const fs::path dir = test::testDir() / "src", out = test::testDir() / ("kv-" + scope);
  fs::remove_all(dir);
  fs::remove_all(out);
  test::runOracle("quantized_checkpoint_oracle.py", "make " + dir.string());
  test::writeTinyTokenizer(dir);
  const std::string dtype = scope == "per_tensor" ? "fp8_e4m3" : "int8";
  const std::string kv = "{dtype: " + dtype + ", scope: " + scope + "}";
  const fs::path pipeline = test::writeTempFile("kv.yaml",
                                                "apiversion: modelslim_v1\nspec:\n  process:\n"
                                                "    - {type: fa3_quant, details: {fa_k: " +
                                                    kv + ", fa_v: " + kv + "}}\n");
  const test::CommandResult r = test::runTinyQuant(dir, out, pipeline);
  ASSERT_EQ(r.exitCode, 0) << r.err;

  at::manual_seed(8);
  const at::Tensor ids = at::randint(0, test::kTinyVocab, {2, 19}, at::kLong);
  {
    safetensors::Writer writer(test::testDir(), {.filePrefix = "ids"});
    writer.add("ids", ids);
    writer.finish();
  }
  const fs::path reference = test::testDir() / "reference.safetensors";
  test::runOracle(
      "quantized_checkpoint_oracle.py",
      "kv " + out.string() + " " + (test::testDir() / "ids.safetensors").string() + " " + reference.string());
  const auto theirs = safetensors::File::open(reference);
  const auto ours = safetensors::Checkpoint::open(out, "model");
  for (const char* name : {"model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_scale"}) {
    EXPECT_TRUE(at::equal(theirs->tensor(name), ours.tensor(name))) << name;
  }
  const at::Tensor expected = theirs->tensor("logits");
  const at::Tensor actual = CausalLM::open(out)->forward(ids);
  const double relative = (actual - expected).abs().max().item<double>() / expected.abs().max().item<double>();
  std::cout << scope << ": max|diff|/max|ref| of the logits " << relative << "\n";
  EXPECT_LE(relative, 1e-4);
  // Both sides quantize the cache: the float model's logits are further away.
  const at::Tensor unquantized = CausalLM::open(dir)->forward(ids);
  EXPECT_GT((unquantized - expected).abs().max().item<double>() / expected.abs().max().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Scopes, Fa3Oracle, ::testing::Values("per_tensor", "per_head"));

}  // namespace
}  // namespace qpipe
