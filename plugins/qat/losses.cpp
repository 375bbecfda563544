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

LossTerms computeLoss(const at::Tensor& studentLogits, const at::Tensor& teacherLogits, const at::Tensor& labels,
                      const LossSpec& spec) {
  const int64_t vocab = studentLogits.size(-1);
  const at::Tensor target = labels.slice(1, 1).reshape({-1});
  const at::Tensor supervised = target.ne(-100).nonzero().squeeze(1);
  LossTerms terms{.tokens = supervised.numel()};
  QPIPE_REQUIRE(terms.tokens > 0, ErrorCode::kInput, "a training sample has no supervised token (every label -100)");
  const auto positions = [&](const at::Tensor& logits) {
    return logits.slice(1, 0, -1).reshape({-1, vocab}).index_select(0, supervised).to(at::kFloat);
  };
  const at::Tensor s = positions(studentLogits);
  const at::Tensor gold = target.index_select(0, supervised);
  const at::Tensor logS = at::log_softmax(s, -1);
  at::Tensor total = at::zeros({}, s.options());
  if (spec.lmWeight > 0) {
    terms.lm = -logS.gather(-1, gold.unsqueeze(1)).mean();
    total = total + spec.lmWeight * terms.lm;
  }
  if (spec.distills()) {
    const at::Tensor t = positions(teacherLogits.detach());
    const at::Tensor logT = at::log_softmax(t, -1);
    // KL(p_t‖p_s) and KL(p_s‖p_t) per token: kl, rkl and cakld train on them, the others only log
    // them, so those build no graph for them.
    at::Tensor forward, backward;
    {
      const bool trainsOnKl =
          spec.type == LossType::kKl || spec.type == LossType::kRkl || spec.type == LossType::kCakld;
      std::optional<at::NoGradGuard> diagnosticsOnly;
      if (!trainsOnKl) diagnosticsOnly.emplace();
      forward = rowKl(logT, logS);
      backward = rowKl(logS, logT);
    }
    switch (spec.type) {
      case LossType::kKl:
        terms.kd = forward.mean();
        break;
      case LossType::kRkl:
        terms.kd = backward.mean();
        break;
      case LossType::kMse:
        terms.kd = at::mse_loss(s, t);
        break;
      case LossType::kKd: {
        const double temperature = spec.temperature;
        terms.kd = temperature * temperature *
                   rowKl(at::log_softmax(t / temperature, -1), at::log_softmax(s / temperature, -1)).mean();
        break;
      }
      case LossType::kCakld: {
        const at::Tensor confidence = logT.gather(-1, gold.unsqueeze(1)).squeeze(1).exp();
        terms.kd = (confidence * backward + (1 - confidence) * forward).mean();
        break;
      }
      case LossType::kKlTopK:
        terms.kd = topKKl(t, s, t, spec.topK).mean();
        break;
      case LossType::kRklTopK:
        terms.kd = topKKl(s, t, s, spec.topK).mean();
        break;
      case LossType::kOrigin:
        break;
    }
    terms.forwardKl = forward.mean().detach();
    terms.backwardKl = backward.mean().detach();
    total = total + spec.kdWeight * terms.kd;
  }
  terms.total = total;
  return terms;
}

}  // namespace qpipe::qat
