// fa3_quant: msmodelslim's FA3QuantProcessor (processor/quant/fa3; docs/attention.md). Q, K and V
// as they enter each Attention's scaled_dot_product_attention, after the q/k norms and RoPE (its
// q_hook, k_hook and v_hook, which msmodelslim's adapters call the fa_q, fa_k and fa_v
// placeholders), are quantized per head with static scales, or per token at run time:
//   preprocess   a per_token input gets its AttentionQuant at once; a static one (per_head, or
//                qpipe's per_tensor) a HeadObserver, a recall window per head (ratio 0.9999 for Q
//                and K, 1.0 for V, msmodelslim's), merged over the heads for per_tensor
//   process      calibrate(): in a staged forward each observer settles (the per-head min/max
//                all-reduced across ranks, the scales fixed) once every sample reached it, and
//                fake-quantizes from then on, so the rest of the layer sees the deployed
//                attention; otherwise observe → settle → propagate
//   postprocess  HeadObserver → AttentionQuant, what savers write and inference runs
// Distributed-complete: minima and maxima merge exactly, and every rank holds every attention.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/attention_quant.h"
#include "qpipe/observer.h"
#include "qpipe/plugin.h"
#include "qpipe/qconfig.h"

namespace qpipe {
namespace {

struct Input {
  const char* hook;  // the HookPoint below the attention module
  const char* name;  // msmodelslim's placeholder name: what include/exclude match and savers write
  double ratio;      // msmodelslim's recall-window ratio
};
constexpr std::array<Input, 3> kInputs = {
    {{"q_hook", "fa_q", 0.9999}, {"k_hook", "fa_k", 0.9999}, {"v_hook", "fa_v", 1.0}}};

// Observes one input per head, then settles and fake-quantizes like the AttentionQuant it becomes.
class HeadObserver final : public Module {
 public:
  HeadObserver(quant::QScheme scheme, double ratio, std::shared_ptr<ProcessGroup> group, bool staged)
      : Module("HeadObserver"), scheme_(scheme), observer_(ratio), group_(std::move(group)), staged_(staged) {}

  at::Tensor forward(const at::Tensor& x) override {
    if (!params_) {
      observer_.update(x);
      if (!staged_) return x;
      settlePoint(this, [this] { settle(); });
    }
    return quant::fakeQuantize(x, *params_, scheme_);
  }

  // Every rank's window merged (min of starts, max of ends) and the per-head scales fixed. Every
  // rank calls it for the same observers in the same order.
  void settle() {
    if (params_) return;
    QPIPE_CHECK(!observer_.empty(), "an attention observer settled without a calibration sample");
    at::Tensor bounds = at::cat({-observer_.state().min, observer_.state().max});
    group_->allReduce(bounds, ReduceOp::kMax);
    at::Tensor min = -bounds.slice(0, 0, 1), max = bounds.slice(0, 1, 2);
    // per_tensor: the heads' windows merged.
    if (scheme_.scope == quant::QScope::kPerTensor) {
      min = min.amin().reshape({1});
      max = max.amax().reshape({1});
    }
    params_ = quant::computeQParams(min, max, scheme_);
  }

  std::shared_ptr<AttentionQuant> deploy() {
    settle();
    return std::make_shared<AttentionQuant>(scheme_, *params_);
  }

 private:
  quant::QScheme scheme_;
  quant::RecallWindowObserver observer_;
  std::shared_ptr<ProcessGroup> group_;
  bool staged_;
  std::optional<quant::QParams> params_;
};

class Fa3Quant final : public Processor {
 public:
  Fa3Quant(const ConfigNode& config, const ProcessorContext& context)
      : context_(context), filter_(context.moduleFilter(config)) {
    const ConfigNode& qconfig = config.at("qconfig");
    const ConfigNode& details = config.at("details");
    const bool detailed = std::any_of(kInputs.begin(), kInputs.end(),
                                      [&](const Input& input) { return !details.at(input.name).isNull(); });
    if (!qconfig.isNull() && detailed) {
      throw context.configError(config, "details", "qconfig and details are mutually exclusive; give one of them");
    }
    const Schema schema = quant::attentionQConfigSchema();
    for (size_t i = 0; i < kInputs.size(); ++i) {
      const ConfigNode& entry = detailed ? details.at(kInputs[i].name) : qconfig;
      const std::string path =
          detailed ? context.fieldPath(std::string("details.") + kInputs[i].name) : context.fieldPath("qconfig");
      // An input that details leaves out stays in float: {fa_k, fa_v} alone quantizes the KV cache.
      configs_[i] =
          detailed && entry.isNull()
              ? quant::QConfig{.scheme = {.dtype = quant::QDtype::kFloat}, .method = quant::QMethod::kNone}
              : quant::parseAttentionQConfig(schema.validate(entry.isNull() ? ConfigNode::map() : entry, path), path);
    }
  }

  void preprocess(LayerRequest& request) override {
    observers_.clear();
    if (isNonLayerUnit(request)) return;
    // The attention modules first: replacing their hook points frees modules the list holds.
    std::vector<std::string> attentions;
    for (auto& [path, module] : request.module->namedModules()) {
      if (!path.empty() && module->findChild(kInputs[0].hook) != nullptr) attentions.push_back(path);
    }
    for (const std::string& path : attentions) attention(request, path);
    if (!request.staged && !observers_.empty()) {
      request.betweenForwards.emplace_back([this] {
        for (const Observed& o : observers_) o.observer->settle();
      });
    }
  }

  void postprocess(LayerRequest& request) override {
    for (const Observed& o : observers_) {
      std::shared_ptr<AttentionQuant> quant = o.observer->deploy();
      const at::Tensor scale = quant->parameter("scale");
      request.report(o.name, "scale_min", scale.min().item<double>());
      request.report(o.name, "scale_max", scale.max().item<double>());
      request.module->replace(o.path, std::move(quant));
    }
    observers_.clear();
  }

  void postRun() override { context_.logger->info("fa3_quant: ", quantized_, " attention inputs quantized"); }

  // Only per_token inputs: nothing to calibrate.
  bool isDataFree() const override {
    for (const quant::QConfig& c : configs_) {
      if (c.enabled() && !c.isDynamic()) return false;
    }
    return true;
  }
  bool supportDistributed() const override { return true; }
  // Attention modules lie in decoder layers only.
  bool actsOn(const LayerRequest& unit) const override { return !isNonLayerUnit(unit); }
  PlannedOutputs plannedOutputs() const override {
    const auto& [q, k, v] = configs_;
    return {.attention = {{PlannedOutputs::quantized(q.scheme), PlannedOutputs::quantized(k.scheme),
                           PlannedOutputs::quantized(v.scheme)}}};
  }

 private:
  struct Observed {
    std::string path;  // the hook point below the unit
    std::string name;  // <attention>.fa_q
    std::shared_ptr<HeadObserver> observer;
  };

  void attention(LayerRequest& request, const std::string& attentionPath) {
    for (size_t i = 0; i < kInputs.size(); ++i) {
      const quant::QConfig& config = configs_[i];
      const std::string path = attentionPath + "." + kInputs[i].hook;
      const std::string name = moduleName(request, attentionPath + "." + kInputs[i].name);
      if (!config.enabled() || !filter_->matches(name)) continue;
      request.module->getSubmodule(path).as<HookPoint>(moduleName(request, path));
      ++quantized_;
      if (config.isDynamic()) {
        request.module->replace(path, std::make_shared<AttentionQuant>(config.scheme, std::nullopt));
        continue;
      }
      auto observer = std::make_shared<HeadObserver>(config.scheme, kInputs[i].ratio, context_.group, request.staged);
      request.module->replace(path, observer);
      observers_.push_back({path, name, std::move(observer)});
    }
  }

  ProcessorContext context_;
  std::shared_ptr<ModuleFilter> filter_;
  std::array<quant::QConfig, 3> configs_;
  std::vector<Observed> observers_;
  int64_t quantized_ = 0;
};

void registerProcessors(PluginRegistrar& registrar) {
  // The qconfig blocks are checked against quant::attentionQConfigSchema() by the factory: a
  // nested schema would fill in an absent block, and qconfig and details exclude each other.
  Schema details;
  for (const Input& input : kInputs) {
    details.add({.name = input.name, .type = ValueType::kMap, .help = std::string(input.hook) + "'s quantization"});
  }
  Schema schema;
  schema
      .add({.name = "qconfig",
            .type = ValueType::kMap,
            .help = "one quantization for Q, K and V (default int8 per_head symmetric minmax)"})
      .nested("details", std::move(details), false,
              "{fa_q, fa_k, fa_v}: one quantization each; an input left out stays in float")
      .includeExclude();
  registrar.addProcessor({
      .type = "fa3_quant",
      .description = "quantizes attention's Q, K and V per head (static) or per token (dynamic)",
      .schema = std::move(schema),
      .factory = [](const ConfigNode& config,
                    const ProcessorContext& context) { return std::make_unique<Fa3Quant>(config, context); },
  });
}

}  // namespace
}  // namespace qpipe

QPIPE_PLUGIN("fa3", "1.0.0", "msmodelslim's fa3_quant: per-head Q/K/V quantization of attention",
             qpipe::registerProcessors)
