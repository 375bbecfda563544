// The machinery the smoothing processors share (docs/smoothing.md): which of a layer's declared
// subgraphs a step smooths, the per-channel activation statistics of their consumers' inputs
// (merged across ranks exactly), the grouped-query reduction of ov, and the fusion of the scales
// into the producer and the consumers. An algorithm supplies only its statistics and its formula.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "qpipe/plugin.h"

namespace qpipe::smooth {

// The statistics an algorithm computes scales from, per consumer input channel.
struct ChannelStats {
  at::Tensor min;  // fp32 [channels] over every token every rank saw
  at::Tensor max;
};

// How ov's per-head scales become one scale per KV-group channel (msmodelslim's MQGA reduction).
enum class GroupReduction {
  kMaxOfStatistics,  // reduce the activation and weight statistics (max), then compute the scale
  kMeanOfScales,     // compute every head's scales, then average them over the group
};

class SmoothingProcessor : public Processor {
 public:
  // `type` names the step in messages; `config` holds enable_subgraph_type and include/exclude.
  SmoothingProcessor(std::string type, const ConfigNode& config, const ProcessorContext& context);
  ~SmoothingProcessor() override;

  void preprocess(LayerRequest& request) override;
  void postprocess(LayerRequest& request) override;
  void postRun() override;
  // Maxima and minima merge exactly in any order, so W ranks smooth with the 1-rank statistics.
  bool supportDistributed() const override { return true; }

  // The enable_subgraph_type (default `defaults`) and include/exclude fields every smoothing
  // processor accepts.
  static Schema& addCommonFields(Schema& schema, const std::vector<SubgraphType>& defaults);

 protected:
  // Per input channel j of the consumers: the activation statistic a_j from the consumers' input
  // statistics, the weight statistic w_j from the consumers' weights (fp32 [out, in] each), and
  // the scale from both.
  virtual at::Tensor activationStatistic(const ChannelStats& stats) const = 0;
  virtual at::Tensor weightStatistic(const std::vector<at::Tensor>& weights) const = 0;
  virtual at::Tensor scale(const at::Tensor& activation, const at::Tensor& weight) const = 0;
  virtual GroupReduction groupReduction() const = 0;
  // What the report records for every smoothed subgraph besides its scale range.
  virtual std::vector<std::pair<std::string, double>> reportValues() const { return {}; }

  const ProcessorContext& context() const { return context_; }

 private:
  struct Watched;
  void smooth(LayerRequest& request, Watched& watched);

  std::string type_;
  ProcessorContext context_;
  std::vector<SubgraphType> types_;
  std::shared_ptr<ModuleFilter> filter_;
  std::vector<std::unique_ptr<Watched>> watched_;
  int64_t smoothed_ = 0;
};

// The ov reduction: per-head scales `perHead` [heads·headDim] (or statistics) to one value per
// KV-group channel [kvHeads·headDim], with `reduce` over the heads of each group.
at::Tensor reduceGroups(const at::Tensor& perHead, int64_t kvHeads, int64_t headDim, bool mean);
// The inverse direction: one value per KV-group channel repeated for every head of its group.
at::Tensor expandGroups(const at::Tensor& perGroup, int64_t heads, int64_t kvHeads, int64_t headDim);

}  // namespace qpipe::smooth
