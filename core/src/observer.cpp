// Calibration observers. References: msmodelslim core/observer/minmax.py and histogram.py
// (reference/msmodelslim.md §c.1); the histogram search ports the l2 search of
// torch.ao.quantization.HistogramObserver, which msmodelslim's observer derives from.
#include "qpipe/observer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qpipe/error.h"

namespace qpipe::quant {

Aggregation parseAggregation(std::string_view name, std::string_view where) {
  if (name == "max") return Aggregation::kMax;
  if (name == "mean") return Aggregation::kMean;
  QPIPE_REQUIRE(false, ErrorCode::kConfig, where, ": unknown aggregation_type '", name, "'; expected one of max, mean");
  return Aggregation::kMax;
}

MinMaxObserver::MinMaxObserver(QScheme scheme, Aggregation aggregation) : scheme_(scheme), aggregation_(aggregation) {
  QPIPE_REQUIRE(scheme.scope != QScope::kPerToken, ErrorCode::kConfig, "minmax observer: ", scheme.name(),
                " is dynamic (scales computed per batch), there is nothing to observe");
}

void MinMaxObserver::update(const at::Tensor& x) {
  const auto [min, max] = quant::minMax(x, scheme_);
  State batch;
  if (aggregation_ == Aggregation::kMax) {
    batch.min = min;
    batch.max = max;
  } else {
    // msmodelslim averages per-batch extremes in float64.
    batch.sumMin = min.to(at::kDouble);
    batch.sumMax = max.to(at::kDouble);
  }
  batch.batches = 1;
  merge(batch);
}

void MinMaxObserver::merge(const State& other) {
  if (other.batches == 0) return;
  if (empty()) {
    state_ = other;
    return;
  }
  if (aggregation_ == Aggregation::kMax) {
    QPIPE_CHECK(other.min.defined() && other.min.sizes() == state_.min.sizes(), "minmax observer: merging shape ",
                other.min.defined() ? other.min.sizes() : at::IntArrayRef{}, " into ", state_.min.sizes());
    state_.min = at::minimum(state_.min, other.min);
    state_.max = at::maximum(state_.max, other.max);
  } else {
    QPIPE_CHECK(other.sumMin.defined() && other.sumMin.sizes() == state_.sumMin.sizes(),
                "minmax observer: merging shape ", other.sumMin.defined() ? other.sumMin.sizes() : at::IntArrayRef{},
                " into ", state_.sumMin.sizes());
    state_.sumMin = state_.sumMin + other.sumMin;
    state_.sumMax = state_.sumMax + other.sumMax;
  }
  state_.batches += other.batches;
}

void MinMaxObserver::reset() {
  state_ = {};
}

std::pair<at::Tensor, at::Tensor> MinMaxObserver::minMax() const {
  QPIPE_CHECK(!empty(), "minmax observer: qparams requested before any batch");
  if (aggregation_ == Aggregation::kMax) return {state_.min, state_.max};
  const double batches = static_cast<double>(state_.batches);
  return {(state_.sumMin / batches).to(at::kFloat), (state_.sumMax / batches).to(at::kFloat)};
}

QParams MinMaxObserver::qparams() const {
  const auto [min, max] = minMax();
  return computeQParams(min, max, scheme_);
}

namespace {

// Mass of a histogram over [from, to] moved onto the bins of [onto0, onto1] ⊇ [from, to]: each bin
// splits into kUpsampleRate equal parts, each landing in the target bin holding its centre (the
// upsampling torch's HistogramObserver uses when the range grows).
at::Tensor rebin(const at::Tensor& histogram, double from0, double from1, double onto0, double onto1) {
  if (from0 == onto0 && from1 == onto1) return histogram;
  constexpr int64_t kBins = HistogramObserver::kBins;
  constexpr int64_t kRate = HistogramObserver::kUpsampleRate;
  const auto options = histogram.options();
  const double width = (from1 - from0) / kBins;
  const at::Tensor centres = from0 + (at::arange(kBins * kRate, options) + 0.5) * (width / kRate);
  const at::Tensor index = ((centres - onto0) * (kBins / (onto1 - onto0))).floor().clamp(0, kBins - 1).to(at::kLong);
  return at::zeros({kBins}, options).index_add_(0, index, histogram.repeat_interleave(kRate) / kRate);
}

at::Tensor binCounts(const at::Tensor& x, double min, double max) {
  constexpr int64_t kBins = HistogramObserver::kBins;
  const at::Tensor values = x.to(at::kDouble);
  // A constant batch has a zero-width range: everything lands in bin 0.
  const at::Tensor index = max > min
                               ? ((values - min) * (kBins / (max - min))).floor().clamp(0, kBins - 1).to(at::kLong)
                               : at::zeros_like(values, values.options().dtype(at::kLong));
  return at::bincount(index, {}, kBins).to(at::kDouble);
}

}  // namespace

HistogramObserver::HistogramObserver(QScheme scheme) : scheme_(scheme) {
  QPIPE_REQUIRE((scheme.dtype == QDtype::kInt8 || scheme.dtype == QDtype::kInt4) && scheme.scope == QScope::kPerTensor,
                ErrorCode::kConfig, "histogram observer supports int8/int4 per_tensor only, got ", scheme.name());
}

void HistogramObserver::update(const at::Tensor& x) {
  const at::Tensor values = x.detach().to(at::kFloat).flatten().cpu();
  if (values.numel() == 0) return;
  const double min = values.min().item<float>();
  const double max = values.max().item<float>();
  merge({binCounts(values, min, max), min, max});
}

void HistogramObserver::merge(const State& other) {
  if (!other.histogram.defined()) return;
  if (empty()) {
    state_ = other;
    return;
  }
  const double min = std::min(state_.min, other.min);
  const double max = std::max(state_.max, other.max);
  state_.histogram = rebin(state_.histogram, state_.min, state_.max, min, max) +
                     rebin(other.histogram, other.min, other.max, min, max);
  state_.min = min;
  state_.max = max;
}

// torch's _compute_quantization_error: the l2 error of mapping bins [startBin, endBin] onto
// 2^bits uniform destination bins, integrating x² over each source bin's uniform density.
double HistogramObserver::quantizationError(int64_t startBin, int64_t endBin) const {
  const int64_t dstBins = int64_t{1} << (scheme_.dtype == QDtype::kInt4 ? 4 : 8);
  const double binWidth = (state_.max - state_.min) / kBins;
  const double dstWidth = binWidth * static_cast<double>(endBin - startBin + 1) / static_cast<double>(dstBins);
  if (dstWidth == 0.0) return 0.0;
  const auto normOf = [](double deltaBegin, double deltaEnd, double density) {
    return density * (deltaEnd * deltaEnd * deltaEnd - deltaBegin * deltaBegin * deltaBegin) / 3;
  };
  const double half = dstWidth / 2;
  const at::Tensor histogram = state_.histogram.contiguous();
  const double* counts = histogram.data_ptr<double>();
  double norm = 0;
  for (int64_t bin = 0; bin < kBins; ++bin) {
    const double begin = static_cast<double>(bin - startBin) * binWidth;
    const double end = begin + binWidth;
    const double dstOfBegin = std::clamp(std::floor(begin / dstWidth), 0.0, static_cast<double>(dstBins - 1));
    const double dstOfEnd = std::clamp(std::floor(end / dstWidth), 0.0, static_cast<double>(dstBins - 1));
    const double density = counts[bin] / binWidth;
    norm += normOf(begin - (dstOfBegin + 0.5) * dstWidth, half, density);
    norm += (dstOfEnd - dstOfBegin - 1) * normOf(-half, half, density);
    norm += normOf(-half, end - (dstOfEnd * dstWidth + half), density);
  }
  return norm;
}

// torch's _non_linear_param_search: shrink the cumulative-quantile window [alpha, beta] by 1e-5
// on the side that drops more bins, until the l2 error stops decreasing.
std::pair<double, double> HistogramObserver::clipRange() const {
  QPIPE_CHECK(!empty(), "histogram observer: qparams requested before any batch");
  const at::Tensor cumulative = state_.histogram.cumsum(0).contiguous();
  const double* cSum = cumulative.data_ptr<double>();
  const double total = cSum[kBins - 1];
  constexpr double kStep = 1e-5;
  double alpha = 0;
  double beta = 1;
  int64_t startBin = 0;
  int64_t endBin = kBins - 1;
  double normMin = std::numeric_limits<double>::infinity();
  while (alpha < beta) {
    const double nextAlpha = alpha + kStep;
    const double nextBeta = beta - kStep;
    // torch compares its fp32 cumulative histogram with the bound rounded to fp32; the rounding
    // decides whether a single outlier count is cut, so it is kept for parity.
    const float lowerBound = static_cast<float>(nextAlpha * total);
    const float upperBound = static_cast<float>(nextBeta * total);
    int64_t l = startBin;
    while (l < endBin && static_cast<float>(cSum[l]) < lowerBound) ++l;
    int64_t r = endBin;
    while (r > startBin && static_cast<float>(cSum[r]) > upperBound) --r;
    int64_t nextStart = startBin;
    int64_t nextEnd = endBin;
    if (l - startBin > endBin - r) {
      nextStart = l;
      alpha = nextAlpha;
    } else {
      nextEnd = r;
      beta = nextBeta;
    }
    if (nextStart == startBin && nextEnd == endBin) continue;
    const double norm = quantizationError(nextStart, nextEnd);
    if (norm > normMin) break;
    normMin = norm;
    startBin = nextStart;
    endBin = nextEnd;
  }
  const double binWidth = (state_.max - state_.min) / kBins;
  // Bin edges can overshoot the data by rounding; the window never extends past the data.
  return {std::max(state_.min + binWidth * static_cast<double>(startBin), state_.min),
          std::min(state_.min + binWidth * static_cast<double>(endBin + 1), state_.max)};
}

QParams HistogramObserver::qparams() const {
  const auto [min, max] = clipRange();
  return computeQParams(at::full({1}, min, at::kFloat), at::full({1}, max, at::kFloat), scheme_);
}

}  // namespace qpipe::quant
