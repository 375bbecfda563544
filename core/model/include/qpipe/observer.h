// Calibration observers: statistics over calibration batches that become QParams.
//
// Contract:
// - update() folds one batch in; qparams() turns what was seen into QParams (qpipe/quant.h).
// - state() exposes everything accumulated and merge() folds another observer's state in. Every
//   observer's state is a function of the MULTISET of batches it has seen, never of their order
//   or of how they were split: merging the observers of any partition of the batches, in any
//   order, gives the state of one observer that saw them all, bit for bit. That is what makes a
//   W-rank calibration equal the 1-rank one (dist/include/qpipe/dist/observer_sync.h gathers
//   the states across ranks and merges them).
// - MinMaxObserver, aggregation max: the elementwise min/max.
// - MinMaxObserver, aggregation mean: every batch's min/max (fp32). The mean is computed in
//   qparams(): per element, the batch values sorted, summed in float64 in that order, divided by
//   the count — sorting makes the float64 sum independent of the order the batches came in.
// - RecallWindowObserver: the elementwise min of the batches' window starts and max of their ends.
// - HistogramObserver: a 2048-bin histogram on a power-of-two range [-2^k, 2^k), k the least
//   integer with absmax < 2^k. Growing the range from k to k+1 merges adjacent bin pairs exactly,
//   so counts (float64 integers) and per-bin extremes are independent of the order of batches.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "qpipe/quant.h"

namespace qpipe::quant {

enum class Aggregation { kMax, kMean };

// msmodelslim `aggregation_type`: max or mean.
Aggregation parseAggregation(std::string_view name, std::string_view where);

// Reference: msmodelslim core/observer/minmax.py (MsMinMaxObserver).
// Reduces over the scheme's scope (per_tensor, per_channel, per_group, per_head); per_token is
// dynamic and has nothing to observe. NVFP4 activations observe the whole tensor's range: their
// qparams() hold only the static global scale (the block scales are computed per input).
class MinMaxObserver {
 public:
  struct State {
    at::Tensor min;  // kMax: elementwise extremes, fp32 in the scope's shape
    at::Tensor max;  //
    // kMean: each batch's min and max (fp32, the scope's shape); their order carries no meaning.
    std::vector<at::Tensor> batchMin;
    std::vector<at::Tensor> batchMax;
    int64_t batches = 0;
  };

  explicit MinMaxObserver(QScheme scheme, Aggregation aggregation = Aggregation::kMax);

  void update(const at::Tensor& x);
  void merge(const State& other);
  void reset();

  Aggregation aggregation() const { return aggregation_; }
  const State& state() const { return state_; }
  bool empty() const { return state_.batches == 0; }
  // The aggregated min and max (fp32); requires at least one batch.
  std::pair<at::Tensor, at::Tensor> minMax() const;
  QParams qparams() const;

 private:
  QScheme scheme_;
  Aggregation aggregation_;
  State state_;
};

// Reference: msmodelslim core/observer/histogram.py, derived from
// torch.ao.quantization.HistogramObserver (_non_linear_param_search, _compute_quantization_error).
// int8 per_tensor (as msmodelslim registers it).
//
// Unlike torch's and msmodelslim's (bins over the running [min, max], rebinned with 16x upsampling
// when the range grows — lossy, so the result depends on the order of the batches), the bins lie
// on [-2^k, 2^k): bin b holds [(b - 1024)·2^(k-10), (b - 1023)·2^(k-10)). A value's bin is
// floor(v·2^(10-k)) + 1024, exact in float64, and going from k to k+1 sends bin b to
// floor((b - 1024)/2) + 1024, the bin every value of b falls in directly. The search runs on the
// occupied bins, which hold 512 to 2048 bins of data (one-sided data just above a power of two
// gets the fewest).
class HistogramObserver {
 public:
  static constexpr int64_t kBins = 2048;
  // The k of a histogram of zeros only: below any non-zero fp32 (whose k is at least -148), so
  // merging it with anything takes the other's k.
  static constexpr int kZeroExponent = -149;

  struct State {
    at::Tensor histogram;          // float64 [kBins], counts over [-2^exponent, 2^exponent); undefined before data
    at::Tensor binMin;             // float64 [kBins]: the least and greatest value seen in each bin
    at::Tensor binMax;             // (±inf when empty), to tighten the clip window to real data
    int exponent = kZeroExponent;  // k
  };

  // msmodelslim `search_method`: l2_norm (default) or kl_divergence.
  enum class Search { kL2Norm, kKlDivergence };
  static Search parseSearch(std::string_view name, std::string_view where);

  explicit HistogramObserver(QScheme scheme, Search search = Search::kL2Norm);

  void update(const at::Tensor& x);
  void merge(const State& other);
  void reset() { state_ = {}; }

  const State& state() const { return state_; }
  bool empty() const { return !state_.histogram.defined(); }
  // The width of a bin, 2^(k-10), and the lower end of bin 0, -2^k.
  double binWidth() const;
  double lowerEdge() const;
  // The clip window chosen by the search over the occupied bins, tightened to the data in it.
  std::pair<double, double> clipRange() const;
  QParams qparams() const;

  // `state` with its bins moved onto [-2^exponent, 2^exponent), exponent >= state.exponent.
  static State rebin(const State& state, int exponent);

 private:
  double quantizationError(int64_t startBin, int64_t endBin) const;
  double l2Error(int64_t startBin, int64_t endBin) const;
  double klError(int64_t startBin, int64_t endBin) const;

  QScheme scheme_;
  Search search_;
  State state_;
};

// Reference: msmodelslim core/observer/recall_window.py (RecallWindowObserver), as its fa3_quant
// uses it, per head. For each head of a [batch, heads, seq, head_dim] batch, its N values sorted
// v_0 ≤ … ≤ v_{N−1} and T = max(1, ⌊ratio·N⌋): the narrowest window [v_i, v_{i+T−1}] (the lowest i
// among equal widths), so ratio 1 is the plain min and max. Batches accumulate as the min of the
// windows' starts and the max of their ends. msmodelslim groups a batch's values by head with
// `view(heads, -1)` on the [batch, heads, …] tensor, which is per head only for one-sample
// batches (what it feeds); here the values of head h are x[:, h] for any batch size.
class RecallWindowObserver {
 public:
  struct State {
    at::Tensor min;  // fp32 [1, heads, 1, 1]; undefined before the first batch
    at::Tensor max;
  };

  explicit RecallWindowObserver(double ratio);

  void update(const at::Tensor& x);
  void merge(const State& other);
  const State& state() const { return state_; }
  bool empty() const { return !state_.min.defined(); }
  double ratio() const { return ratio_; }
  // The window of one batch, per head: {start, end}, fp32 [1, heads, 1, 1].
  std::pair<at::Tensor, at::Tensor> window(const at::Tensor& x) const;

 private:
  double ratio_;
  State state_;
};

}  // namespace qpipe::quant
