// Calibration observers: running statistics over calibration batches that become QParams.
//
// Contract:
// - update() folds one batch in; qparams() turns what was seen into QParams (qpipe/quant.h).
// - state() exposes everything accumulated and merge() folds another observer's state in, so a
//   multi-rank sync can reduce the states (all-reduce MIN/MAX, or SUM of sums and counts) and
//   every rank ends with the same QParams.
// - MinMaxObserver, aggregation max: the state is the elementwise min/max, so any split and merge
//   order gives the single-pass answer bit for bit. Aggregation mean: the state is float64 sums
//   of per-batch min/max and the batch count; merging gives the single-pass answer up to the
//   float64 rounding of the sums (summation order), far below fp32 resolution.
// - HistogramObserver: the state is a 2048-bin histogram over [min, max] of everything seen;
//   merging rebins both onto the union range, so it is exact when the ranges agree (per-bin
//   extremes, used to tighten the clip window, merge exactly in any case).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string_view>
#include <utility>

#include "qpipe/quant.h"

namespace qpipe::quant {

enum class Aggregation { kMax, kMean };

// msmodelslim `aggregation_type`: max or mean.
Aggregation parseAggregation(std::string_view name, std::string_view where);

// Reference: msmodelslim core/observer/minmax.py (MsMinMaxObserver; reference/msmodelslim.md §c.1).
// Reduces over the scheme's scope (per_tensor, per_channel, per_group, per_head); per_token is
// dynamic and has nothing to observe.
class MinMaxObserver {
 public:
  struct State {
    at::Tensor min;     // kMax: running extremes, fp32 in the scope's shape
    at::Tensor max;     //
    at::Tensor sumMin;  // kMean: sums of per-batch min/max, float64
    at::Tensor sumMax;  //
    int64_t batches = 0;
  };

  explicit MinMaxObserver(QScheme scheme, Aggregation aggregation = Aggregation::kMax);

  void update(const at::Tensor& x);
  void merge(const State& other);
  void reset();

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
class HistogramObserver {
 public:
  static constexpr int64_t kBins = 2048;
  static constexpr int64_t kUpsampleRate = 16;

  struct State {
    at::Tensor histogram;  // float64 [kBins] over [min, max]; undefined before the first batch
    at::Tensor binMin;     // float64 [kBins]: the least and greatest value seen in each bin
    at::Tensor binMax;     // (±inf when empty), to tighten the clip window to real data
    double min = 0;        // the range of everything seen
    double max = 0;
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
  // The clip window chosen by the l2 search, tightened to the data range.
  std::pair<double, double> clipRange() const;
  QParams qparams() const;

 private:
  double quantizationError(int64_t startBin, int64_t endBin) const;
  double l2Error(int64_t startBin, int64_t endBin) const;
  double klError(int64_t startBin, int64_t endBin) const;

  QScheme scheme_;
  Search search_;
  State state_;
};

}  // namespace qpipe::quant
