#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "qpipe/perplexity.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

using test::errorOf;

// Every position predicts the same distribution over 4 tokens: p = 1/2, 1/4, 1/8, 1/8, so a token's
// NLL is 1, 2, 3, 3 times ln 2. The +5 shift checks that logits are normalized.
at::Tensor fixedLogits(const at::Tensor& windows) {
  const auto row = at::log(at::tensor({0.5, 0.25, 0.125, 0.125}, at::kFloat)) + 5;
  return row.expand({windows.size(0), windows.size(1), 4}).contiguous();
}

TEST(Perplexity, HandComputedWindows) {
  // seq_len 4: windows [3 0 1 2] and [0 0 0 1]; the trailing [2] is dropped. The scored tokens are
  // 0 1 2 (NLL 1 + 2 + 3 ln 2) and 0 0 1 (1 + 1 + 2 ln 2): 10 ln 2 over 6 tokens.
  const std::vector<int64_t> ids = {3, 0, 1, 2, 0, 0, 0, 1, 2};
  const auto result = computePerplexity(ids, {.seqLen = 4}, fixedLogits);
  EXPECT_EQ(result.windows, 2);
  EXPECT_EQ(result.tokens, 6);
  EXPECT_NEAR(result.totalNll, 10 * std::log(2.0), 1e-6);
  EXPECT_NEAR(result.meanNll, 10 * std::log(2.0) / 6, 1e-7);
  EXPECT_NEAR(result.perplexity, std::pow(2.0, 10.0 / 6), 1e-6);

  const auto first = computePerplexity(ids, {.seqLen = 4, .maxWindows = 1}, fixedLogits);
  EXPECT_EQ(first.windows, 1);
  EXPECT_EQ(first.tokens, 3);
  EXPECT_NEAR(first.perplexity, 4.0, 1e-6);
}

TEST(Perplexity, UniformLogitsGiveTheVocabularySize) {
  const std::vector<int64_t> ids(100, 7);
  const auto result = computePerplexity(ids, {.seqLen = 10, .batchSize = 4}, [](const at::Tensor& windows) {
    return at::zeros({windows.size(0), windows.size(1), 32}, at::kBFloat16);
  });
  EXPECT_EQ(result.windows, 10);
  EXPECT_EQ(result.tokens, 90);
  EXPECT_NEAR(result.perplexity, 32.0, 1e-4);
}

// A context-dependent model: the logits at a position are a row of a random table chosen by the
// current token, so the NLL of token t depends on token t - 1.
class TableModel {
 public:
  explicit TableModel(int64_t vocab) : table_(at::randn({vocab, vocab}, at::kFloat)) {}
  at::Tensor operator()(const at::Tensor& windows) const { return at::embedding(table_, windows); }

  // The definition, written out in double with plain loops.
  double referenceMeanNll(const std::vector<int64_t>& ids, int64_t seqLen, int64_t windows) const {
    const auto table = table_.to(at::kDouble).contiguous();
    const auto* t = table.const_data_ptr<double>();
    const int64_t vocab = table.size(0);
    double total = 0;
    for (int64_t w = 0; w < windows; ++w) {
      for (int64_t i = w * seqLen + 1; i < (w + 1) * seqLen; ++i) {
        const double* row = t + ids[i - 1] * vocab;
        double sum = 0;
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v]);
        total += std::log(sum) - row[ids[i]];
      }
    }
    return total / static_cast<double>(windows * (seqLen - 1));
  }

 private:
  at::Tensor table_;
};

TEST(Perplexity, MatchesTheDefinitionAndIgnoresBatching) {
  at::manual_seed(11);
  const TableModel model(50);
  const auto idTensor = at::randint(50, {1037}, at::kLong);
  const std::vector<int64_t> ids(idTensor.const_data_ptr<int64_t>(), idTensor.const_data_ptr<int64_t>() + 1037);
  const auto forward = [&](const at::Tensor& windows) { return model(windows); };

  const double expected = model.referenceMeanNll(ids, 64, 16);  // 1037 / 64 = 16 full windows
  const auto one = computePerplexity(ids, {.seqLen = 64, .batchSize = 1}, forward);
  EXPECT_EQ(one.windows, 16);
  EXPECT_NEAR(one.meanNll, expected, 1e-6 * expected);
  EXPECT_NEAR(one.perplexity, std::exp(expected), 1e-6 * std::exp(expected));
  for (const int64_t batch : {3, 16, 40}) {
    const auto batched = computePerplexity(ids, {.seqLen = 64, .batchSize = batch}, forward);
    EXPECT_EQ(batched.windows, 16);
    EXPECT_NEAR(batched.totalNll, one.totalNll, 1e-12 * one.totalNll) << "batch " << batch;
  }

  const auto capped = computePerplexity(ids, {.seqLen = 64, .maxWindows = 5, .batchSize = 2}, forward);
  EXPECT_EQ(capped.windows, 5);
  const double cappedExpected = model.referenceMeanNll(ids, 64, 5);
  EXPECT_NEAR(capped.meanNll, cappedExpected, 1e-6 * cappedExpected);
}

TEST(Perplexity, ProgressReportsEachBatch) {
  const std::vector<int64_t> ids = {3, 0, 1, 2, 0, 0, 0, 1, 2, 1, 1, 1};
  std::vector<std::tuple<int64_t, int64_t, double>> calls;
  PerplexityOptions options{.seqLen = 4, .batchSize = 2};
  options.progress = [&](int64_t done, int64_t total, double ppl) { calls.emplace_back(done, total, ppl); };
  std::vector<int64_t> batchSizes;
  computePerplexity(ids, options, [&](const at::Tensor& windows) {
    batchSizes.push_back(windows.size(0));
    return fixedLogits(windows);
  });
  EXPECT_EQ(batchSizes, (std::vector<int64_t>{2, 1}));
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(std::get<0>(calls[0]), 2);
  EXPECT_EQ(std::get<1>(calls[0]), 3);
  EXPECT_NEAR(std::get<2>(calls[0]), std::pow(2.0, 10.0 / 6), 1e-6);
  EXPECT_EQ(std::get<0>(calls[1]), 3);
}

TEST(Perplexity, WindowsAndJoin) {
  EXPECT_EQ(perplexityWindows(9, 4, 0), 2);
  EXPECT_EQ(perplexityWindows(9, 4, 1), 1);
  EXPECT_EQ(perplexityWindows(3, 4, 0), 0);
  EXPECT_EQ(joinEvalTexts({"a", "b", "c"}), "a\n\nb\n\nc");
  EXPECT_EQ(joinEvalTexts({"a"}), "a");
}

TEST(Perplexity, Errors) {
  const std::vector<int64_t> ids = {3, 0, 1, 2, 0};
  EXPECT_EQ(errorOf([&] { computePerplexity(ids, {.seqLen = 1}, fixedLogits); }, ErrorCode::kUsage),
            "perplexity: seq_len must be at least 2 (one context token and one scored token), got 1");
  EXPECT_EQ(errorOf([&] { computePerplexity(ids, {.seqLen = 4, .maxWindows = -1}, fixedLogits); }, ErrorCode::kUsage),
            "perplexity: max_windows must be >= 0 (0 = all), got -1");
  EXPECT_EQ(errorOf([&] { computePerplexity(ids, {.seqLen = 4, .batchSize = 0}, fixedLogits); }, ErrorCode::kUsage),
            "perplexity: the batch size must be at least 1, got 0");
  EXPECT_EQ(errorOf([&] { computePerplexity(ids, {.seqLen = 6}, fixedLogits); }, ErrorCode::kInput),
            "perplexity: the evaluation text has 5 tokens, fewer than one window of seq_len 6; give more text or a "
            "smaller seq_len");
  EXPECT_EQ(errorOf(
                [&] {
                  computePerplexity({0, 1, 4, 2}, {.seqLen = 4}, fixedLogits);
                },
                ErrorCode::kInput),
            "perplexity: token id 4 is outside the model's 4 logits; do the tokenizer and the model match?");
  EXPECT_EQ(errorOf(
                [&] {
                  computePerplexity({0, -1, 3, 2}, {.seqLen = 4}, fixedLogits);
                },
                ErrorCode::kInput),
            "perplexity: token id -1 is outside the model's 4 logits; do the tokenizer and the model match?");
}

}  // namespace
}  // namespace qpipe
