// Tokenizer load time and encode throughput: every text of a data file, encoded one text per call, after a
// warm-up pass (the BPE word cache is then warm, as in a long calibration run).
//   qpipe_bench_tokenizer TOKENIZER_JSON DATA_FILE PASSES
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "qpipe/dataset.h"
#include "qpipe/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON DATA_FILE PASSES\n", argv[0]);
    return 2;
  }
  const auto loading = std::chrono::steady_clock::now();
  const qpipe::Tokenizer tokenizer = qpipe::Tokenizer::fromFile(argv[1]);
  const double loadSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - loading).count();
  const auto samples = qpipe::loadDataset(argv[2]);
  const int passes = std::atoi(argv[3]);
  size_t bytes = 0;
  for (const auto& sample : samples) bytes += sample.text.size();
  for (const auto& sample : samples) tokenizer.encode(sample.text);
  size_t tokens = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int pass = 0; pass < passes; ++pass) {
    for (const auto& sample : samples) tokens += tokenizer.encode(sample.text).size();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("qpipe load_ms=%.1f texts=%zu bytes=%zu tokens/s=%.0f\n", loadSeconds * 1e3, samples.size(), bytes,
              tokens / seconds);
  return 0;
}
