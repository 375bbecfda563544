// Quantized attention inputs (docs/attention.md). fa3_quant puts an AttentionQuant at an
// Attention's q_hook, k_hook or v_hook: where Q and K (after the q/k norms and RoPE) and V enter
// scaled_dot_product_attention, as [batch, heads, seq, head_dim] (K and V with the KV heads). It
// fake-quantizes them, so the calibration of later layers and `qpipe eval` see the deployed
// attention: per head with static scales, or per token (each head's head_dim values at one
// position) computed at run time.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "qpipe/module.h"
#include "qpipe/quant.h"

namespace qpipe {

// typeName "AttentionQuant". Static modules hold the parameters "scale" fp32 and "zero_point"
// int32, [1, heads, 1, 1] per_head or [1] per_tensor; dynamic (per_token) ones hold none.
class AttentionQuant : public Module {
 public:
  // `params` exactly for a static (per_head, per_tensor) scheme; per_token is dynamic.
  // Error(kConfig) for any other scope, naming it.
  AttentionQuant(quant::QScheme scheme, std::optional<quant::QParams> params);
  at::Tensor forward(const at::Tensor& input) override;

  const quant::QScheme& scheme() const { return scheme_; }
  bool isDynamic() const { return scheme_.scope == quant::QScope::kPerToken; }
  // Static only.
  quant::QParams params();

 private:
  quant::QScheme scheme_;
};

}  // namespace qpipe
