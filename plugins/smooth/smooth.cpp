// The outlier-smoothing processors (docs/smoothing.md). Each smooths the subgraphs a layer's model
// family declares (qpipe/subgraph.h) with per-input-channel scales s: the consumers' columns are
// multiplied by s, the producer's output channels divided by it, so the float model computes the
// same function and the consumers' inputs lose their outlier channels before quantization.
//   smooth_quant  SmoothQuant as llm-compressor's SmoothQuantModifier computes it:
//                 s = range(X)^α / (2·max|W|)^(1−α), s = range(X) where the weights are zero,
//                 floored at scale_min; ov reduces the statistics over each KV group (max)
//   iter_smooth   msmodelslim's IterSmooth: s = max|X|^α / max|W|^(1−α) floored at scale_min,
//                 with |W| for every subgraph type; ov averages the heads' scales per KV group
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/plugin.h"
#include "smoothing.h"

namespace qpipe::smooth {
namespace {

// Per input column: the largest |W| over the rows of every consumer.
at::Tensor columnAbsMax(const std::vector<at::Tensor>& weights) {
  return at::cat(weights, 0).abs().amax(0);
}

class SmoothQuant final : public SmoothingProcessor {
 public:
  SmoothQuant(const ConfigNode& config, const ProcessorContext& context)
      : SmoothingProcessor("smooth_quant", config, context),
        alpha_(config.at("alpha").asFloat()),
        scaleMin_(config.at("scale_min").asFloat()) {}

 protected:
  at::Tensor activationStatistic(const ChannelStats& stats) const override { return stats.max - stats.min; }
  at::Tensor weightStatistic(const std::vector<at::Tensor>& weights) const override {
    return 2.0 * columnAbsMax(weights);
  }
  at::Tensor scale(const at::Tensor& activation, const at::Tensor& weight) const override {
    const at::Tensor s = activation.pow(alpha_) / weight.pow(1.0 - alpha_);
    return at::where(weight > 0, s, activation).clamp_min(scaleMin_);
  }
  GroupReduction groupReduction() const override { return GroupReduction::kMaxOfStatistics; }
  std::vector<std::pair<std::string, double>> reportValues() const override { return {{"alpha", alpha_}}; }

 private:
  double alpha_, scaleMin_;
};

class IterSmooth final : public SmoothingProcessor {
 public:
  IterSmooth(const ConfigNode& config, const ProcessorContext& context)
      : SmoothingProcessor("iter_smooth", config, context),
        alpha_(config.at("alpha").asFloat()),
        scaleMin_(config.at("scale_min").asFloat()) {
    if (!config.at("symmetric").asBool()) {
      throw context.configError(config, "symmetric",
                                "False (msmodelslim's asymmetric shift, which gives the norm a bias) is not supported "
                                "yet; use symmetric: True");
    }
  }

 protected:
  at::Tensor activationStatistic(const ChannelStats& stats) const override {
    return at::maximum(stats.min.abs(), stats.max.abs());
  }
  at::Tensor weightStatistic(const std::vector<at::Tensor>& weights) const override { return columnAbsMax(weights); }
  // A column that is zero in every consumer takes any scale; 1 leaves it alone.
  at::Tensor scale(const at::Tensor& activation, const at::Tensor& weight) const override {
    const at::Tensor s = (activation.pow(alpha_) / weight.pow(1.0 - alpha_)).clamp_min(scaleMin_);
    return at::where(weight > 0, s, at::ones_like(s));
  }
  GroupReduction groupReduction() const override { return GroupReduction::kMeanOfScales; }
  std::vector<std::pair<std::string, double>> reportValues() const override { return {{"alpha", alpha_}}; }

 private:
  double alpha_, scaleMin_;
};

FieldSpec fraction(std::string name, double value, std::string help) {
  return {.name = std::move(name),
          .type = ValueType::kFloat,
          .help = std::move(help),
          .defaultValue = ConfigNode::number(value),
          .minimum = 0.0,
          .maximum = 1.0};
}

FieldSpec scaleFloor() {
  return {.name = "scale_min",
          .type = ValueType::kFloat,
          .help = "the smallest smoothing scale",
          .defaultValue = ConfigNode::number(1e-5),
          .minimum = 1e-30};
}

template <typename T>
ProcessorFactory factory() {
  return [](const ConfigNode& config, const ProcessorContext& context) { return std::make_unique<T>(config, context); };
}

void registerProcessors(PluginRegistrar& registrar) {
  Schema smoothQuant;
  smoothQuant.add(fraction("alpha", 0.5, "migration strength α")).add(scaleFloor());
  SmoothingProcessor::addCommonFields(smoothQuant, {SubgraphType::kNormLinear});
  registrar.addProcessor({
      .type = "smooth_quant",
      .description = "SmoothQuant (llm-compressor's statistics): moves activation outliers into the weights",
      .schema = std::move(smoothQuant),
      .factory = factory<SmoothQuant>(),
  });

  Schema iterSmooth;
  iterSmooth.add(fraction("alpha", 0.9, "migration strength α"))
      .add(scaleFloor())
      .optional("symmetric", ValueType::kBool, ConfigNode::boolean(true), "symmetric statistics (True only, for now)");
  SmoothingProcessor::addCommonFields(iterSmooth, allSubgraphTypes());
  registrar.addProcessor({
      .type = "iter_smooth",
      .description = "msmodelslim's iter_smooth: max|X|^α / max|W|^(1-α) on every declared subgraph",
      .schema = std::move(iterSmooth),
      .factory = factory<IterSmooth>(),
  });
}

}  // namespace
}  // namespace qpipe::smooth

QPIPE_PLUGIN("smooth", "1.0.0", "Outlier smoothing: smooth_quant and msmodelslim's iter_smooth",
             qpipe::smooth::registerProcessors)
