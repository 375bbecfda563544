// The machinery the smoothing processors share (docs/smoothing.md): which of a layer's declared
// subgraphs a step smooths, the per-channel activation statistics of their consumers' inputs
// (merged across ranks exactly), the grouped-query reduction of ov, and the fusion of the scales
// into the producer and the consumers. An algorithm supplies only its statistics and its formula.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/plugin.h"
#include "qpipe/scheduler/task_scheduler.h"

namespace qpipe::smooth {

// What an algorithm computes one subgraph's scales from. Per consumer input channel j: the
// activation statistics over every token every rank saw, and the consumers' weights.
struct SubgraphInput {
  const Subgraph& graph;
  const std::string& name;                 // the source's full name
  at::Tensor min;                          // fp32 [channels]
  at::Tensor max;                          // fp32 [channels]
  // [out, channels], one per consumer, in target order, as the modules hold them (dtype, device):
  // an algorithm converts what it reads.
  const std::vector<at::Tensor>& weights;
  // The consumers' input tokens [tokens, channels] in global sample order (every rank's, rank by
  // rank), at most `searchTokens` of them evenly spaced; undefined unless the processor keeps them.
  at::Tensor tokens;
  // mean |X_j| over every token every rank saw, summed in sample order (the same bits on any number
  // of ranks); undefined unless the processor asks for it.
  at::Tensor absMean;
};

// One subgraph's scales: the producer's output channels are divided by `producer`, the
// consumers' input columns multiplied by `consumer` (the same tensor but for ov, where each KV
// group channel's scale is repeated for the heads of the group). With a `shift` (norm-linear
// only: msmodelslim's asymmetric mode) the consumers see (X − shift) / s: the norm's bias becomes
// (bias − shift) / s and each consumer's bias gains W·shift.
struct Scales {
  at::Tensor producer;
  at::Tensor consumer;
  at::Tensor shift;  // fp32 [channels], or undefined
};

// How ov's per-head values become one scale per KV-group channel (msmodelslim's MQGA reduction).
enum class GroupReduction {
  kMaxOfStatistics,  // reduce the activation and weight statistics (max), then apply the formula
  kMeanOfScales,     // apply the formula per head, then average the scales over the group
};

// A candidate's squared errors and its float product's squares, each summed per block of
// kLossBlock output columns of the weight the search compares (the stacked consumers' rows). A
// loss adds the blocks in order, so a candidate split into pieces of whole blocks, tasks on other
// ranks, gives the loss of one piece bit for bit.
constexpr int64_t kLossBlock = 128;
struct LossBlocks {
  std::vector<double> error;
  std::vector<double> reference;
};

// How an algorithm finds one subgraph's scales. A search runs in rounds of candidates whose losses
// are independent of each other: each candidate is a scheduler task on whichever rank takes it
// (docs/scheduler.md), and every rank then calls `choose` with the round's losses in candidate
// order, so every rank holds the choice one rank would have made. `loss` of a later round may
// read what earlier rounds chose. An algorithm without a search has no rounds.
class Search {
 public:
  virtual ~Search() = default;
  virtual double loss(int round, int candidate) const = 0;
  // Where the processor splits candidates (SmoothingProcessor::lossBlocks): the sums of blocks
  // [first, first + count), and the loss from every block's, in order, which equals loss().
  virtual LossBlocks lossPart(int round, int candidate, int64_t first, int64_t count) const;
  virtual double lossOf(const LossBlocks& blocks) const;
  virtual void choose(int round, const std::vector<double>& losses) = 0;
  // A search with rounds compares its candidates against the float product X·Wᵀ (productChunks)
  // of its input's tokens X [tokens, channels] and this W [out, channels] (fp32, CPU), which costs
  // 3-4 candidates. Where the channels are many (kSharedProductChannels), the processor computes
  // it once, chunk by chunk in parallel tasks, and gives every rank's search all the chunks, in
  // order, before the first round; otherwise the search computes it at its first loss on a rank.
  virtual at::Tensor productWeight() const { return {}; }
  virtual void setProduct(std::vector<at::Tensor> /*chunks*/) {}
  // The chosen scales; `report` collects what the quant report records besides the range.
  virtual Scales scales(std::vector<std::pair<std::string, double>>& report) const = 0;
};

// A search's float product X·Wᵀ in chunks of kProductChunk tokens, computed so wherever it is
// computed (one chunk per task, or all on one rank): its bits do not depend on the rank count.
constexpr int64_t kProductChunk = 64;
int64_t productChunkRows(int64_t tokens, int64_t chunk);
at::Tensor productChunk(const at::Tensor& tokens, const at::Tensor& weight, int64_t chunk);
std::vector<at::Tensor> productChunks(const at::Tensor& tokens, const at::Tensor& weight);
// Inputs at least this wide share their product across the ranks. X·Wᵀ costs 2·channels flops
// per output value, receiving it 4 bytes: at this host's 80 GFLOP/s a core and 0.81 GB/s
// all-gather the two break even at about 200 channels, before the product's wave adds two
// collectives a stage; on the 64-expert MoE (128 and 256 channels) sharing made the searches
// 1.4× slower (docs/benchmarks.md). 384 leaves that margin.
constexpr int64_t kSharedProductChannels = 384;

// A search with no rounds: scales already known, and what the report records about them.
std::unique_ptr<Search> chosen(Scales scales, std::vector<std::pair<std::string, double>> report);

// Per-channel activation and weight statistics → scales.
using ScaleFormula = std::function<at::Tensor(const at::Tensor& activation, const at::Tensor& weight)>;

class SmoothingProcessor : public Processor {
 public:
  // `type` names the step in messages; `config` holds enable_subgraph_type and include/exclude.
  SmoothingProcessor(std::string type, const ConfigNode& config, const ProcessorContext& context);
  ~SmoothingProcessor() override;

  void preprocess(LayerRequest& request) override;
  // Only the consumers' inputs are read: the samples stop at the last of them when a later step
  // forwards the layer again.
  void process(LayerRequest& request) override;
  void postprocess(LayerRequest& request) override;
  void postRun() override;
  // Maxima and minima merge exactly in any order, so W ranks smooth with the 1-rank statistics.
  bool supportDistributed() const override { return true; }
  // Subgraphs lie in decoder layers only.
  bool actsOn(const LayerRequest& unit) const override { return !isNonLayerUnit(unit); }

  // The enable_subgraph_type (default `defaults`) and include/exclude fields every smoothing
  // processor accepts.
  static Schema& addCommonFields(Schema& schema, const std::vector<SubgraphType>& defaults);
  // The search_split field of the processors whose candidates split (splitCandidates).
  static FieldSpec searchSplitField();

 protected:
  // Whether the step smooths subgraphs of `type` (enable_subgraph_type).
  bool smooths(SubgraphType type) const;
  // `searchTokens`: keep up to this many consumer input tokens per subgraph for the algorithm
  // (SubgraphInput::tokens); 0 keeps none.
  void keepTokens(int64_t searchTokens) { searchTokens_ = searchTokens; }
  // Collect mean |X| per channel (SubgraphInput::absMean).
  void keepAbsMean() { absMean_ = true; }
  // The candidates of each round of the algorithm's search, the same for every subgraph of the
  // step; none by default.
  virtual std::vector<int> searchRounds() const { return {}; }
  // The subgraph's search, made on every rank once the subgraphs before it that share a module
  // are smoothed; `input` (what it refers to) outlives the search.
  virtual std::unique_ptr<Search> search(const SubgraphInput& input) const = 0;
  // How many of the subgraph's consumers (the first ones) its search multiplies: its tasks' cost.
  virtual size_t searchedConsumers(const Subgraph& graph) const { return graph.targets.size(); }
  // The kLossBlock blocks a candidate's loss splits into (Search::lossPart) when the searched
  // consumers have `outFeatures` outputs in all and `inFeatures` inputs; 0 where it does not split.
  virtual int64_t lossBlocks(int64_t /*outFeatures*/, int64_t /*inFeatures*/) const { return 0; }
  // `pieces` (the search_split field): every splittable candidate in that many pieces (at most
  // its blocks); 0 picks by the rank count, 1 never splits. The results do not change.
  void splitCandidates(int64_t pieces) { searchSplit_ = pieces; }
  // What each piece of a candidate repeats (the tokens' quantization), as a fraction of a whole
  // candidate: the price of a split, which the pieces picked by the rank count weigh.
  virtual double pieceOverhead() const { return 0.1; }
  // `formula` applied to per-channel statistics, with ov's KV-group reduction; `weight` may be
  // undefined where the formula reads no weight statistic.
  static Scales grouped(const Subgraph& graph, const at::Tensor& activation, const at::Tensor& weight,
                        const ScaleFormula& formula, GroupReduction reduction);

 private:
  struct Watched;
  std::vector<std::vector<at::Tensor>> allGatherParts(const std::vector<at::Tensor>& parts, at::ScalarType dtype) const;
  // Each watched subgraph's allTokens, and its absMean, from every rank's.
  void gatherTokens();
  void gatherAbsMean();
  // The subgraphs' searches and fusions as scheduler tasks, their report values and costs.
  void scheduleAndSmooth(LayerRequest& request);
  int64_t candidatePieces(const std::vector<Watched*>& stage, int candidates) const;
  // The stage's searches' float products as tasks; `submitted` records each (subgraph, report
  // instance, part of the search).
  void submitProducts(LayerRequest& request, const std::vector<Watched*>& stage,
                      scheduler::DistributedTaskScheduler& tasks,
                      const std::function<void(Watched*, std::string, bool)>& submitted);
  // False (with a warning) when no calibration token reached the subgraph; an error for NaN or Inf.
  bool smoothable(LayerRequest& request, const Watched& watched) const;
  // The subgraph's search, made at its first use on this rank (a candidate, a choice, the fusion).
  Search& searchOf(LayerRequest& request, Watched& watched) const;
  // Fuses the chosen scales into the subgraph's modules (on every rank); its report values.
  ConfigNode smooth(LayerRequest& request, Watched& watched) const;

  std::string type_;
  ProcessorContext context_;
  std::vector<SubgraphType> types_;
  std::shared_ptr<ModuleFilter> filter_;
  std::vector<std::unique_ptr<Watched>> watched_;
  int64_t searchTokens_ = 0;
  int64_t searchSplit_ = 1;
  bool absMean_ = false;
  int64_t smoothed_ = 0;
  scheduler::RunSummary scheduled_;  // the subgraph tasks of every unit
};

// The ov reduction: per-head scales `perHead` [heads·headDim] (or statistics) to one value per
// KV-group channel [kvHeads·headDim], with `reduce` over the heads of each group.
at::Tensor reduceGroups(const at::Tensor& perHead, int64_t kvHeads, int64_t headDim, bool mean);
// The inverse direction: one value per KV-group channel repeated for every head of its group.
at::Tensor expandGroups(const at::Tensor& perGroup, int64_t heads, int64_t kvHeads, int64_t headDim);

}  // namespace qpipe::smooth
