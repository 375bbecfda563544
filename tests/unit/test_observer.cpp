// Observers: hand-computed statistics; states independent of the order of the batches and of how
// they are split (round-robin over 2 and 3 "ranks", merged as dist::syncObserver merges),
// compared bit for bit with one observer over everything.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "qpipe/observer.h"
#include "test_helpers.h"

namespace qpipe::quant {
namespace {

at::Tensor floats(std::vector<float> values, at::IntArrayRef shape) {
  return at::tensor(values, at::kFloat).reshape(shape);
}

std::vector<float> valuesOf(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

const QScheme kInt8Tensor{QDtype::kInt8, QScope::kPerTensor, true, 0};
const QScheme kInt8TensorAsym{QDtype::kInt8, QScope::kPerTensor, false, 0};
const QScheme kInt8Channel{QDtype::kInt8, QScope::kPerChannel, true, 0};

TEST(MinMaxObserver, MaxAggregationKeepsRunningExtremes) {
  MinMaxObserver observer(kInt8Tensor);
  EXPECT_TRUE(observer.empty());
  observer.update(floats({1, -2, 3}, {3}));
  observer.update(floats({254, -1}, {2}));
  observer.update(floats({0, -4}, {2}));
  // min(-2, -1, -4) = -4, max(3, 254, 0) = 254; scale 254/127 = 2.
  const auto [min, max] = observer.minMax();
  EXPECT_EQ(valuesOf(min), std::vector<float>{-4});
  EXPECT_EQ(valuesOf(max), std::vector<float>{254});
  EXPECT_EQ(observer.qparams().scale.item<float>(), 2.0f);
  EXPECT_EQ(observer.state().batches, 3);
  observer.reset();
  EXPECT_TRUE(observer.empty());
  observer.update(floats({-127}, {1}));
  EXPECT_EQ(observer.qparams().scale.item<float>(), 1.0f);
}

TEST(MinMaxObserver, MeanAggregationAveragesBatchExtremesPerChannel) {
  MinMaxObserver observer(kInt8Channel, Aggregation::kMean);
  // Batch 1 rows: [1, -2] → (-2, 1); [4, 0] → (0, 4). Batch 2: [3, 0] → (0, 3); [-4, 8] → (-4, 8).
  observer.update(floats({1, -2, 4, 0}, {2, 2}));
  observer.update(floats({3, 0, -4, 8}, {2, 2}));
  // Means: min (-2+0)/2 = -1, (0-4)/2 = -2; max (1+3)/2 = 2, (4+8)/2 = 6.
  const auto [min, max] = observer.minMax();
  EXPECT_EQ(min.sizes(), at::IntArrayRef({2, 1}));
  EXPECT_EQ(valuesOf(min), (std::vector<float>{-1, -2}));
  EXPECT_EQ(valuesOf(max), (std::vector<float>{2, 6}));
  EXPECT_EQ(observer.state().batchMin.size(), 2u);
  // Asymmetric per tensor on the same idea: mean min -127.5, mean max 382.5 → scale 2, zp -64.
  MinMaxObserver asym(kInt8TensorAsym, Aggregation::kMean);
  asym.update(floats({-200, 400}, {2}));
  asym.update(floats({-55, 365}, {2}));
  const QParams p = asym.qparams();
  EXPECT_EQ(p.scale.item<float>(), 2.0f);
  EXPECT_EQ(p.zeroPoint.item<int32_t>(), -64);
}

TEST(MinMaxObserver, PerGroupStateShape) {
  MinMaxObserver observer({QDtype::kInt4, QScope::kPerGroup, true, 2});
  // Groups {7, -1}, {0, 14} → absmax 7, 14 → scales 1, 2.
  observer.update(floats({7, -1, 0, 14}, {1, 4}));
  EXPECT_EQ(valuesOf(observer.qparams().scale), (std::vector<float>{1, 2}));
}

TEST(MinMaxObserver, RejectsPerTokenAndUnknownAggregation) {
  EXPECT_EQ(test::errorOf(
                [] {
                  MinMaxObserver({QDtype::kInt8, QScope::kPerToken, true, 0});
                },
                ErrorCode::kConfig),
            "minmax observer: int8_per_token_sym is dynamic (scales computed per batch), there is nothing to observe");
  EXPECT_EQ(
      test::errorOf([] { parseAggregation("median", "p.yaml:9:27 qconfig.act.ext.aggregation_type"); },
                    ErrorCode::kConfig),
      "p.yaml:9:27 qconfig.act.ext.aggregation_type: unknown aggregation_type 'median'; expected one of max, mean");
  EXPECT_EQ(parseAggregation("mean", "x"), Aggregation::kMean);
}

// Batches of different sizes and ranges (scales over several powers of two), so that order and
// split matter to anything that is not exact.
std::vector<at::Tensor> calibrationBatches(int64_t count, int64_t width) {
  at::manual_seed(7);
  std::vector<at::Tensor> batches;
  for (int64_t i = 0; i < count; ++i) {
    const double scale = std::pow(1.7, static_cast<double>(i % 9)) / 3;
    batches.push_back(at::randn({2 + i % 3, width}) * scale + 0.01 * static_cast<double>(i));
  }
  return batches;
}

std::vector<at::Tensor> shuffled(std::vector<at::Tensor> batches) {
  const at::Tensor order = at::randperm(static_cast<int64_t>(batches.size()), at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < order.numel(); ++i) out.push_back(batches[order[i].item<int64_t>()]);
  return out;
}

// Deals the batches round-robin to `ranks` observers (batch i to rank i mod ranks, as the runner
// deals samples) and merges their states in rank order, as dist::syncObserver does after
// gathering them.
template <typename Observer, typename... Args>
Observer dealtAndMerged(const std::vector<at::Tensor>& batches, int ranks, Args... args) {
  std::vector<Observer> parts(ranks, Observer(args...));
  for (size_t i = 0; i < batches.size(); ++i) parts[i % ranks].update(batches[i]);
  Observer merged(args...);
  for (const Observer& part : parts) merged.merge(part.state());
  return merged;
}

void expectSameQParams(const QParams& a, const QParams& b) {
  EXPECT_TRUE(at::equal(a.scale, b.scale)) << a.scale << b.scale;
  EXPECT_TRUE(at::equal(a.zeroPoint, b.zeroPoint)) << a.zeroPoint << b.zeroPoint;
}

TEST(MinMaxObserver, OrderAndSplitDoNotChangeTheBits) {
  const std::vector<at::Tensor> batches = calibrationBatches(23, 16);
  for (const Aggregation aggregation : {Aggregation::kMax, Aggregation::kMean}) {
    for (const QScheme& scheme : {kInt8TensorAsym, kInt8Channel}) {
      const auto observe = [&](const std::vector<at::Tensor>& data) {
        MinMaxObserver observer(scheme, aggregation);
        for (const at::Tensor& b : data) observer.update(scheme.scope == QScope::kPerChannel ? b.t() : b);
        return observer;
      };
      const MinMaxObserver single = observe(batches);
      const auto [min, max] = single.minMax();
      for (int trial = 0; trial < 3; ++trial) {
        const MinMaxObserver other = observe(shuffled(batches));
        EXPECT_TRUE(at::equal(other.minMax().first, min));
        EXPECT_TRUE(at::equal(other.minMax().second, max));
        expectSameQParams(other.qparams(), single.qparams());
      }
      std::vector<at::Tensor> transposed;
      for (const at::Tensor& b : batches) transposed.push_back(scheme.scope == QScope::kPerChannel ? b.t() : b);
      for (const int ranks : {2, 3}) {
        const auto merged = dealtAndMerged<MinMaxObserver>(transposed, ranks, scheme, aggregation);
        EXPECT_EQ(merged.state().batches, 23);
        EXPECT_TRUE(at::equal(merged.minMax().first, min)) << ranks;
        EXPECT_TRUE(at::equal(merged.minMax().second, max)) << ranks;
        expectSameQParams(merged.qparams(), single.qparams());
      }
    }
  }
}

TEST(MinMaxObserver, MeanSumsSortedValuesInFloat64) {
  // Batch minima 2^60, 1 and -2^60 (fp32 values): summed in arrival order in float64, the order
  // 2^60, -2^60, 1 gives 1 and the order 2^60, 1, -2^60 gives 0 (2^60 + 1 rounds to 2^60). The
  // observer sums them sorted, -2^60 + 1 + 2^60 = 0, whatever the order: a mean of 0 every time.
  const float big = std::ldexp(1.0f, 60);
  std::vector<float> values{big, 1, -big};
  std::sort(values.begin(), values.end());
  do {
    MinMaxObserver observer(kInt8Tensor, Aggregation::kMean);
    for (const float v : values) observer.update(floats({v}, {1}));
    EXPECT_EQ(observer.minMax().first.item<float>(), 0.0f) << values[0] << " " << values[1] << " " << values[2];
  } while (std::next_permutation(values.begin(), values.end()));
}

TEST(HistogramObserver, RejectsUnsupportedSchemes) {
  EXPECT_EQ(test::errorOf(
                [] {
                  HistogramObserver({QDtype::kFp8E4m3, QScope::kPerTensor, true, 0});
                },
                ErrorCode::kConfig),
            "histogram observer supports int8 per_tensor only, got fp8_e4m3_per_tensor_sym");
}

// The expected windows come from tests/oracle/histogram_quant_pins.py: the power-of-two histogram
// built in numpy, torch 2.11's HistogramObserver._compute_quantization_error for the l2 error,
// driven by msmodelslim's search (started from the error of the occupied range) and tightening
// (the data's own min/max inside the window).
TEST(HistogramObserver, KeepsTheFullRangeOfEvenlyFilledData) {
  // 20,480 points evenly over [-4, 4): k = 2, ten values in each of the 2048 bins of width 1/256;
  // every clip adds more error than it saves, so the window is the data's own range.
  HistogramObserver observer(kInt8Tensor);
  observer.update((at::arange(20480, at::kFloat) + 0.5) / 20480 * 8 - 4);
  EXPECT_EQ(observer.state().exponent, 2);
  EXPECT_TRUE(at::equal(observer.state().histogram, at::full({2048}, 10.0, at::kDouble)));
  const auto [lo, hi] = observer.clipRange();
  EXPECT_EQ(lo, -3.999804735183716);
  EXPECT_EQ(hi, 3.9998044967651367);
  EXPECT_EQ(observer.qparams().scale.item<float>(), 3.9998044967651367f / 127.0f);
}

TEST(HistogramObserver, DropsALoneValueInTheLastBin) {
  // linspace(-3, 5): k = 3, bins of width 1/128; -3 opens bin 640 and 5 is alone in bin 1664
  // ([5, 5 + 1/128)), about 20 values in each bin between. Cutting that bin costs one value and
  // shortens the range: the window ends at bin 1663, whose largest value is 4.999609...
  HistogramObserver observer(kInt8Tensor);
  observer.update(at::linspace(-3, 5, 20480));
  EXPECT_EQ(observer.state().exponent, 3);
  EXPECT_EQ(observer.state().histogram[1664].item<double>(), 1.0);
  const auto [lo, hi] = observer.clipRange();
  EXPECT_EQ(lo, -3.0);
  EXPECT_EQ(hi, 4.999609470367432);
}

TEST(HistogramObserver, TightensPastASingleOutlier) {
  // k = 10: bins of width 1, [-1, 1] fills bins 1023..1025 and 1000 lies in bin 2024. The search
  // drops only that bin (in fp32, 0.99999 · 100001 rounds to 100000, so the cumulative-quantile
  // bound cannot pass the outlier's count): window [1023, 2023], whose data spans [-1, 1].
  // Asymmetric int8: scale 1/255 + 1/255, where fp32 1/255 = 0.0039215689 lies above the real
  // 1/255, so 1/scale = 127.4999… and zp = round(127.4999…) - 128 = -1.
  HistogramObserver observer(kInt8TensorAsym);
  observer.update(at::cat({at::linspace(-1, 1, 100000), floats({1000}, {1})}));
  const auto [lo, hi] = observer.clipRange();
  EXPECT_EQ(lo, -1.0);
  EXPECT_EQ(hi, 1.0);
  const QParams p = observer.qparams();
  EXPECT_EQ(p.scale.item<float>(), 1.0f / 255.0f + 1.0f / 255.0f);
  EXPECT_EQ(p.zeroPoint.item<int32_t>(), -1);
}

TEST(HistogramObserver, ClipsHeavyTails) {
  // Quantiles of a Cauchy-like distribution, 20,000 points in [-47.9, 47.9] (k = 6, occupied
  // bins 257..1790): the window ends 12 bins early, at bin 1778, and the largest value inside it
  // is 46.85566711425781; the lower tail is kept.
  const at::Tensor u = (at::arange(20000, at::kFloat) + 0.5) / 20000;
  HistogramObserver observer(kInt8TensorAsym);
  observer.update(at::tan((u - 0.5) * 3.1));
  const auto [lo, hi] = observer.clipRange();
  EXPECT_EQ(lo, -47.89984893798828);
  EXPECT_EQ(hi, 46.85566711425781);
}

TEST(HistogramObserver, KlDivergenceSearch) {
  // The KL error (msmodelslim's _compute_kl_error, replayed in the same script) keeps the whole
  // range of normal quantiles, where l2 cuts the upper tail at 2.5896…, and, like l2, drops the
  // lone value in the last bin of linspace(-3, 5).
  const at::Tensor u = (at::arange(20000, at::kFloat) + 0.5) / 20000;
  HistogramObserver normal(kInt8TensorAsym, HistogramObserver::Search::kKlDivergence);
  normal.update(at::erfinv(u * 2 - 1));
  EXPECT_EQ(normal.clipRange(), std::make_pair(-2.867733955383301, 2.8679311275482178));
  HistogramObserver l2(kInt8TensorAsym);
  l2.update(at::erfinv(u * 2 - 1));
  EXPECT_EQ(l2.clipRange(), std::make_pair(-2.867733955383301, 2.5896220207214355));
  HistogramObserver uniform(kInt8Tensor, HistogramObserver::Search::kKlDivergence);
  uniform.update(at::linspace(-3, 5, 20480));
  EXPECT_EQ(uniform.clipRange(), std::make_pair(-3.0, 4.999609470367432));
  EXPECT_EQ(test::errorOf([] { HistogramObserver::parseSearch("mse", "p.yaml:3:5 qconfig.act.ext.search_method"); },
                          ErrorCode::kConfig),
            "p.yaml:3:5 qconfig.act.ext.search_method: unknown search_method 'mse'; expected one of l2_norm, "
            "kl_divergence");
}

TEST(HistogramObserver, PowerOfTwoBinsByHand) {
  HistogramObserver growing(kInt8Tensor);
  // absmax 2 = 0.5·2^2: k = 2, bins of width 2^-8; v lands in floor(v·256) + 1024.
  growing.update(floats({0, 1, 1, 2}, {4}));
  EXPECT_EQ(growing.state().exponent, 2);
  EXPECT_EQ(growing.state().histogram[1280].item<double>(), 2.0);
  EXPECT_EQ(growing.state().histogram[1536].item<double>(), 1.0);
  // absmax 30: k = 5, width 2^-5, floor(v·32) + 1024: -10 → 704, 30 → 1984, and the old bins
  // move by floor((b - 1024)/8) + 1024: 1024 → 1024, 1280 → 1056, 1536 → 1088, exactly where
  // 0, 1 and 2 fall directly. Nothing is lost or smeared.
  growing.update(floats({-10, 30}, {2}));
  EXPECT_EQ(growing.state().exponent, 5);
  EXPECT_EQ(growing.binWidth(), 1.0 / 32);
  EXPECT_EQ(growing.lowerEdge(), -32.0);
  const at::Tensor nonzero = growing.state().histogram.nonzero().flatten();
  EXPECT_EQ(std::vector<int64_t>(nonzero.data_ptr<int64_t>(), nonzero.data_ptr<int64_t>() + nonzero.numel()),
            (std::vector<int64_t>{704, 1024, 1056, 1088, 1984}));
  EXPECT_EQ(growing.state().histogram[1056].item<double>(), 2.0);
  EXPECT_EQ(growing.state().binMin[1056].item<double>(), 1.0);
  EXPECT_EQ(growing.state().binMax[1088].item<double>(), 2.0);
  EXPECT_EQ(at::sum(growing.state().histogram).item<double>(), 6.0);
  HistogramObserver direct(kInt8Tensor);
  direct.update(floats({0, 1, 1, 2, -10, 30}, {6}));
  EXPECT_TRUE(at::equal(direct.state().histogram, growing.state().histogram));
  // Zeros only: k is below every non-zero value's, so merging takes the other's k.
  HistogramObserver zeros(kInt8Tensor);
  zeros.update(at::zeros({3}));
  EXPECT_EQ(zeros.state().exponent, HistogramObserver::kZeroExponent);
  EXPECT_EQ(zeros.state().histogram[1024].item<double>(), 3.0);
  zeros.merge(direct.state());
  EXPECT_EQ(zeros.state().exponent, 5);
  EXPECT_EQ(zeros.state().histogram[1024].item<double>(), 4.0);
}

TEST(HistogramObserver, OrderAndSplitDoNotChangeTheBits) {
  // Ranges over several powers of two, so that the range grows many times in any order.
  const std::vector<at::Tensor> batches = calibrationBatches(23, 64);
  HistogramObserver single(kInt8TensorAsym);
  for (const at::Tensor& b : batches) single.update(b);
  const auto expectSame = [&](const HistogramObserver& other, const std::string& what) {
    EXPECT_EQ(other.state().exponent, single.state().exponent) << what;
    EXPECT_TRUE(at::equal(other.state().histogram, single.state().histogram)) << what;
    EXPECT_TRUE(at::equal(other.state().binMin, single.state().binMin)) << what;
    EXPECT_TRUE(at::equal(other.state().binMax, single.state().binMax)) << what;
    EXPECT_EQ(other.clipRange(), single.clipRange()) << what;
    expectSameQParams(other.qparams(), single.qparams());
  };
  for (int trial = 0; trial < 3; ++trial) {
    HistogramObserver other(kInt8TensorAsym);
    for (const at::Tensor& b : shuffled(batches)) other.update(b);
    expectSame(other, "shuffled");
  }
  for (const int ranks : {2, 3}) {
    expectSame(dealtAndMerged<HistogramObserver>(batches, ranks, kInt8TensorAsym, HistogramObserver::Search::kL2Norm),
               "ranks " + std::to_string(ranks));
  }
  // One pass over everything at once: a function of the values, not of the batches.
  HistogramObserver whole(kInt8TensorAsym);
  std::vector<at::Tensor> flat;
  for (const at::Tensor& b : batches) flat.push_back(b.flatten());
  whole.update(at::cat(flat));
  expectSame(whole, "one batch");
  // Bins are counted in full: a state sums to the number of values.
  EXPECT_EQ(single.state().histogram.sum().item<double>(), static_cast<double>(at::cat(flat).numel()));
}

}  // namespace
}  // namespace qpipe::quant
