// Observers: hand-computed statistics, and merging split calibration data against one pass.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

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
  EXPECT_EQ(observer.state().sumMin.scalar_type(), at::kDouble);
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

// Splits 12 batches into `groups` consecutive groups, observes each, merges the states.
MinMaxObserver mergedOver(const std::vector<at::Tensor>& batches, int groups, Aggregation aggregation) {
  std::vector<MinMaxObserver> parts(groups, MinMaxObserver(kInt8Channel, aggregation));
  for (size_t i = 0; i < batches.size(); ++i) parts[i * groups / batches.size()].update(batches[i]);
  MinMaxObserver merged(kInt8Channel, aggregation);
  for (const MinMaxObserver& part : parts) merged.merge(part.state());
  return merged;
}

TEST(MinMaxObserver, MergingSplitsEqualsOnePass) {
  at::manual_seed(7);
  std::vector<at::Tensor> batches;
  for (int i = 0; i < 12; ++i) batches.push_back(at::randn({4, 16}) * (i + 1));
  for (const Aggregation aggregation : {Aggregation::kMax, Aggregation::kMean}) {
    MinMaxObserver single(kInt8Channel, aggregation);
    for (const at::Tensor& batch : batches) single.update(batch);
    for (const int groups : {2, 3}) {
      const MinMaxObserver merged = mergedOver(batches, groups, aggregation);
      EXPECT_EQ(merged.state().batches, 12);
      if (aggregation == Aggregation::kMax) {
        EXPECT_TRUE(at::equal(merged.state().min, single.state().min));
        EXPECT_TRUE(at::equal(merged.state().max, single.state().max));
        EXPECT_TRUE(at::equal(merged.qparams().scale, single.qparams().scale));
      } else {
        EXPECT_LE((merged.state().sumMin - single.state().sumMin).abs().max().item<double>(), 1e-12);
        EXPECT_LE((merged.state().sumMax - single.state().sumMax).abs().max().item<double>(), 1e-12);
      }
    }
  }
}

TEST(HistogramObserver, RejectsUnsupportedSchemes) {
  EXPECT_EQ(test::errorOf(
                [] {
                  HistogramObserver({QDtype::kFp8E4m3, QScope::kPerTensor, true, 0});
                },
                ErrorCode::kConfig),
            "histogram observer supports int8 per_tensor only, got fp8_e4m3_per_tensor_sym");
}

// The expected windows come from torch 2.11's HistogramObserver (histogram and l2 error) driven
// by msmodelslim's search (starting from the full-range error) and tightening (the data's own
// min/max inside the window), computed in Python and pinned here.
TEST(HistogramObserver, KeepsTheFullRangeOfUniformData) {
  // Evenly spread data: every clip adds more error than it saves.
  HistogramObserver observer(kInt8Tensor);
  observer.update(at::linspace(-3, 5, 20480));
  const auto [lo, hi] = observer.clipRange();
  EXPECT_EQ(lo, -3.0);
  EXPECT_EQ(hi, 5.0);
  // Symmetric int8 from the window: max(3, 5)/127.
  EXPECT_EQ(observer.qparams().scale.item<float>(), 5.0f / 127.0f);
}

TEST(HistogramObserver, TightensPastASingleOutlier) {
  // The search drops only the last bin (in fp32, 0.99999 · 100001 rounds to 100000, so the
  // cumulative-quantile bound cannot pass the outlier's count): window [-1, -1 + 1001·2047/2048]
  // = [-1, 999.51]; the data inside it spans [-1, 1]. Asymmetric int8: scale 1/255 + 1/255,
  // where fp32 1/255 = 0.0039215689 lies above the real 1/255, so 1/scale = 127.4999… and
  // zp = round(127.4999…) - 128 = -1.
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
  // Quantiles of a Cauchy-like distribution, 20,000 points in [-47.9, 47.9]: the window ends 23
  // bins early at 46.82, and the largest value inside it is 46.517730712890625.
  const at::Tensor u = (at::arange(20000, at::kFloat) + 0.5) / 20000;
  HistogramObserver observer(kInt8TensorAsym);
  observer.update(at::tan((u - 0.5) * 3.1));
  const auto [lo, hi] = observer.clipRange();
  EXPECT_EQ(lo, -47.89984893798828);
  EXPECT_EQ(hi, 46.517730712890625);
}

TEST(HistogramObserver, KlDivergenceSearch) {
  // Normal quantiles, 20,000 points in [-2.868, 2.865]: the KL search drops the last bin and the
  // largest value left is 2.6807315349578857 (pinned from msmodelslim's _compute_kl_error
  // replayed in Python). The full-range cases above keep their full range under KL too.
  const at::Tensor u = (at::arange(20000, at::kFloat) + 0.5) / 20000;
  HistogramObserver normal(kInt8TensorAsym, HistogramObserver::Search::kKlDivergence);
  normal.update(at::erfinv(u * 2 - 1));
  const auto [lo, hi] = normal.clipRange();
  EXPECT_EQ(lo, -2.867733955383301);
  EXPECT_EQ(hi, 2.6807315349578857);
  HistogramObserver uniform(kInt8Tensor, HistogramObserver::Search::kKlDivergence);
  uniform.update(at::linspace(-3, 5, 20480));
  EXPECT_EQ(uniform.clipRange(), std::make_pair(-3.0, 5.0));
  EXPECT_EQ(test::errorOf([] { HistogramObserver::parseSearch("mse", "p.yaml:3:5 qconfig.act.ext.search_method"); },
                          ErrorCode::kConfig),
            "p.yaml:3:5 qconfig.act.ext.search_method: unknown search_method 'mse'; expected one of l2_norm, "
            "kl_divergence");
}

TEST(HistogramObserver, RangeGrowthKeepsMassAndMergingSplitsEqualsOnePass) {
  at::manual_seed(11);
  // Every batch spans the same [-4, 4] (both ends pinned), so the histograms share their bins
  // and the merged state must equal one pass exactly.
  std::vector<at::Tensor> batches;
  for (int i = 0; i < 6; ++i) {
    at::Tensor b = (at::rand({1000}) * 8 - 4).clamp(-3.9, 3.9);
    b[0] = -4.0f;
    b[1] = 4.0f;
    batches.push_back(b);
  }
  HistogramObserver single(kInt8Tensor);
  for (const at::Tensor& b : batches) single.update(b);
  for (const int groups : {2, 3}) {
    std::vector<HistogramObserver> parts(groups, HistogramObserver(kInt8Tensor));
    for (size_t i = 0; i < batches.size(); ++i) parts[i * groups / batches.size()].update(batches[i]);
    HistogramObserver merged(kInt8Tensor);
    for (const HistogramObserver& part : parts) merged.merge(part.state());
    EXPECT_TRUE(at::equal(merged.state().histogram, single.state().histogram));
    EXPECT_TRUE(at::equal(merged.state().binMin, single.state().binMin));
    EXPECT_TRUE(at::equal(merged.state().binMax, single.state().binMax));
    EXPECT_EQ(merged.clipRange(), single.clipRange());
  }
  // A batch that widens the range rebins what was seen: no mass is lost.
  HistogramObserver growing(kInt8Tensor);
  growing.update(floats({0, 1, 1, 2}, {4}));
  growing.update(floats({-10, 30}, {2}));
  EXPECT_EQ(growing.state().min, -10.0);
  EXPECT_EQ(growing.state().max, 30.0);
  EXPECT_DOUBLE_EQ(at::sum(growing.state().histogram).item<double>(), 6.0);
  // The extremes moved exactly: 0, 1, 1, 2 land in bins floor((v + 10)·2048/40) = 512, 563, 614.
  EXPECT_EQ(growing.state().binMin[563].item<double>(), 1.0);
  EXPECT_EQ(growing.state().binMax[614].item<double>(), 2.0);
}

}  // namespace
}  // namespace qpipe::quant
