#include "smoothing.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>

namespace qpipe::smooth {

namespace {

// msmodelslim's order within a layer: a module that produces for one subgraph and consumes for
// another (up_proj, v_proj) has its rows scaled first, so the norm-linear weight statistic sees
// the weights as they will be quantized.
int priority(SubgraphType type) {
  switch (type) {
    case SubgraphType::kUpDown:
      return 1;
    case SubgraphType::kOv:
      return 2;
    case SubgraphType::kLinearLinear:
      return 3;
    case SubgraphType::kNormLinear:
      return 4;
  }
  return 5;
}

// "norm-linear model.layers.0.input_layernorm → self_attn.q_proj, self_attn.k_proj".
std::string describe(const std::string& sourceName, const Subgraph& graph) {
  std::string text = concat(subgraphTypeName(graph.type), " ", sourceName, " →");
  for (size_t i = 0; i < graph.targets.size(); ++i) text += (i == 0 ? " " : ", ") + graph.targets[i];
  return text;
}

std::vector<std::string> typeNames(const std::vector<SubgraphType>& types) {
  std::vector<std::string> names;
  for (SubgraphType type : types) names.emplace_back(subgraphTypeName(type));
  return names;
}

// tensor·factor or tensor / factor, computed in fp32 and stored in the tensor's own dtype.
at::Tensor multiplied(const at::Tensor& tensor, const at::Tensor& factor) {
  return (tensor.to(at::kFloat) * factor.to(tensor.device())).to(tensor.scalar_type());
}
at::Tensor divided(const at::Tensor& tensor, const at::Tensor& factor) {
  return (tensor.to(at::kFloat) / factor.to(tensor.device())).to(tensor.scalar_type());
}

// bias += delta (fp32), creating the bias in the weight's dtype where the module has none.
void addBias(Module& module, const at::Tensor& delta) {
  const at::Tensor& weight = module.parameter("weight");
  if (!module.hasParameter("bias")) {
    module.addParameter("bias", delta.to(weight.device(), weight.scalar_type()));
    return;
  }
  at::Tensor& bias = module.parameter("bias");
  bias = (bias.to(at::kFloat) + delta.to(bias.device())).to(bias.scalar_type());
}

// The first `count` consumers' weight elements: a search task's time is about proportional to
// those it multiplies times its tokens (the scheduler hands the costliest out first).
double consumerElements(LayerRequest& request, const Subgraph& graph, size_t count) {
  double elements = 0;
  for (size_t t = 0; t < std::min(count, graph.targets.size()); ++t) {
    elements += static_cast<double>(request.module->getSubmodule(graph.targets[t]).parameter("weight").numel());
  }
  return elements;
}

// The first `count` consumers' outputs in all, and their inputs: the weight a search stacks.
std::pair<int64_t, int64_t> consumerShape(LayerRequest& request, const Subgraph& graph, size_t count) {
  int64_t out = 0, in = 0;
  for (size_t t = 0; t < std::min(count, graph.targets.size()); ++t) {
    const at::Tensor& weight = request.module->getSubmodule(graph.targets[t]).parameter("weight");
    out += weight.size(0);
    in = weight.size(1);
  }
  return {out, in};
}

// A candidate's loss as a task result: JSON has no NaN or infinity, so those travel as text.
ConfigNode lossNode(double loss) {
  if (std::isfinite(loss)) return ConfigNode::number(loss);
  return ConfigNode::string(std::isnan(loss) ? "nan" : (loss > 0 ? "inf" : "-inf"));
}
double lossOf(const ConfigNode& node) {
  return node.kind() == ConfigNode::Kind::kString ? std::stod(node.asString()) : node.asFloat();
}

// Per column of `rows` rows: lo = min(lo, x) and hi = max(hi, x), a NaN staying as in amin and
// amax, and with `absSum`, absSum += |x| in double, row after row.
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void columnStatsInto(const float* __restrict x,
                                                                                 int64_t rows, int64_t stride,
                                                                                 int64_t cols, float* __restrict lo,
                                                                                 float* __restrict hi,
                                                                                 double* __restrict absSum) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * stride;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = row[c];
      lo[c] = v < lo[c] || v != v ? v : lo[c];
      hi[c] = v > hi[c] || v != v ? v : hi[c];
    }
    if (absSum == nullptr) continue;
    for (int64_t c = 0; c < cols; ++c) absSum[c] += std::fabs(static_cast<double>(row[c]));
  }
}

// A smoothing hook's statistics of one forward call's inputs `flat` [tokens, channels] (fp32,
// contiguous, CPU) in one pass: amin, amax and abs().sum(0, kDouble) were four passes over every
// token and a copy, 7 % of a flex_awq_ssz run on one thread. The columns split over the threads,
// each summed in row order, so the bits do not depend on the split.
void columnStats(const at::Tensor& flat, at::Tensor& min, at::Tensor& max, at::Tensor& absSum) {
  const int64_t rows = flat.size(0), cols = flat.size(1);
  const float* x = flat.const_data_ptr<float>();
  float* lo = min.mutable_data_ptr<float>();
  float* hi = max.mutable_data_ptr<float>();
  double* sum = absSum.defined() ? absSum.mutable_data_ptr<double>() : nullptr;
  at::parallel_for(0, cols, std::max<int64_t>(64, 32768 / std::max<int64_t>(rows, 1)), [&](int64_t begin, int64_t end) {
    columnStatsInto(x + begin, rows, cols, end - begin, lo + begin, hi + begin, sum ? sum + begin : nullptr);
  });
}

// A piece's sums as a task result: its blocks' errors, then their reference sums.
ConfigNode blocksNode(const LossBlocks& part) {
  std::vector<ConfigNode> values;
  for (const std::vector<double>* sums : {&part.error, &part.reference}) {
    for (const double v : *sums) values.push_back(lossNode(v));
  }
  return ConfigNode::list(std::move(values));
}

// A piece's result into the candidate's blocks [first, first + count).
void storeBlocks(const ConfigNode& result, int64_t first, int64_t count, LossBlocks& into) {
  const std::vector<ConfigNode>& values = result.items();
  QPIPE_CHECK(static_cast<int64_t>(values.size()) == 2 * count, "a loss piece of ", count, " blocks carries ",
              values.size(), " sums");
  for (int64_t b = 0; b < count; ++b) {
    into.error[first + b] = lossOf(values[b]);
    into.reference[first + b] = lossOf(values[count + b]);
  }
}

class ChosenScales final : public Search {
 public:
  ChosenScales(Scales scales, std::vector<std::pair<std::string, double>> report)
      : scales_(std::move(scales)), report_(std::move(report)) {}
  double loss(int, int) const override { QPIPE_CHECK(false, "a search without rounds has no candidates"); }
  void choose(int, const std::vector<double>&) override {
    QPIPE_CHECK(false, "a search without rounds has nothing to choose");
  }
  Scales scales(std::vector<std::pair<std::string, double>>& report) const override {
    report.insert(report.end(), report_.begin(), report_.end());
    return scales_;
  }

 private:
  Scales scales_;
  std::vector<std::pair<std::string, double>> report_;
};

}  // namespace

LossBlocks Search::lossPart(int, int, int64_t, int64_t) const {
  QPIPE_CHECK(false, "this search does not split its candidates");
}

double Search::lossOf(const LossBlocks&) const {
  QPIPE_CHECK(false, "this search does not split its candidates");
}

int64_t productChunkRows(int64_t tokens, int64_t chunk) {
  return std::min(kProductChunk, tokens - chunk * kProductChunk);
}

at::Tensor productChunk(const at::Tensor& tokens, const at::Tensor& weight, int64_t chunk) {
  return at::matmul(tokens.narrow(0, chunk * kProductChunk, productChunkRows(tokens.size(0), chunk)), weight.t());
}

std::vector<at::Tensor> productChunks(const at::Tensor& tokens, const at::Tensor& weight) {
  std::vector<at::Tensor> chunks;
  for (int64_t c = 0; c * kProductChunk < tokens.size(0); ++c) chunks.push_back(productChunk(tokens, weight, c));
  return chunks;
}

std::unique_ptr<Search> chosen(Scales scales, std::vector<std::pair<std::string, double>> report) {
  return std::make_unique<ChosenScales>(std::move(scales), std::move(report));
}

struct SmoothingProcessor::Watched {
  Subgraph graph;
  std::string name;         // the source's full name
  std::string firstPath;    // targets[0] below the layer
  Linear* first = nullptr;  // its input is what the statistics describe
  Module::HookHandle hook = 0;
  at::Tensor min;  // fp32 [channels] on the CPU; +inf / -inf until a token arrives
  at::Tensor max;
  std::vector<at::Tensor> tokens;  // this rank's inputs [n, channels], fp32 CPU, when kept
  std::vector<int64_t> sampleOf;   // the run's sample index of each entry of `tokens`
  at::Tensor allTokens;            // every rank's, in sample order, at most searchTokens_
  // Per forward call, when kept: Σ|x| per channel (double), the token count, the sample index.
  std::vector<at::Tensor> absSums;
  std::vector<int64_t> absCounts;
  std::vector<int64_t> absSamples;
  at::Tensor absMean;
  // The search, made at first use (searchOf), what its input refers to, and each round's losses.
  std::vector<at::Tensor> weights;  // as the consumers hold them, in target order
  std::unique_ptr<SubgraphInput> input;
  std::unique_ptr<Search> search;
  std::vector<std::vector<double>> losses;
  // Where its candidates split (SmoothingProcessor::lossBlocks): the blocks, and each round's
  // candidates' sums as the pieces bring them (none where a round keeps its candidates whole).
  int64_t lossBlocks = 0;
  std::vector<std::vector<LossBlocks>> blocks;
  std::vector<at::Tensor> product;  // the search's float product, chunk by chunk, until it has it
  double searchedElements = 0;      // of the consumers its search multiplies: its tasks' cost per token
};

FieldSpec SmoothingProcessor::searchSplitField() {
  return {.name = "search_split",
          .type = ValueType::kInt,
          .help =
              "pieces per search candidate (whole blocks of 128 outputs), for waves that would leave ranks idle: "
              "0 picks by the rank count, 1 never splits; the results are the same",
          .defaultValue = ConfigNode::integer(0),
          .minimum = 0};
}

// Pieces per splittable candidate in a round's wave of `candidates` candidates per subgraph of
// `stage`: the number (up to 16, and up to the fewest blocks of a splittable subgraph) whose wave
// the ranks would finish soonest, every task counted alike: ceil(tasks / ranks) rounds of a
// piece, which costs 1 / pieces of a candidate plus what every piece repeats (pieceOverhead). A
// split must promise a wave 5 % shorter: on 2 and 8 ranks SmolLM2's waves of 21 and 42 stay
// whole, on 64 they take 3 pieces. One on one rank, and where the waves run locally.
int64_t SmoothingProcessor::candidatePieces(const std::vector<Watched*>& stage, int candidates) const {
  if (searchSplit_ > 0) return searchSplit_;
  const int64_t world = context_.group->worldSize();
  if (world <= 1 || ParallelTaskScope::active() || scheduler::DistributedTaskScheduler::globalDisableParallel()) {
    return 1;
  }
  int64_t most = 16;
  bool splittable = false;
  for (const Watched* w : stage) {
    if (w->lossBlocks == 0) continue;
    splittable = true;
    most = std::min(most, w->lossBlocks);
  }
  if (!splittable) return 1;
  // A whole candidate of a subgraph that does not split bounds the wave from below.
  const bool whole = std::any_of(stage.begin(), stage.end(), [](const Watched* w) { return w->lossBlocks == 0; });
  const auto waveTime = [&](int64_t pieces) {
    int64_t tasks = 0;
    for (const Watched* w : stage) tasks += candidates * (w->lossBlocks > 0 ? pieces : 1);
    const double rounds = static_cast<double>((tasks + world - 1) / world);
    return std::max(rounds * (1.0 / static_cast<double>(pieces) + pieceOverhead()), whole ? 1 + pieceOverhead() : 0.0);
  };
  const double unsplit = waveTime(1);
  int64_t best = 1;
  double bestTime = unsplit;
  for (int64_t pieces = 2; pieces <= most; ++pieces) {
    const double time = waveTime(pieces);
    if (time < bestTime && time < 0.95 * unsplit) std::tie(best, bestTime) = std::pair(pieces, time);
  }
  return best;
}

Schema& SmoothingProcessor::addCommonFields(Schema& schema, const std::vector<SubgraphType>& defaults) {
  return schema
      .optional("enable_subgraph_type", ValueType::kStringList, ConfigNode::stringList(typeNames(defaults)),
                "subgraph types to smooth, of " + joinNames(typeNames(allSubgraphTypes())))
      .includeExclude();
}

SmoothingProcessor::SmoothingProcessor(std::string type, const ConfigNode& config, const ProcessorContext& context)
    : type_(std::move(type)), context_(context), filter_(context.moduleFilter(config)) {
  const ConfigNode& enabled = config.at("enable_subgraph_type");
  if (enabled.items().empty()) {
    throw configError(enabled, context.fieldPath("enable_subgraph_type"),
                      concat("an empty list smooths nothing; list some of ", joinNames(typeNames(allSubgraphTypes())),
                             ", or remove the step"));
  }
  for (const ConfigNode& item : enabled.items()) {
    const std::optional<SubgraphType> parsed = parseSubgraphType(item.asString());
    if (!parsed) {
      throw configError(item, context.fieldPath("enable_subgraph_type"),
                        concat("unknown subgraph type '", item.asString(), "'; expected one of ",
                               joinNames(typeNames(allSubgraphTypes()))));
    }
    if (std::find(types_.begin(), types_.end(), *parsed) == types_.end()) types_.push_back(*parsed);
  }
}

SmoothingProcessor::~SmoothingProcessor() = default;

void SmoothingProcessor::preprocess(LayerRequest& request) {
  watched_.clear();
  if (isNonLayerUnit(request)) return;
  QPIPE_REQUIRE(!request.subgraphs.empty(), ErrorCode::kConfig, "model family '", request.family,
                "' declares no smoothing subgraphs (", request.name,
                "), so there is nothing to smooth; docs/smoothing.md lists the families that do");
  for (const Subgraph& graph : request.subgraphs) {
    if (std::find(types_.begin(), types_.end(), graph.type) == types_.end()) continue;
    const std::string name = moduleName(request, graph.source);
    if (!filter_->matches(name)) continue;
    auto watched = std::make_unique<Watched>(Watched{graph, name, graph.targets.front()});
    try {
      Module& source = request.module->getSubmodule(graph.source);
      if (graph.type == SubgraphType::kNormLinear) {
        source.as<RMSNorm>(name);
      } else {
        source.as<Linear>(name);
      }
      for (const std::string& target : graph.targets) {
        Linear& linear = request.module->getSubmodule(target).as<Linear>(moduleName(request, target));
        if (watched->first == nullptr) watched->first = &linear;
      }
    } catch (const Error& e) {
      throw Error(e.code(), concat("subgraph ", describe(name, graph), ": ", e.what()));
    }
    const int64_t channels = watched->first->inFeatures();
    watched->min = at::full({channels}, std::numeric_limits<float>::infinity(), at::kFloat);
    watched->max = at::full({channels}, -std::numeric_limits<float>::infinity(), at::kFloat);
    Watched* w = watched.get();
    const bool keep = searchTokens_ > 0, mean = absMean_;
    const LayerRequest* unit = &request;  // alive until postprocess removes the hook
    w->hook = w->first->addForwardPreHook([w, keep, mean, unit](Module&, const at::Tensor& x) {
      if (x.numel() == 0) return at::Tensor();
      const at::Tensor flat = x.reshape({-1, x.size(-1)}).to(at::kCPU, at::kFloat).contiguous();
      const int64_t sample = currentSample(*unit);
      QPIPE_CHECK(!(keep || mean) || sample >= 0, "a smoothing statistic outside a calibration forward");
      at::Tensor absSum = mean ? at::zeros({flat.size(1)}, at::kDouble) : at::Tensor();
      columnStats(flat, w->min, w->max, absSum);
      if (keep) {
        w->tokens.push_back(flat.clone());
        w->sampleOf.push_back(sample);
      }
      if (mean) {
        w->absSums.push_back(std::move(absSum));
        w->absCounts.push_back(flat.size(0));
        w->absSamples.push_back(sample);
      }
      return at::Tensor();
    });
    watched_.push_back(std::move(watched));
  }
}

void SmoothingProcessor::process(LayerRequest& request) {
  std::vector<Module*> watched;
  for (const auto& w : watched_) watched.push_back(w->first);
  calibrateInputsOf(request, watched);
}

void SmoothingProcessor::postprocess(LayerRequest& request) {
  if (watched_.empty()) return;
  std::vector<at::Tensor> parts;
  for (const auto& w : watched_) {
    QPIPE_REQUIRE(&request.module->getSubmodule(w->firstPath) == w->first, ErrorCode::kConfig,
                  moduleName(request, w->firstPath), " was replaced before its statistics were read; run ", type_,
                  " as its own step, before quantization");
    w->first->removeHook(w->hook);
    parts.push_back(-w->min);
    parts.push_back(w->max);
  }
  // One collective per layer, the same on every rank: the subgraphs come from the family's
  // declaration, and each holds ±inf where this rank saw no token.
  at::Tensor merged = at::cat(parts);
  context_.group->allReduce(merged, ReduceOp::kMax);
  int64_t offset = 0;
  for (const auto& w : watched_) {
    const int64_t n = w->min.numel();
    w->min = -merged.slice(0, offset, offset + n);
    w->max = merged.slice(0, offset + n, offset + 2 * n);
    offset += 2 * n;
  }
  if (searchTokens_ > 0) gatherTokens();
  if (absMean_) gatherAbsMean();
  std::stable_sort(watched_.begin(), watched_.end(),
                   [](const auto& a, const auto& b) { return priority(a->graph.type) < priority(b->graph.type); });
  scheduleAndSmooth(request);
  watched_.clear();
}

// The float product X·Wᵀ of each search of a stage whose input is at least
// kSharedProductChannels wide, one parallel task per chunk whose rows travel in the wave's
// exchange, then one local task per subgraph that gives every rank's search the whole.
void SmoothingProcessor::submitProducts(LayerRequest& request, const std::vector<Watched*>& stage,
                                        scheduler::DistributedTaskScheduler& tasks,
                                        const std::function<void(Watched*, std::string, bool)>& submitted) {
  std::vector<Watched*> shared;
  for (Watched* w : stage) {
    if (w->allTokens.size(1) >= kSharedProductChannels) shared.push_back(w);
  }
  for (Watched* w : shared) {
    const int64_t count = w->allTokens.size(0), chunks = (count + kProductChunk - 1) / kProductChunk;
    w->product.assign(static_cast<size_t>(chunks), at::Tensor());
    for (int64_t c = 0; c < chunks; ++c) {
      tasks.submit(
          {.name = type_ + ".product",
           .fn =
               [this, &request, w, c](const ConfigNode&) {
                 const at::Tensor weight = searchOf(request, *w).productWeight();
                 QPIPE_CHECK(weight.defined(), "the ", type_, " search of ", w->name,
                             " has rounds but no product weight");
                 w->product[static_cast<size_t>(c)] = productChunk(w->allTokens, weight, c);
                 return ConfigNode();
               },
           .args = ConfigNode::map({{"source", ConfigNode::string(w->name)}, {"chunk", ConfigNode::integer(c)}}),
           .syncTensors =
               [this, &request, w, c, count](const TaskRecord& record, SyncContext& context) {
                 at::Tensor& rows = w->product[static_cast<size_t>(c)];
                 if (record.executorRank != context.group.rank()) {
                   const at::Tensor weight = searchOf(request, *w).productWeight();
                   rows = at::empty({productChunkRows(count, c), weight.size(0)}, weight.options());
                 }
                 return std::vector<at::Tensor>{rows};
               },
           .syncName = "smooth.product",
           .cost = static_cast<double>(productChunkRows(count, c)) * w->searchedElements});
      submitted(w, concat("p", c), true);
    }
  }
  for (Watched* w : shared) {
    tasks.submit({.name = type_ + ".product_whole",
                  .fn =
                      [this, &request, w](const ConfigNode&) {
                        if (!w->product.empty()) searchOf(request, *w).setProduct(std::move(w->product));
                        w->product.clear();
                        return ConfigNode();
                      },
                  .args = ConfigNode::map({{"source", ConfigNode::string(w->name)}}),
                  .parallel = false});
    submitted(w, "p", false);
  }
}

// docs/scheduler.md: the candidates of the subgraphs' searches are the parallel tasks; choosing
// and fusing run on every rank (local tasks: no weights broadcast). Subgraphs that share no
// module form a stage, whose candidates share a wave; a stage ends at the first subgraph sharing
// a module with one in it, which then searches on the smoothed weights (msmodelslim's order).
void SmoothingProcessor::scheduleAndSmooth(LayerRequest& request) {
  const std::vector<int> rounds = searchRounds();
  std::vector<Watched*> live;
  std::map<const Watched*, std::vector<std::string>> members;  // source, then targets
  for (const auto& w : watched_) {
    if (!smoothable(request, *w)) continue;
    live.push_back(w.get());
    if (!rounds.empty()) {
      w->searchedElements = consumerElements(request, w->graph, searchedConsumers(w->graph));
      const auto [out, in] = consumerShape(request, w->graph, searchedConsumers(w->graph));
      w->lossBlocks = lossBlocks(out, in);
    }
    std::vector<std::string>& paths = members[w.get()];
    paths.push_back(w->graph.source);
    paths.insert(paths.end(), w->graph.targets.begin(), w->graph.targets.end());
  }
  // The scheduler's own wave rule, applied to two subgraphs' modules.
  const auto share = [&](const Watched* a, const Watched* b) {
    return std::any_of(members[a].begin(), members[a].end(), [&](const std::string& p) {
      return std::any_of(members[b].begin(), members[b].end(),
                         [&](const std::string& q) { return scheduler::pathsOverlap(p, q); });
    });
  };
  scheduler::DistributedTaskScheduler tasks(*request.module, *context_.group, {.name = type_});
  // Per submitted task: its subgraph, which of the subgraph's tasks it is in the report
  // ("p<chunk>" for a chunk of the float product, "p" for the whole, "r<round>c<candidate>",
  // "r<round>" for a choice, empty for the fusion), and if it is part of the parallel search.
  struct Submitted {
    Watched* subgraph;
    std::string instance;
    bool searching;
  };
  std::vector<Submitted> submitted;
  for (size_t begin = 0; begin < live.size();) {
    size_t end = begin + 1;
    while (end < live.size() &&
           std::none_of(live.begin() + begin, live.begin() + end, [&](Watched* w) { return share(w, live[end]); })) {
      ++end;
    }
    const std::vector<Watched*> stage(live.begin() + begin, live.begin() + end);
    for (Watched* w : stage) {
      w->losses.resize(rounds.size());
      w->blocks.resize(rounds.size());
    }
    if (!rounds.empty()) {
      submitProducts(request, stage, tasks, [&](Watched* w, std::string instance, bool searching) {
        submitted.push_back({w, std::move(instance), searching});
      });
    }
    for (size_t r = 0; r < rounds.size(); ++r) {
      const int round = static_cast<int>(r);
      const int64_t split = candidatePieces(stage, rounds[r]);
      for (Watched* w : stage) {
        constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
        w->losses[r].assign(rounds[r], kNaN);
        const int64_t pieces = std::clamp<int64_t>(split, 1, std::max<int64_t>(w->lossBlocks, 1));
        const std::vector<double> unset(static_cast<size_t>(w->lossBlocks), kNaN);
        w->blocks[r].assign(pieces > 1 ? rounds[r] : 0, LossBlocks{unset, unset});
        const double cost = static_cast<double>(w->allTokens.size(0)) * w->searchedElements;
        for (int c = 0; c < rounds[r]; ++c) {
          if (pieces == 1) {
            tasks.submit({.name = type_ + ".candidate",
                          .fn =
                              [this, &request, w, round, c](const ConfigNode&) {
                                const double loss = searchOf(request, *w).loss(round, c);
                                w->losses[round][c] = loss;
                                return lossNode(loss);
                              },
                          .args = ConfigNode::map({{"source", ConfigNode::string(w->name)},
                                                   {"round", ConfigNode::integer(round)},
                                                   {"candidate", ConfigNode::integer(c)}}),
                          .sync = [w, round, c](const TaskRecord& record,
                                                SyncContext&) { w->losses[round][c] = lossOf(record.result); },
                          .syncName = "smooth.loss",
                          .cost = cost});
            submitted.push_back({w, concat("r", round, "c", c), true});
            continue;
          }
          // Pieces of whole blocks, as even as the blocks allow; the choice adds them up.
          for (int64_t piece = 0; piece < pieces; ++piece) {
            const int64_t first = piece * w->lossBlocks / pieces, count = (piece + 1) * w->lossBlocks / pieces - first;
            tasks.submit({.name = type_ + ".candidate",
                          .fn =
                              [this, &request, w, round, c, first, count](const ConfigNode&) {
                                const LossBlocks part = searchOf(request, *w).lossPart(round, c, first, count);
                                const ConfigNode result = blocksNode(part);
                                storeBlocks(result, first, count, w->blocks[round][c]);
                                return result;
                              },
                          .args = ConfigNode::map(
                              {{"source", ConfigNode::string(w->name)},
                               {"round", ConfigNode::integer(round)},
                               {"candidate", ConfigNode::integer(c)},
                               {"blocks", ConfigNode::list({ConfigNode::integer(first), ConfigNode::integer(count)})}}),
                          .sync = [w, round, c, first, count](
                                      const TaskRecord& record,
                                      SyncContext&) { storeBlocks(record.result, first, count, w->blocks[round][c]); },
                          .syncName = "smooth.loss_blocks",
                          .cost = cost * static_cast<double>(count) / static_cast<double>(w->lossBlocks)});
            submitted.push_back({w, concat("r", round, "c", c, "b", first), true});
          }
        }
      }
      for (Watched* w : stage) {
        tasks.submit(
            {.name = type_ + ".choice",
             .fn =
                 [this, &request, w, round](const ConfigNode&) {
                   Search& search = searchOf(request, *w);
                   for (size_t c = 0; c < w->blocks[round].size(); ++c) {
                     w->losses[round][c] = search.lossOf(w->blocks[round][c]);
                   }
                   search.choose(round, w->losses[round]);
                   return ConfigNode();
                 },
             .args = ConfigNode::map({{"source", ConfigNode::string(w->name)}, {"round", ConfigNode::integer(round)}}),
             .parallel = false});
        submitted.push_back({w, concat("r", round), false});
      }
    }
    for (Watched* w : stage) {
      tasks.submit(
          {.name = type_ + ".subgraph",
           .fn = [this, &request, w](const ConfigNode&) { return smooth(request, *w); },
           .args = ConfigNode::map({{"source", ConfigNode::string(w->name)},
                                    {"type", ConfigNode::string(std::string(subgraphTypeName(w->graph.type)))}}),
           .dependencies = members[w],
           .parallel = false});
      submitted.push_back({w, "", false});
    }
    begin = end;
  }
  const std::vector<TaskRecord> records = tasks.run();
  std::map<Watched*, double> searchSeconds;
  for (size_t i = 0; i < records.size(); ++i) {
    const TaskRecord& record = records[i];
    const auto& [w, instance, searching] = submitted[i];
    scheduler::reportTask(request, w->name, record, instance);
    if (searching) searchSeconds[w] += record.execSeconds;
    if (!instance.empty()) continue;
    ++smoothed_;
    for (const ConfigNode& value : record.result.items()) {
      request.report(value.items()[0].asString(), value.items()[1].asString(), value.items()[2].asFloat());
    }
    // What the scheduler splits, on its executors' clocks: the benches report it on its own.
    if (!rounds.empty()) request.report(w->name, "search_seconds", searchSeconds[w]);
  }
  scheduled_ += tasks.summary();
  for (const auto& [key, value] : tasks.summary().reportValues()) request.report(request.name, key, value);
}

// Every rank's parts in two collectives whatever their number (one 1-D tensor of `dtype` per
// subgraph; the ranks watch the same subgraphs): result[i][r] is rank r's part i.
std::vector<std::vector<at::Tensor>> SmoothingProcessor::allGatherParts(const std::vector<at::Tensor>& parts,
                                                                        at::ScalarType dtype) const {
  std::vector<int64_t> lengths;
  for (const at::Tensor& part : parts) lengths.push_back(part.numel());
  const std::vector<at::Tensor> everyLength = context_.group->allGather(at::tensor(lengths, at::kLong));
  const std::vector<at::Tensor> everyData =
      context_.group->allGather(parts.empty() ? at::empty({0}, dtype) : at::cat(parts));
  std::vector<std::vector<at::Tensor>> out(parts.size());
  for (size_t r = 0; r < everyData.size(); ++r) {
    const auto* length = everyLength[r].data_ptr<int64_t>();
    int64_t offset = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      out[i].push_back(everyData[r].narrow(0, offset, length[i]));
      offset += length[i];
    }
  }
  return out;
}

// Every rank's kept tokens, ordered by the run's sample index (each sample's rows in the order its
// forward produced them), so the rows are those one rank with every sample would have kept: at
// most searchTokens_ of them, evenly spaced. The ranks first exchange how many rows each forward
// call gave, so that each sends only its selected rows, not every token of the layer; every
// subgraph's in the same few collectives.
void SmoothingProcessor::gatherTokens() {
  std::vector<at::Tensor> calls;  // per subgraph: (sample, rows) per forward call of this rank
  for (const auto& w : watched_) {
    std::vector<int64_t> pairs;
    for (size_t i = 0; i < w->tokens.size(); ++i) {
      pairs.push_back(w->sampleOf[i]);
      pairs.push_back(w->tokens[i].size(0));
    }
    calls.push_back(at::tensor(pairs, at::kLong));
  }
  const std::vector<std::vector<at::Tensor>> everyCall = allGatherParts(calls, at::kLong);
  std::vector<at::Tensor> rowParts, positionParts;
  for (size_t s = 0; s < watched_.size(); ++s) {
    Watched& w = *watched_[s];
    // The global order: the calls of every rank, rank by rank, stably sorted by sample.
    struct Call {
      int64_t sample, rows;
      int rank;
      size_t index;  // in its rank's list
    };
    std::vector<Call> order;
    for (size_t r = 0; r < everyCall[s].size(); ++r) {
      const auto* pairs = everyCall[s][r].data_ptr<int64_t>();
      for (int64_t i = 0; i < everyCall[s][r].numel() / 2; ++i) {
        order.push_back({pairs[2 * i], pairs[2 * i + 1], static_cast<int>(r), static_cast<size_t>(i)});
      }
    }
    std::stable_sort(order.begin(), order.end(), [](const Call& a, const Call& b) { return a.sample < b.sample; });
    int64_t n = 0;
    for (const Call& call : order) n += call.rows;
    const int64_t kept = std::min(n, searchTokens_);
    // This rank's selected rows and their positions in the result: global row floor(i·n / kept).
    std::vector<at::Tensor> rows;
    std::vector<int64_t> positions;
    int64_t offset = 0, i = 0;
    for (const Call& call : order) {
      std::vector<int64_t> local;
      for (; i < kept && i * n / kept < offset + call.rows; ++i) {
        if (call.rank == context_.group->rank()) {
          local.push_back(i * n / kept - offset);
          positions.push_back(i);
        }
      }
      if (!local.empty()) rows.push_back(w.tokens[call.index].index_select(0, at::tensor(local, at::kLong)));
      offset += call.rows;
    }
    w.tokens.clear();
    w.sampleOf.clear();
    rowParts.push_back(rows.empty() ? at::empty({0}, at::kFloat) : at::cat(rows).reshape({-1}));
    positionParts.push_back(at::tensor(positions, at::kLong));
  }
  const std::vector<std::vector<at::Tensor>> everyRow = allGatherParts(rowParts, at::kFloat);
  const std::vector<std::vector<at::Tensor>> everyPosition = allGatherParts(positionParts, at::kLong);
  for (size_t s = 0; s < watched_.size(); ++s) {
    const at::Tensor all = at::cat(everyRow[s]).view({-1, watched_[s]->min.numel()});
    watched_[s]->allTokens = all.index_select(0, at::argsort(at::cat(everyPosition[s])));
  }
}

// Every rank's per-call sums, added one by one in sample order: the order one rank would add them.
void SmoothingProcessor::gatherAbsMean() {
  std::vector<at::Tensor> sums, samples;
  for (const auto& w : watched_) {
    // One row per call: Σ|x| per channel, then the call's token count (exact in double).
    std::vector<at::Tensor> calls;
    for (size_t i = 0; i < w->absSums.size(); ++i) {
      calls.push_back(at::cat({w->absSums[i], at::full({1}, static_cast<double>(w->absCounts[i]), at::kDouble)}));
    }
    sums.push_back(calls.empty() ? at::empty({0}, at::kDouble) : at::stack(calls).reshape({-1}));
    samples.push_back(at::tensor(w->absSamples, at::kLong));
    w->absSums.clear();
    w->absCounts.clear();
    w->absSamples.clear();
  }
  const std::vector<std::vector<at::Tensor>> everySum = allGatherParts(sums, at::kDouble);
  const std::vector<std::vector<at::Tensor>> everySample = allGatherParts(samples, at::kLong);
  for (size_t s = 0; s < watched_.size(); ++s) {
    const int64_t channels = watched_[s]->min.numel();
    const at::Tensor order =
        std::get<1>(at::sort(at::cat(everySample[s]), /*stable=*/true, /*dim=*/0, /*descending=*/false));
    const at::Tensor ordered = at::cat(everySum[s]).view({-1, channels + 1}).index_select(0, order);
    at::Tensor total = at::zeros({channels}, at::kDouble);
    for (int64_t i = 0; i < ordered.size(0); ++i) total.add_(ordered[i].slice(0, 0, channels));
    const double tokens = ordered.select(1, channels).sum().item<double>();
    watched_[s]->absMean = (total / std::max(tokens, 1.0)).to(at::kFloat);
  }
}

bool SmoothingProcessor::smoothable(LayerRequest& request, const Watched& w) const {
  // Channels no token reached hold min > max (all of them or none); NaN compares false as well.
  const bool nan = at::isnan(w.min).any().item<bool>() || at::isnan(w.max).any().item<bool>();
  if (!nan && !w.max.ge(w.min).all().item<bool>()) {
    context_.logger->warn(type_, ": no calibration token reached ", moduleName(request, w.firstPath), "; ",
                          describe(w.name, w.graph), " is left unsmoothed");
    return false;
  }
  QPIPE_REQUIRE(at::isfinite(w.min).all().item<bool>() && at::isfinite(w.max).all().item<bool>(), ErrorCode::kInput,
                "the calibration inputs of ", describe(w.name, w.graph),
                " hold NaN or Inf, so it has no finite smoothing scale (does the float model overflow on the "
                "calibration data? `qpipe "
                "eval` shows it)");
  return true;
}

bool SmoothingProcessor::smooths(SubgraphType type) const {
  return std::find(types_.begin(), types_.end(), type) != types_.end();
}

Search& SmoothingProcessor::searchOf(LayerRequest& request, Watched& w) const {
  if (!w.search) {
    for (const std::string& target : w.graph.targets) {
      auto& linear = request.module->getSubmodule(target).as<Linear>(moduleName(request, target));
      w.weights.push_back(linear.weight());
    }
    w.input = std::make_unique<SubgraphInput>(
        SubgraphInput{w.graph, w.name, w.min, w.max, w.weights, w.allTokens, w.absMean});
    w.search = search(*w.input);
  }
  return *w.search;
}

ConfigNode SmoothingProcessor::smooth(LayerRequest& request, Watched& w) const {
  const Subgraph& graph = w.graph;
  std::vector<Linear*> consumers;
  for (const std::string& target : graph.targets) {
    consumers.push_back(&request.module->getSubmodule(target).as<Linear>(moduleName(request, target)));
  }
  std::vector<std::pair<std::string, double>> values;
  const Scales chosen = searchOf(request, w).scales(values);
  w.search.reset();
  w.input.reset();
  w.weights.clear();
  const at::Tensor& producer = chosen.producer;
  const at::Tensor& consumer = chosen.consumer;
  const at::Tensor& shift = chosen.shift;
  QPIPE_CHECK(!shift.defined() || graph.type == SubgraphType::kNormLinear, "a shift outside norm-linear");
  if (shift.defined()) {
    for (Linear* linear : consumers)
      addBias(*linear, at::mv(linear->weight().to(at::kFloat), shift.to(linear->weight().device())));
  }
  for (Linear* linear : consumers) linear->weight() = multiplied(linear->weight(), consumer.unsqueeze(0));
  Module& source = request.module->getSubmodule(graph.source);
  at::Tensor& sourceWeight = source.parameter("weight");
  sourceWeight = divided(sourceWeight, graph.type == SubgraphType::kNormLinear ? producer : producer.unsqueeze(1));
  if (shift.defined()) addBias(source, -shift);
  if (source.hasParameter("bias")) {
    at::Tensor& bias = source.parameter("bias");
    bias = divided(bias, producer);
  }
  // What the report records: [module, key, value] triples, on every rank (the task's result).
  std::vector<ConfigNode> report;
  const auto add = [&](const std::string& key, double value) {
    report.push_back(
        ConfigNode::list({ConfigNode::string(w.name), ConfigNode::string(key), ConfigNode::number(value)}));
  };
  if (shift.defined()) add("shift_abs_max", shift.abs().max().item<double>());
  add("scale_min", producer.min().item<double>());
  add("scale_max", producer.max().item<double>());
  for (const auto& [key, value] : values) add(key, value);
  return ConfigNode::list(std::move(report));
}

void SmoothingProcessor::postRun() {
  context_.logger->info(type_, ": ", smoothed_, " subgraphs smoothed");
  if (scheduled_.parallelWaves > 0) context_.logger->info(type_, ": subgraphs [DTS] ", scheduled_.line());
  if (scheduled_.notWorthSplitting()) {
    context_.logger->warn(type_, ": the subgraphs' sync cost more than splitting them saved (", scheduled_.syncSeconds,
                          " s): not worth splitting");
  }
}

Scales SmoothingProcessor::grouped(const Subgraph& graph, const at::Tensor& activation, const at::Tensor& weight,
                                   const ScaleFormula& formula, GroupReduction reduction) {
  if (graph.type != SubgraphType::kOv) {
    const at::Tensor s = formula(activation, weight);
    return {s, s};
  }
  const int64_t kv = graph.kvHeads, dim = graph.headDim;
  const at::Tensor producer = reduction == GroupReduction::kMaxOfStatistics
                                  ? formula(reduceGroups(activation, kv, dim, false),
                                            weight.defined() ? reduceGroups(weight, kv, dim, false) : weight)
                                  : reduceGroups(formula(activation, weight), kv, dim, true);
  return {producer, expandGroups(producer, graph.heads, kv, dim)};
}

at::Tensor reduceGroups(const at::Tensor& perHead, int64_t kvHeads, int64_t headDim, bool mean) {
  const at::Tensor grouped = perHead.view({kvHeads, -1, headDim});
  return (mean ? grouped.mean(1) : grouped.amax(1)).reshape({-1});
}

at::Tensor expandGroups(const at::Tensor& perGroup, int64_t heads, int64_t kvHeads, int64_t headDim) {
  return perGroup.view({kvHeads, 1, headDim}).expand({kvHeads, heads / kvHeads, headDim}).reshape({-1});
}

}  // namespace qpipe::smooth
