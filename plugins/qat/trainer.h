// The optimisation loop's parts (docs/qat.md): LibTorch's AdamW over parameter groups, learning
// rate schedules as HF's get_*_schedule_with_warmup, gradient clipping as
// torch.nn.utils.clip_grad_norm_, and the sample order of each epoch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class AdamW;
}
namespace qpipe {
class ProcessGroup;
}

namespace qpipe::qat {

enum class Schedule { kConstant, kConstantWithWarmup, kLinear, kCosine };

// HF's spellings: constant, constant_with_warmup, linear, cosine.
Schedule parseSchedule(const std::string& name);

// The factor on the base learning rate at optimizer step `step` (0-based) of `total`, `warmup`
// of them warming up: HF's LambdaLR functions exactly (step 0 of a warmup trains at factor 0).
double scheduleFactor(Schedule schedule, int64_t step, int64_t total, int64_t warmup);

struct ParamGroup {
  std::vector<at::Tensor> params;
  double learningRate = 0;
};

struct OptimizerOptions {
  double weightDecay = 0;  // HF's default; AdamW's own default (0.01) would shrink the scales
  double maxGradNorm = 1;  // 0: no clipping
  Schedule schedule = Schedule::kCosine;
  int64_t totalSteps = 1;
  int64_t warmupSteps = 0;
};

struct StepStats {
  double gradNorm = 0;      // the total L2 norm before clipping, as HF logs it
  double learningRate = 0;  // of the first group, at this step
};

// AdamW over the groups, each with its own base learning rate, scheduled together.
class Optimizer {
 public:
  Optimizer(std::vector<ParamGroup> groups, const OptimizerOptions& options);
  ~Optimizer();

  // After the step's backward passes: clips the gradients, sets this step's learning rates,
  // updates the parameters and zeroes the gradients.
  StepStats step();
  int64_t stepsTaken() const { return steps_; }

  // AdamW's state, to save: per parameter i (the groups' order), "<i>.exp_avg", "<i>.exp_avg_sq"
  // and "<i>.step" (int64 [1]), zeros for a parameter no step has reached yet, and "steps" (the
  // schedule's position).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Loads what state() gave, `tensor(name)` returning it: the steps from here are the ones the
  // optimizer that saved it would have taken. Error(kInput) naming a tensor of the wrong shape.
  void loadState(const std::function<at::Tensor(const std::string&)>& tensor);

 private:
  std::vector<double> baseRates_;
  std::vector<at::Tensor> params_;
  OptimizerOptions options_;
  std::unique_ptr<torch::optim::AdamW> adam_;
  int64_t steps_ = 0;
};

// Data-parallel training gives every rank the same trained tensors by construction (docs/qat.md,
// Several ranks); this checks it. `tensors` are this rank's, in an order every rank shares (each
// rank's tensors have the same shapes). Returns the index of the first tensor that differs from
// rank 0's on any rank, the same on every rank, or -1: one broadcast of their concatenation and one
// all-reduce.
int64_t firstReplicaDifference(const std::vector<at::Tensor>& tensors, ProcessGroup& group);

// bf16 compute (HF's `bf16: True`, which trains under torch.autocast): while it lives, and when
// `enabled`, matrix products and attention on `device` run in bf16 with fp32 accumulation, while
// the parameters, the scales, the fake quantizers' arithmetic and the losses stay fp32.
class Bf16Autocast {
 public:
  Bf16Autocast(bool enabled, at::DeviceType device);
  ~Bf16Autocast();
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool enabled_;
  at::DeviceType device_;
  bool wasEnabled_ = false;
  at::ScalarType previousDtype_ = at::kFloat;
};

// The order of `n` samples in epoch `epoch`: a Fisher–Yates shuffle driven by a 64-bit Mersenne
// Twister seeded with seed + epoch, so it is the same on every platform and standard library.
std::vector<int64_t> epochOrder(int64_t n, int64_t seed, int64_t epoch);

}  // namespace qpipe::qat
