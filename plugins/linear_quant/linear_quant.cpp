// linear_quant: msmodelslim's LinearQuantProcessor (processor/quant/linear.py). Every Linear of a
// unit (a decoder layer, or the non-layer modules: lm_head) that matches include/exclude is
// quantized with one `qconfig`:
//   preprocess   Linear → LinearQuantizer; with static activations, registers the sync of the
//                layer's observers between the two calibration forwards
//   process      calibrate(): observe forward → sync and freeze → propagate forward (static
//                activations); skipped when the qconfig is data-free
//   postprocess  LinearQuantizer → QuantLinear, what savers write and inference runs
// Distributed-complete: the observers' merged states are the 1-rank states bit for bit
// (qpipe/dist/observer_sync.h), so W ranks give the 1-rank checkpoint.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/dist/observer_sync.h"
#include "qpipe/error.h"
#include "qpipe/linear_quantizer.h"
#include "qpipe/log.h"
#include "qpipe/pattern.h"
#include "qpipe/plugin.h"
#include "qpipe/qconfig.h"
#include "qpipe/schema.h"

namespace {

class LinearQuant final : public qpipe::Processor {
 public:
  LinearQuant(const qpipe::ConfigNode& config, const qpipe::ProcessorContext& context)
      : logger_(context.logger),
        qconfig_(qpipe::quant::parseLinearQConfig(
            config.at("qconfig"), context.configPath.empty() ? "qconfig" : context.configPath + ".qconfig")),
        filter_(config.at("include").asStringList(), config.at("exclude").asStringList()) {}

  void preprocess(qpipe::LayerRequest& request) override {
    pending_.clear();
    for (auto& [path, linear] : matchingLinears(request)) {
      if (isDataFree()) {
        pending_.emplace_back(path, nullptr);
        continue;
      }
      // Replacing drops the float Linear: the quantizer keeps what it needs.
      auto quantizer = std::make_shared<qpipe::LinearQuantizer>(*linear, qconfig_);
      request.module->replace(path, quantizer);
      pending_.emplace_back(path, std::move(quantizer));
    }
    if (std::any_of(pending_.begin(), pending_.end(), [](const auto& p) { return p.second && p.second->observes(); })) {
      request.betweenForwards.emplace_back([this] { synchronizeAll(); });
    }
  }

  void postprocess(qpipe::LayerRequest& request) override {
    // A process() that forwarded without calibrate() left the observers open: fix them now
    // (the outputs then lack the final activation quantization, the checkpoint does not).
    synchronizeAll();
    for (auto& [path, quantizer] : pending_) {
      const std::string name = qpipe::moduleName(request, path);
      if (quantizer == nullptr) {
        auto& linear = static_cast<qpipe::Linear&>(request.module->getSubmodule(path));
        quantizer = std::make_shared<qpipe::LinearQuantizer>(linear, qconfig_);
      }
      request.module->replace(path, quantizer->deploy(name));
      ++quantized_;
    }
    pending_.clear();
  }

  void postRun() override {
    for (const auto& pattern : filter_.unmatchedPatterns()) {
      logger_->warn("linear_quant: ", pattern, " matched no Linear module");
    }
    logger_->info("linear_quant: ", quantized_, " Linear modules quantized (", qconfig_.describe(), ")");
  }

  bool isDataFree() const override { return qconfig_.isDataFree(); }
  // Weights are data-free, dynamic activations have nothing to merge and static observers are
  // synchronised (every rank calls synchronizeAll on the same quantizers in the same order).
  bool supportDistributed() const override { return true; }

 private:
  // Merges every static observer of the layer across ranks and freezes its parameters.
  void synchronizeAll() {
    for (auto& [path, quantizer] : pending_) {
      if (quantizer && quantizer->observes() && !quantizer->frozen()) qpipe::dist::synchronize(*quantizer);
    }
  }

  // The Linear modules of the unit that the patterns select, by path below the unit.
  std::vector<std::pair<std::string, qpipe::Linear*>> matchingLinears(qpipe::LayerRequest& request) {
    std::vector<std::pair<std::string, qpipe::Linear*>> out;
    for (auto& [path, module] : request.module->namedModules()) {
      const std::string name = qpipe::moduleName(request, path);
      if (module->typeName() != "Linear" || !filter_.matches(name)) continue;
      auto* linear = static_cast<qpipe::Linear*>(module);
      checkGroups(name, *linear);
      out.emplace_back(path, linear);
    }
    return out;
  }

  // Named here, where the module is known, rather than deep in the quantization math.
  void checkGroups(const std::string& name, qpipe::Linear& linear) const {
    const int64_t group = qconfig_.weight.scheme.groupSize;
    if (group == 0 || linear.inFeatures() % group == 0) return;
    throw qpipe::Error(
        qpipe::ErrorCode::kConfig,
        qpipe::detail::concat(name, ": in_features ", linear.inFeatures(), " is not a multiple of group_size ", group,
                              "; choose a group_size that divides it or exclude the module"));
  }

  std::shared_ptr<qpipe::Logger> logger_;
  qpipe::quant::LinearQConfig qconfig_;
  qpipe::ModuleFilter filter_;
  std::vector<std::pair<std::string, std::shared_ptr<qpipe::LinearQuantizer>>> pending_;
  int64_t quantized_ = 0;
};

void registerProcessors(qpipe::PluginRegistrar& registrar) {
  qpipe::Schema schema;
  schema.nested("qconfig", qpipe::quant::linearQConfigSchema(), true, "act and weight quantization").includeExclude();
  registrar.addProcessor({
      .type = "linear_quant",
      .description = "quantizes Linear weights and input activations (int8, int4, fp8_e4m3)",
      .schema = std::move(schema),
      .factory = [](const qpipe::ConfigNode& config,
                    const qpipe::ProcessorContext& context) { return std::make_unique<LinearQuant>(config, context); },
  });
}

}  // namespace

QPIPE_PLUGIN("linear_quant", "1.0.0", "msmodelslim's linear_quant: W8A8, W8A16, W4A16, W4A8, FP8", registerProcessors)
