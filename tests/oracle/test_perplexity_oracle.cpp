// computePerplexity against tests/oracle/perplexity.py: the same ids and the same toy model,
// the windowing and the NLL done independently in PyTorch.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

#include "qpipe/perplexity.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

std::string writeRaw(const std::string& name, const at::Tensor& tensor) {
  const auto path = test::writeTempFile(name, "");
  const auto contiguous = tensor.contiguous();
  std::ofstream(path, std::ios::binary)
      .write(static_cast<const char*>(contiguous.const_data_ptr()), static_cast<std::streamsize>(contiguous.nbytes()));
  return path.string();
}

struct Case {
  int64_t vocab;
  int64_t numIds;
  int64_t seqLen;
  int64_t maxWindows;
  int64_t batchSize;
  at::ScalarType dtype;
};

void expectMatchesOracle(const Case& c) {
  at::manual_seed(c.vocab * 31 + c.seqLen);
  const at::Tensor ids = at::randint(c.vocab, {c.numIds}, at::kLong);
  // Scaled so that the distributions are far from uniform and the NLLs differ token by token.
  const at::Tensor table = at::randn({c.vocab, c.vocab}, at::kFloat) * 3;
  const at::Tensor position = at::randn({c.seqLen, c.vocab}, at::kFloat);

  const std::vector<int64_t> idVector(ids.const_data_ptr<int64_t>(), ids.const_data_ptr<int64_t>() + c.numIds);
  const auto result = computePerplexity(
      idVector, {.seqLen = c.seqLen, .maxWindows = c.maxWindows, .batchSize = c.batchSize},
      [&](const at::Tensor& windows) { return (at::embedding(table, windows) + position).to(c.dtype); });

  const std::string args = writeRaw("ids.bin", ids) + " " + writeRaw("table.bin", table) + " " +
                           writeRaw("position.bin", position) + " " + std::to_string(c.vocab) + " " +
                           std::to_string(c.seqLen) + " " + std::to_string(c.maxWindows) + " " +
                           (c.dtype == at::kBFloat16 ? "bfloat16" : "float32");
  const auto oracle = nlohmann::json::parse(test::runOracle("perplexity.py", args));
  EXPECT_EQ(result.windows, oracle["windows"].get<int64_t>());
  EXPECT_EQ(result.tokens, oracle["tokens"].get<int64_t>());
  const double ppl = oracle["ppl"].get<double>();
  const double meanNll = oracle["mean_nll"].get<double>();
  EXPECT_NEAR(result.perplexity, ppl, 1e-6 * ppl);
  EXPECT_NEAR(result.meanNll, meanNll, 1e-6 * meanNll);
}

TEST(PerplexityOracle, Float32AllWindows) {
  expectMatchesOracle({257, 5000, 128, 0, 3, at::kFloat});
}

TEST(PerplexityOracle, Float32MaxWindowsBatched) {
  expectMatchesOracle({1000, 4100, 512, 5, 2, at::kFloat});
}

TEST(PerplexityOracle, BFloat16Logits) {
  expectMatchesOracle({300, 3000, 100, 0, 7, at::kBFloat16});
}

}  // namespace
}  // namespace qpipe
