#include "losses.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string_view>
#include <utility>

#include "qpipe/error.h"

namespace qpipe::qat {
namespace {

constexpr int64_t kChunkBytes = int64_t{64} << 20;

// Σ_v exp(p)·(p − q) per row of log-probabilities p and q: KL(P‖Q) of each token.
at::Tensor rowKl(const at::Tensor& logP, const at::Tensor& logQ) {
  return (logP.exp() * (logP - logQ)).sum(-1);
}

// KL over the `k` largest logits of `by` per token, both sides' logits renormalised over them.
at::Tensor topKKl(const at::Tensor& p, const at::Tensor& q, const at::Tensor& by, int64_t k) {
  const at::Tensor index = std::get<1>(by.detach().topk(std::min<int64_t>(k, by.size(-1)), -1));
  return rowKl(at::log_softmax(p.gather(-1, index), -1), at::log_softmax(q.gather(-1, index), -1));
}

}  // namespace

LossSpec parseLoss(const std::string& name, int64_t topK) {
  LossSpec spec{.name = name};
  constexpr std::array<std::pair<std::string_view, LossType>, 6> kPlain = {{{"origin", LossType::kOrigin},
                                                                            {"kl", LossType::kKl},
                                                                            {"rkl", LossType::kRkl},
                                                                            {"mse", LossType::kMse},
                                                                            {"kd", LossType::kKd},
                                                                            {"cakld", LossType::kCakld}}};
  for (const auto& [plain, type] : kPlain) {
    if (name == plain) {
      spec.type = type;
      return spec;
    }
  }
  constexpr std::array<std::pair<std::string_view, LossType>, 3> kTopK = {
      {{"kl_top", LossType::kKlTopK}, {"r_kl_top", LossType::kRklTopK}, {"rkl_top", LossType::kRklTopK}}};
  for (const auto& [prefix, type] : kTopK) {
    if (!name.starts_with(prefix)) continue;
    const std::string_view rest = std::string_view(name).substr(prefix.size());
    int64_t suffix = 1000;
    if (!rest.empty()) {
      const std::string_view digits = rest.substr(1);
      const bool numeric = rest[0] == '_' && !digits.empty() && digits.size() < 10 &&
                           std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!numeric) break;
      suffix = std::stoll(std::string(digits));
      QPIPE_REQUIRE(suffix > 0, ErrorCode::kConfig, "'", name, "': K must be at least 1");
    }
    spec.type = type;
    spec.topK = topK > 0 ? topK : suffix;
    return spec;
  }
  throw Error(ErrorCode::kConfig, concat("'", name,
                                         "' is not a loss (origin, kl, rkl, mse, kd, cakld, kl_top[_K], r_kl_top[_K])"));
}

LossTerms computeLoss(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& labels,
                      const LossSpec& spec, const Head& head, int64_t chunkRows) {
  const int64_t width = student.size(-1);
  const int64_t vocab = head.apply ? head.vocab : width;
  const at::Tensor target = labels.slice(1, 1).reshape({-1});
  const at::Tensor supervised = target.ne(-100).nonzero().squeeze(1);
  const int64_t n = supervised.numel();
  QPIPE_REQUIRE(n > 0, ErrorCode::kInput, "a training sample has no supervised token (every label -100)");
  const auto rowsOf = [&](const at::Tensor& x) {
    return x.slice(1, 0, -1).reshape({-1, width}).index_select(0, supervised);
  };
  const auto logitsOf = [&](const at::Tensor& rows) { return (head.apply ? head.apply(rows) : rows).to(at::kFloat); };
  const at::Tensor studentRows = rowsOf(student);
  const bool backward = at::GradMode::is_enabled() && studentRows.requires_grad();
  // The chunks' graphs end here: each chunk's backward stops at this leaf's gradient.
  const at::Tensor leaf = studentRows.detach().requires_grad_(backward);
  const at::Tensor teacherRows = spec.distills() ? rowsOf(teacher.detach()) : at::Tensor();
  const at::Tensor gold = target.index_select(0, supervised);
  // kl, rkl and cakld train on KL(p_t‖p_s) and KL(p_s‖p_t); the other losses only log them.
  const bool trainsOnKl = spec.type == LossType::kKl || spec.type == LossType::kRkl || spec.type == LossType::kCakld;
  const int64_t rows = chunkRows > 0 ? chunkRows : std::max<int64_t>(1, kChunkBytes / (vocab * 4));
  double lm = 0, kd = 0, forwardKl = 0, backwardKl = 0;
  for (int64_t begin = 0; begin < n; begin += rows) {
    const int64_t end = std::min(n, begin + rows);
    const at::Tensor s = logitsOf(leaf.slice(0, begin, end));
    const at::Tensor logS = at::log_softmax(s, -1);
    const at::Tensor chunkGold = gold.slice(0, begin, end).unsqueeze(1);
    at::Tensor chunk = at::zeros({}, s.options());  // this chunk's share of the total
    if (spec.lmWeight > 0) {
      const at::Tensor sum = -logS.gather(-1, chunkGold).sum();
      lm += sum.item<double>();
      chunk = chunk + spec.lmWeight * sum;
    }
    if (spec.distills()) {
      at::Tensor t, logT;
      {
        const at::NoGradGuard noGrad;
        t = logitsOf(teacherRows.slice(0, begin, end));
        logT = at::log_softmax(t, -1);
      }
      at::Tensor forward, backwardTerm;
      {
        std::optional<at::NoGradGuard> diagnosticsOnly;
        if (!trainsOnKl) diagnosticsOnly.emplace();
        forward = rowKl(logT, logS);
        backwardTerm = rowKl(logS, logT);
      }
      at::Tensor sum;
      switch (spec.type) {
        case LossType::kKl:
          sum = forward.sum();
          break;
        case LossType::kRkl:
          sum = backwardTerm.sum();
          break;
        case LossType::kMse:  // the mean over the N·V logits
          sum = (s - t).pow(2).sum() / static_cast<double>(vocab);
          break;
        case LossType::kKd: {
          const double temperature = spec.temperature;
          sum = temperature * temperature *
                rowKl(at::log_softmax(t / temperature, -1), at::log_softmax(s / temperature, -1)).sum();
          break;
        }
        case LossType::kCakld: {
          const at::Tensor confidence = logT.gather(-1, chunkGold).squeeze(1).exp();
          sum = (confidence * backwardTerm + (1 - confidence) * forward).sum();
          break;
        }
        case LossType::kKlTopK:
          sum = topKKl(t, s, t, spec.topK).sum();
          break;
        case LossType::kRklTopK:
          sum = topKKl(s, t, s, spec.topK).sum();
          break;
        case LossType::kOrigin:
          break;
      }
      kd += sum.item<double>();
      forwardKl += forward.sum().item<double>();
      backwardKl += backwardTerm.sum().item<double>();
      chunk = chunk + spec.kdWeight * sum;
    }
    if (backward && chunk.requires_grad()) (chunk / static_cast<double>(n)).backward();
  }
  const auto mean = [&](double sum) { return at::scalar_tensor(sum / static_cast<double>(n), at::kFloat); };
  LossTerms terms{.tokens = n};
  double total = 0;
  if (spec.lmWeight > 0) {
    terms.lm = mean(lm);
    total += spec.lmWeight * lm / static_cast<double>(n);
  }
  if (spec.distills()) {
    terms.kd = mean(kd);
    terms.forwardKl = mean(forwardKl);
    terms.backwardKl = mean(backwardKl);
    total += spec.kdWeight * kd / static_cast<double>(n);
  }
  terms.total = at::scalar_tensor(total, at::kFloat);
  if (backward && leaf.grad().defined()) {
    // Its value is the loss; its gradient in the student's graph is the chunks' gradient.
    const at::Tensor carried = (studentRows.to(at::kFloat) * leaf.grad()).sum();
    terms.total = terms.total + (carried - carried.detach());
  }
  return terms;
}

}  // namespace qpipe::qat
