// Int8Linear, Int8Weight and int8Matmul, Fp8Linear, bf16Matmul, bf16MatmulAdd and fp8Values, Bf16x3Linear,
// GroupedBf16Linear, GroupedInt8Linear
// (qpipe/quant_linear.h, qpipe/quant.h) against exact arithmetic (integers, doubles), and against
// fake quantization in fp32 within its rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bf16_gemm.h"
#include "grouped_int8_gemm.h"
#include "qpipe/quant.h"
#include "qpipe/quant_linear.h"
#include "test_helpers.h"

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

// sums [rows, N] rounded to fp32 once, times sx[m]·sw[n], plus b, shaped as x with N outputs.
at::Tensor scaledReference(const at::Tensor& x, const at::Tensor& sums, const QParams& p, const at::Tensor& sw,
                           const at::Tensor& bias) {
  at::Tensor y = sums.to(at::kFloat) * (p.scale.to(at::kFloat).reshape({-1, 1}) * sw.reshape({1, -1}));
  if (bias.defined()) y = y + bias;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = sums.size(1);
  return y.view(shape);
}

// The same bits on one thread as on the default number.
template <typename F>
at::Tensor onOneThread(const F& f) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::Tensor y = f();
  at::set_num_threads(threads);
  return y;
}

// Every kernel against int64 arithmetic, on shapes that cross each edge of the packed kernel's
// blocking: rows not a multiple of its 4-row tile or beyond its 192-row block, outputs not a
// multiple of its 16-wide panel, odd K, K below one 16-column pack block and beyond its 256-column
// block, and the extreme codes.
TEST(Int8Weight, EveryKernelIsExactAcrossTheBlockingEdges) {
  at::manual_seed(7);
  const std::vector<std::array<int64_t, 3>> shapes = {{1, 1, 1},     {3, 7, 5},       {4, 16, 16}, {5, 33, 17},
                                                      {13, 600, 48}, {197, 1029, 37}, {64, 257, 1}};
  for (const auto& [m, k, n] : shapes) {
    at::Tensor a = at::randint(-128, 128, {m, k}, at::kChar);
    at::Tensor w = at::randint(-128, 128, {n, k}, at::kChar);
    a[0].fill_(-128);
    w[0].fill_(-128);
    if (m > 1) a[m - 1].fill_(127);
    if (n > 1) w[n - 1].fill_(127);
    const at::Tensor exact = at::matmul(a.to(at::kLong), w.to(at::kLong).t());
    for (const quant::Int8Kernel kernel :
         {quant::Int8Kernel::kBest, quant::Int8Kernel::kPacked, quant::Int8Kernel::kReference}) {
      const quant::Int8Weight weight(w, kernel);
      const at::Tensor y = weight.matmul(a);
      ASSERT_EQ(y.scalar_type(), at::kInt);
      EXPECT_TRUE(at::equal(y.to(at::kLong), exact))
          << m << "x" << k << "x" << n << " kernel " << static_cast<int>(kernel);
      EXPECT_TRUE(at::equal(onOneThread([&] { return weight.matmul(a); }), y));
    }
  }
}

TEST(Int8Weight, ReadsRowsSpacedApartAndEmptyShapes) {
  at::manual_seed(8);
  const at::Tensor wide = at::randint(-128, 128, {9, 70}, at::kChar);
  const at::Tensor a = wide.slice(1, 3, 53);  // rows 70 apart, 50 wide
  const at::Tensor w = at::randint(-128, 128, {21, 50}, at::kChar);
  const at::Tensor exact = at::matmul(a.to(at::kLong), w.to(at::kLong).t());
  const quant::Int8Weight packed(w, quant::Int8Kernel::kPacked);
  EXPECT_TRUE(at::equal(packed.matmul(a).to(at::kLong), exact));
  EXPECT_EQ(packed.matmul(at::empty({0, 50}, at::kChar)).sizes(), at::IntArrayRef({0, 21}));
  const quant::Int8Weight noK(at::empty({6, 0}, at::kChar), quant::Int8Kernel::kPacked);
  EXPECT_TRUE(at::equal(noK.matmul(at::empty({2, 0}, at::kChar)), at::zeros({2, 6}, at::kInt)));
}

TEST(Int8Weight, RefusesInputsOfTheWrongShapeOrType) {
  const quant::Int8Weight weight(at::zeros({4, 8}, at::kChar), quant::Int8Kernel::kPacked);
  const auto message = [&](const at::Tensor& a) {
    try {
      weight.matmul(a);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(
      message(at::zeros({2, 7}, at::kChar)).find("an int8 GEMM with a [4, 8] weight takes int8 [M, 8], got [2, 7]"),
      std::string::npos);
  EXPECT_NE(message(at::zeros({2, 8})).find("takes int8 [M, 8], got [2, 8] Float"), std::string::npos);
  EXPECT_THROW(quant::Int8Weight(at::zeros({4, 8})), std::exception);
}

// y = float(Σ (qx − zx)·qw) · (sx·sw) + b with the sum in int64: what Int8Linear promises, bit for bit.
at::Tensor exactReference(const at::Tensor& x, const ActivationQuant& act, const at::Tensor& qw, const at::Tensor& sw,
                          const at::Tensor& bias) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const QParams p = act.isDynamic() ? quant::computeQParams(flat, act.scheme) : act.params;
  const at::Tensor q = quant::quantize(flat, p, act.scheme).to(at::kLong);
  return scaledReference(x, at::matmul(q - p.zeroPoint.to(at::kLong).reshape({-1, 1}), qw.to(at::kLong).t()), p, sw,
                         bias);
}

class Int8LinearWeights : public ::testing::TestWithParam<QDtype> {};

// int8 weights (W8A8) and int4 ones held in int8 (W4A8).
TEST_P(Int8LinearWeights, AreTheExactIntegerSumTimesTheScalesBitForBit) {
  at::manual_seed(6);
  const at::Tensor w = at::randn({24, 40});
  const QScheme weightScheme{GetParam(), QScope::kPerChannel, true, 0};
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
  // Nor one whose sums could leave 32 bits.
  const int64_t wide = Int8Linear::kMaxInt8K + 1;
  EXPECT_FALSE(
      Int8Linear(at::ones({1, wide}, at::kChar), at::ones({1})).forward(at::ones({1, wide}), cases[0], {}).has_value());
  if (GetParam() == QDtype::kInt4) {
    EXPECT_TRUE(qw.le(7).logical_and(qw.ge(-8)).all().item<bool>()) << "int4 codes in [-8, 7]";
  }
}

INSTANTIATE_TEST_SUITE_P(Int8AndInt4, Int8LinearWeights, ::testing::Values(QDtype::kInt8, QDtype::kInt4),
                         [](const ::testing::TestParamInfo<QDtype>& info) {
                           return info.param == QDtype::kInt8 ? std::string("int8") : std::string("int4");
                         });

TEST(Int8Linear, ForwardCodesIsForwardsProductOfTheCodes) {
  // Codes and params quantized by the caller, as forward() quantizes them; per token and per
  // tensor with a zero point; and codes of tokens divided by column scales
  // (quant::quantizeDividedTokens, the smoothing searches' input).
  at::manual_seed(9);
  const at::Tensor w = at::randn({24, 40});
  const QScheme weightScheme{QDtype::kInt8, QScope::kPerChannel, true, 0};
  const auto [wp, qw] = quant::quantizeWeight(w, weightScheme);
  const Int8Linear linear(qw, wp.scale);
  const at::Tensor x = at::randn({7, 40}) * 2;
  const QScheme dynamic{QDtype::kInt8, QScope::kPerToken, true, 0};
  const QScheme staticAsym{QDtype::kInt8, QScope::kPerTensor, false, 0};
  for (const ActivationQuant& act :
       {ActivationQuant{dynamic, {}}, ActivationQuant{staticAsym, quant::computeQParams(x * 0.25, staticAsym)}}) {
    const QParams params = act.isDynamic() ? quant::computeQParams(x, act.scheme) : act.params;
    const at::Tensor bias = at::randn({24});
    EXPECT_TRUE(at::equal(linear.forwardCodes(quant::quantize(x, params, act.scheme), params, bias),
                          *linear.forward(x, act, bias)))
        << act.scheme.name();
  }
  const at::Tensor divisor = at::rand({40}) * 3 + 0.01;
  const auto [params, codes] = quant::quantizeDividedTokens(x, divisor, dynamic);
  EXPECT_TRUE(at::equal(linear.forwardCodes(codes, params, {}),
                        *linear.forward(x / divisor, ActivationQuant{dynamic, {}}, {})));
  try {
    linear.forwardCodes(codes.slice(1, 1), params, {});
    ADD_FAILURE() << "39 columns of codes for K = 40";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Int8Linear::forwardCodes takes int8 CPU codes [M, 40], got [7, 39] Char"),
              std::string::npos)
        << e.what();
  }
}

TEST(Int8Linear, ForwardCodesRowsVisitsForwardCodesRowsOnceEach) {
  // Enough rows to spread over the threads (the grain is 16384 / N rows), per tensor with a zero
  // point and a bias, and per token: every row seen once, with forwardCodes' bits.
  at::manual_seed(12);
  const at::Tensor w = at::randn({96, 56});
  const auto [wp, qw] = quant::quantizeWeight(w, QScheme{QDtype::kInt8, QScope::kPerChannel, true, 0});
  const Int8Linear linear(qw, wp.scale);
  const at::Tensor x = at::randn({1000, 56});
  const QScheme dynamic{QDtype::kInt8, QScope::kPerToken, true, 0};
  const QScheme staticAsym{QDtype::kInt8, QScope::kPerTensor, false, 0};
  for (const auto& [scheme, bias] : {std::pair{dynamic, at::Tensor()}, std::pair{staticAsym, at::randn({96})}}) {
    const QParams params = quant::computeQParams(x, scheme);
    const at::Tensor codes = quant::quantize(x, params, scheme);
    const at::Tensor expected = linear.forwardCodes(codes, params, bias);
    at::Tensor seen = at::full({1000, 96}, std::numeric_limits<float>::quiet_NaN());
    std::vector<std::atomic<int>> visits(1000);
    linear.forwardCodesRows(codes, params, bias, [&](int64_t m, const float* y) {
      ++visits[static_cast<size_t>(m)];
      std::copy(y, y + 96, seen[m].data_ptr<float>());
    });
    EXPECT_TRUE(std::all_of(visits.begin(), visits.end(), [](const std::atomic<int>& v) { return v == 1; }))
        << scheme.name();
    EXPECT_TRUE(at::equal(seen, expected)) << scheme.name();
  }
  try {
    linear.forwardCodesRows(at::zeros({3, 56}), quant::computeQParams(x, dynamic), {}, [](int64_t, const float*) {});
    ADD_FAILURE() << "fp32 codes";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Int8Linear::forwardCodes takes int8 CPU codes [M, 56], got [3, 56] Float"),
              std::string::npos)
        << e.what();
  }
}

TEST(Int8Linear, IsExactAtTheExtremesOfTheSumsOverWideRows) {
  // qx − z is 255, its largest, in row 0, 0 in row 1 and both in row 2; every qw is −128 or 127:
  // the extreme terms of the sums, over 70 outputs (vector bodies and tails), with and without
  // a bias.
  const int64_t k = 4099;
  const at::Tensor qw = at::randint(0, 2, {70, k}, at::kChar) * 255 - 128;  // −128 or 127
  const at::Tensor sw = at::rand({70}) + 0.5;
  const QScheme staticAsym{QDtype::kInt8, QScope::kPerTensor, false, 0};
  const ActivationQuant act{staticAsym, {at::full({1}, 0.5f), at::full({1}, -128, at::kInt)}};
  at::Tensor x = at::full({3, k}, 127.5f);  // qx = 127
  x[1].fill_(-64.0f);                       // qx = −128: qx − z = 0
  x[2].slice(0, 0, k / 2).fill_(-1e6f);     // saturates at −128
  const Int8Linear linear(qw, sw);
  for (const at::Tensor& bias : {at::Tensor(), at::randn({70})}) {
    const std::optional<at::Tensor> y = linear.forward(x, act, bias);
    ASSERT_TRUE(y.has_value());
    EXPECT_TRUE(at::equal(*y, exactReference(x, act, qw, sw, bias)));
  }
}

TEST(Int8Linear, SupportsInt8AndInt4PerChannelSymmetricWeightsWithInt8Activations) {
  const QScheme w8{QDtype::kInt8, QScope::kPerChannel, true, 0};
  const ActivationQuant dynamic{{QDtype::kInt8, QScope::kPerToken, true, 0}, {}};
  EXPECT_TRUE(Int8Linear::supports(w8, dynamic));
  EXPECT_TRUE(Int8Linear::supports({QDtype::kInt4, QScope::kPerChannel, true, 0}, dynamic));  // W4A8
  EXPECT_FALSE(Int8Linear::supports(w8, std::nullopt));  // weight-only
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt4, QScope::kPerChannel, true, 0}, std::nullopt));  // W4A16
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 64}, dynamic));
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, dynamic));
  EXPECT_FALSE(Int8Linear::supports({QDtype::kInt8, QScope::kPerGroup, true, 64}, dynamic));
  EXPECT_FALSE(Int8Linear::supports(w8, ActivationQuant{{QDtype::kFp8E4m3, QScope::kPerToken, true, 0}, {}}));
  // Static without parameters (not calibrated yet).
  EXPECT_FALSE(Int8Linear::supports(w8, ActivationQuant{{QDtype::kInt8, QScope::kPerTensor, false, 0}, {}}));
}

TEST(Fp8Values, AreQuantizesE4m3ValuesExactlyAtEveryEdge) {
  const QScheme perTensor{QDtype::kFp8E4m3, QScope::kPerTensor, true, 0};
  // Every E4M3 value, the midpoints between neighbours (ties to even), values just off them, the
  // subnormal range, saturation past ±448, ±inf and zeros of both signs; then random rows.
  const at::Tensor codes = at::arange(0, 256, at::kInt).to(at::kByte).view(at::kFloat8_e4m3fn).to(at::kFloat);
  const at::Tensor finite = std::get<0>(codes.masked_select(codes.isfinite()).sort());
  const at::Tensor mids = (finite.slice(0, 1) + finite.slice(0, 0, -1)) / 2;
  const float inf = std::numeric_limits<float>::infinity();
  const at::Tensor edges = at::cat({finite, mids, at::nextafter(mids, at::full_like(mids, inf)),
                                    at::nextafter(mids, at::full_like(mids, -inf)), at::linspace(-0.02, 0.02, 4001),
                                    at::tensor({460.0f, -464.0f, 1e30f, -1e30f, inf, -inf, 0.0f, -0.0f, 1e-30f})});
  const int64_t random = 6000 + (7 - (edges.numel() + 6000) % 7) % 7;
  const at::Tensor x = at::cat({edges, at::randn({random}) * 100}).reshape({-1, 7});
  const QParams one{at::ones({1}), at::zeros({1}, at::kInt)};
  const at::Tensor values = quant::fp8Values(x, one.scale, at::kBFloat16);
  const at::Tensor quantized = quant::quantize(x, one, perTensor);
  EXPECT_TRUE(at::equal(values.view(at::kShort), quantized.to(at::kBFloat16).view(at::kShort)));
  EXPECT_TRUE(
      at::equal(quant::fp8Values(x, one.scale, at::kFloat).view(at::kInt), quantized.to(at::kFloat).view(at::kInt)));
  // One scale per row, and NaN stays NaN.
  const at::Tensor rowScale = at::rand({x.size(0), 1}) + 0.01;
  const QScheme perToken{QDtype::kFp8E4m3, QScope::kPerToken, true, 0};
  const at::Tensor perTokenValues = quant::quantize(x, {rowScale, at::zeros_like(rowScale, at::kInt)}, perToken);
  EXPECT_TRUE(at::equal(quant::fp8Values(x, rowScale, at::kBFloat16), perTokenValues.to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(quant::fp8Values(x, rowScale, at::kFloat), perTokenValues.to(at::kFloat)));
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    EXPECT_TRUE(quant::fp8Values(at::full({1, 3}, std::nanf("")), one.scale, dtype).isnan().all().item<bool>());
  }
  try {
    quant::fp8Values(x, one.scale, at::kHalf);
    ADD_FAILURE() << "fp16 values";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fp8Values writes bf16 or fp32, not Half"), std::string::npos) << e.what();
  }
}

TEST(Bf16Matmul, ProductsAreExactAndTheSumRoundsOnceInFp32PerAddition) {
  at::manual_seed(7);
  // E4M3 values, whose products are exact in fp32: against the exact sum in double the error is
  // that of an fp32 accumulation.
  const at::Tensor a = (at::randn({37, 1031}) * 50).to(at::kFloat8_e4m3fn).to(at::kBFloat16);
  const at::Tensor b = (at::randn({19, 1031}) * 50).to(at::kFloat8_e4m3fn).to(at::kBFloat16);
  const at::Tensor exact = at::matmul(a.to(at::kDouble), b.to(at::kDouble).t());
  const at::Tensor y = quant::bf16Matmul(a, b);
  ASSERT_EQ(y.scalar_type(), at::kFloat);
  const double bound = 1031 * std::ldexp(1.0, -24) *
                       at::matmul(a.to(at::kDouble).abs(), b.to(at::kDouble).abs().t()).max().item<double>();
  EXPECT_LE((y.to(at::kDouble) - exact).abs().max().item<double>(), bound);
  EXPECT_TRUE(at::equal(onOneThread([&] { return quant::bf16Matmul(a, b); }), y));
  // Several blocks of rows, shared among the threads: still the one-thread bits.
  const at::Tensor tall = (at::randn({300, 96}) * 50).to(at::kFloat8_e4m3fn).to(at::kBFloat16);
  const at::Tensor tallY = quant::bf16Matmul(tall, b.slice(1, 0, 96));
  EXPECT_TRUE(at::equal(onOneThread([&] { return quant::bf16Matmul(tall, b.slice(1, 0, 96)); }), tallY));
  // Empty operands, and shapes that do not match.
  EXPECT_EQ(quant::bf16Matmul(a.slice(0, 0, 0), b).sizes(), (std::vector<int64_t>{0, 19}));
  EXPECT_TRUE(at::equal(quant::bf16Matmul(a.slice(1, 0, 0), b.slice(1, 0, 0)), at::zeros({37, 19})));
  // Views of part of each row, read in place, and other layouts, copied: the same bits.
  EXPECT_TRUE(at::equal(quant::bf16Matmul(a.slice(1, 3, 900), b.slice(1, 3, 900)),
                        quant::bf16Matmul(a.slice(1, 3, 900).contiguous(), b.slice(1, 3, 900).contiguous())));
  EXPECT_TRUE(at::equal(quant::bf16Matmul(a.t().contiguous().t(), b), y));
  EXPECT_THROW(quant::bf16Matmul(a, a.slice(1, 1)), std::exception);
  // Widened operands take the fp32 GEMM: the widening path's bits, within the bound on any CPU.
  const at::Tensor widened = quant::bf16Matmul(a.to(at::kFloat), b.to(at::kFloat));
  EXPECT_LE((widened.to(at::kDouble) - exact).abs().max().item<double>(), bound);
  EXPECT_TRUE(at::equal(onOneThread([&] { return quant::bf16Matmul(a.to(at::kFloat), b.to(at::kFloat)); }), widened));
  if (quant::bf16MatmulKernel() == quant::Bf16Kernel::kFp32) {
    EXPECT_TRUE(at::equal(widened, y));
  }
  try {
    quant::bf16Matmul(a, b.to(at::kFloat));
    ADD_FAILURE() << "bf16 times fp32";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("bf16Matmul takes bf16 (or fp32) [M, K] and [N, K], got [37, 1031] BFloat16 "
                                         "and [19, 1031] Float"),
              std::string::npos)
        << e.what();
  }
}

// qpipe's vdpbf16ps kernel, called directly on every CPU that can run it (bf16Matmul uses it on
// AMD only): the products exact, one fp32 rounding per addition, a row's bits independent of the
// rows around it (its position in a block of the micro-kernel, or M), of N (a wider panel
// layout) and of the thread count; odd K and a partial last panel take the same path.
TEST(Bf16Matmul, Avx512Bf16KernelRowsAndColumnsDoNotDependOnTheirNeighbours) {
  if (!quant::detail::canRunAvx512Bf16Gemm()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  EXPECT_EQ(quant::bf16MatmulKernel() == quant::Bf16Kernel::kAvx512Bf16,
            __builtin_cpu_is("amd") != 0 && __builtin_cpu_supports("amx-bf16") == 0);
  at::manual_seed(7);
  const auto e4m3 = [](int64_t rows, int64_t cols) {
    return (at::randn({rows, cols}) * 50).to(at::kFloat8_e4m3fn).to(at::kBFloat16);
  };
  // a · bᵀ into `out`, or added to it when accumulating.
  const auto kernel = [](const at::Tensor& a, const at::Tensor& b, at::Tensor out = {}, bool accumulate = false) {
    if (!out.defined()) out = at::empty({a.size(0), b.size(0)});
    quant::detail::avx512Bf16Gemm(a.const_data_ptr<c10::BFloat16>(), a.stride(0), b.const_data_ptr<c10::BFloat16>(),
                                  b.stride(0), a.size(0), b.size(0), a.size(1), accumulate,
                                  out.mutable_data_ptr<float>());
    return out;
  };
  const at::Tensor a = e4m3(300, 1031), b = e4m3(19, 1031), more = e4m3(26, 1031);
  const at::Tensor y = kernel(a, b);
  const at::Tensor exact = at::matmul(a.to(at::kDouble), b.to(at::kDouble).t());
  const double bound = 1031 * std::ldexp(1.0, -24) *
                       at::matmul(a.to(at::kDouble).abs(), b.to(at::kDouble).abs().t()).max().item<double>();
  EXPECT_LE((y.to(at::kDouble) - exact).abs().max().item<double>(), bound);
  EXPECT_TRUE(at::equal(onOneThread([&] { return kernel(a, b); }), y));
  EXPECT_TRUE(at::equal(kernel(a.slice(0, 5, 298).contiguous(), b), y.slice(0, 5, 298)));
  EXPECT_TRUE(at::equal(kernel(a.slice(0, 3, 4).contiguous(), b), y.slice(0, 3, 4)));
  EXPECT_TRUE(at::equal(kernel(a, at::cat({b, more})).slice(1, 0, 19), y));
  // Accumulating adds the product to what the output held.
  const at::Tensor sum = kernel(a, b, at::ones({300, 19}), true);
  EXPECT_LE((sum.to(at::kDouble) - 1 - exact).abs().max().item<double>(),
            bound + 1e-6 * exact.abs().max().item<double>());
}

// Asks MKL for thread-invariant GEMMs, then exits 0 if it took that and shapes whose sums MKL
// otherwise split by thread (seen on an Intel Xeon host) give one thread's bits on two, through
// LibTorch and through bf16Matmul.
[[noreturn]] void exitWithThreadInvariance() {
  const bool strict = quant::threadInvariantBlas();
  at::manual_seed(11);
  bool same = true;
  for (const auto& [m, k, n] : {std::tuple{37, 1031, 19}, {128, 1536, 576}, {512, 4096, 192}, {8, 576, 576}}) {
    const at::Tensor a = at::randn({m, k}), b = at::randn({n, k});
    at::set_num_threads(2);
    const at::Tensor two = at::linear(a, b);
    same = same && at::equal(onOneThread([&] { return at::linear(a, b); }), two);
    // bf16Matmul's fp32 GEMM, one call in this mode.
    const at::Tensor a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
    const at::Tensor product = quant::bf16Matmul(a16, b16);
    same = same && at::equal(onOneThread([&] { return quant::bf16Matmul(a16, b16); }), product);
  }
  // A weight packed once (on two threads) gives bf16Matmul's bits for any M, on two threads and
  // on one, widened from bf16 or given in fp32, read from a view whose rows are spaced apart.
  const at::Tensor b = at::randn({576, 1536}).to(at::kBFloat16).to(at::kFloat);
  const quant::Bf16MatmulWeight weight(b);
  const at::ScalarType dtype = weight.inputDtype();
  const bool packed = !at::hasMKL() || weight.packed() || quant::bf16MatmulKernel() != quant::Bf16Kernel::kFp32;
  for (const int64_t m : {1, 7, 100, 512, 2000}) {
    const at::Tensor wide = at::randn({m, 1600}).to(at::kBFloat16);
    const at::Tensor a = wide.slice(1, 0, 1536);
    const at::Tensor reference = quant::bf16Matmul(a.to(dtype), b.to(dtype));
    same = same && at::equal(weight.matmul(a.to(dtype)), reference) &&
           at::equal(onOneThread([&] { return weight.matmul(a.to(dtype)); }), reference) &&
           at::equal(weight.matmul(a), reference) && at::equal(weight.matmul(a.contiguous()), reference);
  }
  same = same && weight.matmul(at::empty({0, 1536})).sizes() == at::IntArrayRef({0, 576});
  // Weights stacked along N (q/k/v's FP8 GEMM in SharedInputGemm) give each weight's own bits.
  const std::vector<at::Tensor> shards{at::randn({576, 576}), at::randn({192, 576}), at::randn({192, 576})};
  const quant::Bf16MatmulWeight stacked(at::cat(shards));
  for (const int64_t m : {1, 7, 512, 2000}) {
    const at::Tensor a = at::randn({m, 576}).to(dtype);
    const at::Tensor y = stacked.matmul(a);
    int64_t offset = 0;
    for (const at::Tensor& shard : shards) {
      same = same && at::equal(y.narrow(1, offset, shard.size(0)), quant::Bf16MatmulWeight(shard).matmul(a));
      offset += shard.size(0);
    }
  }
  std::exit(strict && same && packed ? 0 : 1);
}

// MKL takes its strict mode only before its first computation, so the check runs in a fresh copy
// of this binary (the threadsafe death-test style starts one). MKL documents strict mode for its
// Intel code paths only.
TEST(ThreadInvariantBlas, GemmBitsDoNotDependOnTheThreadCount) {
  if (!at::hasMKL()) GTEST_SKIP() << "this LibTorch has no MKL";
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel") == 0) GTEST_SKIP() << "MKL's strict mode covers Intel CPUs only";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exitWithThreadInvariance(), ::testing::ExitedWithCode(0), "");
}

// Outside MKL's strict mode (this test process) the weight is kept as bf16Matmul reads it;
// exitWithThreadInvariance checks the packed form.
TEST(Bf16MatmulWeight, GivesBf16MatmulsBitsAndNamesABadInput) {
  at::manual_seed(9);
  const at::Tensor b = (at::randn({19, 1031}) * 50).to(at::kFloat8_e4m3fn).to(at::kFloat);
  const quant::Bf16MatmulWeight weight(b);
  EXPECT_EQ(weight.n(), 19);
  EXPECT_EQ(weight.k(), 1031);
  EXPECT_EQ(weight.inputDtype(), quant::bf16MatmulKernel() == quant::Bf16Kernel::kFp32 ? at::kFloat : at::kBFloat16);
  const at::Tensor a = (at::randn({37, 1031}) * 50).to(at::kFloat8_e4m3fn).to(weight.inputDtype());
  EXPECT_TRUE(at::equal(weight.matmul(a), quant::bf16Matmul(a, b.to(weight.inputDtype()))));
  EXPECT_EQ(weight.matmul(a.slice(0, 0, 0)).sizes(), (std::vector<int64_t>{0, 19}));
  try {
    weight.matmul(at::zeros({37, 1030}));
    ADD_FAILURE() << "K = 1030 against 1031";
  } catch (const std::exception& e) {
    EXPECT_NE(
        std::string(e.what()).find("Bf16MatmulWeight::matmul takes a bf16 or fp32 [M, 1031], got [37, 1030] Float"),
        std::string::npos)
        << e.what();
  }
  try {
    quant::Bf16MatmulWeight(at::zeros({4}));
    ADD_FAILURE() << "a 1-D weight";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Bf16MatmulWeight takes a bf16 or fp32 [N, K], got [4] Float"),
              std::string::npos)
        << e.what();
  }
}

TEST(Bf16MatmulAdd, AddsTheProductToWhatOutHolds) {
  at::manual_seed(8);
  const at::Tensor a = at::randn({23, 517}).to(at::kBFloat16);
  const at::Tensor b = at::randn({29, 517}).to(at::kBFloat16);
  const at::Tensor start = at::randn({23, 29});
  at::Tensor out = start.clone();
  quant::bf16MatmulAdd(a, b, out);
  const at::Tensor exact = start.to(at::kDouble) + at::matmul(a.to(at::kDouble), b.to(at::kDouble).t());
  const double bound = 518 * std::ldexp(1.0, -24) *
                       (start.to(at::kDouble).abs() + at::matmul(a.to(at::kDouble).abs(), b.to(at::kDouble).abs().t()))
                           .max()
                           .item<double>();
  EXPECT_LE((out.to(at::kDouble) - exact).abs().max().item<double>(), bound);
  at::Tensor wrong = at::zeros({23, 28});
  try {
    quant::bf16MatmulAdd(a, b, wrong);
    ADD_FAILURE() << "a [23, 29] product added into [23, 28]";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("adds into a contiguous fp32 [23, 29], got [23, 28]"), std::string::npos)
        << e.what();
  }
}

TEST(SplitBf16, IsLibTorchsRoundingOfTheValueAndOfWhatItLeaves) {
  // Every bf16 pattern with low bits below, at and above the rounding midpoint, and random values.
  const at::Tensor top = at::arange(0, 65536, at::kInt).bitwise_left_shift(16);
  at::Tensor bits = at::cat({top, top + 0x7FFF, top + 0x8000, top + 0x8001, top + 0xFFFF,
                             at::randint(0, 65536, {65536}, at::kInt) + top})
                        .reshape({6, 65536});
  bits = at::cat({bits, at::randn({6, 65536}).view(at::kInt)}, 1);
  const at::Tensor x = bits.view(at::kFloat);
  const at::Tensor parts = quant::splitBf16(x, /*hiFirst=*/true);
  const int64_t cols = x.size(1);
  ASSERT_EQ(parts.sizes(), (std::vector<int64_t>{6, 2 * cols}));
  const at::Tensor hi = parts.slice(1, 0, cols), lo = parts.slice(1, cols);
  EXPECT_TRUE(
      at::equal(quant::splitBf16(x, /*hiFirst=*/false).view(at::kShort), at::cat({lo, hi}, 1).view(at::kShort)));
  const at::Tensor castHi = x.to(at::kBFloat16);
  const at::Tensor castLo = (x - castHi.to(at::kFloat)).to(at::kBFloat16);
  // The same patterns, but for NaN, which LibTorch's vectorized cast writes as 0xFFFF and its
  // scalar cast as 0x7FC0.
  const auto expectSame = [](const at::Tensor& part, const at::Tensor& cast) {
    const at::Tensor number = ~cast.isnan();
    EXPECT_TRUE(at::equal(part.view(at::kShort).masked_select(number), cast.view(at::kShort).masked_select(number)));
    EXPECT_TRUE(at::equal(part.isnan(), cast.isnan()));
  };
  expectSame(hi, castHi);
  expectSame(lo, castLo);
  const at::Tensor finite = x.isfinite() & hi.isfinite();
  const at::Tensor rest = (x.to(at::kDouble) - hi.to(at::kDouble) - lo.to(at::kDouble)).abs();
  // Relative to |x|, but for lo's subnormals (spaced 2⁻¹³³ apart).
  const at::Tensor bound = at::clamp_min(x.to(at::kDouble).abs() * std::ldexp(1.0, -16), std::ldexp(1.0, -134));
  EXPECT_TRUE((rest.masked_select(finite) <= bound.masked_select(finite)).all().item<bool>());
  EXPECT_THROW(quant::splitBf16(x.to(at::kDouble), true), std::exception);
}

// Within the bf16x3 bound of the exact product: per element 3·2⁻¹⁶·(1 + 2⁻⁸) of Σ|x·w| for the
// dropped terms and the parts' own rounding, plus the fp32 sums' rounding (K + 3 additions).
void expectWithinBf16x3(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const at::Tensor xd = x.reshape({-1, w.size(1)}).to(at::kDouble), wd = w.to(at::kDouble);
  at::Tensor exact = at::matmul(xd, wd.t());
  at::Tensor magnitude = at::matmul(xd.abs(), wd.abs().t());
  if (bias.defined()) {
    exact = exact + bias.to(at::kDouble);
    magnitude = magnitude + bias.to(at::kDouble).abs();
  }
  const double unit = 3.05 * std::ldexp(1.0, -16) + (w.size(1) + 3) * std::ldexp(1.0, -24);
  const at::Tensor err = (y.reshape(exact.sizes()).to(at::kDouble) - exact).abs();
  EXPECT_TRUE((err <= magnitude * unit).all().item<bool>())
      << "worst error / bound " << (err / (magnitude * unit)).max().item<double>();
}

TEST(Bf16x3Linear, IsTheFp32ProductWithinTheBf16x3Bound) {
  at::manual_seed(9);
  // An int4 group-wise weight as W4A16 dequantizes it, inputs with outliers and a zero row.
  const at::Tensor w = at::randint(-8, 8, {67, 384}).to(at::kFloat) *
                       (at::rand({67, 3, 1}) * 0.01f + 1e-4f).expand({67, 3, 128}).reshape({67, 384});
  at::Tensor x = at::randn({2, 41, 384});
  x[0][3].zero_();
  x[1][5][7] = 3.0e4f;
  x[1][6].mul_(1e-30f);
  const at::Tensor bias = at::randn({67});
  const Bf16x3Linear gemm(w);
  const std::optional<at::Tensor> y = gemm.forward(x, bias);
  ASSERT_TRUE(y.has_value());
  EXPECT_EQ(y->sizes(), (std::vector<int64_t>{2, 41, 67}));
  expectWithinBf16x3(*y, x, w, bias);
  EXPECT_TRUE(at::equal((*y)[0][3], bias));
  expectWithinBf16x3(*gemm.forward(x, at::Tensor()), x, w, at::Tensor());
  // Far closer than one bf16 GEMM (rounding x and w once each), which this replaces.
  const at::Tensor exact = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t()) + bias.to(at::kDouble);
  const at::Tensor oneBf16 = quant::bf16Matmul(x.reshape({-1, 384}).to(at::kBFloat16), w.to(at::kBFloat16)) + bias;
  EXPECT_LT((y->to(at::kDouble) - exact).abs().max().item<double>() * 20,
            (oneBf16.view({2, 41, 67}).to(at::kDouble) - exact).abs().max().item<double>());
  EXPECT_TRUE(at::equal(onOneThread([&] { return *gemm.forward(x, bias); }), *y));
  // No GEMM for other inputs.
  EXPECT_FALSE(gemm.forward(x.to(at::kDouble), bias).has_value());
}

TEST(QuantLinear, WeightOnlyFp32RunsBf16x3WithAmxGroupedBf16OnZen5GroupedInt8OnZen4AndTheFp32GemmElsewhere) {
  at::manual_seed(10);
  Linear linear(at::randn({48, 256}) * 0.05f, at::randn({48}));
  const QScheme w4{QDtype::kInt4, QScope::kPerGroup, true, 64};
  const QParams params = quant::computeQParams(linear.weight(), w4);
  const auto deployed = QuantLinear::fromLinear(linear, params, w4, std::nullopt);
  const at::Tensor x = at::randn({3, 17, 256});
  const at::Tensor y = deployed->forward(x);
  const at::Tensor dequantized = deployed->dequantizedWeight();
  const at::Tensor q = deployed->parameter("weight");
  const bool amx = quant::bf16MatmulKernel() == quant::Bf16Kernel::kAmx, bf16 = GroupedBf16Linear::cpuRuns(),
             int8 = GroupedInt8Linear::cpuRuns();
  // bf16x3 and GroupedBf16Linear within their bounds (3·2⁻¹⁶ and 2⁻¹⁶ of Σ|x·w|); GroupedInt8Linear's
  // is its own test's.
  if (!int8) expectWithinBf16x3(y, x, dequantized, linear.bias());
  const at::Tensor expected = amx    ? *Bf16x3Linear(dequantized).forward(x, linear.bias())
                              : bf16 ? *GroupedBf16Linear(q, params, w4).forward(x, linear.bias())
                              : int8 ? *GroupedInt8Linear(q, params, w4).forward(x, linear.bias())
                                     : at::linear(x, dequantized, linear.bias());
  EXPECT_TRUE(at::equal(y, expected));
  if (!amx && !bf16 && !int8) {  // the probe's GEMM of few rows: a float Linear's
    const FewRowsGemm fewRows;
    EXPECT_TRUE(at::equal(deployed->forward(x), Linear(dequantized, linear.bias())(x)));
  }
}

// The weight-only schemes the grouped GEMMs run, as W4A16, W8A16 and the FP4 A16 practices make them.
const std::vector<QScheme>& groupedSchemes() {
  static const std::vector<QScheme> schemes{{QDtype::kInt4, QScope::kPerGroup, true, 64},
                                            {QDtype::kInt4, QScope::kPerGroup, false, 128},
                                            {QDtype::kInt4, QScope::kPerChannel, true, 0},
                                            {QDtype::kInt8, QScope::kPerChannel, true, 0},
                                            {QDtype::kInt8, QScope::kPerChannel, false, 0},
                                            {QDtype::kInt8, QScope::kPerTensor, true, 0},
                                            {QDtype::kInt8, QScope::kPerTensor, false, 0},
                                            {QDtype::kNvfp4, QScope::kPerGroup, true, quant::kNvfp4GroupSize},
                                            {QDtype::kMxfp4, QScope::kPerGroup, true, quant::kMxfp4GroupSize}};
  return schemes;
}

// The exact dequantized weight in double, [N, K]: (q − z)·s per group, or an FP4 code's value times
// its block's divisor.
at::Tensor exactWeight(const at::Tensor& q, const QParams& params, const QScheme& scheme) {
  const int64_t n = q.size(0), k = q.size(1), groups = scheme.scope == QScope::kPerGroup ? k / scheme.groupSize : 1;
  const auto perGroup = [&](const at::Tensor& t) {
    return t.to(at::kDouble).reshape({t.numel() == 1 ? 1 : n, groups, 1});
  };
  const bool fp4 = quant::isFp4(scheme.dtype);
  const at::Tensor values = fp4 ? quant::fromFp4E2m1(q).to(at::kDouble).view({n, groups, -1})
                                : q.to(at::kDouble).view({n, groups, -1}) - perGroup(params.zeroPoint);
  return (values * perGroup(fp4 ? quant::fp4Divisor(params, scheme.dtype) : params.scale)).view({n, k});
}

// An output's bits depend on its row and column only: not on the thread count, the rows beside it,
// or more outputs (a fourth panel of 32, the third one full); the bias is added to the finished sum.
template <typename Gemm>
void expectBitsOfRowAndColumnOnly(const Gemm& gemm, const at::Tensor& q, const QParams& params, const QScheme& scheme,
                                  const at::Tensor& x, const at::Tensor& bias) {
  const at::Tensor y = *gemm.forward(x, bias);
  EXPECT_TRUE(at::equal(onOneThread([&] { return *gemm.forward(x, bias); }), y));
  EXPECT_TRUE(at::equal(*gemm.forward(x.slice(1, 2, 9), bias), y.slice(1, 2, 9)));
  EXPECT_TRUE(at::equal(*gemm.forward(x, at::Tensor()) + bias, y));
  const int64_t n = q.size(0);
  const at::Tensor wider = at::cat({q, q.slice(0, 0, 40)});
  QParams widerParams = params;
  if (params.scale.numel() > 1) {
    widerParams = {at::cat({params.scale, params.scale.slice(0, 0, 40)}),
                   at::cat({params.zeroPoint, params.zeroPoint.slice(0, 0, 40)}), params.globalScale};
  }
  const at::Tensor widerY = *Gemm(wider, widerParams, scheme).forward(x, at::Tensor());
  EXPECT_TRUE(at::equal(widerY.slice(-1, 0, n), *gemm.forward(x, at::Tensor())));
  // More rows than one block of the kernels (512 and 256): the rows past it as they are alone.
  at::manual_seed(14);
  const at::Tensor tall = at::randn({600, q.size(1)});
  EXPECT_TRUE(at::equal(gemm.forward(tall, bias)->slice(0, 517, 600), *gemm.forward(tall.slice(0, 517, 600), bias)));
  // No GEMM for other inputs, nor where autograd records the input.
  EXPECT_FALSE(gemm.forward(x.to(at::kDouble), bias));
  EXPECT_FALSE(gemm.forward(x.clone().requires_grad_(), bias));
}

// Inputs with an all-zero row, an outlier and a row of tiny values.
at::Tensor groupedInput() {
  at::manual_seed(12);
  at::Tensor x = at::randn({2, 41, 384});
  x[0][3].zero_();
  x[1][5][7] = 3.0e4f;
  x[1][6].mul_(1e-30f);
  return x;
}

// GroupedBf16Linear, called on every CPU that can run its kernel (QuantLinear uses it on Zen 5
// only): within 2⁻¹⁶ plus the fp32 sums' rounding of the exact Σ x·(q − z)·s, relative to Σ|x·w|.
TEST(GroupedBf16Linear, IsTheDequantizedProductWithinTwoPartsOfTheInput) {
  if (!quant::detail::canRunAvx512Bf16Gemm()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  const at::Tensor x = groupedInput(), bias = at::randn({67}), weight = at::randn({67, 384}) * 0.05f;
  for (const QScheme& scheme : groupedSchemes()) {
    SCOPED_TRACE(scheme.name());
    const QParams params = quant::computeQParams(weight, scheme);
    const at::Tensor q = quant::quantize(weight, params, scheme);
    ASSERT_TRUE(GroupedBf16Linear::supports(scheme, q, params));
    const GroupedBf16Linear gemm(q, params, scheme);
    const std::optional<at::Tensor> y = gemm.forward(x, bias);
    ASSERT_TRUE(y.has_value());
    EXPECT_EQ(y->sizes(), (std::vector<int64_t>{2, 41, 67}));
    const int64_t groups = scheme.scope == QScope::kPerGroup ? 384 / scheme.groupSize : 1;
    const at::Tensor w = exactWeight(q, params, scheme);
    const at::Tensor xd = x.reshape({-1, 384}).to(at::kDouble);
    const at::Tensor exact = at::matmul(xd, w.t()) + bias.to(at::kDouble);
    const at::Tensor magnitude = at::matmul(xd.abs(), w.abs().t()) + bias.to(at::kDouble).abs();
    const double unit = 1.01 * std::ldexp(1.0, -16) + (384 + 2 * groups + 3) * std::ldexp(1.0, -24);
    const at::Tensor err = (y->reshape({-1, 67}).to(at::kDouble) - exact).abs();
    EXPECT_TRUE((err <= magnitude * unit).all().item<bool>())
        << "worst error / bound " << (err / (magnitude * unit)).max().item<double>();
    EXPECT_TRUE(at::equal((*y)[0][3], bias));
    expectBitsOfRowAndColumnOnly(gemm, q, params, scheme, x, bias);
  }
  // Far closer than one bf16 GEMM of x, which this replaces.
  const QScheme w4{QDtype::kInt4, QScope::kPerGroup, true, 64};
  const QParams params = quant::computeQParams(weight, w4);
  const at::Tensor q = quant::quantize(weight, params, w4);
  const at::Tensor dequantized = quant::dequantize(q, params, w4);
  const at::Tensor exact = at::matmul(x.to(at::kDouble), dequantized.to(at::kDouble).t());
  const at::Tensor y = *GroupedBf16Linear(q, params, w4).forward(x, at::Tensor());
  const at::Tensor oneBf16 = at::matmul(x.to(at::kBFloat16).to(at::kDouble), dequantized.to(at::kDouble).t());
  EXPECT_LT((y.to(at::kDouble) - exact).abs().max().item<double>() * 20, (oneBf16 - exact).abs().max().item<double>());
}

// GroupedInt8Linear's output for x against the exact product: within Σ_blocks (max|x| · Σ|w|) /
// 32512 (the input's two int8 parts), plus the fp32 rounding of the block sums, their scaling and
// the bias, relative to Σ|x·w| + |b|.
void expectWithinTwoInt8Parts(const at::Tensor& y, const at::Tensor& x, const at::Tensor& q, const QParams& params,
                              const QScheme& scheme, const at::Tensor& bias) {
  const int64_t n = q.size(0), k = q.size(1);
  const int64_t block = quant::detail::groupedInt8Block(scheme.scope == QScope::kPerGroup ? scheme.groupSize : k);
  const int64_t blocks = k / block;
  const at::Tensor xd = x.reshape({-1, k}).to(at::kDouble), w = exactWeight(q, params, scheme);
  const at::Tensor exact = at::matmul(xd, w.t()) + bias.to(at::kDouble);
  const at::Tensor magnitude = at::matmul(xd.abs(), w.abs().t()) + bias.to(at::kDouble).abs();
  const at::Tensor inputBound =
      at::matmul(std::get<0>(xd.abs().view({-1, blocks, block}).max(2)), w.abs().view({n, blocks, block}).sum(2).t()) /
      32512.0;
  const at::Tensor bound = inputBound * 1.01 + (magnitude + inputBound) * ((blocks + 4) * std::ldexp(1.0, -24));
  const at::Tensor err = (y.reshape({-1, n}).to(at::kDouble) - exact).abs();
  EXPECT_TRUE((err <= bound).all().item<bool>()) << "worst error / bound " << (err / bound).max().item<double>();
}

// GroupedInt8Linear, called on every CPU that can run its kernel (QuantLinear uses it on Zen 4
// only).
TEST(GroupedInt8Linear, IsTheDequantizedProductWithinTwoInt8PartsOfEachBlockOfTheInput) {
  if (!quant::detail::canRunAvx512VnniGemm()) GTEST_SKIP() << "this CPU has no AVX512-VNNI";
  const at::Tensor x = groupedInput(), bias = at::randn({67}), weight = at::randn({67, 384}) * 0.05f;
  for (const QScheme& scheme : groupedSchemes()) {
    SCOPED_TRACE(scheme.name());
    const QParams params = quant::computeQParams(weight, scheme);
    const at::Tensor q = quant::quantize(weight, params, scheme);
    if (!GroupedInt8Linear::supports(scheme, q, params)) {
      // Asymmetric int8 codes span 255 around their zero point: their Linears keep the fp32 GEMM.
      EXPECT_TRUE(scheme.dtype == QDtype::kInt8 && !scheme.symmetric);
      continue;
    }
    const GroupedInt8Linear gemm(q, params, scheme);
    const std::optional<at::Tensor> y = gemm.forward(x, bias);
    ASSERT_TRUE(y.has_value());
    EXPECT_EQ(y->sizes(), (std::vector<int64_t>{2, 41, 67}));
    expectWithinTwoInt8Parts(*y, x, q, params, scheme, bias);
    EXPECT_TRUE(at::equal((*y)[0][3], bias));
    expectBitsOfRowAndColumnOnly(gemm, q, params, scheme, x, bias);
  }
  const QScheme w4{QDtype::kInt4, QScope::kPerGroup, true, 64};
  const QParams params = quant::computeQParams(weight, w4);
  const at::Tensor q = quant::quantize(weight, params, w4);
  const GroupedInt8Linear gemm(q, params, w4);
  // Without outliers, several times closer than one bf16 GEMM of x.
  const at::Tensor plain = at::randn({64, 384});
  const at::Tensor dequantized = quant::dequantize(q, params, w4).to(at::kDouble);
  const at::Tensor exact = at::matmul(plain.to(at::kDouble), dequantized.t());
  const at::Tensor oneBf16 = at::matmul(plain.to(at::kBFloat16).to(at::kDouble), dequantized.t());
  EXPECT_LT((gemm.forward(plain, at::Tensor())->to(at::kDouble) - exact).abs().max().item<double>() * 8,
            (oneBf16 - exact).abs().max().item<double>());
  // A NaN or an infinity makes its row's outputs NaN and leaves the other rows as they were; a
  // block below FLT_MIN · 127 counts as zeros.
  at::Tensor odd = plain.slice(0, 0, 4).clone();
  odd[0][5] = std::numeric_limits<float>::quiet_NaN();
  odd[1][300] = std::numeric_limits<float>::infinity();
  odd[2].fill_(1e-37f);
  const at::Tensor y = *gemm.forward(odd, bias);
  EXPECT_TRUE(y.slice(0, 0, 2).isnan().all().item<bool>());
  EXPECT_TRUE(at::equal(y[2], bias));
  EXPECT_TRUE(at::equal(y[3], (*gemm.forward(plain, bias))[3]));
}

// What GroupedBf16Linear takes, on any CPU: integer or FP4 codes with even groups that divide K,
// zero points that keep q − z exact in bf16.
TEST(GroupedBf16Linear, SupportsIntegerCodesWithEvenGroupsAndZeroPointsWithin128) {
  const at::Tensor codes = at::zeros({4, 8}, at::kChar), odd = at::zeros({4, 9}, at::kChar);
  const QParams none{at::ones({4, 1}), at::zeros({4, 1}, at::kInt), at::Tensor()};
  EXPECT_TRUE(GroupedBf16Linear::supports({QDtype::kInt8, QScope::kPerChannel, true, 0}, codes, none));
  EXPECT_TRUE(GroupedBf16Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 4}, codes, none));
  EXPECT_FALSE(GroupedBf16Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 3}, odd, none));
  EXPECT_FALSE(GroupedBf16Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 6}, codes, none));
  EXPECT_FALSE(GroupedBf16Linear::supports({QDtype::kInt8, QScope::kPerChannel, true, 0}, odd, none));
  EXPECT_TRUE(
      GroupedBf16Linear::supports({QDtype::kMxfp4, QScope::kPerGroup, true, 32}, at::zeros({4, 64}, at::kByte), none));
  EXPECT_FALSE(
      GroupedBf16Linear::supports({QDtype::kMxfp4, QScope::kPerGroup, true, 32}, at::zeros({4, 64}, at::kChar), none));
  EXPECT_FALSE(GroupedBf16Linear::supports({QDtype::kFp8E4m3, QScope::kPerChannel, true, 0},
                                           at::zeros({4, 8}, at::kFloat8_e4m3fn), none));
  const QParams far{at::ones({4, 1}), at::full({4, 1}, 129, at::kInt), at::Tensor()};
  EXPECT_FALSE(GroupedBf16Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, codes, far));
  const QParams edge{at::ones({4, 1}), at::full({4, 1}, -128, at::kInt), at::Tensor()};
  EXPECT_TRUE(GroupedBf16Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, codes, edge));
}

// The kernel's edges: a single row (decoding) and rows left over from its 4-row steps, a single
// block (its bias added after one scaling), groups of two blocks, blocks that end inside a vector
// of 16 inputs, and outputs that end inside one.
TEST(GroupedInt8Linear, CoversSingleRowsSingleBlocksWideGroupsAndPartialVectors) {
  if (!quant::detail::canRunAvx512VnniGemm()) GTEST_SKIP() << "this CPU has no AVX512-VNNI";
  at::manual_seed(15);
  for (const auto& [scheme, k] : {std::pair{QScheme{QDtype::kInt8, QScope::kPerChannel, true, 0}, int64_t{64}},
                                  std::pair{QScheme{QDtype::kInt4, QScope::kPerGroup, true, 192}, int64_t{384}},
                                  std::pair{QScheme{QDtype::kInt4, QScope::kPerGroup, false, 20}, int64_t{400}}}) {
    SCOPED_TRACE(scheme.name() + " K " + std::to_string(k));
    const at::Tensor weight = at::randn({37, k}) * 0.05f, bias = at::randn({37});
    const QParams params = quant::computeQParams(weight, scheme);
    const at::Tensor q = quant::quantize(weight, params, scheme);
    ASSERT_TRUE(GroupedInt8Linear::supports(scheme, q, params));
    const GroupedInt8Linear gemm(q, params, scheme);
    const at::Tensor x = at::randn({5, k});
    const at::Tensor y = *gemm.forward(x, bias);
    expectWithinTwoInt8Parts(y, x, q, params, scheme, bias);
    EXPECT_TRUE(at::equal(*gemm.forward(x, at::Tensor()) + bias, y));
    for (int64_t row = 0; row < 5; ++row) EXPECT_TRUE(at::equal(*gemm.forward(x[row], bias), y[row]));
  }
}

// The panels' layout, on every CPU (the GEMM that reads them needs AVX512-VNNI): panels of 32 rows,
// each run of four columns holding the rows' four codes side by side as code + 128, a last panel
// padded with zero bytes, and the scales per panel, group and row; rows read with their stride.
TEST(GroupedInt8Panels, HoldEachPanelsRowsSideBySideFourCodesAtATime) {
  const int64_t n = 37, k = 24, group = 8, groups = k / group, ldv = k + 5, panels = 2;
  std::vector<int8_t> codes(static_cast<size_t>(n * ldv));
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<int8_t>(static_cast<int>(i * 37 % 256) - 128);
  std::vector<float> scales(static_cast<size_t>(n * groups));
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.5F + static_cast<float>(i);
  const quant::detail::GroupedInt8Panels packed =
      quant::detail::packGroupedInt8(codes.data(), ldv, scales.data(), groups, n, k, group);
  ASSERT_EQ(packed.values.size(), static_cast<size_t>(panels * 32 * k));
  ASSERT_EQ(packed.scales.size(), static_cast<size_t>(panels * 32 * groups));
  for (int64_t panel = 0; panel < panels; ++panel) {
    for (int64_t r = 0; r < 32; ++r) {
      const int64_t row = panel * 32 + r;
      for (int64_t c = 0; c < k; ++c) {
        const uint8_t expected =
            row < n ? static_cast<uint8_t>(codes[static_cast<size_t>(row * ldv + c)] + 128) : uint8_t{0};
        ASSERT_EQ(packed.values[static_cast<size_t>(panel * 32 * k + (c / 4 * 32 + r) * 4 + c % 4)], expected)
            << "row " << row << " column " << c;
      }
      for (int64_t g = 0; g < groups; ++g) {
        EXPECT_EQ(packed.scales[static_cast<size_t>((panel * groups + g) * 32 + r)],
                  row < n ? scales[static_cast<size_t>(row * groups + g)] : 0.0F);
      }
    }
  }
}

// Both grouped GEMMs name an input of the wrong width, and a weight they cannot run.
TEST(GroupedInt8Linear, NamesAnInputOfTheWrongWidthAndCodesItCannotRun) {
  const QScheme w4{QDtype::kInt4, QScope::kPerGroup, true, 64};
  const at::Tensor weight = at::randn({8, 128});
  const QParams params = quant::computeQParams(weight, w4);
  const at::Tensor q = quant::quantize(weight, params, w4);
  const auto message = [](const auto& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string wrongWidth = "a quantized Linear of 128 inputs got an input of shape [3, 127]";
  if (quant::detail::canRunAvx512VnniGemm()) {
    EXPECT_NE(message([&] {
                GroupedInt8Linear(q, params, w4).forward(at::randn({3, 127}), at::Tensor());
              }).find(wrongWidth),
              std::string::npos);
  }
  if (quant::detail::canRunAvx512Bf16Gemm()) {
    EXPECT_NE(message([&] {
                GroupedBf16Linear(q, params, w4).forward(at::randn({3, 127}), at::Tensor());
              }).find(wrongWidth),
              std::string::npos);
  }
  const QScheme g12{QDtype::kInt4, QScope::kPerGroup, true, 12};
  EXPECT_NE(message([&] {
              GroupedInt8Linear(at::zeros({8, 48}, at::kChar), params, g12);
            })
                .find("GroupedInt8Linear takes int8, int4 or FP4 codes [N, K] with blocks of 16 to 128 inputs dividing "
                      "the group and every q − z within [-128, 127], got [8, 48] Char of w int4_per_group_sym"),
            std::string::npos);
}

// Fp4Linear, called on every CPU that can run its kernel (QuantLinear uses it on AMD Zen 4 and
// later): fake quantization's real numbers, within the fp32 rounding of the block sums, their
// scaling and the bias; an output's bits independent of the thread count and of the rows around it.
TEST(Fp4Linear, IsFakeQuantizationsProductWithExactBlockSums) {
  if (!quant::detail::canRunAvx512VnniGemm()) GTEST_SKIP() << "this CPU has no AVX512-VNNI";
  const at::Tensor x = groupedInput(), bias = at::randn({67}), weight = at::randn({67, 384}) * 0.05f;
  for (const QScheme& scheme : {QScheme{QDtype::kNvfp4, QScope::kPerGroup, true, quant::kNvfp4GroupSize},
                                QScheme{QDtype::kMxfp4, QScope::kPerGroup, true, quant::kMxfp4GroupSize}}) {
    SCOPED_TRACE(scheme.name());
    const QParams params = quant::computeQParams(weight, scheme);
    const at::Tensor q = quant::quantize(weight, params, scheme);
    ActivationQuant input{scheme, {}};
    if (scheme.dtype == QDtype::kNvfp4) input.params.globalScale = quant::nvfp4GlobalScale(x.abs().amax() * 0.5);
    ASSERT_TRUE(Fp4Linear::supports(scheme, q, input));
    const Fp4Linear gemm(q, params, scheme, input);
    const at::Tensor y = *gemm.forward(x, bias);
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 41, 67}));
    const at::Tensor xq = input.apply(x).reshape({-1, 384}).to(at::kDouble);
    const at::Tensor w = quant::dequantize(q, params, scheme).to(at::kDouble);
    const at::Tensor exact = at::matmul(xq, w.t()) + bias.to(at::kDouble);
    const at::Tensor magnitude = at::matmul(xq.abs(), w.abs().t()) + bias.to(at::kDouble).abs();
    const at::Tensor err = (y.reshape({-1, 67}).to(at::kDouble) - exact).abs();
    const at::Tensor bound = magnitude * ((384 / scheme.groupSize + 4) * std::ldexp(1.0, -24));
    EXPECT_TRUE((err <= bound).all().item<bool>()) << "worst error / bound " << (err / bound).max().item<double>();
    EXPECT_TRUE(at::equal(onOneThread([&] { return *gemm.forward(x, bias); }), y));
    EXPECT_TRUE(at::equal(*gemm.forward(x.slice(1, 2, 9), bias), y.slice(1, 2, 9)));
    EXPECT_TRUE(at::equal(*gemm.forward(x, at::Tensor()) + bias, y));
    EXPECT_FALSE(gemm.forward(x.clone().requires_grad_(), bias));
    // Which formats it pairs: the weight's own, with its group size.
    const QScheme other{scheme.dtype == QDtype::kNvfp4 ? QDtype::kMxfp4 : QDtype::kNvfp4, QScope::kPerGroup, true,
                        scheme.dtype == QDtype::kNvfp4 ? quant::kMxfp4GroupSize : quant::kNvfp4GroupSize};
    EXPECT_FALSE(Fp4Linear::supports(scheme, q, ActivationQuant{other, {}}));
    EXPECT_FALSE(Fp4Linear::supports(scheme, q, std::nullopt));
    EXPECT_FALSE(Fp4Linear::supports(QScheme{QDtype::kInt4, QScope::kPerGroup, true, scheme.groupSize},
                                     at::zeros({67, 384}, at::kChar), input));
  }
}

// A W4A4 MXFP4 QuantLinear runs Fp4Linear where the CPU does, fake quantization elsewhere; a W4A4
// NVFP4 one fake quantization, unless it is inference-only (its input's calibrated global scale
// must see the inputs QAT's differentiable forward computes).
TEST(QuantLinear, W4a4Fp4RunsFp4LinearOnAmdWithVnniAndFakeQuantizationElsewhere) {
  at::manual_seed(16);
  Linear linear(at::randn({48, 256}) * 0.05f, at::randn({48}));
  const at::Tensor x = at::randn({3, 17, 256});
  for (const QScheme& scheme : {QScheme{QDtype::kNvfp4, QScope::kPerGroup, true, quant::kNvfp4GroupSize},
                                QScheme{QDtype::kMxfp4, QScope::kPerGroup, true, quant::kMxfp4GroupSize}}) {
    SCOPED_TRACE(scheme.name());
    const QParams params = quant::computeQParams(linear.weight(), scheme);
    ActivationQuant input{scheme, {}};
    if (scheme.dtype == QDtype::kNvfp4) input.params.globalScale = quant::nvfp4GlobalScale(x.abs().amax());
    const auto deployed = QuantLinear::fromLinear(linear, params, scheme, input);
    EXPECT_FALSE(deployed->inferenceOnly());
    const at::Tensor fake = at::linear(input.apply(x), deployed->dequantizedWeight(), linear.bias());
    const at::Tensor kernel = test::fp4LinearRuns()
                                  ? *Fp4Linear(deployed->parameter("weight"), deployed->weightParams(), scheme, input)
                                         .forward(x, linear.bias())
                                  : fake;
    EXPECT_TRUE(at::equal(deployed->forward(x), scheme.dtype == QDtype::kMxfp4 ? kernel : fake));
    // After the first forward, too.
    deployed->setInferenceOnly();
    EXPECT_TRUE(at::equal(deployed->forward(x), kernel));
    EXPECT_TRUE(deployed->inferenceOnly());
    if (test::fp4LinearRuns()) {
      EXPECT_FALSE(at::equal(kernel, fake));
    }
  }
}

// What GroupedInt8Linear takes, on any CPU: integer codes whose q − z all lie within [-128, 127],
// or FP4 codes, with groups that divide K and have a divisor of 16 to 128 that is a multiple of 4.
TEST(GroupedInt8Linear, SupportsCodesWithinAByteOfTheirZeroPointAndBlocksOf16To128) {
  const at::Tensor codes = at::zeros({4, 48}, at::kChar);
  const QParams none{at::ones({4, 1}), at::zeros({4, 1}, at::kInt), at::Tensor()};
  EXPECT_TRUE(GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, true, 0}, codes, none));
  EXPECT_TRUE(GroupedInt8Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 16}, codes, none));
  EXPECT_TRUE(GroupedInt8Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 24}, codes, none));
  EXPECT_FALSE(GroupedInt8Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 12}, codes, none));
  EXPECT_FALSE(GroupedInt8Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 6}, codes, none));
  EXPECT_FALSE(GroupedInt8Linear::supports({QDtype::kInt4, QScope::kPerGroup, true, 20}, codes, none));
  EXPECT_FALSE(
      GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, true, 0}, at::zeros({4, 22}, at::kChar), none));
  EXPECT_FALSE(
      GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, true, 0}, at::zeros({4, 12}, at::kChar), none));
  EXPECT_TRUE(
      GroupedInt8Linear::supports({QDtype::kNvfp4, QScope::kPerGroup, true, 16}, at::zeros({4, 32}, at::kByte), none));
  EXPECT_FALSE(GroupedInt8Linear::supports({QDtype::kFp8E4m3, QScope::kPerChannel, true, 0},
                                           at::zeros({4, 8}, at::kFloat8_e4m3fn), none));
  at::Tensor spread = codes.clone();
  spread[0][0] = 127;
  spread[1][1] = -128;
  EXPECT_TRUE(GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, spread, none));
  const QParams up{at::ones({4, 1}), at::full({4, 1}, 1, at::kInt), at::Tensor()};
  EXPECT_FALSE(GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, spread, up));
  const QParams down{at::ones({4, 1}), at::full({4, 1}, -1, at::kInt), at::Tensor()};
  EXPECT_FALSE(GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, spread, down));
  const QParams high{at::ones({4, 1}), at::full({4, 1}, -127, at::kInt), at::Tensor()};
  EXPECT_TRUE(GroupedInt8Linear::supports({QDtype::kInt8, QScope::kPerChannel, false, 0}, codes, high));
}

// QAT's end2end step runs weight-only Linears it does not train inside its autograd graph: their
// forward keeps the input's gradient on every CPU, whichever GEMM runs without one.
TEST(QuantLinear, WeightOnlyForwardRecordsTheInputsGradient) {
  at::manual_seed(13);
  Linear linear(at::randn({48, 256}) * 0.05f, at::randn({48}));
  const QScheme w4{QDtype::kInt4, QScope::kPerGroup, true, 64};
  const auto deployed = QuantLinear::fromLinear(linear, quant::computeQParams(linear.weight(), w4), w4, std::nullopt);
  const at::Tensor x = at::randn({3, 17, 256}).requires_grad_();
  const at::Tensor y = deployed->forward(x);
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  const at::Tensor expected = deployed->dequantizedWeight().sum(0).expand({3, 17, 256});
  EXPECT_TRUE(at::allclose(x.grad(), expected, 1e-5, 1e-6));
}

// y = (Σ fx·fw) · (sx·sw) + b with the sum in double, rounded to fp32 once: Fp8Linear's result
// differs from it by the fp32 accumulation only.
at::Tensor fp8Reference(const at::Tensor& x, const ActivationQuant& act, const at::Tensor& qw, const at::Tensor& sw,
                        const at::Tensor& bias) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const QParams p = act.isDynamic() ? quant::computeQParams(flat, act.scheme) : act.params;
  const at::Tensor fx = quant::quantize(flat, p, act.scheme).to(at::kDouble);
  return scaledReference(x, at::matmul(fx, qw.to(at::kDouble).t()), p, sw, bias);
}

TEST(Fp8Linear, IsTheE4m3ProductSumTimesTheScalesWithinFp32Accumulation) {
  at::manual_seed(8);
  const at::Tensor w = at::randn({24, 300});
  at::Tensor x = at::randn({2, 5, 300}) * 2;
  x[0][3].zero_();  // an all-zero token: its per-token scale is the epsilon floor, its values 0
  const QScheme dynamic{QDtype::kFp8E4m3, QScope::kPerToken, true, 0};
  const QScheme perTensor{QDtype::kFp8E4m3, QScope::kPerTensor, true, 0};
  // Static parameters from a quarter of the range: values saturate at ±448.
  const ActivationQuant cases[] = {{dynamic, {}}, {perTensor, quant::computeQParams(x * 0.25, perTensor)}};
  for (const QScheme& weightScheme : {perTensor, QScheme{QDtype::kFp8E4m3, QScope::kPerChannel, true, 0}}) {
    const QParams wp = quant::computeQParams(w, weightScheme);
    const at::Tensor qw = quant::quantize(w, wp, weightScheme);
    const at::Tensor sw = wp.scale.reshape({-1}).expand({24});
    const Fp8Linear linear(qw, wp.scale);
    for (const ActivationQuant& act : cases) {
      for (const at::Tensor& bias : {at::Tensor(), at::randn({24})}) {
        ASSERT_TRUE(Fp8Linear::supports(weightScheme, act));
        const std::optional<at::Tensor> y = linear.forward(x, act, bias);
        ASSERT_TRUE(y.has_value());
        const at::Tensor exact = fp8Reference(x, act, qw, sw, bias);
        const std::string what = weightScheme.name() + " · " + act.scheme.name();
        EXPECT_LT((*y - exact).abs().max().item<double>(), 1e-6 * exact.abs().max().item<double>()) << what;
        const at::Tensor fake =
            at::linear(act.apply(x), quant::dequantize(qw, wp, weightScheme), bias.defined() ? bias : at::Tensor());
        EXPECT_LT((*y - fake).abs().max().item<double>(), 1e-5 * fake.abs().max().item<double>()) << what;
      }
    }
    EXPECT_TRUE(at::equal(linear.forward(x, cases[0], {})->select(0, 0).select(0, 3), at::zeros({24})));
    EXPECT_FALSE(linear.forward(x.to(at::kDouble), cases[0], {}).has_value());
  }
}

// Linears that read one input, as q/k/v and gate/up run: each output is what the Linear's own
// QuantGemm gives. The int8 sums are exact, so bit for bit; the FP8 GEMM of the stacked weights
// gives the same bits where each output column is its own dot product (MKL's strict mode: checked
// in exitWithThreadInvariance), and within fp32 rounding elsewhere.
TEST(SharedInputGemm, GivesEachLinearsOwnQuantGemmOutput) {
  at::manual_seed(12);
  const at::Tensor x = at::randn({2, 19, 96}) * 3;
  const std::vector<int64_t> outputs{40, 8, 8};
  const auto check = [&](const QScheme& weightScheme, const ActivationQuant& act, const std::vector<bool>& bias) {
    std::vector<SharedInputGemm::Member> members;
    std::vector<at::Tensor> own;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const at::Tensor w = at::randn({outputs[i], 96});
      const QParams wp = quant::computeQParams(w, weightScheme);
      const at::Tensor qw = quant::quantize(w, wp, weightScheme);
      const at::Tensor b = bias[i] ? at::randn({outputs[i]}) : at::Tensor();
      members.push_back({nullptr, qw, wp.scale, b});
      own.push_back(*QuantGemm(qw, wp.scale, weightScheme, act).forward(x, act, b));
    }
    const SharedInputGemm shared(members, weightScheme, act);
    const std::optional<std::vector<at::Tensor>> y = shared.forward(x, act);
    ASSERT_TRUE(y.has_value());
    const bool fp8 = weightScheme.dtype == QDtype::kFp8E4m3;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const std::string what = weightScheme.name() + " · " + act.scheme.name() + ", Linear " + std::to_string(i) +
                               (bias[i] ? " with bias" : "");
      ASSERT_EQ((*y)[i].sizes(), own[i].sizes()) << what;
      // FP8: views of one stacked GEMM's output; int8: each Linear's own GEMM of the shared codes.
      EXPECT_EQ((*y)[i].is_contiguous(), !fp8) << what;
      if (fp8) {
        EXPECT_LE(((*y)[i] - own[i]).abs().max().item<float>(), 1e-5f * own[i].abs().max().item<float>()) << what;
      } else {
        EXPECT_TRUE(at::equal((*y)[i], own[i])) << what;
      }
    }
    EXPECT_FALSE(shared.forward(x.to(at::kDouble), act).has_value());
  };
  const QScheme int8Channel{QDtype::kInt8, QScope::kPerChannel, true, 0};
  const QScheme int4Channel{QDtype::kInt4, QScope::kPerChannel, true, 0};
  const QScheme fp8Tensor{QDtype::kFp8E4m3, QScope::kPerTensor, true, 0};
  const QScheme fp8Channel{QDtype::kFp8E4m3, QScope::kPerChannel, true, 0};
  const QScheme int8Static{QDtype::kInt8, QScope::kPerTensor, false, 0};
  const ActivationQuant int8Dynamic{{QDtype::kInt8, QScope::kPerToken, true, 0}, {}};
  const ActivationQuant fp8Dynamic{{QDtype::kFp8E4m3, QScope::kPerToken, true, 0}, {}};
  for (const bool bias : {false, true}) {
    check(int8Channel, int8Dynamic, {bias, bias, bias});
    check(int4Channel, {int8Static, quant::computeQParams(x, int8Static)}, {bias, bias, bias});
    check(fp8Tensor, {fp8Tensor, quant::computeQParams(x * 0.25, fp8Tensor)}, {bias, bias, bias});
    check(fp8Channel, fp8Dynamic, {bias, bias, bias});
  }
  check(int8Channel, int8Dynamic, {true, false, true});  // int8 GEMMs each take their own bias
  // Through QuantLinear: siblings sharing an input run as one.
  std::vector<std::shared_ptr<QuantLinear>> linears;
  std::vector<Module*> siblings;
  for (const int64_t n : outputs) {
    Linear linear(at::randn({n, 96}));
    linears.push_back(
        QuantLinear::fromLinear(linear, quant::computeQParams(linear.weight(), fp8Channel), fp8Channel, fp8Dynamic));
    siblings.push_back(linears.back().get());
  }
  const std::vector<at::Tensor> y = forwardSharingInput(x, siblings);
  for (size_t i = 0; i < outputs.size(); ++i) {
    EXPECT_FALSE(y[i].is_contiguous());
    const at::Tensor own = linears[i]->forward(x);
    EXPECT_LE((y[i] - own).abs().max().item<float>(), 1e-5f * own.abs().max().item<float>()) << "Linear " << i;
  }
  // A LibTorch error inside the group is one line naming the first module and its input.
  const std::string error = test::errorOf(
      [&] {
        forwardSharingInput(at::randn({1, 5, 95}), siblings);
      },
      ErrorCode::kInternal);
  EXPECT_EQ(error.find("QuantLinear with its siblings forward of [1, 5, 95] Float: "), 0u) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  // Another input quantization among them: each runs alone.
  Linear other(at::randn({8, 96}));
  const auto otherLinear = QuantLinear::fromLinear(other, quant::computeQParams(other.weight(), fp8Channel), fp8Channel,
                                                   ActivationQuant{fp8Tensor, quant::computeQParams(x, fp8Tensor)});
  siblings.back() = otherLinear.get();
  EXPECT_TRUE(forwardSharingInput(x, siblings)[0].is_contiguous());
}

TEST(Fp8Linear, SupportsE4m3TensorOrChannelWeightsWithE4m3Activations) {
  const QScheme fp8Tensor{QDtype::kFp8E4m3, QScope::kPerTensor, true, 0};
  const ActivationQuant dynamic{{QDtype::kFp8E4m3, QScope::kPerToken, true, 0}, {}};
  EXPECT_TRUE(Fp8Linear::supports(fp8Tensor, dynamic));
  EXPECT_TRUE(Fp8Linear::supports({QDtype::kFp8E4m3, QScope::kPerChannel, true, 0}, dynamic));
  EXPECT_FALSE(Fp8Linear::supports(fp8Tensor, std::nullopt));
  EXPECT_FALSE(Fp8Linear::supports({QDtype::kFp8E4m3, QScope::kPerGroup, true, 128}, dynamic));
  EXPECT_FALSE(Fp8Linear::supports(fp8Tensor, ActivationQuant{{QDtype::kInt8, QScope::kPerToken, true, 0}, {}}));
  EXPECT_FALSE(Fp8Linear::supports(fp8Tensor, ActivationQuant{{QDtype::kFp8E4m3, QScope::kPerTensor, true, 0}, {}}));
  EXPECT_FALSE(Fp8Linear::supports({QDtype::kInt8, QScope::kPerChannel, true, 0}, dynamic));
  // QuantGemm takes either pair, and nothing else.
  EXPECT_TRUE(QuantGemm::supports(fp8Tensor, dynamic));
  EXPECT_TRUE(QuantGemm::supports({QDtype::kInt8, QScope::kPerChannel, true, 0},
                                  ActivationQuant{{QDtype::kInt8, QScope::kPerToken, true, 0}, {}}));
  EXPECT_FALSE(QuantGemm::supports({QDtype::kInt4, QScope::kPerGroup, true, 64}, std::nullopt));
}

}  // namespace
}  // namespace qpipe
