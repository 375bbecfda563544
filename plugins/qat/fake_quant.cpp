#include "fake_quant.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <vector>

#include "qpipe/error.h"

namespace qpipe::qat {
namespace {

// A value whose forward is `value` and whose gradient passes to `through` unchanged:
// (value − through).detach() + through. The difference and the sum are exact here (docs/qat.md),
// so the result is `value` bit for bit.
at::Tensor straightThrough(const at::Tensor& value, const at::Tensor& through) {
  return (value - through).detach() + through;
}

// The scale as the forward uses it, with its gradient multiplied by `factor` on the way back; the
// value is the scale's own (an alias, not a product).
at::Tensor gradientScaled(const at::Tensor& scale, double factor) {
  if (!scale.requires_grad()) return scale;
  at::Tensor alias = scale.view_as(scale);
  alias.register_hook([factor](const at::Tensor& gradient) { return gradient * factor; });
  return alias;
}

// A trained scale stays at or above this fraction of its start: below it every element saturates.
constexpr double kScaleFloor = 0.01;

at::Tensor withGrad(at::Tensor value, bool trains) {
  value.set_requires_grad(trains);
  return value;
}

}  // namespace

LearnedScale::LearnedScale(const at::Tensor& initial, ScaleParam param, bool trains)
    : initial_(initial.detach().to(at::kFloat).clone()), kind_(param) {
  param_ = withGrad(kind_ == ScaleParam::kRelative ? at::ones_like(initial_) : initial_.clone(), trains);
}

at::Tensor LearnedScale::value() const {
  return kind_ == ScaleParam::kRelative ? initial_ * param_ : param_;
}

void LearnedScale::project() {
  if (!trains()) return;
  at::NoGradGuard noGrad;
  if (kind_ == ScaleParam::kRelative) {
    param_.clamp_min_(kScaleFloor);
  } else {
    param_.clamp_min_(initial_ * kScaleFloor);
  }
}

quant::QParams LearnedScale::params() const {
  at::NoGradGuard noGrad;
  const at::Tensor s = value().detach().clone();
  return {s, at::zeros(s.sizes(), s.options().dtype(at::kInt))};
}

at::Tensor storedBlockScale(const at::Tensor& scale, quant::QDtype dtype) {
  QPIPE_CHECK(quant::isFp4(dtype), "storedBlockScale of ", quant::qdtypeName(dtype));
  const at::Tensor s = scale.detach().to(at::kFloat);
  if (dtype == quant::QDtype::kNvfp4) {
    constexpr double kSmallestE4m3 = 1.0 / 512;
    return straightThrough(quant::toFp8E4m3(s.clamp(kSmallestE4m3, 448.0)).to(at::kFloat), scale);
  }
  constexpr int64_t kE8m0Bias = 127;
  const at::Tensor exponent = at::round(at::log2(s)).clamp(-kE8m0Bias, kE8m0Bias);
  return straightThrough(quant::fromE8m0((exponent + kE8m0Bias).to(at::kByte)), scale);
}

at::Tensor fakeQuantize(const at::Tensor& x, const at::Tensor& scale, const quant::QScheme& scheme, Ste ste,
                        const at::Tensor& globalScale) {
  QPIPE_CHECK(scheme.symmetric, "learnable fake quantization takes symmetric schemes, got ", scheme.name());
  if (scheme.dtype == quant::QDtype::kFloat) return x;
  const bool fp4 = quant::isFp4(scheme.dtype);
  at::Tensor divisor = scale;
  if (scheme.dtype == quant::QDtype::kNvfp4) {
    QPIPE_CHECK(globalScale.defined(), "nvfp4 fake quantization without a global scale");
    divisor = scale / globalScale.to(at::kFloat);
  }
  const bool grouped = scheme.scope == quant::QScope::kPerGroup;
  std::vector<int64_t> groups = x.sizes().vec();
  if (grouped) {
    groups.back() /= scheme.groupSize;
    groups.push_back(scheme.groupSize);
  }
  const at::Tensor values = grouped ? x.reshape(groups) : x;
  at::Tensor s = grouped ? divisor.unsqueeze(-1) : divisor;
  const double qmax = quant::qmax(scheme.dtype);
  if (ste == Ste::kLsq) {
    const double perScale = static_cast<double>(x.numel()) / static_cast<double>(scale.numel());
    s = gradientScaled(s, 1.0 / std::sqrt(perScale * qmax));
  }
  const at::Tensor u = values.to(at::kFloat) / s;
  const double lo = quant::qmin(scheme.dtype);
  const auto clamp = [&](const at::Tensor& t) {
    return ste == Ste::kLsq ? t.clamp(lo, qmax) : straightThrough(t.clamp(lo, qmax), t);
  };
  at::Tensor q;
  if (scheme.dtype == quant::QDtype::kFp8E4m3) {
    const at::Tensor clamped = clamp(u);
    // LibTorch's cast of the clamped value: the codes quant::toFp8E4m3 gives (quant.h), in one op.
    q = straightThrough(clamped.detach().to(at::kFloat8_e4m3fn).to(at::kFloat), clamped);
  } else if (fp4) {
    // The E2M1 grid value of the clamped value: the code quant::toFp4E2m1 gives u (it saturates).
    const at::Tensor clamped = clamp(u);
    q = straightThrough(quant::fromFp4E2m1(quant::toFp4E2m1(clamped.detach())), clamped);
  } else {
    q = clamp(straightThrough(at::round(u), u));
  }
  return (q * s).reshape(x.sizes()).to(x.scalar_type());
}

QatLinear::QatLinear(at::Tensor weight, at::Tensor bias, QuantLinear& init, const QatOptions& options)
    : Module("QatLinear"),
      weight_(weight.detach()),
      bias_(bias.defined() ? bias.detach() : bias),
      weightGlobal_(init.weightParams().globalScale),
      weightScheme_(init.weightScheme()),
      input_(init.inputQuant()),
      options_(options),
      weightScale_(init.weightParams().scale, options.param, options.learnable.weightScale && !options.learnable.lwc) {
  if (options.learnable.lwc) {
    std::tie(groupMin_, groupMax_) = quant::minMax(weight_, weightScheme_);
    clipMax_ = withGrad(at::full_like(weightScale_.initial(), options.lwcInit), true);
    clipMin_ = withGrad(at::full_like(weightScale_.initial(), options.lwcInit), true);
  }
  // NVFP4's static input parameter is its global scale, which does not train (block scales come
  // from each input).
  if (input_ && !input_->isDynamic() && input_->scheme.dtype != quant::QDtype::kFloat &&
      !quant::isFp4(input_->scheme.dtype)) {
    inputScale_ = LearnedScale(input_->params.scale, options.param, options.learnable.actScale);
  }
}

at::Tensor QatLinear::scaleFromClip() const {
  const at::Tensor hi = (at::sigmoid(clipMax_) * groupMax_).abs();
  const at::Tensor lo = (at::sigmoid(clipMin_) * groupMin_).abs();
  return at::maximum(at::maximum(hi, lo) / quant::qmax(weightScheme_.dtype), weightScale_.initial() * kScaleFloor);
}

at::Tensor QatLinear::weightScale() const {
  if (options_.learnable.lwc) return scaleFromClip();
  const at::Tensor scale = weightScale_.value();
  return quant::isFp4(weightScheme_.dtype) ? storedBlockScale(scale, weightScheme_.dtype) : scale;
}

std::vector<std::pair<std::string, at::Tensor>> QatLinear::state() const {
  at::NoGradGuard noGrad;
  std::vector<std::pair<std::string, at::Tensor>> tensors{{"weight_scale", weightScale().detach()}};
  if (inputScale_.defined()) tensors.emplace_back("input_scale", inputScale_.value().detach());
  if (options_.learnable.lwc) {
    tensors.emplace_back("clip_max", clipMax_.detach());
    tensors.emplace_back("clip_min", clipMin_.detach());
  }
  return tensors;
}

void QatLinear::restoreClip(const at::Tensor& clipMax, const at::Tensor& clipMin) {
  QPIPE_CHECK(clipMax_.defined() && clipMax.sizes() == clipMax_.sizes() && clipMin.sizes() == clipMin_.sizes(),
              "clip factors of shape ", clipMax.sizes(), " for a module whose are ",
              clipMax_.defined() ? clipMax_.sizes() : at::IntArrayRef{});
  at::NoGradGuard noGrad;
  clipMax_.copy_(clipMax);
  clipMin_.copy_(clipMin);
}

at::Tensor QatLinear::forward(const at::Tensor& input) {
  if (bypassed_) return at::linear(input, weight_, bias_);
  const at::Tensor w = fakeQuantize(weight_, weightScale(), weightScheme_, options_.ste, weightGlobal_);
  at::Tensor x = input;
  if (input_ && input_->scheme.dtype != quant::QDtype::kFloat) {
    const quant::QScheme& scheme = input_->scheme;
    const at::Tensor global = input_->params.globalScale;
    at::Tensor scale;
    if (scheme.dtype == quant::QDtype::kNvfp4) {
      scale = quant::computeQParams(input.detach(), scheme, global).scale;
    } else {
      scale = input_->isDynamic() ? quant::computeQParams(input.detach(), scheme).scale : inputScale_.value();
    }
    x = fakeQuantize(input, scale, scheme, options_.ste, global);
  }
  return at::linear(x, w, bias_);
}

std::vector<std::pair<std::string, at::Tensor>> QatLinear::trainable() const {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, tensor] : {std::pair<std::string, at::Tensor>{"weight_scale", weightScale_.parameter()},
                                     {"clip_max", clipMax_},
                                     {"clip_min", clipMin_},
                                     {"input_scale", inputScale_.parameter()}}) {
    if (tensor.defined() && tensor.requires_grad()) tensors.emplace_back(name, tensor);
  }
  return tensors;
}

void QatLinear::project() {
  weightScale_.project();
  inputScale_.project();
}

std::shared_ptr<QuantLinear> QatLinear::deploy() const {
  at::NoGradGuard noGrad;
  const at::Tensor scale = weightScale().detach().clone();
  const quant::QParams params{scale, at::zeros(scale.sizes(), scale.options().dtype(at::kInt)), weightGlobal_};
  std::optional<ActivationQuant> input = input_;
  if (inputScale_.defined()) input->params = inputScale_.params();
  return std::make_shared<QuantLinear>(quant::quantize(weight_, params, weightScheme_), params, weightScheme_,
                                       std::move(input), bias_, weight_.scalar_type());
}

QatAttentionQuant::QatAttentionQuant(AttentionQuant& init, const QatOptions& options, bool trains)
    : Module("QatAttentionQuant"), scheme_(init.scheme()), ste_(options.ste) {
  QPIPE_REQUIRE(scheme_.symmetric, ErrorCode::kConfig,
                "learnable_scale_qat takes symmetric attention quantization, got ", scheme_.name());
  if (!init.isDynamic()) scale_ = LearnedScale(init.params().scale, options.param, trains);
}

at::Tensor QatAttentionQuant::forward(const at::Tensor& input) {
  if (bypassed_) return input;
  const at::Tensor s = isDynamic() ? quant::computeQParams(input.detach(), scheme_).scale : scale_.value();
  return fakeQuantize(input, s, scheme_, ste_);
}

std::vector<at::Tensor> QatAttentionQuant::trainable() const {
  if (!scale_.trains()) return {};
  return {scale_.parameter()};
}

at::Tensor QatAttentionQuant::scale() const {
  QPIPE_CHECK(!isDynamic(), "QatAttentionQuant::scale of a dynamic module");
  return scale_.params().scale;
}

std::shared_ptr<AttentionQuant> QatAttentionQuant::deploy() const {
  return std::make_shared<AttentionQuant>(scheme_,
                                          isDynamic() ? std::nullopt : std::optional<quant::QParams>(scale_.params()));
}

}  // namespace qpipe::qat
