// linear_quant: msmodelslim's LinearQuantProcessor (processor/quant/linear.py). Every Linear of a
// unit (a decoder layer, or the non-layer modules: lm_head) that matches include/exclude is
// quantized with one `qconfig`:
//   preprocess   Linear → LinearQuantizer; with static activations, each quantizer syncs and
//                freezes its observer at its settle point (a staged forward), or all of them do
//                between the two calibration forwards
//   process      calibrate(): one staged forward, or observe → sync and freeze → propagate;
//                skipped when the qconfig is data-free
//   postprocess  LinearQuantizer → QuantLinear, what savers write and inference runs
// The weight solves (SSZ, minmax) are one scheduler task per Linear (docs/scheduler.md), spread
// over the ranks: at preprocess with static activations, at postprocess when data-free.
// Layers independent when data-free: a multi-rank run may then split them over the ranks.
// Distributed-complete: the observers' merged states are the 1-rank states bit for bit
// (qpipe/dist/observer_sync.h), so W ranks give the 1-rank checkpoint.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "qpipe/dist/observer_sync.h"
#include "qpipe/linear_quantizer.h"
#include "qpipe/plugin.h"
#include "qpipe/qconfig.h"
#include "qpipe/scheduler/task_scheduler.h"

namespace qpipe {
namespace {

class LinearQuant final : public Processor {
 public:
  LinearQuant(const ConfigNode& config, const ProcessorContext& context)
      : context_(context),
        qconfig_(quant::parseLinearQConfig(config.at("qconfig"), context.fieldPath("qconfig"),
                                           context.configWarnings.get())),
        filter_(context.moduleFilter(config)) {}

  void preprocess(LayerRequest& request) override {
    pending_.clear();
    forEach<Linear>(request, *filter_, [&](const std::string& path, const std::string& name, Linear& linear) {
      qconfig_.checkFits(name, linear.inFeatures());
      Pending& p = pending_.emplace_back(Pending{path, name, static_cast<double>(linear.weight().numel()), nullptr});
      if (isDataFree()) return;  // nothing observes: the quantizer is made from the Linear at postprocess
      p.quantizer = std::make_shared<LinearQuantizer>(linear, qconfig_, LinearQuantizer::Weights::kDeferred);
      if (request.staged) {
        p.quantizer->settleInForward([this](LinearQuantizer& q) { dist::synchronize(*context_.group, q); });
      }
      request.module->replace(path, p.quantizer);  // drops the float Linear
    });
    if (isDataFree() || pending_.empty()) return;
    solveWeights(request);
    if (!request.staged) request.betweenForwards.emplace_back([this] { synchronizeAll(); });
  }

  void postprocess(LayerRequest& request) override {
    // A process() that forwarded without calibrate() left the observers open: fix them now
    // (the outputs then lack the final activation quantization, the checkpoint does not).
    synchronizeAll();
    if (isDataFree() && !pending_.empty()) {
      for (Pending& p : pending_) {
        p.quantizer = std::make_shared<LinearQuantizer>(request.module->getSubmodule(p.path).as<Linear>(p.name),
                                                        qconfig_, LinearQuantizer::Weights::kDeferred);
        request.module->replace(p.path, p.quantizer);
      }
      solveWeights(request);
    }
    for (Pending& p : pending_) request.module->replace(p.path, p.quantizer->deploy(p.name));
    // A split run's decoder layers each run on one rank, its non-layer unit on all.
    (request.splitLayers && !isNonLayerUnit(request) ? splitQuantized_ : quantized_) +=
        static_cast<int64_t>(pending_.size());
    pending_.clear();
    splitLayers_ = request.splitLayers;
  }

  void postRun() override {
    if (splitLayers_) {
      at::Tensor count = at::tensor({splitQuantized_}, at::kLong);
      context_.group->allReduce(count, ReduceOp::kSum);
      quantized_ += count.item<int64_t>();
    }
    context_.logger->info("linear_quant: ", quantized_, " Linear modules quantized (", qconfig_.describe(), ")");
    if (quantized_ == 0) {
      context_.logger->warn(
          "linear_quant: no float Linear matched the step's include and exclude patterns (a "
          "quantized checkpoint has none): the step changed nothing");
    }
    if (scheduled_.parallelWaves > 0) context_.logger->info("linear_quant: weight solves [DTS] ", scheduled_.line());
    if (scheduled_.notWorthSplitting()) {
      context_.logger->warn("linear_quant: the weight solves' sync cost more than splitting them saved (",
                            scheduled_.syncSeconds, " s): not worth splitting");
    }
  }

  // The Linears of the unit that the include/exclude patterns select (forEach offers the same).
  bool actsOn(const LayerRequest& unit) const override {
    for (auto& [path, module] : unit.module->namedModules()) {
      if (dynamic_cast<Linear*>(module) != nullptr && filter_->matches(moduleName(unit, path))) return true;
    }
    return false;
  }

  bool isDataFree() const override { return qconfig_.isDataFree(); }
  // Weights are data-free, dynamic activations have nothing to merge and static observers are
  // synchronised (every rank calls synchronizeAll on the same quantizers in the same order).
  bool supportDistributed() const override { return true; }
  // A data-free layer's quantizers depend on its weights alone.
  bool layersIndependent() const override { return isDataFree(); }
  PlannedOutputs plannedOutputs() const override {
    return {.linears = {{qconfig_.weight.scheme, PlannedOutputs::quantized(qconfig_.act.scheme)}}};
  }

 private:
  struct Pending {
    std::string path;  // below the unit
    std::string name;  // full HF name
    double cost;       // its weight's elements: an SSZ search's time is about proportional
    std::shared_ptr<LinearQuantizer> quantizer;
  };

  // One task per quantizer (docs/scheduler.md): each solves its weights. SSZ searches are spread
  // over the ranks, the largest weights first, and their solutions sent to every rank
  // (LinearQuantizer::syncTensors); minmax solves run on every rank, in a local wave.
  void solveWeights(LayerRequest& request) {
    std::vector<std::pair<std::string, LinearQuantizer*>> quantizers;
    for (const Pending& p : pending_) quantizers.emplace_back(p.name, p.quantizer.get());
    shareFusedNvfp4GlobalScales(quantizers);
    scheduler::DistributedTaskScheduler tasks(*request.module, *context_.group, {.name = "linear_quant"});
    for (const Pending& p : pending_) {
      tasks.submit({.name = "linear_quant.solve_weights",
                    .fn =
                        [quantizer = p.quantizer](const ConfigNode&) {
                          quantizer->solveWeights();
                          return ConfigNode::null({});
                        },
                    .args = ConfigNode::map({{"module", ConfigNode::string(p.name)}}),
                    .dependencies = {p.path},
                    // A minmax solve is recomputed by every rank's sync anyway: splitting it would
                    // only add collectives.
                    .parallel = qconfig_.weight.method == quant::QMethod::kSsz,
                    .cost = p.cost});
    }
    const std::vector<TaskRecord> records = tasks.run();
    for (size_t i = 0; i < records.size(); ++i) scheduler::reportTask(request, pending_[i].name, records[i]);
    scheduled_ += tasks.summary();
    for (const auto& [key, value] : tasks.summary().reportValues()) request.report(request.name, key, value);
  }

  // Merges every static observer of the layer across ranks and freezes its parameters.
  void synchronizeAll() {
    for (const Pending& p : pending_) {
      if (p.quantizer) dist::synchronize(*context_.group, *p.quantizer);
    }
  }

  ProcessorContext context_;
  quant::LinearQConfig qconfig_;
  std::shared_ptr<ModuleFilter> filter_;
  std::vector<Pending> pending_;
  int64_t quantized_ = 0;
  int64_t splitQuantized_ = 0;       // in the decoder layers this rank executed in a split run
  bool splitLayers_ = false;         // of the last unit: every rank's last is the non-layer unit
  scheduler::RunSummary scheduled_;  // the weight solves of every unit
};

void registerProcessors(PluginRegistrar& registrar) {
  Schema schema;
  schema.nested("qconfig", quant::linearQConfigSchema(), true, "act and weight quantization").includeExclude();
  registrar.addProcessor({
      .type = "linear_quant",
      .description = "quantizes Linear weights and input activations (int8, int4, fp8_e4m3)",
      .schema = std::move(schema),
      .factory = [](const ConfigNode& config,
                    const ProcessorContext& context) { return std::make_unique<LinearQuant>(config, context); },
  });
}

}  // namespace
}  // namespace qpipe

QPIPE_PLUGIN("linear_quant", "1.0.0", "msmodelslim's linear_quant: W8A8, W8A16, W4A16, W4A8, FP8",
             qpipe::registerProcessors)
