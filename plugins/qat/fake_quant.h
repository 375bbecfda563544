// Fake quantization whose scales learn (docs/qat.md). The forward computes the value the deployed
// QuantLinear computes, bit for bit; the backward is a straight-through estimator, so the scales
// (and the inputs) get gradients through round and clamp.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/attention_quant.h"
#include "qpipe/module.h"
#include "qpipe/quant.h"
#include "qpipe/quant_linear.h"

namespace qpipe::qat {

// How gradients pass round and clamp, with u = x / s and Q the quantizer's grid:
//   kAngelSlim  both straight through (AngelSlim's Quantizer): ∂y/∂x = 1 everywhere and
//               ∂y/∂s = Q(u) − u for every element, saturated ones included.
//   kLsq        round straight through, clamp real (Esser et al., LSQ): ∂y/∂x = 0 and
//               ∂y/∂s = ±qmax outside the range, Q(u) − u inside; the scale's gradient is
//               multiplied by 1/sqrt(N·qmax), N the elements one scale value covers.
enum class Ste { kAngelSlim, kLsq };

// dequantize(quantize(x)) for a symmetric scheme with `scale` in the scheme's keepdim shape
// (quant.h; per_group [out, in/group], or [..., in/group] for activations), differentiable in x and
// scale as `ste` says. The value equals quant::fakeQuantize(x, {scale, 0, globalScale}, scheme)
// bit for bit (docs/qat.md says why). An FP4 `scale` is given as the deployed module stores it
// (storedBlockScale, or computed from an input); NVFP4 divides it by `globalScale`, which does not
// train.
at::Tensor fakeQuantize(const at::Tensor& x, const at::Tensor& scale, const quant::QScheme& scheme, Ste ste,
                        const at::Tensor& globalScale = {});

// An FP4 block scale as the deployed module stores it, with a straight-through gradient: NVFP4's
// rounded to E4M3 within [2^-9, 448] (2^-9 is E4M3's smallest value: a block scale that rounded to
// 0 would divide by zero), MXFP4's to the nearest power of two in [2^-127, 2^127] (nearest in the
// exponent). Both leave a stored scale as it is.
at::Tensor storedBlockScale(const at::Tensor& scale, quant::QDtype dtype);

// What trains (AngelSlim's plugin_config.quant_config.learnable); the float weights never do.
struct Learnable {
  bool weightScale = true;  // the weight scales
  bool actScale = false;    // static activations' input_scale
  bool lwc = false;         // OmniQuant's learnable weight clipping (replaces weightScale's tensor)
};

// What the optimizer holds for a scale s that starts at s0:
//   kAbsolute  s itself (AngelSlim's nn.Parameter): a learning rate is in the scale's units, so one
//              rate moves a layer's small scales far more, relative to their size, than its large ones;
//   kRelative  α with s = s0·α, α from 1 (mcore_qad's LearnableScale): the learning rate is a
//              relative step, the same for every scale.
enum class ScaleParam { kAbsolute, kRelative };

struct QatOptions {
  Learnable learnable;
  Ste ste = Ste::kAngelSlim;
  ScaleParam param = ScaleParam::kRelative;
  double lwcInit = 4.0;  // the clip factors' initial logit: σ(4) ≈ 0.982 of the range
};

// A scale the optimizer may update, held in ScaleParam's form, with its start s0. It never goes
// below s0/100 (project()): the forward never clamps, so the scale exported is the one trained.
class LearnedScale {
 public:
  LearnedScale() = default;
  LearnedScale(const at::Tensor& initial, ScaleParam param, bool trains);

  bool defined() const { return initial_.defined(); }
  // s, differentiable in the parameter (s0·α with kRelative).
  at::Tensor value() const;
  // What the optimizer holds: s or α; it requires grad when the scale trains.
  const at::Tensor& parameter() const { return param_; }
  const at::Tensor& initial() const { return initial_; }
  bool trains() const { return param_.defined() && param_.requires_grad(); }
  // After an optimizer step: back to at least s0/100.
  void project();
  // s as QParams (zero points 0), detached.
  quant::QParams params() const;

 private:
  at::Tensor param_, initial_;
  ScaleParam kind_ = ScaleParam::kRelative;
};

// typeName "QatLinear": a Linear under scale-only QAT. The float weight and bias are frozen; the
// weight's scales (or, with lwc, the clip factors they come from) and a static input scale are
// parameters (ScaleParam says in which form). It starts from a PTQ module's scales, so before any
// step it computes what that module computes. Scales are projected onto [s0/100, ∞) after each
// step (project()): the forward never clamps, so the scale exported is the one trained.
class QatLinear : public Module {
 public:
  QatLinear(at::Tensor weight, at::Tensor bias, QuantLinear& init, const QatOptions& options);

  at::Tensor forward(const at::Tensor& input) override;

  // The tensors an optimizer updates, by local name: weight_scale, clip_max and clip_min (lwc),
  // input_scale (with kRelative, weight_scale and input_scale hold α); each requires grad.
  std::vector<std::pair<std::string, at::Tensor>> trainable() const;
  bool isClipFactor(const std::string& name) const { return name == "clip_max" || name == "clip_min"; }
  // After an optimizer step: every scale back to at least its floor.
  void project();
  // The weight scales the forward uses now (from the clip factors with lwc).
  at::Tensor weightScale() const;
  // The deployed module with the learned scales: quantized weight, weight_scale, input_scale.
  std::shared_ptr<QuantLinear> deploy() const;
  // What a scales artifact keeps of the module, by local name: weight_scale and input_scale as the
  // forward uses them, and with lwc the clip factors' logits clip_max and clip_min; detached.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Sets the lwc logits from a scales artifact (the scales come in through the PTQ module).
  void restoreClip(const at::Tensor& clipMax, const at::Tensor& clipMin);
  // While bypassed, forward is the float Linear's: the model is its own teacher (end2end KD).
  void setBypassed(bool bypassed) { bypassed_ = bypassed; }

 private:
  at::Tensor scaleFromClip() const;  // lwc: σ(c)·range / qmax per scale value, with the floor

  at::Tensor weight_;  // frozen float weight [out, in]
  at::Tensor bias_;
  at::Tensor weightGlobal_;  // NVFP4: the weight's global scale, fixed
  quant::QScheme weightScheme_;
  std::optional<ActivationQuant> input_;
  QatOptions options_;
  LearnedScale weightScale_;                            // trains unless lwc
  at::Tensor clipMax_, clipMin_, groupMax_, groupMin_;  // lwc: logits, and the weight's ranges
  LearnedScale inputScale_;                             // static activations
  bool bypassed_ = false;
};

// typeName "QatAttentionQuant": an AttentionQuant (fa3_quant's, at an Attention's q_hook, k_hook
// or v_hook) under QAT. Its forward is the AttentionQuant's value, bit for bit, with the
// straight-through gradient, so the projections before it keep learning; a static module's scale
// trains when `trains` (learnable.kv_scale, K and V). Dynamic (per_token) ones only pass gradients.
class QatAttentionQuant : public Module {
 public:
  QatAttentionQuant(AttentionQuant& init, const QatOptions& options, bool trains);

  at::Tensor forward(const at::Tensor& input) override;

  // The scale's parameter while it trains, else nothing.
  std::vector<at::Tensor> trainable() const;
  void project() { scale_.project(); }
  // Static only: the scale the forward uses, [1, heads, 1, 1] per_head or [1] per_tensor, detached.
  at::Tensor scale() const;
  bool isDynamic() const { return !scale_.defined(); }
  std::shared_ptr<AttentionQuant> deploy() const;
  // While bypassed, forward is the identity: the float attention (the teacher, blockwise targets).
  void setBypassed(bool bypassed) { bypassed_ = bypassed; }

 private:
  quant::QScheme scheme_;
  Ste ste_;
  LearnedScale scale_;  // undefined for per_token
  bool bypassed_ = false;
};

}  // namespace qpipe::qat
