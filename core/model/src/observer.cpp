// Calibration observers. References: msmodelslim core/observer/minmax.py and histogram.py
// (docs/quantization.md); the histogram search ports the l2 search of
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

namespace {

// NVFP4 activations have one static parameter, the global scale, from the tensor's range.
QScheme observedScheme(const QScheme& scheme) {
  if (scheme.dtype != QDtype::kNvfp4) return scheme;
  return {.dtype = QDtype::kNvfp4, .scope = QScope::kPerTensor};
}

}  // namespace

void MinMaxObserver::update(const at::Tensor& x) {
  const auto [min, max] = quant::minMax(x, observedScheme(scheme_));
  State batch;
  if (aggregation_ == Aggregation::kMax) {
    batch.min = min;
    batch.max = max;
  } else {
    batch.batchMin.push_back(min);
    batch.batchMax.push_back(max);
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
    QPIPE_CHECK(other.batchMin.size() == static_cast<size_t>(other.batches) &&
                    other.batchMax.size() == other.batchMin.size() &&
                    other.batchMin.front().sizes() == state_.batchMin.front().sizes(),
                "minmax observer: merging ", other.batchMin.size(), " batches of shape ",
                other.batchMin.empty() ? at::IntArrayRef{} : other.batchMin.front().sizes(), " into shape ",
                state_.batchMin.front().sizes());
    state_.batchMin.insert(state_.batchMin.end(), other.batchMin.begin(), other.batchMin.end());
    state_.batchMax.insert(state_.batchMax.end(), other.batchMax.begin(), other.batchMax.end());
  }
  state_.batches += other.batches;
}

void MinMaxObserver::reset() {
  state_ = {};
}

namespace {

// The elementwise mean of `values` (fp32, one shape), independent of their order: per element the
// values are sorted and summed in float64 in that order (msmodelslim averages in float64; the sort
// makes the rounding of the sum a function of the multiset, so any split over ranks and any
// sample order give the same bits). Ties in the sort are equal values, or -0 and +0, whose order
// does not change a sum.
at::Tensor orderFreeMean(const std::vector<at::Tensor>& values) {
  std::vector<at::Tensor> rows;
  rows.reserve(values.size());
  for (const at::Tensor& v : values) rows.push_back(v.detach().to(at::kCPU, at::kDouble).reshape({-1}));
  const at::Tensor sorted = std::get<0>(at::stack(rows).sort(0)).contiguous();
  const int64_t count = sorted.size(0);
  const int64_t elements = sorted.size(1);
  const double* data = sorted.const_data_ptr<double>();
  at::Tensor mean = at::empty({elements}, at::kDouble);
  double* out = mean.mutable_data_ptr<double>();
  for (int64_t e = 0; e < elements; ++e) {
    double sum = data[e];
    for (int64_t i = 1; i < count; ++i) sum += data[i * elements + e];
    out[e] = sum / static_cast<double>(count);
  }
  return mean.to(at::kFloat).reshape(values.front().sizes()).to(values.front().device());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> MinMaxObserver::minMax() const {
  QPIPE_CHECK(!empty(), "minmax observer: qparams requested before any batch");
  if (aggregation_ == Aggregation::kMax) return {state_.min, state_.max};
  return {orderFreeMean(state_.batchMin), orderFreeMean(state_.batchMax)};
}

QParams MinMaxObserver::qparams() const {
  const auto [min, max] = minMax();
  if (scheme_.dtype == QDtype::kNvfp4) return {.globalScale = nvfp4GlobalScale(at::maximum(min.abs(), max.abs()))};
  return computeQParams(min, max, scheme_);
}

namespace {

constexpr int64_t kBins = HistogramObserver::kBins;
constexpr int64_t kHalf = kBins / 2;

at::Tensor binExtreme(const at::Tensor& index, const at::Tensor& values, bool lowest) {
  const double empty = lowest ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  return at::full({kBins}, empty, values.options()).scatter_reduce_(0, index, values, lowest ? "amin" : "amax");
}

}  // namespace

HistogramObserver::State HistogramObserver::rebin(const State& state, int exponent) {
  QPIPE_CHECK(exponent >= state.exponent, "histogram observer: rebinning 2^", state.exponent, " onto 2^", exponent);
  if (exponent == state.exponent) return state;
  // Past 11 doublings every bin has reached 1023 or 1024; the cap keeps the divisor in range.
  const int64_t shift = std::min(exponent - state.exponent, 16);
  const auto options = state.histogram.options();
  const at::Tensor index =
      at::div(at::arange(kBins, options.dtype(at::kLong)) - kHalf, int64_t{1} << shift, "floor") + kHalf;
  const double inf = std::numeric_limits<double>::infinity();
  return {at::zeros({kBins}, options).index_add_(0, index, state.histogram),
          at::full({kBins}, inf, options).scatter_reduce_(0, index, state.binMin, "amin"),
          at::full({kBins}, -inf, options).scatter_reduce_(0, index, state.binMax, "amax"), exponent};
}

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
  // Binned where the batch lives; only the kBins-sized results come to the host. Values are
  // fp32, as the statistics of the rest of the quantization core, held in float64 so that the
  // power-of-two scaling below is exact.
  at::Tensor values = x.detach().to(at::kFloat).to(at::kDouble).flatten();
  // msmodelslim drops NaN and inf with a warning: they have no place in a histogram.
  const at::Tensor finite = at::isfinite(values);
  if (!finite.all().item<bool>()) {
    log::logger()->warn("histogram observer: ignoring ", values.numel() - finite.sum().item<int64_t>(),
                        " NaN or infinite values");
    values = values.masked_select(finite);
  }
  if (values.numel() == 0) return;
  const double absmax = values.abs().max().item<double>();
  int exponent = kZeroExponent;
  if (absmax > 0) {
    std::frexp(absmax, &exponent);  // absmax = m·2^e, m in [0.5, 1): the least e with absmax < 2^e
    exponent = std::max(exponent, kZeroExponent);
  }
  // |v|·2^(10-k) < 1024: the floor lies in [-1024, 1023], no clamp needed.
  const at::Tensor index = (values * std::ldexp(1.0, 10 - exponent)).floor_().to(at::kLong) + kHalf;
  merge({at::bincount(index, {}, kBins).to(at::kDouble).cpu(), binExtreme(index, values, true).cpu(),
         binExtreme(index, values, false).cpu(), exponent});
}

void HistogramObserver::merge(const State& other) {
  if (!other.histogram.defined()) return;
  if (empty()) {
    state_ = other;
    return;
  }
  const int exponent = std::max(state_.exponent, other.exponent);
  const State a = rebin(state_, exponent);
  const State b = rebin(other, exponent);
  state_ = {a.histogram + b.histogram, at::minimum(a.binMin, b.binMin), at::maximum(a.binMax, b.binMax), exponent};
}

double HistogramObserver::binWidth() const {
  return std::ldexp(1.0, state_.exponent - 10);
}

double HistogramObserver::lowerEdge() const {
  return -std::ldexp(1.0, state_.exponent);
}

// torch's _compute_quantization_error (msmodelslim _compute_l2_error): the l2 error of mapping
// bins [startBin, endBin] onto 256 uniform destination bins (torch's default quint8, which
// msmodelslim keeps), integrating x² over each source bin's uniform density.
double HistogramObserver::l2Error(int64_t startBin, int64_t endBin) const {
  constexpr int64_t kDstBins = 256;
  const double binWidth = this->binWidth();
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
  const double binWidth = this->binWidth();
  const double lowerEdge = this->lowerEdge();
  const auto options = state_.histogram.options();
  const at::Tensor p = (state_.histogram / state_.histogram.sum()).to(at::kFloat);
  const at::Tensor midpoints = (at::arange(kBins, options) + 0.5) * binWidth + lowerEdge;
  const double lo = static_cast<double>(startBin) * binWidth + lowerEdge;
  const double hi = static_cast<double>(endBin + 1) * binWidth + lowerEdge;
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
// stops at once with the full range; the torch rule is what its comments describe. The full range
// is the occupied bins (torch's histogram spans [min, max]; this one a power-of-two range that
// the data may fill only in part).
std::pair<double, double> HistogramObserver::clipRange() const {
  QPIPE_CHECK(!empty(), "histogram observer: qparams requested before any batch");
  const at::Tensor cumulative = state_.histogram.cumsum(0).contiguous();
  const double* cSum = cumulative.data_ptr<double>();
  const double total = cSum[kBins - 1];
  constexpr double kStep = 1e-5;
  double alpha = 0;
  double beta = 1;
  const at::Tensor occupied = state_.histogram.nonzero();
  QPIPE_CHECK(occupied.numel() > 0, "histogram observer: no counts");
  int64_t startBin = occupied.min().item<int64_t>();
  int64_t endBin = occupied.max().item<int64_t>();
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
  if (lo > hi) {
    return {lowerEdge() + binWidth() * static_cast<double>(startBin),
            lowerEdge() + binWidth() * static_cast<double>(endBin + 1)};
  }
  return {lo, hi};
}

QParams HistogramObserver::qparams() const {
  const auto [min, max] = clipRange();
  return computeQParams(at::full({1}, min, at::kFloat), at::full({1}, max, at::kFloat), scheme_);
}

RecallWindowObserver::RecallWindowObserver(double ratio) : ratio_(ratio) {
  QPIPE_REQUIRE(ratio > 0 && ratio <= 1, ErrorCode::kConfig, "recall window observer: ratio ", ratio,
                " is not in (0, 1]");
}

std::pair<at::Tensor, at::Tensor> RecallWindowObserver::window(const at::Tensor& x) const {
  QPIPE_REQUIRE(x.dim() == 4, ErrorCode::kConfig,
                "recall window observer: per head needs [batch, heads, seq, head_dim], got shape ", x.sizes());
  const int64_t heads = x.size(1);
  const at::Tensor values = x.transpose(0, 1).reshape({heads, -1}).to(at::kFloat);
  const int64_t n = values.size(1);
  QPIPE_REQUIRE(n > 0, ErrorCode::kConfig, "recall window observer: an empty batch");
  const int64_t t = std::max<int64_t>(1, static_cast<int64_t>(ratio_ * static_cast<double>(n)));
  // Only the k = N − T + 1 smallest and largest values can bound a window: window i runs from the
  // i-th smallest to the (k − 1 − i)-th largest.
  const int64_t k = n - t + 1;
  const at::Tensor low = std::get<0>(at::topk(values, k, 1, /*largest=*/false, /*sorted=*/true));
  const at::Tensor high = std::get<0>(at::topk(values, k, 1, /*largest=*/true, /*sorted=*/true)).flip(1);
  const at::Tensor best = (high - low).argmin(1, /*keepdim=*/true);
  const auto shaped = [heads](const at::Tensor& t) { return t.reshape({1, heads, 1, 1}); };
  return {shaped(low.gather(1, best)), shaped(high.gather(1, best))};
}

void RecallWindowObserver::update(const at::Tensor& x) {
  const auto [start, end] = window(x);
  merge({start, end});
}

void RecallWindowObserver::merge(const State& other) {
  if (!other.min.defined()) return;
  if (empty()) {
    state_ = other;
    return;
  }
  QPIPE_CHECK(other.min.sizes() == state_.min.sizes(), "recall window observer: merging shape ", other.min.sizes(),
              " into ", state_.min.sizes());
  state_.min = at::minimum(state_.min, other.min);
  state_.max = at::maximum(state_.max, other.max);
}

}  // namespace qpipe::quant
