// Perplexity of a causal language model over one token stream, as `qpipe eval` reports it
// (docs/data.md):
//
//   1. the evaluation texts are joined with "\n\n" (joinEvalTexts) and tokenized once, without
//      BOS; the caller passes the ids;
//   2. the ids are cut into non-overlapping windows of seqLen tokens; the last partial window is
//      dropped, and only the first maxWindows windows are kept when maxWindows > 0;
//   3. in each window, every token after the first is scored: its negative log-likelihood is
//      -log_softmax(logits of the previous position)[token], computed in fp32 (a chunk of
//      positions at a time);
//   4. PPL = exp(total NLL / tokens scored), the total accumulated in double, window by window.
//
// The forward is a callback, so this file depends on no model: it receives windows
// [batch, seqLen] int64 on the CPU and returns logits [batch, seqLen, vocab] of any floating
// type on any device. Results do not depend on batchSize.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace qpipe {

using LogitsFn = std::function<at::Tensor(const at::Tensor& windows)>;

struct PerplexityOptions {
  int64_t seqLen = 2048;
  int64_t maxWindows = 0;  // 0 = every full window
  int64_t batchSize = 1;   // windows per logitsFn call
  // Called after each batch with the windows done so far, the windows in all, and the running PPL.
  std::function<void(int64_t done, int64_t total, double perplexity)> progress;
};

struct PerplexityResult {
  double perplexity = 0;
  double meanNll = 0;   // nats per scored token; perplexity = exp(meanNll)
  double totalNll = 0;  // nats
  int64_t tokens = 0;   // tokens scored: windows * (seqLen - 1)
  int64_t windows = 0;
};

std::string joinEvalTexts(const std::vector<std::string>& texts);

// Full windows that `numIds` ids make, capped by maxWindows (> 0).
int64_t perplexityWindows(int64_t numIds, int64_t seqLen, int64_t maxWindows);

PerplexityResult computePerplexity(const std::vector<int64_t>& ids, const PerplexityOptions& options,
                                   const LogitsFn& logitsFn);

}  // namespace qpipe
