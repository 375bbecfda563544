#include "qpipe/attention_quant.h"

#include <ATen/ATen.h>

#include <utility>

#include "qpipe/error.h"

namespace qpipe {

AttentionQuant::AttentionQuant(quant::QScheme scheme, std::optional<quant::QParams> params)
    : Module("AttentionQuant"), scheme_(scheme) {
  using quant::QScope;
  QPIPE_REQUIRE(
      scheme.scope == QScope::kPerHead || scheme.scope == QScope::kPerTensor || scheme.scope == QScope::kPerToken,
      ErrorCode::kConfig, "attention quantization is per_head or per_tensor (static) or per_token (dynamic), not ",
      quant::qscopeName(scheme.scope));
  QPIPE_CHECK(params.has_value() == !isDynamic(),
              "AttentionQuant: ", params ? "parameters for a dynamic scheme" : "a static scheme without parameters");
  if (params) {
    const int64_t dims = scheme.scope == QScope::kPerHead ? 4 : 1;
    QPIPE_CHECK(params->scale.dim() == dims && params->scale.sizes() == params->zeroPoint.sizes(),
                "AttentionQuant: scale shape ", params->scale.sizes(), " for ", quant::qscopeName(scheme.scope));
    addParameter("scale", std::move(params->scale));
    addParameter("zero_point", std::move(params->zeroPoint));
  }
}

quant::QParams AttentionQuant::params() {
  QPIPE_CHECK(!isDynamic(), "AttentionQuant::params of a dynamic module");
  return {parameter("scale"), parameter("zero_point")};
}

at::Tensor AttentionQuant::forward(const at::Tensor& input) {
  QPIPE_REQUIRE(input.dim() == 4, ErrorCode::kInput, "attention quantization needs [batch, heads, seq, head_dim], got ",
                input.sizes());
  if (isDynamic()) return quant::fakeQuantize(input, quant::computeQParams(input, scheme_), scheme_);
  const quant::QParams p = params();
  QPIPE_REQUIRE(scheme_.scope != quant::QScope::kPerHead || p.scale.size(1) == input.size(1), ErrorCode::kInput,
                "attention quantization has scales for ", p.scale.size(1), " heads, the input has ", input.size(1));
  return quant::fakeQuantize(input, p, scheme_);
}

}  // namespace qpipe
