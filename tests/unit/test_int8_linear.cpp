// Int8Linear and int8Matmul (qpipe/quant_linear.h, qpipe/quant.h) against exact integer
// arithmetic, and against fake quantization in fp32 within its rounding.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>

#include "qpipe/quant.h"
#include "qpipe/quant_linear.h"

namespace qpipe {
namespace {

using quant::QDtype, quant::QScope, quant::QScheme, quant::QParams;

TEST(Int8Matmul, IsExactAtTheExtremesAndOnRandomValues) {
  at::manual_seed(5);
  at::Tensor a = at::randint(-128, 128, {33, 1029}, at::kChar);
  at::Tensor b = at::randint(-128, 128, {1029, 17}, at::kChar);
  a[0].fill_(127);
  a[1].fill_(-128);
  a[2].zero_();
  b.select(1, 0).fill_(127);
  b.select(1, 1).fill_(-128);
  const at::Tensor exact = at::matmul(a.to(at::kLong), b.to(at::kLong));
  EXPECT_TRUE(at::equal(quant::int8Matmul(a, b).to(at::kLong), exact));
  // The transposed view an Int8Linear passes.
  const at::Tensor w = at::randint(-128, 128, {17, 1029}, at::kChar);
  EXPECT_TRUE(at::equal(quant::int8Matmul(a, w.t()).to(at::kLong), at::matmul(a.to(at::kLong), w.t().to(at::kLong))));
}

// y = float(Σ (qx − zx)·qw) · (sx·sw) + b with the sum in int64: what Int8Linear promises, bit for bit.
at::Tensor exactReference(const at::Tensor& x, const ActivationQuant& act, const at::Tensor& qw, const at::Tensor& sw,
                          const at::Tensor& bias) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const QParams p = act.isDynamic() ? quant::computeQParams(flat, act.scheme) : act.params;
  const at::Tensor q = quant::quantize(flat, p, act.scheme).to(at::kLong);
  const at::Tensor sums = at::matmul(q - p.zeroPoint.to(at::kLong).reshape({-1, 1}), qw.to(at::kLong).t());
  at::Tensor y = sums.to(at::kFloat) * (p.scale.to(at::kFloat).reshape({-1, 1}) * sw.reshape({1, -1}));
  if (bias.defined()) y = y + bias;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = qw.size(0);
  return y.view(shape);
}

TEST(Int8Linear, IsTheExactIntegerSumTimesTheScalesBitForBit) {
  at::manual_seed(6);
  const at::Tensor w = at::randn({24, 40});
  const QScheme weightScheme{QDtype::kInt8, QScope::kPerChannel, true, 0};
  const QParams wp = quant::computeQParams(w, weightScheme);
  const at::Tensor qw = quant::quantize(w, wp, weightScheme);
  const at::Tensor sw = wp.scale.reshape({-1});
  at::Tensor x = at::randn({2, 5, 40}) * 2;
  x[0][3].zero_();  // an all-zero token: its per-token scale is the epsilon floor, its codes 0
  const QScheme dynamic{QDtype::kInt8, QScope::kPerToken, true, 0};
  const QScheme staticAsym{QDtype::kInt8, QScope::kPerTensor, false, 0};
  // Static parameters from a quarter of the range: values saturate at both ends.
  const ActivationQuant cases[] = {{dynamic, {}}, {staticAsym, quant::computeQParams(x * 0.25, staticAsym)}};
  const Int8Linear linear(qw, wp.scale);
  for (const ActivationQuant& act : cases) {
    for (const at::Tensor& bias : {at::Tensor(), at::randn({24})}) {
      ASSERT_TRUE(Int8Linear::supports(weightScheme, act));
      const std::optional<at::Tensor> y = linear.forward(x, act, bias);
      ASSERT_TRUE(y.has_value());
      EXPECT_TRUE(at::equal(*y, exactReference(x, act, qw, sw, bias))) << act.scheme.name();
      // Fake quantization computes the same real number through an fp32 GEMM.
      const at::Tensor fake =
          at::linear(act.apply(x), quant::dequantize(qw, wp, weightScheme), bias.defined() ? bias : at::Tensor());
      EXPECT_LT((*y - fake).abs().max().item<double>(), 1e-5 * fake.abs().max().item<double>()) << act.scheme.name();
    }
  }
  // The all-zero token's outputs are exactly zero (no bias).
  EXPECT_TRUE(at::equal(linear.forward(x, cases[0], {})->select(0, 0).select(0, 3), at::zeros({24})));
  // Not an fp32 CPU input: the caller fake-quantizes.
  EXPECT_FALSE(linear.forward(x.to(at::kDouble), cases[0], {}).has_value());
}

TEST(Int8Linear, SupportsInt8PerChannelSymmetricWeightsWithInt8Activations) {
  const QScheme w8{QDtype::kInt8, QScope::kPerChannel, true, 0};
  const ActivationQuant dynamic{{QDtype::kInt8, QScope::kPerToken, true, 0}, {}};
  EXPECT_TRUE(Int8Linear::supports(w8, dynamic));
  EXPECT_FALSE(Int8Linear::supports(w8, std::nullopt));  // weight-only
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt4, QScope::kPerChannel, true, 0}, dynamic));
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, dynamic));
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt8, QScope::kPerGroup, true, 64}, dynamic));
  EXPECT_FALSE(Int8Linear::supports(w8, ActivationQuant{{QDtype::kFp8E4m3, QScope::kPerToken, true, 0}, {}}));
  // Static without parameters (not calibrated yet).
  EXPECT_FALSE(Int8Linear::supports(w8, ActivationQuant{{QDtype::kInt8, QScope::kPerTensor, false, 0}, {}}));
}

}  // namespace
}  // namespace qpipe
