#include "qpipe/perplexity.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "qpipe/error.h"
#include "qpipe/log.h"

namespace qpipe {
namespace {

void checkOptions(int64_t seqLen, int64_t maxWindows) {
  QPIPE_REQUIRE(seqLen >= 2, ErrorCode::kUsage, "perplexity: seq_len must be at least 2 (one context token and one ",
                "scored token), got ", seqLen);
  QPIPE_REQUIRE(maxWindows >= 0, ErrorCode::kUsage, "perplexity: max_windows must be >= 0 (0 = all), got ", maxWindows);
}

}  // namespace

std::string joinEvalTexts(const std::vector<std::string>& texts) {
  std::string joined;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (i > 0) joined += "\n\n";
    joined += texts[i];
  }
  return joined;
}

int64_t perplexityWindows(int64_t numIds, int64_t seqLen, int64_t maxWindows) {
  checkOptions(seqLen, maxWindows);
  const int64_t windows = numIds / seqLen;
  return maxWindows > 0 ? std::min(windows, maxWindows) : windows;
}

PerplexityResult computePerplexity(const std::vector<int64_t>& ids, const PerplexityOptions& options,
                                   const LogitsFn& logitsFn) {
  const int64_t seqLen = options.seqLen;
  const int64_t windows = perplexityWindows(static_cast<int64_t>(ids.size()), seqLen, options.maxWindows);
  QPIPE_REQUIRE(options.batchSize >= 1, ErrorCode::kUsage, "perplexity: the batch size must be at least 1, got ",
                options.batchSize);
  QPIPE_REQUIRE(windows > 0, ErrorCode::kInput, "perplexity: the evaluation text has ", ids.size(),
                " tokens, fewer than one window of seq_len ", seqLen, "; give more text or a smaller seq_len");
  log::logger()->info("perplexity: ", ids.size(), " tokens, ", windows, " windows of ", seqLen, " tokens, ",
                      windows * (seqLen - 1), " scored");

  // A view of the caller's ids; each batch is copied out, so the callback may keep its input.
  const at::Tensor all =
      at::from_blob(const_cast<int64_t*>(ids.data()), {windows, seqLen}, at::TensorOptions().dtype(at::kLong));
  PerplexityResult result;
  for (int64_t begin = 0; begin < windows; begin += options.batchSize) {
    const int64_t count = std::min(options.batchSize, windows - begin);
    const at::Tensor batch = all.slice(0, begin, begin + count).clone();
    const at::Tensor logits = logitsFn(batch);
    QPIPE_CHECK(logits.defined() && logits.dim() == 3 && logits.size(0) == count && logits.size(1) == seqLen &&
                    c10::isFloatingType(logits.scalar_type()),
                "perplexity: the forward must return [", count, ", ", seqLen, ", vocab] floating logits, got ",
                logits.defined() ? logits.toString() + " " + c10::str(logits.sizes()) : std::string("nothing"));
    const int64_t vocab = logits.size(2);
    const auto [low, high] = std::minmax_element(ids.begin() + begin * seqLen, ids.begin() + (begin + count) * seqLen);
    QPIPE_REQUIRE(*low >= 0 && *high < vocab, ErrorCode::kInput, "perplexity: token id ", *low < 0 ? *low : *high,
                  " is outside the model's ", vocab, " logits; do the tokenizer and the model match?");

    // Position t predicts token t + 1: the last position has nothing to score. log_softmax runs
    // over chunks of positions so that no second logits-sized tensor exists.
    const at::Tensor targets = batch.slice(1, 1).to(logits.device()).unsqueeze(-1);
    constexpr int64_t kChunk = 64;
    std::vector<at::Tensor> chunks;
    for (int64_t start = 0; start < seqLen - 1; start += kChunk) {
      const int64_t end = std::min(start + kChunk, seqLen - 1);
      const at::Tensor scores = logits.slice(1, start, end).to(at::kFloat);
      chunks.push_back(at::log_softmax(scores, -1).gather(-1, targets.slice(1, start, end)).squeeze(-1).neg());
    }
    const at::Tensor nll = at::cat(chunks, 1);
    // Per-window sums in double, added window by window: the total does not depend on batching.
    const at::Tensor windowNll = nll.to(at::kDouble).sum(1).cpu();
    const auto* sums = windowNll.const_data_ptr<double>();
    for (int64_t i = 0; i < count; ++i) {
      QPIPE_REQUIRE(std::isfinite(sums[i]), ErrorCode::kInput, "perplexity: window ", begin + i, " (tokens ",
                    (begin + i) * seqLen, " to ", (begin + i + 1) * seqLen, ") has a non-finite loss (",
                    // A NaN's sign bit depends on the CPU's arithmetic; the message should not.
                    std::isnan(sums[i]) ? std::string("nan") : std::to_string(sums[i]),
                    "): the model computes NaN or Inf");
      result.totalNll += sums[i];
    }
    result.windows += count;
    result.tokens += count * (seqLen - 1);
    if (options.progress) {
      options.progress(result.windows, windows, std::exp(result.totalNll / static_cast<double>(result.tokens)));
    }
  }
  result.meanNll = result.totalNll / static_cast<double>(result.tokens);
  result.perplexity = std::exp(result.meanNll);
  return result;
}

}  // namespace qpipe
