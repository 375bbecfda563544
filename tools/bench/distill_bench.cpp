// Memory and time of one end2end distillation loss (plugins/qat/losses.h) at a large vocabulary,
// on a synthetic lm_head: random final hidden states of a student and a teacher, a random head
// [vocab, hidden], and the loss's forward and backward into the student's hidden states.
//   qpipe_bench_distill whole|chunked TOKENS HIDDEN VOCAB LOSS
// whole: both sides' logits [tokens, vocab] are computed first and the loss takes them in one
// chunk, as the loss did before it applied the head itself; chunked: the loss applies the head a
// chunk of positions at a time. Prints one line: seconds, peak RSS, peak RSS above what the
// inputs and the head take, the loss and the gradient's sum (the same in both modes).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "losses.h"

namespace {

double residentMiB() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * 4096.0 / (1 << 20);
}

double peakMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s whole|chunked TOKENS HIDDEN VOCAB LOSS\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const int64_t tokens = std::stoll(argv[2]), hidden = std::stoll(argv[3]), vocab = std::stoll(argv[4]);
  at::manual_seed(0);
  const at::Tensor weight = at::randn({vocab, hidden}) / std::sqrt(static_cast<double>(hidden));
  const at::Tensor student = at::randn({1, tokens + 1, hidden}).requires_grad_(true);
  const at::Tensor teacher = student.detach() + 0.1 * at::randn({1, tokens + 1, hidden});
  const at::Tensor labels = at::randint(0, vocab, {1, tokens + 1}, at::kLong);
  qpipe::qat::LossSpec spec = qpipe::qat::parseLoss(argv[5], 0);
  spec.kdWeight = 1;
  const double baseline = residentMiB();
  const auto start = std::chrono::steady_clock::now();
  at::AutoGradMode gradients(true);
  qpipe::qat::LossTerms terms;
  if (mode == "whole") {
    at::Tensor teacherLogits;
    {
      const at::NoGradGuard noGrad;
      teacherLogits = at::linear(teacher, weight);
    }
    terms = qpipe::qat::computeLoss(at::linear(student * 1, weight), teacherLogits, labels, spec, {}, tokens);
  } else {
    const qpipe::qat::Head head{.apply = [&](const at::Tensor& rows) { return at::linear(rows, weight); },
                                .vocab = vocab};
    terms = qpipe::qat::computeLoss(student * 1, teacher, labels, spec, head);
  }
  terms.total.backward();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("mode=%s seconds=%.2f peak_mib=%.0f above_inputs_mib=%.0f loss=%.6f grad_sum=%.6e\n", mode.c_str(),
              seconds, peakMiB(), peakMiB() - baseline, terms.total.item<double>(),
              student.grad().abs().sum().item<double>());
  return 0;
}
