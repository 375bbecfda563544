// Forward throughput of qpipe's model on random ids: tokens/s for each batch size.
//   qpipe_bench_forward MODEL_DIR SEQ_LEN ITERATIONS BATCH...
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "qpipe/model.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL_DIR SEQ_LEN ITERATIONS BATCH...\n", argv[0]);
    return 2;
  }
  c10::InferenceMode inference;
  auto model = qpipe::CausalLM::open(argv[1], {.inferenceOnly = true});
  const int64_t seq = std::atoll(argv[2]);
  const int iterations = std::atoi(argv[3]);
  for (int a = 4; a < argc; ++a) {
    const int64_t batch = std::atoll(argv[a]);
    const at::Tensor ids = at::randint(model->config().vocabSize, {batch, seq}, at::kLong);
    model->forward(ids);  // warm-up: loads the layers
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) model->forward(ids);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("qpipe batch=%lld seq=%lld threads=%d tokens/s=%.1f\n", static_cast<long long>(batch),
                static_cast<long long>(seq), at::get_num_threads(), batch * seq * iterations / seconds);
  }
  return 0;
}
