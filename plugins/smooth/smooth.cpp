// The outlier-smoothing processors (docs/smoothing.md). Each smooths the subgraphs a layer's model
// family declares (qpipe/subgraph.h) with per-input-channel scales s: the consumers' columns are
// multiplied by s, the producer's output channels divided by it, so the float model computes the
// same function and the consumers' inputs lose their outlier channels before quantization.
//   smooth_quant  SmoothQuant as llm-compressor's SmoothQuantModifier computes it:
//                 s = range(X)^α / (2·max|W|)^(1−α), s = range(X) where the weights are zero,
//                 floored at scale_min; ov reduces the statistics over each KV group (max)
//   iter_smooth   msmodelslim's IterSmooth: s = max|X|^α / max|W|^(1−α) floored at scale_min,
//                 with |W| for every subgraph type; ov averages the heads' scales per KV group;
//                 asymmetric (symmetric: False) norm-linear centres X on (max + min) / 2 first
//   flex_smooth_quant  msmodelslim's FlexSmoothQuant: s = max|X|^α / max|W|^β, α and β searched
//                 per subgraph on the int8 error of the smoothed product
//   flex_awq_ssz  msmodelslim's FlexAWQSSZ: s = mean|X|^α, α searched through the step's own
//                 quantizer (SSZ int4 in its practices)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "qpipe/linear_quantizer.h"
#include "qpipe/plugin.h"
#include "qpipe/qconfig.h"
#include "qpipe/quant.h"
#include "qpipe/quant_linear.h"
#include "smoothing.h"

namespace qpipe::smooth {
namespace {

// m[k] = max(m[k], |w[k]|) over k < n; a NaN stays (as amax's).
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void absMaxInto(const float* w, float* m, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float a = std::fabs(w[k]);
    m[k] = a > m[k] || a != a ? a : m[k];
  }
}

// Per input column: the largest |W| over the rows of every consumer, in one pass over each weight
// (a search's setup on every rank: cat, abs and amax were three passes and two copies, 7 of the
// 10 ms gate/up's search took to set up on SmolLM2).
at::Tensor columnAbsMax(const std::vector<at::Tensor>& weights) {
  // Off the CPU the tensor ops stay where the weights are, and only the maxima come over.
  if (std::any_of(weights.begin(), weights.end(), [](const at::Tensor& w) { return !w.device().is_cpu(); })) {
    return at::cat(weights, 0).abs().amax(0).to(at::kCPU, at::kFloat);
  }
  QPIPE_CHECK(!weights.empty() && weights.front().dim() == 2, "columnAbsMax takes [out, in] weights");
  const int64_t cols = weights.front().size(1);
  at::Tensor out = at::zeros({cols}, at::kFloat);
  float* m = out.mutable_data_ptr<float>();
  for (const at::Tensor& weight : weights) {
    const at::Tensor w = weight.to(at::kCPU, at::kFloat).contiguous();
    QPIPE_CHECK(w.dim() == 2 && w.size(0) > 0 && w.size(1) == cols, "columnAbsMax takes [out, ", cols,
                "] weights, got ", w.sizes());
    const float* p = w.const_data_ptr<float>();
    // Columns split over the threads, each row's part of them in turn: no sum, so any split gives
    // the same bits.
    at::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < w.size(0); ++r) absMaxInto(p + r * cols + begin, m + begin, end - begin);
    });
  }
  return out;
}

// The weights stacked row-wise, fp32 on the CPU: what a search's loss multiplies.
at::Tensor stackedRows(const std::vector<at::Tensor>& weights) {
  return at::cat(weights, 0).to(at::kCPU, at::kFloat);
}

class SmoothQuant final : public SmoothingProcessor {
 public:
  SmoothQuant(const ConfigNode& config, const ProcessorContext& context)
      : SmoothingProcessor("smooth_quant", config, context),
        alpha_(config.at("alpha").asFloat()),
        scaleMin_(config.at("scale_min").asFloat()) {}

 protected:
  std::unique_ptr<Search> search(const SubgraphInput& in) const override {
    const ScaleFormula formula = [this](const at::Tensor& a, const at::Tensor& w) {
      return at::where(w > 0, a.pow(alpha_) / w.pow(1.0 - alpha_), a).clamp_min(scaleMin_);
    };
    return chosen(
        grouped(in.graph, in.max - in.min, 2.0 * columnAbsMax(in.weights), formula, GroupReduction::kMaxOfStatistics),
        {{"alpha", alpha_}});
  }

 private:
  double alpha_, scaleMin_;
};

// max|X| per channel.
at::Tensor absMax(const SubgraphInput& in) {
  return at::maximum(in.min.abs(), in.max.abs());
}

// s = max|X|^α / max|W|^β floored at `floor`; a column that is zero in every consumer takes any
// scale, and 1 leaves it alone.
ScaleFormula powerFormula(double alpha, double beta, double floor) {
  return [alpha, beta, floor](const at::Tensor& a, const at::Tensor& w) {
    const at::Tensor s = (a.pow(alpha) / w.pow(beta)).clamp_min(floor);
    return at::where(w > 0, s, at::ones_like(s));
  };
}

class IterSmooth final : public SmoothingProcessor {
 public:
  IterSmooth(const ConfigNode& config, const ProcessorContext& context)
      : SmoothingProcessor("iter_smooth", config, context),
        alpha_(config.at("alpha").asFloat()),
        scaleMin_(config.at("scale_min").asFloat()),
        symmetric_(config.at("symmetric").asBool()) {}

  PlannedOutputs plannedOutputs() const override {
    return {.normBias = !symmetric_ && smooths(SubgraphType::kNormLinear)};
  }

 protected:
  // Asymmetric norm-linear (msmodelslim's rule; the other types stay symmetric): the shift is the
  // centre of each channel's range, and the statistic max|X − shift| = (max − min) / 2.
  std::unique_ptr<Search> search(const SubgraphInput& in) const override {
    const ScaleFormula formula = powerFormula(alpha_, 1.0 - alpha_, scaleMin_);
    const at::Tensor w = columnAbsMax(in.weights);
    if (symmetric_ || in.graph.type != SubgraphType::kNormLinear) {
      return chosen(grouped(in.graph, absMax(in), w, formula, GroupReduction::kMeanOfScales), {{"alpha", alpha_}});
    }
    Scales out = grouped(in.graph, (in.max - in.min) / 2, w, formula, GroupReduction::kMeanOfScales);
    out.shift = (in.max + in.min) / 2;
    return chosen(std::move(out), {{"alpha", alpha_}});
  }

 private:
  double alpha_, scaleMin_;
  bool symmetric_;
};

// Σ (a − b)² over n values (Σ a² without b), the differences rounded to fp32 as the tensor ops
// would, their squares summed in double in 16 fixed lanes: the same bits on every CPU and
// thread count.
template <bool kDifference>
[[gnu::always_inline]] inline double sumOfSquares(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 16;  // four vectors of four doubles: four addition chains
  std::array<double, kLanes> lanes{};
  const auto value = [&](int64_t i) -> double {
    if constexpr (kDifference) {
      return a[i] - b[i];
    } else {
      return a[i];
    }
  };
  const int64_t body = n - n % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += value(i + l) * value(i + l);
  }
  for (int64_t i = body; i < n; ++i) lanes[i - body] += value(i) * value(i);
  double sum = 0;
  for (const double lane : lanes) sum += lane;
  return sum;
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] double squaredDifference(const float* a, const float* b,
                                                                                     int64_t n) {
  return sumOfSquares<true>(a, b, n);
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] double squares(const float* a, int64_t n) {
  return sumOfSquares<false>(a, nullptr, n);
}

// The searches' loss: rms(y_q − y) / rms(y) against the float product y = X·Wᵀ: given by the
// processor (Search::setProduct), else computed at the first call, so that a rank that evaluates
// none of a subgraph's candidates never computes it. y is held as its chunks of kProductChunk
// rows (productChunk), never joined. The squares are summed per block of kLossBlock output columns
// (LossBlocks): a row's block in double (rows in parallel), then the block's rows in order, then
// the blocks in order, so the bits depend neither on the thread count nor on how a candidate is
// split into pieces of whole blocks (tasks on other ranks). The tensor ops' difference, square and
// mean were three passes and two temporaries of a candidate's output, about a fifth of a search's
// time (docs/benchmarks.md).
class RelativeError {
 public:
  RelativeError(at::Tensor tokens, at::Tensor weight) : tokens_(std::move(tokens)), weight_(std::move(weight)) {}
  void setReference(std::vector<at::Tensor> chunks) const {
    cols_ = weight_.size(0);
    rows_ = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      at::Tensor& chunk = chunks[c];
      QPIPE_CHECK(chunk.scalar_type() == at::kFloat && chunk.device().is_cpu() && chunk.dim() == 2 &&
                      chunk.size(1) == cols_ && (chunk.size(0) == kProductChunk || c + 1 == chunks.size()),
                  "the float product's chunks are fp32 CPU [", kProductChunk, ", ", cols_, "] (the last shorter), got ",
                  chunk.sizes(), " ", chunk.scalar_type(), " at ", c);
      chunk = chunk.contiguous();
      rows_ += chunk.size(0);
    }
    chunks_ = std::move(chunks);
    ready_ = true;
    reference_ = blockSums(0, blocks(), [&](int64_t m, int64_t col, int64_t n) { return squares(row(m) + col, n); });
  }
  int64_t blocks() const { return (weight_.size(0) + kLossBlock - 1) / kLossBlock; }
  // Every block's sums of a full [rows, cols] fp32 product.
  LossBlocks operator()(const at::Tensor& quantized) const {
    prepare();
    QPIPE_CHECK(quantized.scalar_type() == at::kFloat && quantized.device().is_cpu() &&
                    quantized.sizes() == at::IntArrayRef({rows_, cols_}),
                "the loss compares a [", rows_, ", ", cols_, "] fp32 CPU product, got ", quantized.sizes(), " ",
                quantized.scalar_type());
    const at::Tensor q = quantized.contiguous();
    const float* p = q.const_data_ptr<float>();
    return {blockSums(0, blocks(),
                      [&](int64_t m, int64_t col, int64_t n) {
                        return squaredDifference(p + m * cols_ + col, row(m) + col, n);
                      }),
            reference_};
  }
  // The blocks [first, first + count) of an Int8Linear's product, `linear` holding exactly their
  // output columns, each output row compared as it is made, without the [tokens, out] tensor.
  LossBlocks operator()(const Int8Linear& linear, const at::Tensor& codes, const quant::QParams& params, int64_t first,
                        int64_t count) const {
    prepare();
    const int64_t col = first * kLossBlock, n = std::min(cols_, (first + count) * kLossBlock) - col;
    QPIPE_CHECK(
        first >= 0 && count > 0 && first + count <= blocks() && codes.size(0) == rows_ && linear.outFeatures() == n,
        "the loss compares blocks [", first, ", ", first + count, ") of ", blocks(), " of a [", rows_, ", ", cols_,
        "] product, got ", codes.size(0), " rows of ", linear.outFeatures(), " outputs");
    std::vector<double> perRow(static_cast<size_t>(rows_ * count));
    linear.forwardCodesRows(codes, params, at::Tensor(), [&](int64_t m, const float* y) {
      for (int64_t b = 0; b < count; ++b) {
        const int64_t offset = b * kLossBlock;
        perRow[m * count + b] = squaredDifference(y + offset, row(m) + col + offset, std::min(kLossBlock, n - offset));
      }
    });
    return {ordered(perRow, count), {reference_.begin() + first, reference_.begin() + first + count}};
  }
  // rms(y_q − y) / rms(y) from every block's sums, in order.
  double loss(const LossBlocks& all) const {
    QPIPE_CHECK(static_cast<int64_t>(all.error.size()) == blocks() && all.reference.size() == all.error.size(),
                "a loss adds ", blocks(), " blocks, got ", all.error.size(), " and ", all.reference.size());
    const double elements = static_cast<double>(tokens_.size(0)) * static_cast<double>(weight_.size(0));
    if (elements == 0) return 0;
    double error = 0, norm = 0;
    for (size_t b = 0; b < all.error.size(); ++b) {
      error += all.error[b];
      norm += all.reference[b];
    }
    error = std::sqrt(error / elements);
    norm = std::sqrt(norm / elements);
    return norm > 0 ? error / norm : error;
  }

 private:
  void prepare() const {
    if (!ready_) setReference(productChunks(tokens_, weight_));
  }
  const float* row(int64_t m) const {
    return chunks_[static_cast<size_t>(m / kProductChunk)].const_data_ptr<float>() + (m % kProductChunk) * cols_;
  }
  // Per block b of [first, first + count): Σ over rows m in order of sum(m, column, width).
  template <typename BlockSum>
  std::vector<double> blockSums(int64_t first, int64_t count, const BlockSum& sum) const {
    std::vector<double> perRow(static_cast<size_t>(rows_ * count));
    if (cols_ > 0) {
      at::parallel_for(0, rows_, std::max<int64_t>(1, 16384 / cols_), [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) {
          for (int64_t b = 0; b < count; ++b) {
            const int64_t col = (first + b) * kLossBlock;
            perRow[m * count + b] = sum(m, col, std::min(kLossBlock, cols_ - col));
          }
        }
      });
    }
    return ordered(perRow, count);
  }
  // Row-major [rows, count] sums → each column's, rows in order.
  std::vector<double> ordered(const std::vector<double>& perRow, int64_t count) const {
    std::vector<double> out(static_cast<size_t>(count), 0.0);
    for (int64_t m = 0; m < rows_; ++m) {
      for (int64_t b = 0; b < count; ++b) out[b] += perRow[m * count + b];
    }
    return out;
  }

  at::Tensor tokens_, weight_;
  mutable std::vector<at::Tensor> chunks_;
  mutable std::vector<double> reference_;  // Σ y² per block
  mutable int64_t rows_ = 0, cols_ = 0;
  mutable bool ready_ = false;
};

// The rows of `weight` [out, in] that give the output columns of loss blocks [first, first + count).
at::Tensor blockRows(const at::Tensor& weight, int64_t first, int64_t count) {
  const int64_t begin = first * kLossBlock;
  return weight.narrow(0, begin, std::min(weight.size(0), (first + count) * kLossBlock) - begin);
}

// The grid both searches walk: 0, 0.05, …, 1.
constexpr double kSearchStep = 0.05;
constexpr int kSearchSteps = 20;

// msmodelslim's flex_smooth_quant loss for consumer scales s: the RelativeError of X/s quantized
// to int8 per token times W·s quantized to int8 per output channel (both symmetric, absmax /
// 127), through the exact int8 GEMM (qpipe/quant_linear.h).
class SmoothedInt8Loss {
 public:
  SmoothedInt8Loss(at::Tensor tokens, at::Tensor weight)
      : tokens_(std::move(tokens)), weight_(std::move(weight)), error_(tokens_, weight_) {}
  const at::Tensor& weight() const { return weight_; }
  void setReference(std::vector<at::Tensor> product) { error_.setReference(std::move(product)); }
  int64_t blocks() const { return error_.blocks(); }
  double loss(const LossBlocks& all) const { return error_.loss(all); }

  // The blocks [first, first + count): per output channel, the weight's rows quantize alone.
  LossBlocks operator()(const at::Tensor& consumerScale, int64_t first, int64_t count) const {
    using quant::QDtype, quant::QScope;
    const quant::QScheme perChannel{QDtype::kInt8, QScope::kPerChannel, true, 0};
    const quant::QScheme perToken{QDtype::kInt8, QScope::kPerToken, true, 0};
    auto [params, qweight] = quant::quantizeScaledWeight(blockRows(weight_, first, count), consumerScale, perChannel);
    const Int8Linear linear(qweight, params.scale);
    const auto [tokenParams, tokenCodes] = quant::quantizeDividedTokens(tokens_, consumerScale, perToken);
    return error_(linear, tokenCodes, tokenParams, first, count);
  }

 private:
  at::Tensor tokens_, weight_;
  RelativeError error_;
};

// msmodelslim's flex_smooth_quant: s = max|X|^α / max|W|^β floored at 1e-5, with α and β given or
// found per subgraph by a two-phase grid search (step 0.05) on the int8 loss above: α over [0, 1]
// with β = 1 − α, then β over [0, 1] with the best α (a later value wins a tie, over both phases).
// The loss weights are the consumers' concatenated for norm-linear, o_proj for ov, down_proj for
// up-down; the tokens are up to `search_tokens` of the consumers' inputs in sample order, the same
// on any number of ranks. ov averages the heads' scales per KV group.
class FlexSmoothQuant final : public SmoothingProcessor {
 public:
  FlexSmoothQuant(const ConfigNode& config, const ProcessorContext& context)
      : SmoothingProcessor("flex_smooth_quant", config, context),
        alpha_(optionalFraction(config, "alpha")),
        beta_(optionalFraction(config, "beta")) {
    if (!alpha_ || !beta_) keepTokens(config.at("search_tokens").asInt());
    splitCandidates(config.at("search_split").asInt());
  }

 protected:
  std::vector<int> searchRounds() const override {
    std::vector<int> rounds;
    if (!alpha_) rounds.push_back(kSearchSteps + 1);
    if (!beta_) rounds.push_back(kSearchSteps + 1);
    return rounds;
  }

  std::unique_ptr<Search> search(const SubgraphInput& in) const override {
    return std::make_unique<PairSearch>(in, alpha_, beta_);
  }

  int64_t lossBlocks(int64_t outFeatures, int64_t) const override {
    return (outFeatures + kLossBlock - 1) / kLossBlock;
  }
  // The tokens' int8 codes are a tenth of a candidate: three pieces cost 18 % more than one on
  // SmolLM2 (docs/benchmarks.md).
  double pieceOverhead() const override { return 0.1; }

 private:
  static constexpr double kScaleMin = 1e-5;

  // The rounds: α (when not given), then β (when not given).
  class PairSearch final : public Search {
   public:
    PairSearch(const SubgraphInput& in, std::optional<double> alpha, std::optional<double> beta)
        : graph_(in.graph),
          activation_(absMax(in)),
          weight_(columnAbsMax(in.weights)),
          alphaGiven_(alpha.has_value()),
          betaGiven_(beta.has_value()),
          alpha_(alpha.value_or(0.5)),
          beta_(beta.value_or(0.5)) {
      if (!alphaGiven_ || !betaGiven_) loss_.emplace(in.tokens, stackedRows(in.weights));
    }

    double loss(int round, int candidate) const override {
      return loss_->loss(lossPart(round, candidate, 0, loss_->blocks()));
    }
    LossBlocks lossPart(int round, int candidate, int64_t first, int64_t count) const override {
      const auto [alpha, beta] = pair(round, candidate);
      return (*loss_)(scalesFor(alpha, beta).consumer, first, count);
    }
    double lossOf(const LossBlocks& blocks) const override { return loss_->loss(blocks); }

    at::Tensor productWeight() const override { return loss_ ? loss_->weight() : at::Tensor(); }
    void setProduct(std::vector<at::Tensor> product) override { loss_->setReference(std::move(product)); }

    void choose(int round, const std::vector<double>& losses) override {
      for (size_t c = 0; c < losses.size(); ++c) {
        if (losses[c] <= best_) std::tie(best_, alpha_, beta_) = std::tuple_cat(std::tuple(losses[c]), pair(round, c));
      }
    }

    Scales scales(std::vector<std::pair<std::string, double>>& report) const override {
      if (loss_) report.emplace_back("loss", best_);
      report.emplace_back("alpha", alpha_);
      report.emplace_back("beta", beta_);
      return scalesFor(alpha_, beta_);
    }

   private:
    bool searchesAlpha(int round) const { return !alphaGiven_ && round == 0; }
    // The (α, β) a candidate tries; a β round holds the α chosen so far.
    std::pair<double, double> pair(int round, size_t candidate) const {
      const double value = static_cast<double>(candidate) * kSearchStep;
      if (searchesAlpha(round)) return {value, betaGiven_ ? beta_ : 1.0 - value};
      return {alpha_, value};
    }
    Scales scalesFor(double alpha, double beta) const {
      return grouped(graph_, activation_, weight_, powerFormula(alpha, beta, kScaleMin), GroupReduction::kMeanOfScales);
    }

    const Subgraph& graph_;
    at::Tensor activation_, weight_;
    bool alphaGiven_, betaGiven_;
    double alpha_, beta_;
    double best_ = std::numeric_limits<double>::infinity();
    std::optional<SmoothedInt8Loss> loss_;
  };

  static std::optional<double> optionalFraction(const ConfigNode& config, const char* field) {
    const ConfigNode& value = config.at(field);
    if (value.isNull()) return std::nullopt;
    return value.asFloat();
  }

  std::optional<double> alpha_, beta_;
};

// msmodelslim's flex_awq_ssz: AWQ-style s = max(mean|X|^α, 1e-5) (β = 0), α searched over
// 0, 0.05, …, 1 on the error of the consumers as the step's `qconfig` quantizes them:
// rms(Q(X/s) − X·Wᵀ) / rms(X·Wᵀ), Q the deployed QuantLinear of W·s (its weight quantizer, e.g.
// SSZ int4, run for every α; static activations calibrated on X/s). A later α wins a tie.
// norm-linear with more than three consumers searches on the first two (msmodelslim's rule);
// ov reduces the statistics per KV group with max.
class FlexAwqSsz final : public SmoothingProcessor {
 public:
  FlexAwqSsz(const ConfigNode& config, const ProcessorContext& context)
      : SmoothingProcessor("flex_awq_ssz", config, context),
        qconfig_(quant::parseLinearQConfig(config.at("qconfig"), context.fieldPath("qconfig"),
                                           context.configWarnings.get())) {
    keepTokens(config.at("search_tokens").asInt());
    keepAbsMean();
    splitCandidates(config.at("search_split").asInt());
  }

 protected:
  std::vector<int> searchRounds() const override { return {kSearchSteps + 1}; }

  std::unique_ptr<Search> search(const SubgraphInput& in) const override {
    return std::make_unique<AlphaSearch>(in, qconfig_);
  }

  size_t searchedConsumers(const Subgraph& graph) const override { return searchedCount(graph); }

  int64_t lossBlocks(int64_t outFeatures, int64_t inFeatures) const override {
    return splits(qconfig_, inFeatures) ? (outFeatures + kLossBlock - 1) / kLossBlock : 0;
  }

 private:
  class AlphaSearch final : public Search {
   public:
    AlphaSearch(const SubgraphInput& in, const quant::LinearQConfig& qconfig)
        : graph_(in.graph),
          name_(in.name),
          absMean_(in.absMean),
          tokens_(in.tokens),
          qconfig_(qconfig),
          weight_(stackedRows(searchedWeights(in))),
          error_(tokens_, weight_),
          exactInt8_(exactInt8(qconfig, weight_.size(1))) {}

    at::Tensor productWeight() const override { return weight_; }
    void setProduct(std::vector<at::Tensor> product) override { error_.setReference(std::move(product)); }

    double loss(int round, int candidate) const override {
      if (exactInt8_) return error_.loss(lossPart(round, candidate, 0, error_.blocks()));
      const at::Tensor s = scalesFor(candidate * kSearchStep).consumer.unsqueeze(0);
      Linear scaled(weight_ * s);
      LinearQuantizer quantizer(scaled, qconfig_);
      const at::Tensor x = tokens_ / s;
      if (!qconfig_.isDataFree()) {
        quantizer.forward(x);
        quantizer.freeze();
      }
      return error_.loss(error_(quantizer.deploy(name_)->forward(x)));
    }

    // What the deployed QuantLinear computes (its Int8Linear), bit for bit, without the
    // QuantLinear or the [tokens, out] product written and read back (docs/smoothing.md); per
    // output channel (or group of one), the weight's rows of the blocks quantize alone.
    LossBlocks lossPart(int, int candidate, int64_t first, int64_t count) const override {
      QPIPE_CHECK(exactInt8_ && (count == error_.blocks() || splits(qconfig_, weight_.size(1))),
                  "flex_awq_ssz splits only the loss of Int8Linear consumers with min-max scales per channel");
      const at::Tensor consumer = scalesFor(candidate * kSearchStep).consumer;
      const at::Tensor rows = blockRows(weight_, first, count);
      const quant::QConfig& w = qconfig_.weight;
      quant::QParams params;
      at::Tensor codes;
      if (w.method == quant::QMethod::kSsz) {
        const at::Tensor scaled = rows * consumer.unsqueeze(0);
        params = quant::sszSearch(scaled, w.scheme, w.sszSteps);
        codes = quant::quantize(scaled, params, w.scheme);
      } else {
        std::tie(params, codes) = quant::quantizeScaledWeight(rows, consumer, w.scheme);
      }
      const Int8Linear linear(codes, params.scale);
      const auto [tokenParams, tokenCodes] = quant::quantizeDividedTokens(tokens_, consumer, qconfig_.act.scheme);
      return error_(linear, tokenCodes, tokenParams, first, count);
    }
    double lossOf(const LossBlocks& blocks) const override { return error_.loss(blocks); }

    void choose(int, const std::vector<double>& losses) override {
      for (size_t c = 0; c < losses.size(); ++c) {
        if (losses[c] <= best_) std::tie(best_, alpha_) = std::tuple(losses[c], static_cast<double>(c) * kSearchStep);
      }
    }

    Scales scales(std::vector<std::pair<std::string, double>>& report) const override {
      report.emplace_back("alpha", alpha_);
      report.emplace_back("loss", best_);
      return scalesFor(alpha_);
    }

   private:
    static std::vector<at::Tensor> searchedWeights(const SubgraphInput& in) {
      return {in.weights.begin(), in.weights.begin() + static_cast<std::ptrdiff_t>(searchedCount(in.graph))};
    }
    Scales scalesFor(double alpha) const {
      // The formula reads no weight statistic.
      return grouped(
          graph_, absMean_, at::Tensor(),
          [alpha](const at::Tensor& a, const at::Tensor&) { return a.pow(alpha).clamp_min(1e-5); },
          GroupReduction::kMaxOfStatistics);
    }

    const Subgraph& graph_;
    const std::string& name_;
    at::Tensor absMean_, tokens_;
    const quant::LinearQConfig& qconfig_;
    at::Tensor weight_;
    RelativeError error_;
    bool exactInt8_;
    double best_ = std::numeric_limits<double>::infinity(), alpha_ = 0;
  };

  // Whether the deployed consumers are an Int8Linear fed dynamic per-token codes (msmodelslim's
  // W4A8/W8A8 dynamic practices), whose loss the search can take from the codes directly.
  static bool exactInt8(const quant::LinearQConfig& qconfig, int64_t inFeatures) {
    const quant::QConfig& act = qconfig.act;
    const quant::QMethod method = qconfig.weight.method;
    return (method == quant::QMethod::kSsz || method == quant::QMethod::kMinMax) && act.enabled() && act.isDynamic() &&
           act.scheme.scope == quant::QScope::kPerToken &&
           Int8Linear::supports(qconfig.weight.scheme, ActivationQuant{act.scheme, {}}) &&
           inFeatures <= Int8Linear::kMaxInt8K;
  }
  // Whether a candidate's loss splits by output channel: on the int8 path, with min-max weight
  // scales per channel. A per-tensor scale reads every row, and an SSZ solve stops all rows of a
  // weight at once (quant::sszSearch), so a piece of the rows may stop elsewhere.
  static bool splits(const quant::LinearQConfig& qconfig, int64_t inFeatures) {
    return exactInt8(qconfig, inFeatures) && qconfig.weight.method == quant::QMethod::kMinMax &&
           qconfig.weight.scheme.scope != quant::QScope::kPerTensor;
  }

  // msmodelslim's rule: norm-linear with more than three consumers searches on the first two.
  static size_t searchedCount(const Subgraph& graph) {
    return graph.type == SubgraphType::kNormLinear && graph.targets.size() > 3 ? 2 : graph.targets.size();
  }

  quant::LinearQConfig qconfig_;
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

FieldSpec searchTokens() {
  return {.name = "search_tokens",
          .type = ValueType::kInt,
          .help = "calibration tokens the search evaluates per subgraph (evenly spaced over the samples)",
          .defaultValue = ConfigNode::integer(512),
          .minimum = 1};
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
      .optional("symmetric", ValueType::kBool, ConfigNode::boolean(true),
                "False: norm-linear inputs centred on their range first (the norm and the consumers gain biases)");
  SmoothingProcessor::addCommonFields(iterSmooth, allSubgraphTypes());
  registrar.addProcessor({
      .type = "iter_smooth",
      .description = "msmodelslim's iter_smooth: max|X|^α / max|W|^(1-α) on every declared subgraph",
      .schema = std::move(iterSmooth),
      .factory = factory<IterSmooth>(),
  });

  Schema flex;
  FieldSpec alpha = fraction("alpha", 0, "α; searched when absent");
  alpha.defaultValue.reset();
  FieldSpec beta = fraction("beta", 0, "β; searched when absent");
  beta.defaultValue.reset();
  flex.add(std::move(alpha)).add(std::move(beta)).add(searchTokens()).add(SmoothingProcessor::searchSplitField());
  SmoothingProcessor::addCommonFields(flex, allSubgraphTypes());
  registrar.addProcessor({
      .type = "flex_smooth_quant",
      .description = "msmodelslim's flex_smooth_quant: max|X|^α / max|W|^β with an α/β search per subgraph",
      .schema = std::move(flex),
      .factory = factory<FlexSmoothQuant>(),
  });

  Schema awq;
  awq.nested("qconfig", quant::linearQConfigSchema(), true, "the quantization the α search evaluates (act and weight)")
      .add(searchTokens())
      .add(SmoothingProcessor::searchSplitField());
  SmoothingProcessor::addCommonFields(awq, allSubgraphTypes());
  registrar.addProcessor({
      .type = "flex_awq_ssz",
      .description = "msmodelslim's flex_awq_ssz: mean|X|^α with α searched through the step's quantizer",
      .schema = std::move(awq),
      .factory = factory<FlexAwqSsz>(),
  });
}

}  // namespace
}  // namespace qpipe::smooth

QPIPE_PLUGIN("smooth", "1.0.0",
             "Outlier smoothing: smooth_quant, and msmodelslim's iter_smooth, flex_smooth_quant and flex_awq_ssz",
             qpipe::smooth::registerProcessors)
