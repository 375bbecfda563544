#include "qpipe/quant_linear.h"

#include <ATen/ATen.h>

#include "qpipe/error.h"

namespace qpipe {

at::Tensor ActivationQuant::apply(const at::Tensor& x) const {
  if (scheme.dtype == quant::QDtype::kFloat) return x;
  return quant::fakeQuantize(x, isDynamic() ? quant::computeQParams(x, scheme) : params, scheme);
}

QuantLinear::QuantLinear(at::Tensor qweight, quant::QParams weightParams, quant::QScheme weightScheme,
                         std::optional<ActivationQuant> input, at::Tensor bias, at::ScalarType computeDtype)
    : Module("QuantLinear"), weightScheme_(weightScheme), input_(std::move(input)), computeDtype_(computeDtype) {
  QPIPE_CHECK(qweight.dim() == 2, "QuantLinear weight must be 2-D, got ", qweight.sizes());
  QPIPE_CHECK(weightParams.scale.defined() && weightParams.zeroPoint.defined(), "QuantLinear without weight params");
  addParameter("weight", std::move(qweight));
  addParameter("weight_scale", weightParams.scale.to(at::kFloat));
  if (!weightScheme_.symmetric) addParameter("weight_zero_point", weightParams.zeroPoint.to(at::kInt));
  if (input_ && !input_->isDynamic() && input_->scheme.dtype != quant::QDtype::kFloat) {
    QPIPE_CHECK(input_->params.scale.defined(), "static activation quantization without a scale");
    addParameter("input_scale", input_->params.scale.to(at::kFloat));
    if (!input_->scheme.symmetric) addParameter("input_zero_point", input_->params.zeroPoint.to(at::kInt));
  }
  if (bias.defined()) addParameter("bias", std::move(bias));
}

std::shared_ptr<QuantLinear> QuantLinear::fromLinear(Linear& linear, const quant::QParams& weightParams,
                                                     const quant::QScheme& weightScheme,
                                                     std::optional<ActivationQuant> input) {
  const at::Tensor weight = linear.weight();
  return std::make_shared<QuantLinear>(quant::quantize(weight, weightParams, weightScheme), weightParams, weightScheme,
                                       std::move(input), linear.bias(), weight.scalar_type());
}

quant::QParams QuantLinear::weightParams() {
  const at::Tensor scale = parameter("weight_scale");
  return {scale, hasParameter("weight_zero_point") ? parameter("weight_zero_point")
                                                   : at::zeros_like(scale, scale.options().dtype(at::kInt))};
}

at::Tensor QuantLinear::bias() {
  return hasParameter("bias") ? parameter("bias") : at::Tensor();
}

at::Tensor QuantLinear::dequantizedWeight() {
  const at::Tensor& q = parameter("weight");
  if (!dequantized_.defined() || dequantized_.device() != q.device()) {
    dequantized_ = quant::dequantize(q, weightParams(), weightScheme_).to(computeDtype_);
  }
  return dequantized_;
}

at::Tensor QuantLinear::forward(const at::Tensor& input) {
  const at::Tensor x = input_ ? input_->apply(input) : input;
  return at::linear(x, dequantizedWeight(), bias());
}

}  // namespace qpipe
