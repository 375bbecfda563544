#include "trainer.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>

#include "qpipe/error.h"
#include "qpipe/process_group.h"

namespace qpipe::qat {

Schedule parseSchedule(const std::string& name) {
  if (name == "constant") return Schedule::kConstant;
  if (name == "constant_with_warmup") return Schedule::kConstantWithWarmup;
  if (name == "linear") return Schedule::kLinear;
  if (name == "cosine") return Schedule::kCosine;
  throw Error(ErrorCode::kConfig, concat("unknown lr_scheduler_type '", name, "'"));
}

double scheduleFactor(Schedule schedule, int64_t step, int64_t total, int64_t warmup) {
  if (schedule == Schedule::kConstant) return 1;
  if (step < warmup) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  const double decaying = static_cast<double>(std::max<int64_t>(1, total - warmup));
  switch (schedule) {
    case Schedule::kConstantWithWarmup:
      return 1;
    case Schedule::kLinear:
      return std::max(0.0, static_cast<double>(total - step) / decaying);
    case Schedule::kCosine: {
      const double progress = static_cast<double>(step - warmup) / decaying;
      return std::max(0.0, 0.5 * (1 + std::cos(std::numbers::pi * progress)));
    }
    case Schedule::kConstant:
      break;
  }
  return 1;
}

Optimizer::Optimizer(std::vector<ParamGroup> groups, const OptimizerOptions& options) : options_(options) {
  std::vector<torch::optim::OptimizerParamGroup> adamGroups;
  for (ParamGroup& group : groups) {
    if (group.params.empty()) continue;
    baseRates_.push_back(group.learningRate);
    params_.insert(params_.end(), group.params.begin(), group.params.end());
    adamGroups.emplace_back(std::move(group.params),
                            std::make_unique<torch::optim::AdamWOptions>(
                                torch::optim::AdamWOptions(group.learningRate).weight_decay(options.weightDecay)));
  }
  QPIPE_CHECK(!adamGroups.empty(), "an optimizer without parameters");
  adam_ = std::make_unique<torch::optim::AdamW>(std::move(adamGroups));
}

Optimizer::~Optimizer() = default;

StepStats Optimizer::step() {
  at::NoGradGuard noGrad;
  double squares = 0;
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  StepStats stats{.gradNorm = std::sqrt(squares)};
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1.
  if (options_.maxGradNorm > 0) {
    const double coefficient = options_.maxGradNorm / (stats.gradNorm + 1e-6);
    if (coefficient < 1) {
      for (const at::Tensor& p : params_) {
        if (p.grad().defined()) p.mutable_grad().mul_(coefficient);
      }
    }
  }
  const double factor = scheduleFactor(options_.schedule, steps_, options_.totalSteps, options_.warmupSteps);
  auto& groups = adam_->param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    static_cast<torch::optim::AdamWOptions&>(groups[i].options()).lr(baseRates_[i] * factor);
  }
  stats.learningRate = baseRates_.front() * factor;
  adam_->step();
  adam_->zero_grad(/*set_to_none=*/true);
  ++steps_;
  return stats;
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const auto& states = adam_->state();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto found = states.find(params_[i].unsafeGetTensorImpl());
    const auto* adam =
        found == states.end() ? nullptr : static_cast<const torch::optim::AdamWParamState*>(found->second.get());
    const std::string prefix = std::to_string(i) + ".";
    tensors.emplace_back(prefix + "exp_avg", adam ? adam->exp_avg() : at::zeros_like(params_[i]));
    tensors.emplace_back(prefix + "exp_avg_sq", adam ? adam->exp_avg_sq() : at::zeros_like(params_[i]));
    tensors.emplace_back(prefix + "step", at::full({1}, adam ? adam->step() : 0, at::kLong));
  }
  tensors.emplace_back("steps", at::full({1}, steps_, at::kLong));
  return tensors;
}

void Optimizer::loadState(const std::function<at::Tensor(const std::string&)>& tensor) {
  const auto read = [&](const std::string& name, const at::Tensor& like) {
    const at::Tensor t = tensor(name);
    QPIPE_REQUIRE(
        t.defined() && t.sizes() == like.sizes(), ErrorCode::kInput, "optimizer state '", name, "' ",
        t.defined() ? concat("has shape ", t.sizes(), ", expected ", like.sizes()) : std::string("is missing"));
    return t.to(like.device(), like.scalar_type()).clone();
  };
  auto& states = adam_->state();
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string prefix = std::to_string(i) + ".";
    const int64_t step = read(prefix + "step", at::zeros({1}, at::kLong)).item<int64_t>();
    if (step == 0) continue;  // AdamW starts such a parameter's state on its first step
    auto adam = std::make_unique<torch::optim::AdamWParamState>();
    adam->step(step);
    adam->exp_avg(read(prefix + "exp_avg", params_[i]));
    adam->exp_avg_sq(read(prefix + "exp_avg_sq", params_[i]));
    states[params_[i].unsafeGetTensorImpl()] = std::move(adam);
  }
  steps_ = read("steps", at::zeros({1}, at::kLong)).item<int64_t>();
}

Bf16Autocast::Bf16Autocast(bool enabled, at::DeviceType device) : enabled_(enabled), device_(device) {
  if (!enabled_) return;
  wasEnabled_ = at::autocast::is_autocast_enabled(device_);
  previousDtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_dtype(device_, at::kBFloat16);
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::increment_nesting();
}

Bf16Autocast::~Bf16Autocast() {
  if (!enabled_) return;
  // The casts of the frozen weights are cached while autocast is on; the cache ends with it.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, wasEnabled_);
  at::autocast::set_autocast_dtype(device_, previousDtype_);
}

std::vector<int64_t> epochOrder(int64_t n, int64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::mt19937_64 engine(static_cast<uint64_t>(seed + epoch));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(engine() % static_cast<uint64_t>(i + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

int64_t firstReplicaDifference(const std::vector<at::Tensor>& tensors, ProcessGroup& group) {
  if (group.worldSize() < 2 || tensors.empty()) return -1;
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : tensors) flat.push_back(t.detach().to(at::kFloat).reshape({-1}));
  const at::Tensor mine = at::cat(flat);
  at::Tensor reference = mine.clone();
  group.broadcast(reference, 0);
  const auto count = static_cast<int64_t>(tensors.size());
  int64_t first = count;
  for (int64_t i = 0, offset = 0; i < count && first == count; ++i) {
    const int64_t n = flat[static_cast<size_t>(i)].numel();
    if (!at::equal(mine.narrow(0, offset, n), reference.narrow(0, offset, n))) first = i;
    offset += n;
  }
  at::Tensor index = at::full({1}, first, mine.options().dtype(at::kLong));
  group.allReduce(index, ReduceOp::kMin);
  const int64_t agreed = index.item<int64_t>();
  return agreed == count ? -1 : agreed;
}

}  // namespace qpipe::qat
