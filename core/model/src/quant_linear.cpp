#include "qpipe/quant_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "qpipe/error.h"

namespace qpipe {

bool Int8Linear::supports(const quant::QScheme& weight, const std::optional<ActivationQuant>& input) {
  using quant::QDtype, quant::QScope;
  return weight.dtype == QDtype::kInt8 && weight.scope == QScope::kPerChannel && weight.symmetric && input &&
         input->scheme.dtype == QDtype::kInt8 &&
         (input->scheme.scope == QScope::kPerToken ||
          (input->scheme.scope == QScope::kPerTensor && input->params.scale.defined()));
}

Int8Linear::Int8Linear(const at::Tensor& qweight, const at::Tensor& scale)
    : weightT_(qweight.t()),
      rowSums_(qweight.sum(1, false, at::kLong)),
      scale_(scale.to(at::kFloat).reshape({-1}).contiguous()) {
  QPIPE_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && scale_.numel() == qweight.size(0),
              "Int8Linear takes an int8 [N, K] weight and N scales, got ", qweight.sizes(), " and ", scale.sizes());
}

std::optional<at::Tensor> Int8Linear::forward(const at::Tensor& x, const ActivationQuant& input,
                                              const at::Tensor& bias) const {
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || !weightT_.device().is_cpu()) return std::nullopt;
  const int64_t k = weightT_.size(0), n = weightT_.size(1);
  const at::Tensor flat = x.reshape({-1, k});
  const quant::QParams params = input.isDynamic() ? quant::computeQParams(flat, input.scheme) : input.params;
  const at::Tensor acc = quant::int8Matmul(quant::quantize(flat, params, input.scheme), weightT_).contiguous();
  const int64_t rows = acc.size(0);
  const at::Tensor sx = params.scale.to(at::kFloat).reshape({-1}).contiguous();
  const at::Tensor zx = params.zeroPoint.to(at::kLong).reshape({-1}).contiguous();
  const bool perRow = sx.numel() != 1;
  at::Tensor out = at::empty({rows, n}, x.options());
  const at::Tensor b = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const int32_t* a = acc.const_data_ptr<int32_t>();
  const int64_t* rs = rowSums_.const_data_ptr<int64_t>();
  const float* sw = scale_.const_data_ptr<float>();
  const float* pb = b.defined() ? b.const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float s = sx.const_data_ptr<float>()[perRow ? m : 0];
      const int64_t z = zx.const_data_ptr<int64_t>()[perRow ? m : 0];
      for (int64_t j = 0; j < n; ++j) {
        const float y = static_cast<float>(a[m * n + j] - z * rs[j]) * (s * sw[j]);
        o[m * n + j] = pb != nullptr ? y + pb[j] : y;
      }
    }
  });
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

at::Tensor ActivationQuant::apply(const at::Tensor& x) const {
  if (scheme.dtype == quant::QDtype::kFloat) return x;
  if (quant::isFp4(scheme.dtype)) return quant::fakeQuantizeFp4Dynamic(x, scheme, params.globalScale);
  return quant::fakeQuantize(x, isDynamic() ? quant::computeQParams(x, scheme) : params, scheme);
}

QuantLinear::QuantLinear(at::Tensor qweight, quant::QParams weightParams, quant::QScheme weightScheme,
                         std::optional<ActivationQuant> input, at::Tensor bias, at::ScalarType computeDtype)
    : Module("QuantLinear"), weightScheme_(weightScheme), input_(std::move(input)), computeDtype_(computeDtype) {
  QPIPE_CHECK(qweight.dim() == 2, "QuantLinear weight must be 2-D, got ", qweight.sizes());
  QPIPE_CHECK(weightParams.scale.defined() && weightParams.zeroPoint.defined(), "QuantLinear without weight params");
  addParameter("weight", std::move(qweight));
  addParameter("weight_scale", weightParams.scale.to(at::kFloat));
  if (weightParams.globalScale.defined()) addParameter("weight_global_scale", weightParams.globalScale.to(at::kFloat));
  if (!weightScheme_.symmetric) addParameter("weight_zero_point", weightParams.zeroPoint.to(at::kInt));
  if (input_ && input_->scheme.dtype == quant::QDtype::kNvfp4) {
    QPIPE_CHECK(input_->params.globalScale.defined(), "nvfp4 activation quantization without a global scale");
    addParameter("input_global_scale", input_->params.globalScale.to(at::kFloat));
  } else if (input_ && !input_->isDynamic() && input_->scheme.dtype != quant::QDtype::kFloat) {
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
  return {scale,
          hasParameter("weight_zero_point") ? parameter("weight_zero_point")
                                            : at::zeros_like(scale, scale.options().dtype(at::kInt)),
          hasParameter("weight_global_scale") ? parameter("weight_global_scale") : at::Tensor()};
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
  if (!int8_ && Int8Linear::supports(weightScheme_, input_) && parameter("weight").device().is_cpu()) {
    int8_.emplace(parameter("weight"), parameter("weight_scale"));
  }
  if (int8_) {
    if (std::optional<at::Tensor> y = int8_->forward(input, *input_, bias())) return *y;
  }
  const at::Tensor x = input_ ? input_->apply(input) : input;
  return at::linear(x, dequantizedWeight(), bias());
}

}  // namespace qpipe
