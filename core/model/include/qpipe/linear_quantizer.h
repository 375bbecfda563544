// A Linear under calibration (msmodelslim's LinearQuantizer, core/quantizer/linear.py):
// forward = linear(actQuant(x), fakeQuant(W), b).
//
// - Weights are data-free: minmax or ssz parameters and the quantized weight are computed once,
//   at construction or, deferred, by solveWeights() (a scheduler task: docs/scheduler.md); the
//   float weight is then dropped (the forward uses the dequantized one). After a parallel task
//   solved them on one rank, syncTensors() gives every rank the same solution.
// - Static activations (per_tensor minmax or histogram) calibrate in two phases:
//     observing (from construction): forward observes x and passes it on unquantized — or, set
//       up with settleInForward() inside a staged run (qpipe/staged.h), observes x, waits until
//       every sample's input was observed and settled, and goes on frozen (one pass per layer);
//     freeze(): the activation parameters are fixed from the observer as it is then — after a
//       multi-rank run merged the observers (dist::synchronize does both);
//     frozen: forward fake-quantizes x with those final parameters, exactly as the deployed
//       module will, and observes nothing more.
//   So a layer's outputs, the next layer's calibration inputs, do not depend on the order of the
//   samples or on how they were dealt to ranks. msmodelslim instead fake-quantizes with the
//   running range seen so far (order dependent); qpipe departs from it on purpose.
//   The mean aggregation counts one observer update per forward call: a processor forwards the
//   layer once per sample in the observing phase (the runner does), so one update is one sample.
// - Dynamic activations (per_token) are fake-quantized per token in every phase; nothing is observed.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>

#include "qpipe/distributed_sync.h"
#include "qpipe/module.h"
#include "qpipe/observer.h"
#include "qpipe/qconfig.h"
#include "qpipe/quant_linear.h"

namespace qpipe {

class LinearQuantizer : public Module, public DistributedSync, public InputSharing {
 public:
  enum class Weights { kSolve, kDeferred };
  LinearQuantizer(Linear& linear, const quant::LinearQConfig& config, Weights weights = Weights::kSolve);

  // The weight parameters and the quantized weight (minmax, or the SSZ search), once; the float
  // weight is dropped. Every other call needs them solved.
  void solveWeights();
  bool weightsSolved() const { return qweight_.defined(); }
  const quant::LinearQConfig& config() const { return config_; }
  // NVFP4 weights: before solveWeights(), the largest |w| of the float weight, and the global
  // scale to solve with in place of the weight's own (fused shards share one: vLLM runs q/k/v and
  // gate/up as one GEMM with one global scale).
  at::Tensor weightAbsMax() const;
  void shareGlobalScale(at::Tensor globalScale);
  // After another rank solved the weights in a parallel task: minmax is recomputed here (exact,
  // cheap; no tensors); an SSZ solution's scale and codes come from the executor (int4 codes
  // packed; the zero point of a symmetric solution is 0 here).
  std::vector<at::Tensor> syncTensors(const TaskRecord& record, SyncContext& context) override;
  void syncDone(const TaskRecord& record, SyncContext& context) override;

  at::Tensor forward(const at::Tensor& input) override;
  // Siblings that are LinearQuantizers of this one's schemes, all observing in a staged run or
  // none: observed together and settled at one point (in sibling order); then, where QuantGemm
  // applies and their input parameters agree, one SharedInputGemm. The same observers and
  // parameters as each sibling's forward in turn, and its outputs (FP8: see SharedInputGemm).
  // It may decline after settling: the siblings are frozen then, and each one's own forward
  // gives its output without observing again.
  std::optional<std::vector<at::Tensor>> forwardSiblings(const at::Tensor& input,
                                                         const std::vector<Module*>& siblings) override;

  // True when the activations are static: calibration needs an observing forward and freeze().
  bool observes() const { return minMax_.has_value() || histogram_.has_value(); }
  // One-pass calibration: while not frozen, each forward observes its input and then waits at a
  // settle point of the staged run it is called in; `settle` runs once, when every sample has
  // been observed, and must freeze the quantizer (dist::synchronize does). The forward then
  // fake-quantizes with the final parameters.
  void settleInForward(std::function<void(LinearQuantizer&)> settle) { settle_ = std::move(settle); }
  // Fixes the static activation parameters from the observer (its merged state on a multi-rank
  // run; see dist::synchronize). Calling it again recomputes them from the observer as it is.
  // An observer that saw nothing leaves the quantizer uncalibrated (deploy() says so).
  void freeze();
  bool frozen() const { return frozen_; }
  // True when freeze() found data for the static activation observer (or none is needed).
  bool calibrated() const;
  // The module inference runs. Requires calibrated(); `name` is for the error message.
  std::shared_ptr<QuantLinear> deploy(const std::string& name) const;

  // The activation observer, for a multi-rank sync to merge (null when there is none).
  quant::MinMaxObserver* minMaxObserver() { return minMax_ ? &*minMax_ : nullptr; }
  quant::HistogramObserver* histogramObserver() { return histogram_ ? &*histogram_ : nullptr; }

 private:
  std::optional<ActivationQuant> activationQuant() const;
  void observe(const at::Tensor& x);
  bool observing() const { return observes() && !frozen_; }
  // The forward by QuantGemm, where it applies (the activations' parameters known).
  std::optional<at::Tensor> gemmForward(const at::Tensor& x);

  quant::LinearQConfig config_;
  at::Tensor weight_;  // the float weight until solveWeights()
  quant::QParams weightParams_;
  at::Tensor qweight_;     // quantize(W)
  at::Tensor syncedCodes_;        // between syncTensors() and syncDone(): the SSZ codes as they travel
  at::Tensor sharedGlobalScale_;  // nvfp4: set by shareGlobalScale()
  at::Tensor bias_;        // undefined when the layer has none
  at::ScalarType dtype_;   // W's dtype, the compute dtype
  at::Tensor fakeWeight_;  // dequantize(qweight_) in W's dtype, made by the first fake-quantized forward
  std::optional<quant::MinMaxObserver> minMax_;
  std::optional<quant::HistogramObserver> histogram_;
  bool frozen_ = false;
  std::function<void(LinearQuantizer&)> settle_;
  std::optional<quant::QParams> actParams_;  // static activations, set by freeze() from data
  std::optional<QuantGemm> gemm_;
  std::optional<SharedInputGemm> shared_;  // made by forwardSiblings, for the siblings it names
};

// NVFP4 weights: vLLM fuses q/k/v and gate/up into one GEMM each (its packed_modules_mapping) and
// keeps one weight global scale for it, so the shards' block scales must be computed with one
// global scale: that of their largest |w|, as llm-compressor does (the smallest of their own).
// Gives every shard among `quantizers` (HF names; weights not yet solved) that scale; does
// nothing for other schemes.
void shareFusedNvfp4GlobalScales(const std::vector<std::pair<std::string, LinearQuantizer*>>& quantizers);

}  // namespace qpipe
