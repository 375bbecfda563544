// Calibration observers. References: msmodelslim core/observer/minmax.py and histogram.py
// (reference/msmodelslim.md §c.1); the histogram search ports the l2 search of
// torch.ao.quantization.HistogramObserver, which msmodelslim's observer derives from.
#include "qpipe/observer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/log.h"

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

constexpr int64_t kBins = HistogramObserver::kBins;

// The bin of each value of `values` (float64) in a kBins histogram over [min, max]; a zero-width
// range (a constant batch) puts everything in bin 0.
at::Tensor binOf(const at::Tensor& values, double min, double max) {
  if (!(max > min)) return at::zeros_like(values, values.options().dtype(at::kLong));
  return ((values - min) * (kBins / (max - min))).floor().clamp(0, kBins - 1).to(at::kLong);
}

at::Tensor binExtreme(const at::Tensor& index, const at::Tensor& values, bool lowest) {
  const double empty = lowest ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  return at::full({kBins}, empty, values.options()).scatter_reduce_(0, index, values, lowest ? "amin" : "amax");
}

// `state` moved onto the bins of [min, max] ⊇ its range. Counts: each bin splits into
// kUpsampleRate equal parts, each landing in the bin holding its midpoint (msmodelslim
// _upscale_histogram, after torch's HistogramObserver). Per-bin extremes are real values, so they
// move exactly to the bin that holds them.
HistogramObserver::State rebin(const HistogramObserver::State& state, double min, double max) {
  if (state.min == min && state.max == max) return state;
  constexpr int64_t kRate = HistogramObserver::kUpsampleRate;
  const auto options = state.histogram.options();
  const double width = (state.max - state.min) / kBins;
  const at::Tensor midpoints = state.min + (at::arange(kBins * kRate, options) + 0.5) * (width / kRate);
  HistogramObserver::State out{
      at::zeros({kBins}, options)
          .index_add_(0, binOf(midpoints, min, max), state.histogram.repeat_interleave(kRate) / kRate),
      {},
      {},
      min,
      max};
  // Empty bins hold ±inf, which the reductions ignore; any in-range index will do for them.
  const auto move = [&](const at::Tensor& extremes, bool lowest) {
    const at::Tensor where = at::where(at::isfinite(extremes), extremes, at::full_like(extremes, min));
    return binExtreme(binOf(where, min, max), extremes, lowest);
  };
  out.binMin = move(state.binMin, true);
  out.binMax = move(state.binMax, false);
  return out;
}

}  // namespace

HistogramObserver::Search HistogramObserver::parseSearch(std::string_view name, std::string_view where) {
  if (name == "l2_norm") return Search::kL2Norm;
  if (name == "kl_divergence") return Search::kKlDivergence;
  QPIPE_REQUIRE(false, ErrorCode::kConfig, where, ": unknown search_method '", name,
                "'; expected one of l2_norm, kl_divergence");
  return Search::kL2Norm;
}

HistogramObserver::HistogramObserver(QScheme scheme, Search search) : scheme_(scheme), search_(search) {
  QPIPE_REQUIRE(scheme.dtype == QDtype::kInt8 && scheme.scope == QScope::kPerTensor, ErrorCode::kConfig,
                "histogram observer supports int8 per_tensor only, got ", scheme.name());
}

void HistogramObserver::update(const at::Tensor& x) {
  // Binned where the batch lives; only the kBins-sized results come to the host.
  at::Tensor values = x.detach().to(at::kDouble).flatten();
  // msmodelslim drops NaN and inf with a warning: they have no place in a histogram.
  const at::Tensor finite = at::isfinite(values);
  if (!finite.all().item<bool>()) {
    log::logger()->warn("histogram observer: ignoring ", values.numel() - finite.sum().item<int64_t>(),
                        " NaN or infinite values");
    values = values.masked_select(finite);
  }
  if (values.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(values);
  // The range is kept in fp32 values, as the statistics of the rest of the quantization core.
  const double min = static_cast<float>(lo.item<double>());
  const double max = static_cast<float>(hi.item<double>());
  const at::Tensor index = binOf(values, min, max);
  merge({at::bincount(index, {}, kBins).to(at::kDouble).cpu(), binExtreme(index, values, true).cpu(),
         binExtreme(index, values, false).cpu(), min, max});
}

void HistogramObserver::merge(const State& other) {
  if (!other.histogram.defined()) return;
  if (empty()) {
    state_ = other;
    return;
  }
  const double min = std::min(state_.min, other.min);
  const double max = std::max(state_.max, other.max);
  const State a = rebin(state_, min, max);
  const State b = rebin(other, min, max);
  state_ = {a.histogram + b.histogram, at::minimum(a.binMin, b.binMin), at::maximum(a.binMax, b.binMax), min, max};
}

// torch's _compute_quantization_error (msmodelslim _compute_l2_error): the l2 error of mapping
// bins [startBin, endBin] onto 256 uniform destination bins (torch's default quint8, which
// msmodelslim keeps), integrating x² over each source bin's uniform density.
double HistogramObserver::l2Error(int64_t startBin, int64_t endBin) const {
  constexpr int64_t kDstBins = 256;
  const double binWidth = (state_.max - state_.min) / kBins;
  const double dstWidth = binWidth * static_cast<double>(endBin - startBin + 1) / kDstBins;
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
    const double dstOfBegin = std::clamp(std::floor(begin / dstWidth), 0.0, static_cast<double>(kDstBins - 1));
    const double dstOfEnd = std::clamp(std::floor(end / dstWidth), 0.0, static_cast<double>(kDstBins - 1));
    const double density = counts[bin] / binWidth;
    norm += normOf(begin - (dstOfBegin + 0.5) * dstWidth, half, density);
    norm += (dstOfEnd - dstOfBegin - 1) * normOf(-half, half, density);
    norm += normOf(-half, end - (dstOfEnd * dstWidth + half), density);
  }
  return norm;
}

// msmodelslim _compute_kl_error: KL(p || q) where p is the histogram and q spreads the mass that
// fake quantization with the window's own qparams sends to each bin evenly over the source bins
// that land there. Bin midpoints stand for their bin's values; bins outside the window go to the
// window's ends. With exact arithmetic q equals p on evenly filled data and the search cannot tell
// windows apart, so msmodelslim's precisions are kept: p in fp32, summed per bin after rounding to
// fp16 (its bincount weights), q and the divergence in fp32.
double HistogramObserver::klError(int64_t startBin, int64_t endBin) const {
  const double eps = std::numeric_limits<float>::epsilon();  // of msmodelslim's fp32 histogram
  const double binWidth = (state_.max - state_.min) / kBins;
  const auto options = state_.histogram.options();
  const at::Tensor p = (state_.histogram / state_.histogram.sum()).to(at::kFloat);
  const at::Tensor midpoints = (at::arange(kBins, options) + 0.5) * binWidth + state_.min;
  const double lo = static_cast<double>(startBin) * binWidth + state_.min;
  const double hi = static_cast<double>(endBin + 1) * binWidth + state_.min;
  const QParams params = computeQParams(at::full({1}, lo, at::kFloat), at::full({1}, hi, at::kFloat), scheme_);
  at::Tensor fake = fakeQuantize(midpoints.to(at::kFloat), params, scheme_).to(at::kDouble);
  fake.slice(0, 0, startBin).fill_(lo);
  fake.slice(0, endBin).fill_(hi);
  const at::Tensor target =
      ((fake - lo) / binWidth).floor().add(static_cast<double>(startBin)).clamp(startBin, endBin).to(at::kLong);
  const at::Tensor mass = at::zeros({kBins}, options).index_add_(0, target, p.to(at::kHalf).to(at::kDouble));
  const at::Tensor sources = at::bincount(target, {}, kBins).to(at::kDouble);
  const at::Tensor q = (mass / sources.clamp_min(eps)).index_select(0, target).to(at::kFloat);
  return (p * at::log(p.clamp_min(eps) / q.clamp_min(eps))).sum().item<double>();
}

double HistogramObserver::quantizationError(int64_t startBin, int64_t endBin) const {
  return search_ == Search::kL2Norm ? l2Error(startBin, endBin) : klError(startBin, endBin);
}

// torch's _non_linear_param_search with msmodelslim's start (the error of the full range, so a
// window is only taken when it beats no clipping): shrink the cumulative-quantile window
// [alpha, beta] by 1e-5 on the side that drops more bins, until the l2 error stops decreasing.
// msmodelslim's copy swaps the two moves (the window jumps to [right, end]), which in practice
// stops at once with the full range; the torch rule is what its comments describe.
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
  double normMin = quantizationError(startBin, endBin);
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
  // msmodelslim then tightens the window to the real data inside it; the per-bin extremes give
  // that over everything observed.
  const double lo = state_.binMin.slice(0, startBin, endBin + 1).min().item<double>();
  const double hi = state_.binMax.slice(0, startBin, endBin + 1).max().item<double>();
  const double binWidth = (state_.max - state_.min) / kBins;
  if (lo > hi) {
    return {state_.min + binWidth * static_cast<double>(startBin),
            state_.min + binWidth * static_cast<double>(endBin + 1)};
  }
  return {lo, hi};
}

QParams HistogramObserver::qparams() const {
  const auto [min, max] = clipRange();
  return computeQParams(at::full({1}, min, at::kFloat), at::full({1}, max, at::kFloat), scheme_);
}

}  // namespace qpipe::quant
