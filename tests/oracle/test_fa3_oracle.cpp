// fa3_quant in compressed-tensors (docs/attention.md): `qpipe quant` quantizes K and V (or Q, K
// and V) of a tiny transformers Llama and saves kv_cache_scheme (and the attention group), and
// transformers + compressed-tensors load it: the scales it holds are ours bit for bit, and its
// attention-quantized logits match qpipe's own load of the checkpoint.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "qpipe/model.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

class Fa3Oracle : public ::testing::TestWithParam<std::string> {};

TEST_P(Fa3Oracle, TransformersReadsOurScalesAndQuantizesAttentionAsWeDo) {
  const std::string scheme = GetParam();
  const fs::path dir = test::testDir() / "src", out = test::testDir() / ("attention-" + scheme);
  fs::remove_all(dir);
  fs::remove_all(out);
  test::runOracle("quantized_checkpoint_oracle.py", "make " + dir.string());
  test::writeTinyTokenizer(dir);
  // fp8 per-tensor K/V (vLLM's cache), int8 per-head K/V, and FA3: int8 per-head Q, K and V.
  const std::string step = scheme == "kv_fp8_tensor" ? "{type: fa3_quant, details: {fa_k: {dtype: fp8_e4m3, scope: "
                                                       "per_tensor}, fa_v: {dtype: fp8_e4m3, scope: per_tensor}}}"
                           : scheme == "kv_int8_head"
                               ? "{type: fa3_quant, details: {fa_k: {dtype: int8}, fa_v: {dtype: int8}}}"
                               : "{type: fa3_quant}";
  const fs::path pipeline =
      test::writeTempFile("attention.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n    - " + step + "\n");
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
  std::vector<std::string> scales = {"model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_scale"};
  if (scheme == "fa3_int8_head") scales.push_back("model.layers.1.self_attn.q_scale");
  for (const std::string& name : scales) {
    EXPECT_TRUE(at::equal(theirs->tensor(name), ours.tensor(name))) << name;
  }
  const at::Tensor expected = theirs->tensor("logits");
  const at::Tensor actual = CausalLM::open(out)->forward(ids);
  const double relative = (actual - expected).abs().max().item<double>() / expected.abs().max().item<double>();
  std::cout << scheme << ": max|diff|/max|ref| of the logits " << relative << "\n";
  EXPECT_LE(relative, 1e-4);
  // Both sides quantize the cache: the float model's logits are further away.
  const at::Tensor unquantized = CausalLM::open(dir)->forward(ids);
  EXPECT_GT((unquantized - expected).abs().max().item<double>() / expected.abs().max().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Schemes, Fa3Oracle, ::testing::Values("kv_fp8_tensor", "kv_int8_head", "fa3_int8_head"));

}  // namespace
}  // namespace qpipe
