#include "qpipe/linear_quantizer.h"

#include <ATen/ATen.h>

#include <tuple>

#include "qpipe/error.h"
#include "qpipe/model.h"
#include "qpipe/staged.h"

namespace qpipe {

using quant::QMethod;

LinearQuantizer::LinearQuantizer(Linear& linear, const quant::LinearQConfig& config, Weights weights)
    : Module("LinearQuantizer"),
      config_(config),
      weight_(linear.weight()),
      bias_(linear.bias()),
      dtype_(linear.weight().scalar_type()) {
  if (weights == Weights::kSolve) solveWeights();
  const quant::QConfig& act = config_.act;
  if (act.enabled() && !act.isDynamic()) {
    if (act.method == QMethod::kHistogram) {
      histogram_.emplace(act.scheme, act.search);
    } else {
      minMax_.emplace(act.scheme, act.aggregation);
    }
  }
}

void LinearQuantizer::solveWeights() {
  if (weightsSolved()) return;
  if (config_.weight.method == QMethod::kSsz) {
    weightParams_ = quant::sszSearch(weight_, config_.weight.scheme, config_.weight.sszSteps);
    qweight_ = quant::quantize(weight_, weightParams_, config_.weight.scheme);
  } else if (sharedGlobalScale_.defined()) {
    weightParams_ = quant::computeQParams(weight_, config_.weight.scheme, sharedGlobalScale_);
    qweight_ = quant::quantize(weight_, weightParams_, config_.weight.scheme);
  } else {
    std::tie(weightParams_, qweight_) = quant::quantizeWeight(weight_, config_.weight.scheme);
  }
  weight_ = at::Tensor();
}

at::Tensor LinearQuantizer::weightAbsMax() const {
  QPIPE_CHECK(!weightsSolved(), "weightAbsMax() after solveWeights()");
  return weight_.abs().amax().to(at::kFloat).reshape({1});
}

void LinearQuantizer::shareGlobalScale(at::Tensor globalScale) {
  QPIPE_CHECK(!weightsSolved() && config_.weight.scheme.dtype == quant::QDtype::kNvfp4,
              "shareGlobalScale() is for nvfp4 weights not yet solved");
  sharedGlobalScale_ = std::move(globalScale);
}

std::vector<at::Tensor> LinearQuantizer::syncTensors(const TaskRecord& record, SyncContext& context) {
  if (config_.weight.method != QMethod::kSsz) {
    solveWeights();
    return {};
  }
  // SSZ solutions are per-channel and symmetric (sszSearch refuses others): the scale [out, 1]
  // and the codes travel, int4 codes packed eight a word (half the bytes); the zero point is 0.
  const bool int4 = config_.weight.scheme.dtype == quant::QDtype::kInt4;
  if (context.group.rank() == record.executorRank) {
    QPIPE_CHECK(weightsSolved() && weightParams_.scale.dim() == 2 && weightParams_.scale.size(1) == 1, "rank ",
                record.executorRank, " ran the weight solve but holds no per-channel solution");
    syncedCodes_ = int4 ? quant::packInt4(qweight_) : qweight_;
  } else {
    // Buffers of the executor's dtypes and shapes; the float weight stays until syncDone() reads
    // its width.
    const int64_t out = weight_.size(0), in = weight_.size(1);
    const at::TensorOptions options = weight_.options();
    weightParams_ = {.scale = at::empty({out, 1}, options.dtype(at::kFloat)),
                     .zeroPoint = at::zeros({out, 1}, options.dtype(at::kInt))};
    syncedCodes_ =
        int4 ? at::empty({out, (in + 7) / 8}, options.dtype(at::kInt)) : at::empty({out, in}, options.dtype(at::kChar));
  }
  return {weightParams_.scale, syncedCodes_};
}

void LinearQuantizer::syncDone(const TaskRecord& /*record*/, SyncContext& /*context*/) {
  if (!syncedCodes_.defined()) return;
  if (!weightsSolved()) {
    // int32 words are packed int4 codes; int8 codes travel as they are.
    const bool packed = syncedCodes_.scalar_type() == at::kInt;
    qweight_ = packed ? quant::unpackInt4(syncedCodes_, weight_.size(1)) : syncedCodes_;
    weight_ = at::Tensor();
  }
  syncedCodes_ = at::Tensor();
}

at::Tensor LinearQuantizer::forward(const at::Tensor& input) {
  QPIPE_CHECK(weightsSolved(), "LinearQuantizer::forward before solveWeights()");
  at::Tensor x = input;
  if (observes()) {
    if (!frozen_) {
      observe(x);
      if (settle_) {
        settlePoint(this, [this] {
          settle_(*this);
          QPIPE_CHECK(frozen_, "a LinearQuantizer's settle step did not freeze it");
        });
      }
    }
    // Frozen without parameters: no calibration data reached this module in the observing
    // forward; deploy() reports it by name.
    if (frozen_ && actParams_) {
      if (std::optional<at::Tensor> y = gemmForward(x)) return *y;
      x = ActivationQuant{config_.act.scheme, *actParams_}.apply(x);
    }
  } else if (config_.act.enabled()) {
    if (std::optional<at::Tensor> y = gemmForward(x)) return *y;
    x = ActivationQuant{config_.act.scheme, {}}.apply(x);
  }
  if (!fakeWeight_.defined()) {
    fakeWeight_ = quant::dequantize(qweight_, weightParams_, config_.weight.scheme).to(dtype_);
  }
  return at::linear(x, fakeWeight_, bias_);
}

void LinearQuantizer::observe(const at::Tensor& x) {
  if (minMax_) minMax_->update(x);
  if (histogram_) histogram_->update(x);
}

std::optional<std::vector<at::Tensor>> LinearQuantizer::forwardSiblings(const at::Tensor& input,
                                                                        const std::vector<Module*>& siblings) {
  std::vector<LinearQuantizer*> group;
  for (Module* module : siblings) {
    auto* sibling = dynamic_cast<LinearQuantizer*>(module);
    if (sibling == nullptr || !sibling->weightsSolved() || sibling->config_.weight.scheme != config_.weight.scheme ||
        sibling->config_.act.scheme != config_.act.scheme || sibling->observing() != observing() ||
        (sibling->observing() && !sibling->settle_)) {
      return std::nullopt;
    }
    group.push_back(sibling);
  }
  if (observing()) {
    for (LinearQuantizer* sibling : group) sibling->observe(input);
    // A point of its own: a task that reached q_proj's lone settle point instead would be an error.
    settlePoint(&shared_, [&group] {
      for (LinearQuantizer* sibling : group) {
        sibling->settle_(*sibling);
        QPIPE_CHECK(sibling->frozen_, "a LinearQuantizer's settle step did not freeze it");
      }
    });
  }
  // From here on each sibling's own forward gives the same outputs, so declining is still right.
  const std::optional<ActivationQuant> act = activationQuant();
  if (!calibrated() || !act || !QuantGemm::supports(config_.weight.scheme, act) ||
      !SharedInputGemm::runs(input, qweight_)) {
    return std::nullopt;
  }
  for (LinearQuantizer* sibling : group) {
    if (!sibling->calibrated() || !sameActivationQuant(sibling->activationQuant(), act) ||
        sibling->bias_.defined() != bias_.defined()) {
      return std::nullopt;
    }
  }
  if (!shared_ || !shared_->madeFor(siblings)) {
    std::vector<SharedInputGemm::Member> members;
    for (LinearQuantizer* sibling : group) {
      members.push_back({sibling, sibling->qweight_, sibling->weightParams_.scale, sibling->bias_});
    }
    shared_.emplace(members, config_.weight.scheme, act);
  }
  return shared_->forward(input, *act);
}

std::optional<at::Tensor> LinearQuantizer::gemmForward(const at::Tensor& x) {
  const std::optional<ActivationQuant> act = activationQuant();
  if (!QuantGemm::supports(config_.weight.scheme, act)) return std::nullopt;
  if (!gemm_) gemm_.emplace(qweight_, weightParams_.scale, config_.weight.scheme, act);
  return gemm_->forward(x, *act, bias_);
}

void LinearQuantizer::freeze() {
  frozen_ = true;
  actParams_.reset();
  std::optional<quant::QParams> params;
  if (minMax_ && !minMax_->empty()) params = minMax_->qparams();
  if (histogram_ && !histogram_->empty()) params = histogram_->qparams();
  if (params) {
    // The histogram drops non-finite values; a min-max range takes them in, and a NaN or infinite
    // scale would compute NaN from here on and end in a checkpoint that does.
    const std::string where = path();
    const auto finite = [](const at::Tensor& t) { return !t.defined() || allFinite(t); };
    QPIPE_REQUIRE(finite(params->scale) && finite(params->zeroPoint) && finite(params->globalScale), ErrorCode::kInput,
                  where.empty() ? "a static activation" : where,
                  ": the inputs it saw in calibration hold NaN or Inf, so its static activation scale is not finite "
                  "(does the float model overflow on the calibration data? `qpipe eval` shows it)");
    // The observer's state may have come back from a cross-rank sync on the CPU.
    const at::Device device = qweight_.device();
    const auto onDevice = [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
    actParams_ = quant::QParams{onDevice(params->scale), onDevice(params->zeroPoint), onDevice(params->globalScale)};
  }
}

bool LinearQuantizer::calibrated() const {
  return !observes() || actParams_.has_value();
}

std::optional<ActivationQuant> LinearQuantizer::activationQuant() const {
  const quant::QConfig& act = config_.act;
  if (!act.enabled()) return std::nullopt;
  if (observes()) return ActivationQuant{act.scheme, *actParams_};
  return ActivationQuant{act.scheme, {}};
}

std::shared_ptr<QuantLinear> LinearQuantizer::deploy(const std::string& name) const {
  QPIPE_CHECK(weightsSolved(), name, ": deploy() before solveWeights()");
  QPIPE_CHECK(!observes() || frozen_, name,
              ": deploy() before freeze(): the static activation parameters are not fixed");
  QPIPE_REQUIRE(calibrated(), ErrorCode::kInput, name,
                ": no calibration data reached this module, so its static activation scale is unknown; "
                "add calibration samples or exclude it");
  return std::make_shared<QuantLinear>(qweight_, weightParams_, config_.weight.scheme, activationQuant(), bias_,
                                       dtype_);
}

namespace {

// The fused GEMM a projection is a shard of ("<attention>.qkv_proj", "<mlp>.gate_up_proj"), or "".
std::string fusedGemm(const std::string& name) {
  const size_t dot = name.rfind('.');
  const std::string parent = dot == std::string::npos ? "" : name.substr(0, dot);
  const std::string leaf = name.substr(dot == std::string::npos ? 0 : dot + 1);
  if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") return parent + ".qkv_proj";
  if (leaf == "gate_proj" || leaf == "up_proj") return parent + ".gate_up_proj";
  return "";
}

}  // namespace

void shareFusedNvfp4GlobalScales(const std::vector<std::pair<std::string, LinearQuantizer*>>& quantizers) {
  std::map<std::string, std::vector<LinearQuantizer*>> fused;
  for (const auto& [name, quantizer] : quantizers) {
    if (quantizer->config().weight.scheme.dtype != quant::QDtype::kNvfp4) continue;
    if (const std::string key = fusedGemm(name); !key.empty()) fused[key].push_back(quantizer);
  }
  for (const auto& [key, shards] : fused) {
    at::Tensor absmax = shards.front()->weightAbsMax();
    for (LinearQuantizer* shard : shards) absmax = at::maximum(absmax, shard->weightAbsMax());
    const at::Tensor global = quant::nvfp4GlobalScale(absmax);
    for (LinearQuantizer* shard : shards) shard->shareGlobalScale(global);
  }
}

}  // namespace qpipe
