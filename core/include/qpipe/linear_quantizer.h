// A Linear under calibration (msmodelslim's LinearQuantizer, core/quantizer/linear.py):
// forward = linear(actQuant(x), fakeQuant(W), b), observing x on the way, so the layer's outputs
// carry the quantization error into the next layer as they will at inference.
//
// - Weights are data-free: minmax or ssz parameters and the quantized weight are computed once,
//   at construction; the float weight is not kept (the forward uses the dequantized one).
// - Static activations (per_tensor minmax): each forward updates the running observer and
//   fake-quantizes x with the parameters seen so far, as msmodelslim does.
// - Histogram activations: the forward observes x and passes it on unquantized (the l2/KL
//   search is too costly to run per batch); parameters are searched once at deploy().
// - Dynamic activations (per_token) are fake-quantized per token; nothing is observed.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>

#include "qpipe/module.h"
#include "qpipe/observer.h"
#include "qpipe/qconfig.h"
#include "qpipe/quant_linear.h"

namespace qpipe {

class LinearQuantizer : public Module {
 public:
  LinearQuantizer(Linear& linear, const quant::LinearQConfig& config);

  at::Tensor forward(const at::Tensor& input) override;

  // True when a static activation observer has seen at least one batch (or none is needed).
  bool calibrated() const;
  // The module inference runs. Requires calibrated(); `name` is for the error message.
  std::shared_ptr<QuantLinear> deploy(const std::string& name) const;

  // Observer states, for a multi-rank sync to merge (null when the side has none).
  quant::MinMaxObserver* minMaxObserver() { return minMax_ ? &*minMax_ : nullptr; }
  quant::HistogramObserver* histogramObserver() { return histogram_ ? &*histogram_ : nullptr; }

 private:
  std::optional<ActivationQuant> activationQuant() const;

  quant::LinearQConfig config_;
  quant::QParams weightParams_;
  at::Tensor qweight_;     // quantize(W)
  at::Tensor bias_;        // undefined when the layer has none
  at::ScalarType dtype_;   // W's dtype, the compute dtype
  at::Tensor fakeWeight_;  // dequantize(qweight_) in W's dtype, made by the first forward
  std::optional<quant::MinMaxObserver> minMax_;
  std::optional<quant::HistogramObserver> histogram_;
};

}  // namespace qpipe
