// Quantization primitives against hand-computed cases (arithmetic in the comments) and, for FP8,
// against LibTorch's own cast over every bf16 bit pattern.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "qpipe/quant.h"
#include "test_helpers.h"

namespace qpipe::quant {
namespace {

at::Tensor floats(std::vector<float> values, at::IntArrayRef shape) {
  return at::tensor(values, at::kFloat).reshape(shape);
}

template <typename T>
std::vector<T> valuesOf(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return {c.data_ptr<T>(), c.data_ptr<T>() + c.numel()};
}

std::vector<uint8_t> bytesOf(const at::Tensor& fp8) {
  return valuesOf<uint8_t>(fp8.view(at::kByte));
}

QScheme scheme(QDtype dtype, QScope scope, bool symmetric = true, int64_t groupSize = 0) {
  return {dtype, scope, symmetric, groupSize};
}

TEST(QuantScheme, ParsesAndPrintsMsmodelslimNames) {
  for (const char* name : {"int8", "int4", "fp8_e4m3", "float"}) {
    EXPECT_EQ(qdtypeName(parseQDtype(name, "w")), name);
  }
  for (const char* name : {"per_tensor", "per_channel", "per_group", "per_token", "per_head"}) {
    EXPECT_EQ(qscopeName(parseQScope(name, "w")), name);
  }
  EXPECT_EQ(scheme(QDtype::kInt8, QScope::kPerToken).name(), "int8_per_token_sym");
  EXPECT_EQ(scheme(QDtype::kInt4, QScope::kPerGroup, false, 128).name(), "int4_per_group_asym");
}

TEST(QuantScheme, RejectsUnknownNamesAndInvalidCombinations) {
  EXPECT_EQ(test::errorOf([] { parseQDtype("int3", "p.yaml:4:12 qconfig.weight.dtype"); }, ErrorCode::kConfig),
            "p.yaml:4:12 qconfig.weight.dtype: unknown dtype 'int3'; expected one of int8, int4, fp8_e4m3, nvfp4, "
            "mxfp4, float");
  EXPECT_EQ(test::errorOf([] { parseQScope("per_row", "p.yaml:5:12 qconfig.weight.scope"); }, ErrorCode::kConfig),
            "p.yaml:5:12 qconfig.weight.scope: unknown scope 'per_row'; expected one of per_tensor, per_channel, "
            "per_group, per_token, per_head");
  EXPECT_EQ(
      test::errorOf([] { scheme(QDtype::kFp8E4m3, QScope::kPerTensor, false).validate("act"); }, ErrorCode::kConfig),
      "act: fp8_e4m3 is symmetric only; set symmetric: true");
  EXPECT_EQ(test::errorOf([] { scheme(QDtype::kInt4, QScope::kPerGroup).validate("weight"); }, ErrorCode::kConfig),
            "weight: per_group needs group_size > 0, got 0");
  EXPECT_EQ(test::errorOf([] { scheme(QDtype::kInt4, QScope::kPerChannel, true, 64).validate("weight"); },
                          ErrorCode::kConfig),
            "weight: group_size 64 only applies to per_group, not per_channel");
  EXPECT_EQ(test::errorOf(
                [] {
                  computeQParams(at::zeros({4, 100}), scheme(QDtype::kInt4, QScope::kPerGroup, true, 64));
                },
                ErrorCode::kConfig),
            "per_group with group_size 64 needs [..., in] with in a multiple of 64, got shape [4, 100]");
  EXPECT_EQ(test::errorOf(
                [] {
                  computeQParams(at::zeros({2, 3}), scheme(QDtype::kInt8, QScope::kPerHead));
                },
                ErrorCode::kConfig),
            "per_head needs [batch, heads, seq, head_dim], got shape [2, 3]");
  scheme(QDtype::kInt4, QScope::kPerGroup, false, 128).validate("weight");
}

TEST(QuantInt8, SymmetricPerTensor) {
  const QScheme s = scheme(QDtype::kInt8, QScope::kPerTensor);
  const at::Tensor x = floats({-254, 3, 5, 100, 1}, {5});
  const QParams p = computeQParams(x, s);
  // absmax 254 / 127 = 2.
  EXPECT_EQ(p.scale.sizes(), at::IntArrayRef({1}));
  EXPECT_EQ(p.scale.item<float>(), 2.0f);
  EXPECT_EQ(p.zeroPoint.item<int32_t>(), 0);
  // x/2 = -127, 1.5, 2.5, 50, 0.5; half-to-even: -127, 2, 2, 50, 0.
  const at::Tensor q = quantize(x, p, s);
  EXPECT_EQ(q.scalar_type(), at::kChar);
  EXPECT_EQ(valuesOf<int8_t>(q), (std::vector<int8_t>{-127, 2, 2, 50, 0}));
  EXPECT_EQ(valuesOf<float>(dequantize(q, p, s)), (std::vector<float>{-254, 4, 4, 100, 0}));
}

TEST(QuantInt8, AsymmetricPerTensor) {
  const QScheme s = scheme(QDtype::kInt8, QScope::kPerTensor, false);
  const at::Tensor x = floats({-127.5, 382.5, 0, 1, 3}, {5});
  const QParams p = computeQParams(x, s);
  // scale = 382.5/255 - (-127.5)/255 = 1.5 + 0.5 = 2; zp = round(127.5/2) - 128 = 64 - 128 = -64.
  EXPECT_EQ(p.scale.item<float>(), 2.0f);
  EXPECT_EQ(p.zeroPoint.item<int32_t>(), -64);
  // x/2 - 64 = -127.75, 127.25, -64, -63.5, -62.5 → -128, 127, -64, -64 (even), -62 (even).
  const at::Tensor q = quantize(x, p, s);
  EXPECT_EQ(valuesOf<int8_t>(q), (std::vector<int8_t>{-128, 127, -64, -64, -62}));
  // (q + 64) * 2.
  EXPECT_EQ(valuesOf<float>(dequantize(q, p, s)), (std::vector<float>{-128, 382, 0, 0, 4}));
}

TEST(QuantInt8, RangeAlwaysContainsZeroAndScaleHasEpsFloor) {
  // All-positive data: min widens to 0. sym: 10/127; asym: 10/255 and zp = 0 - 128.
  const at::Tensor x = floats({2, 10}, {2});
  EXPECT_EQ(computeQParams(x, scheme(QDtype::kInt8, QScope::kPerTensor)).scale.item<float>(), 10.0f / 127.0f);
  const QParams asym = computeQParams(x, scheme(QDtype::kInt8, QScope::kPerTensor, false));
  EXPECT_EQ(asym.scale.item<float>(), 10.0f / 255.0f);
  EXPECT_EQ(asym.zeroPoint.item<int32_t>(), -128);
  // All zeros: scale = fp32 eps = 2^-23.
  EXPECT_EQ(computeQParams(at::zeros({3}), scheme(QDtype::kInt8, QScope::kPerTensor)).scale.item<float>(),
            1.0f / 8388608.0f);
}

TEST(QuantInt4, SymmetricPerChannel) {
  const QScheme s = scheme(QDtype::kInt4, QScope::kPerChannel);
  const at::Tensor w = floats({7, -3.5, 1, -14, 2, 3}, {2, 3});
  const QParams p = computeQParams(w, s);
  // Row absmax 7 and 14, / 7 → scales 1 and 2, shape [2, 1].
  EXPECT_EQ(p.scale.sizes(), at::IntArrayRef({2, 1}));
  EXPECT_EQ(valuesOf<float>(p.scale), (std::vector<float>{1, 2}));
  // Row 0: 7, -3.5 → -4 (even), 1. Row 1: -7, 1, 1.5 → 2 (even).
  EXPECT_EQ(valuesOf<int8_t>(quantize(w, p, s)), (std::vector<int8_t>{7, -4, 1, -7, 1, 2}));
}

TEST(QuantInt4, ClampsToMinusEightSeven) {
  const QScheme s = scheme(QDtype::kInt4, QScope::kPerTensor);
  const QParams p{at::ones({1}), at::zeros({1}, at::kInt)};
  EXPECT_EQ(valuesOf<int8_t>(quantize(floats({-9, -8.4, 7.4, 100}, {4}), p, s)), (std::vector<int8_t>{-8, -8, 7, 7}));
}

TEST(QuantInt4, AsymmetricPerGroup) {
  const QScheme s = scheme(QDtype::kInt4, QScope::kPerGroup, false, 2);
  const at::Tensor w = floats({-7.5, 0, 1, 30}, {1, 4});
  const QParams p = computeQParams(w, s);
  // Group {-7.5, 0}: scale = 0/15 + 7.5/15 = 0.5, zp = round(7.5/0.5) - 8 = 7.
  // Group {1, 30}: min widens to 0, scale = 30/15 = 2, zp = round(0) - 8 = -8.
  EXPECT_EQ(p.scale.sizes(), at::IntArrayRef({1, 2}));
  EXPECT_EQ(valuesOf<float>(p.scale), (std::vector<float>{0.5, 2}));
  EXPECT_EQ(valuesOf<int32_t>(p.zeroPoint), (std::vector<int32_t>{7, -8}));
  // -15 + 7 = -8; 0 + 7 = 7; 0.5 - 8 = -7.5 → -8 (even); 15 - 8 = 7.
  const at::Tensor q = quantize(w, p, s);
  EXPECT_EQ(valuesOf<int8_t>(q), (std::vector<int8_t>{-8, 7, -8, 7}));
  // (-8-7)*0.5 = -7.5, 0, (-8+8)*2 = 0, (7+8)*2 = 30.
  EXPECT_EQ(valuesOf<float>(dequantize(q, p, s)), (std::vector<float>{-7.5, 0, 0, 30}));
}

TEST(QuantShapes, PerTokenAndPerHead) {
  // per_token over [2, 3, 4] → [2, 3, 1]: token absmax 127·(1..6) → scales 1..6.
  at::Tensor x = at::zeros({2, 3, 4});
  for (int t = 0; t < 6; ++t) x.view({6, 4})[t][t % 4] = -127.0f * (t + 1);
  const QParams token = computeQParams(x, scheme(QDtype::kInt8, QScope::kPerToken));
  EXPECT_EQ(token.scale.sizes(), at::IntArrayRef({2, 3, 1}));
  EXPECT_EQ(valuesOf<float>(token.scale), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  // per_head over [1, 2, 3, 2] → [1, 2, 1, 1]: head 0 absmax 448 → 1, head 1 absmax 896 → 2.
  at::Tensor kv = at::zeros({1, 2, 3, 2});
  kv[0][0][1][1] = 448.0f;
  kv[0][1][2][0] = -896.0f;
  const QParams head = computeQParams(kv, scheme(QDtype::kFp8E4m3, QScope::kPerHead));
  EXPECT_EQ(head.scale.sizes(), at::IntArrayRef({1, 2, 1, 1}));
  EXPECT_EQ(valuesOf<float>(head.scale), (std::vector<float>{1, 2}));
}

TEST(QuantFp8, PerTensorHandComputed) {
  const QScheme s = scheme(QDtype::kFp8E4m3, QScope::kPerTensor);
  // absmax 896 / 448 = 2. x/2 = -448, 1.0625, 1.1875, 2^-9, 2^-10, 3·2^-10.
  const at::Tensor x = floats({-896, 2.125, 2.375, 1.0f / 256, 1.0f / 512, 3.0f / 512}, {6});
  const QParams p = computeQParams(x, s);
  EXPECT_EQ(p.scale.item<float>(), 2.0f);
  // -448 = S.1111.110 = 0xFE. 1.0625 is halfway 1.0 (0x38) / 1.125 (0x39): even → 0x38.
  // 1.1875 is halfway 1.125 (0x39) / 1.25 (0x3A): even → 0x3A. 2^-9 is the smallest subnormal
  // 0x01; 2^-10 is halfway 0 / 0x01 → 0x00; 3·2^-10 halfway 0x01 / 0x02 → 0x02.
  const at::Tensor q = quantize(x, p, s);
  EXPECT_EQ(q.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(bytesOf(q), (std::vector<uint8_t>{0xFE, 0x38, 0x3A, 0x01, 0x00, 0x02}));
  EXPECT_EQ(valuesOf<float>(dequantize(q, p, s)), (std::vector<float>{-896, 2, 2.5, 1.0f / 256, 0, 1.0f / 128}));
  // The scale floor: all zeros → 1e-12 / 448.
  EXPECT_EQ(computeQParams(at::zeros({2}), s).scale.item<float>(), 1e-12f / 448.0f);
}

TEST(QuantFp8, FromFp8E4m3IsLibTorchsCastOfEveryCode) {
  // Every code in a 2-D layout, then a view that is not contiguous.
  const at::Tensor codes = at::arange(0, 256, at::kInt).to(at::kByte).view(at::kFloat8_e4m3fn).reshape({16, 16});
  const at::Tensor ours = fromFp8E4m3(codes);
  ASSERT_EQ(ours.sizes(), codes.sizes());
  EXPECT_TRUE(at::equal(ours.view(at::kInt), codes.to(at::kFloat).view(at::kInt)));
  EXPECT_TRUE(at::equal(fromFp8E4m3(codes.t()).view(at::kInt), codes.t().to(at::kFloat).contiguous().view(at::kInt)));
  EXPECT_EQ(test::errorOf([&] { fromFp8E4m3(at::zeros({2})); }, ErrorCode::kInternal)
                .rfind("fromFp8E4m3 takes E4M3FN codes, got Float [check", 0),
            0u);
}

// Every bf16 bit pattern through toFp8E4m3 against LibTorch's cast of the clamped value.
TEST(QuantFp8, AllBf16PatternsMatchLibTorchCast) {
  std::vector<uint16_t> patterns(65536);
  for (uint32_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<uint16_t>(i);
  const at::Tensor bf16 = at::from_blob(patterns.data(), {65536}, at::kShort).view(at::kBFloat16).clone();
  const at::Tensor x = bf16.to(at::kFloat);
  const std::vector<uint8_t> ours = bytesOf(toFp8E4m3(bf16));
  const std::vector<uint8_t> viaQuantize =
      bytesOf(quantize(bf16, {at::ones({1}), at::zeros({1}, at::kInt)}, scheme(QDtype::kFp8E4m3, QScope::kPerTensor)));
  // The same fp32 values through quantize's one-pass row kernel, and through fakeQuantize's.
  const std::vector<uint8_t> viaRowKernel =
      bytesOf(quantize(x, {at::ones({1}), at::zeros({1}, at::kInt)}, scheme(QDtype::kFp8E4m3, QScope::kPerTensor)));
  const std::vector<float> fake = valuesOf<float>(
      fakeQuantize(x, {at::ones({1}), at::zeros({1}, at::kInt)}, scheme(QDtype::kFp8E4m3, QScope::kPerTensor)));
  const std::vector<float> decoded = valuesOf<float>(toFp8E4m3(bf16).to(at::kFloat));
  const std::vector<uint8_t> torch = bytesOf(x.clamp(-448, 448).to(at::kFloat8_e4m3fn));
  const std::vector<float> values = valuesOf<float>(x);
  int finite = 0;
  for (uint32_t i = 0; i < patterns.size(); ++i) {
    const uint8_t sign = (patterns[i] & 0x8000) ? 0x80 : 0x00;
    ASSERT_EQ(ours[i], viaQuantize[i]) << "pattern " << i;
    ASSERT_EQ(ours[i], viaRowKernel[i]) << "pattern " << i;
    if (!std::isnan(values[i])) {
      ASSERT_EQ(std::bit_cast<uint32_t>(fake[i]), std::bit_cast<uint32_t>(decoded[i])) << "pattern " << i;
    }
    if (std::isfinite(values[i])) {
      ++finite;
      ASSERT_EQ(ours[i], torch[i]) << "bf16 pattern 0x" << std::hex << i << " value " << values[i];
    } else if (std::isinf(values[i])) {
      ASSERT_EQ(ours[i], sign | 0x7E) << "inf saturates to ±448, pattern 0x" << std::hex << i;
    } else {
      ASSERT_EQ(ours[i], sign | 0x7F) << "NaN stays NaN with its sign, pattern 0x" << std::hex << i;
    }
  }
  // 2·(255 exponents · 128 mantissas) finite patterns.
  EXPECT_EQ(finite, 65280);
}

TEST(QuantFloat, OffIsIdentity) {
  const QScheme s = scheme(QDtype::kFloat, QScope::kPerTensor);
  const at::Tensor x = floats({1.3f, -2.7f}, {2}).to(at::kBFloat16);
  const QParams p = computeQParams(x, s);
  EXPECT_TRUE(at::equal(fakeQuantize(x, p, s), x));
}

TEST(QuantFake, KeepsInputDtype) {
  const QScheme s = scheme(QDtype::kInt8, QScope::kPerTensor);
  const at::Tensor x = floats({-254, 3}, {2}).to(at::kBFloat16);
  const at::Tensor y = fakeQuantize(x, computeQParams(x, s), s);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  // 3/2 = 1.5 → 2 → 4.
  EXPECT_EQ(valuesOf<float>(y.to(at::kFloat)), (std::vector<float>{-254, 4}));
}

// quantize's and fakeQuantize's one-pass kernels (fp32, every int and FP8 scope) against the
// definition in tensor ops: the same bits.
TEST(QuantFake, OnePassKernelsAreTheTensorOpMathBitForBit) {  // quantize, fakeQuantize, dequantize
  at::manual_seed(11);
  // Rows: random, ties at .5 after scaling, saturating both ends, an all-zero token (its
  // per-token scale is the epsilon floor), large values; odd widths leave a vector tail.
  at::Tensor x = at::randn({7, 37}) * 3;
  x[1] = at::arange(37, at::kFloat) * 0.5 - 9;
  x[2] = at::linspace(-1e4, 1e4, 37);
  x[3].zero_();
  x[4] = at::randn({37}) * 1e30;
  const at::Tensor wide = at::randn({3, 2, 1029});
  const at::Tensor weight = at::randn({24, 64});
  for (const QDtype dtype : {QDtype::kInt8, QDtype::kInt4, QDtype::kFp8E4m3}) {
    for (const QScope scope : {QScope::kPerTensor, QScope::kPerToken, QScope::kPerChannel, QScope::kPerGroup}) {
      for (const bool symmetric : {true, false}) {
        if (dtype == QDtype::kFp8E4m3 && (!symmetric || scope == QScope::kPerGroup)) continue;
        const QScheme s = scheme(dtype, scope, symmetric, scope == QScope::kPerGroup ? 16 : 0);
        const bool weightScope = scope == QScope::kPerChannel || scope == QScope::kPerGroup;
        const std::vector<at::Tensor> inputs = weightScope
                                                   ? std::vector<at::Tensor>{weight, weight.t().contiguous().t()}
                                                   : std::vector<at::Tensor>{x, wide, x.t()};  // .t(): not contiguous
        for (const at::Tensor& input : inputs) {
          // Static: parameters fixed on other data, so that values saturate.
          for (const QParams& params : {computeQParams(input, s), computeQParams(input * 0.25, s)}) {
            // per_group parameters [out, in / group] apply to [out, in / group, group].
            const auto widen = [&](const at::Tensor& t) { return scope == QScope::kPerGroup ? t.unsqueeze(-1) : t; };
            const at::Tensor scale = widen(params.scale.to(at::kFloat));
            const at::Tensor zero = widen(params.zeroPoint.to(at::kFloat));
            const at::Tensor in = scope == QScope::kPerGroup ? input.reshape({24, 4, 16}) : input;
            at::Tensor fake;
            if (dtype == QDtype::kFp8E4m3) {
              fake = toFp8E4m3(in / scale).to(at::kFloat) * scale;
            } else {
              const at::Tensor codes = at::round(in / scale + zero).clamp(qmin(dtype), qmax(dtype)).to(at::kChar);
              EXPECT_TRUE(at::equal(quantize(input, params, s), codes.reshape(input.sizes()))) << s.name();
              fake = (codes.to(at::kFloat) - zero) * scale;  // through int8: zeros lose their sign
            }
            fake = fake.reshape(input.sizes());
            EXPECT_TRUE(at::equal(fakeQuantize(input, params, s).view(at::kInt), fake.contiguous().view(at::kInt)))
                << s.name();
            if (dtype != QDtype::kFp8E4m3) {  // dequantize's one-pass kernel on the codes
              EXPECT_TRUE(at::equal(dequantize(quantize(input, params, s), params, s).view(at::kInt),
                                    fake.contiguous().view(at::kInt)))
                  << s.name();
            }
          }
        }
      }
    }
  }
}

TEST(QuantWeight, OnePassIsComputeQParamsThenQuantizeBitForBit) {
  at::manual_seed(12);
  at::Tensor w = at::randn({9, 577}) * 0.05;
  w[1].zero_();
  w[2].fill_(-0.3);
  w[3][100] = 25;
  w[4] = w[4].abs();  // no negative value: the range still contains 0
  for (const QDtype dtype : {QDtype::kInt8, QDtype::kInt4}) {
    const QScheme s = scheme(dtype, QScope::kPerChannel);
    for (const at::Tensor& weight : {w, w.t().contiguous().t(), w.to(at::kBFloat16)}) {
      const auto [params, codes] = quantizeWeight(weight, s);
      const QParams reference = computeQParams(weight, s);
      EXPECT_TRUE(at::equal(params.scale.view(at::kInt), reference.scale.view(at::kInt))) << s.name();
      EXPECT_TRUE(at::equal(params.zeroPoint, reference.zeroPoint)) << s.name();
      EXPECT_TRUE(at::equal(
          codes, at::round(weight.to(at::kFloat) / reference.scale).clamp(qmin(dtype), qmax(dtype)).to(at::kChar)))
          << s.name();
    }
  }
  // A NaN, in the rows' 16-lane body or in their tail, takes the tensor-op path, whose NaN the
  // scale keeps.
  w[5][3] = std::numeric_limits<float>::quiet_NaN();
  w[6][576] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor scales = quantizeWeight(w, scheme(QDtype::kInt8, QScope::kPerChannel)).first.scale;
  EXPECT_TRUE(std::isnan(scales[5].item<float>()));
  EXPECT_TRUE(std::isnan(scales[6].item<float>()));
  EXPECT_FALSE(std::isnan(scales[7].item<float>()));
}

TEST(QuantWeight, OnePassPerGroupIsComputeQParamsThenQuantizeBitForBit) {
  at::manual_seed(13);
  at::Tensor w = at::randn({5, 192}) * 0.05;
  w[1].narrow(0, 64, 64).zero_();  // an all-zero group: the scale's floor
  w[2].narrow(0, 0, 32).fill_(-0.3);
  w[3][100] = 25;
  for (const QDtype dtype : {QDtype::kInt8, QDtype::kInt4}) {
    for (const int64_t group : {32, 64, 192}) {
      const QScheme s = scheme(dtype, QScope::kPerGroup, true, group);
      const auto [params, codes] = quantizeWeight(w, s);
      const QParams reference = computeQParams(w, s);
      ASSERT_EQ(params.scale.sizes(), reference.scale.sizes()) << s.name();
      EXPECT_TRUE(at::equal(params.scale.view(at::kInt), reference.scale.view(at::kInt))) << s.name();
      EXPECT_TRUE(at::equal(params.zeroPoint, reference.zeroPoint)) << s.name();
      EXPECT_TRUE(at::equal(codes, quantize(w, reference, s))) << s.name();
    }
  }
  // A NaN takes the tensor-op path: its group's scale is NaN, the others are not.
  w[4][70] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor scales = quantizeWeight(w, scheme(QDtype::kInt4, QScope::kPerGroup, true, 64)).first.scale;
  EXPECT_TRUE(std::isnan(scales[4][1].item<float>()));
  EXPECT_FALSE(std::isnan(scales[4][0].item<float>()));
}

TEST(QuantParams, PerTokenOnePassIsTheTensorOpsBitForBit) {
  // Random tokens, an all-zero one, all-positive and all-negative ones, signed zeros, infinities
  // and a tail shorter than the vector lanes; int8 and int4, symmetric and not, and E4M3; the
  // tensor ops (minMax, then the range's formula) are the reference.
  at::manual_seed(15);
  for (const int64_t cols : {int64_t{1}, int64_t{77}, int64_t{1536}}) {
    at::Tensor x = at::randn({2, 7, cols}) * 3;
    x[0][1].zero_();
    x[0][2] = x[0][2].abs() + 0.5;
    x[0][3] = -x[0][3].abs() - 0.5;
    x[0][4].fill_(-0.0);
    x[1][5][0] = std::numeric_limits<float>::infinity();
    x[1][6][cols - 1] = -std::numeric_limits<float>::infinity();
    for (const QScheme& s :
         {scheme(QDtype::kInt8, QScope::kPerToken), scheme(QDtype::kInt8, QScope::kPerToken, false),
          scheme(QDtype::kInt4, QScope::kPerToken, false), scheme(QDtype::kFp8E4m3, QScope::kPerToken)}) {
      const QParams ours = computeQParams(x, s);
      const auto [min, max] = minMax(x, s);
      const QParams reference = computeQParams(min, max, s);
      ASSERT_EQ(ours.scale.sizes(), reference.scale.sizes()) << s.name();
      EXPECT_TRUE(at::equal(ours.scale.view(at::kInt), reference.scale.view(at::kInt))) << s.name() << " " << cols;
      EXPECT_TRUE(at::equal(ours.zeroPoint, reference.zeroPoint)) << s.name() << " " << cols;
    }
  }
  // A NaN takes the tensor ops, whose scale carries it.
  at::Tensor x = at::randn({3, 40});
  x[1][33] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor scale = computeQParams(x, scheme(QDtype::kInt8, QScope::kPerToken)).scale;
  EXPECT_TRUE(std::isnan(scale[1].item<float>()));
  EXPECT_FALSE(std::isnan(scale[0].item<float>()));
}

TEST(QuantWeight, ScaledIsTheQuantizedProductBitForBit) {
  // Rows long enough for one scaled block each, and short ones many to a block; per channel and
  // per group; the tensor-op path for a bf16 scale, a scheme without the one-pass path and a NaN.
  at::manual_seed(14);
  for (const auto& [rows, cols] : {std::pair{9, 1536}, std::pair{300, 96}}) {
    at::Tensor w = at::randn({rows, cols}) * 0.05;
    w[1].zero_();
    w[3][10] = 25;
    const at::Tensor by = at::rand({cols}) * 4 + 1e-5;
    for (const QScheme& s :
         {scheme(QDtype::kInt8, QScope::kPerChannel), scheme(QDtype::kInt4, QScope::kPerGroup, true, 32),
          scheme(QDtype::kInt8, QScope::kPerChannel, false)}) {
      const auto [params, codes] = quantizeScaledWeight(w, by, s);
      const auto [expected, expectedCodes] = quantizeWeight(w * by.unsqueeze(0), s);
      EXPECT_TRUE(at::equal(params.scale.view(at::kInt), expected.scale.view(at::kInt))) << s.name() << " " << rows;
      EXPECT_TRUE(at::equal(params.zeroPoint, expected.zeroPoint)) << s.name();
      EXPECT_TRUE(at::equal(codes, expectedCodes)) << s.name() << " " << rows;
    }
    const QScheme perChannel = scheme(QDtype::kInt8, QScope::kPerChannel);
    EXPECT_TRUE(at::equal(quantizeScaledWeight(w, by.to(at::kBFloat16), perChannel).second,
                          quantizeWeight(w * by.to(at::kBFloat16).unsqueeze(0), perChannel).second));
    w[2][5] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(quantizeScaledWeight(w, by, perChannel).first.scale[2].item<float>()));
  }
  EXPECT_EQ(test::errorOf(
                [] {
                  quantizeScaledWeight(at::ones({2, 3}), at::ones({2}), scheme(QDtype::kInt8, QScope::kPerChannel));
                },
                ErrorCode::kInternal)
                .rfind("quantizeScaledWeight takes w [N, K] and K column scales, got [2, 3] and [2] [check", 0),
            0u);
}

TEST(QuantParams, DividedTokensAreTheQuantizedQuotientBitForBit) {
  // Tokens long enough for one block each and short ones many to a block; int8 and int4
  // symmetric on the one-pass path, asymmetric and FP8 through the tensor ops; zero tokens, a
  // NaN, and the error for another scope.
  at::manual_seed(16);
  for (const auto& [rows, cols] : {std::pair{9, 1536}, std::pair{300, 96}}) {
    at::Tensor x = at::randn({rows, cols}) * 3;
    x[1].zero_();
    x[4][7] = 80;
    const at::Tensor divisor = at::rand({cols}) * 4 + 1e-5;
    for (const QScheme& s :
         {scheme(QDtype::kInt8, QScope::kPerToken), scheme(QDtype::kInt4, QScope::kPerToken),
          scheme(QDtype::kInt8, QScope::kPerToken, false), scheme(QDtype::kFp8E4m3, QScope::kPerToken)}) {
      const auto [params, codes] = quantizeDividedTokens(x, divisor, s);
      const at::Tensor quotient = x / divisor;
      const QParams expected = computeQParams(quotient, s);
      ASSERT_EQ(params.scale.sizes(), expected.scale.sizes()) << s.name();
      EXPECT_TRUE(at::equal(params.scale.view(at::kInt), expected.scale.view(at::kInt))) << s.name() << " " << rows;
      EXPECT_TRUE(at::equal(params.zeroPoint, expected.zeroPoint)) << s.name();
      EXPECT_TRUE(at::equal(codes.view(at::kByte), quantize(quotient, expected, s).view(at::kByte))) << s.name();
    }
    x[2][5] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(
        quantizeDividedTokens(x, divisor, scheme(QDtype::kInt8, QScope::kPerToken)).first.scale[2].item<float>()));
  }
  EXPECT_EQ(
      test::errorOf(
          [] {
            quantizeDividedTokens(at::ones({2, 3}), at::ones({3}), scheme(QDtype::kInt8, QScope::kPerTensor));
          },
          ErrorCode::kInternal)
          .rfind("quantizeDividedTokens takes x [M, K], K column divisors and a per_token scheme, got [2, 3], [3] "
                 "and int8_per_tensor_sym [check",
                 0),
      0u);
}

TEST(QuantPack, Int4HandComputed) {
  // u = q + 8 = 0, 1, 8, 15, 9, 10, 11, 12 | 13. Word 0, element k in bits 4k..4k+3 (element 0
  // least significant): nibbles from the top C B A 9 F 8 1 0 → 0xCBA9F810; word 1 = 0xD, the
  // rest padded with u = 0.
  const at::Tensor q = at::tensor(std::vector<int8_t>{-8, -7, 0, 7, 1, 2, 3, 4, 5}, at::kChar).reshape({1, 9});
  const at::Tensor packed = packInt4(q);
  EXPECT_EQ(packed.scalar_type(), at::kInt);
  EXPECT_EQ(packed.sizes(), at::IntArrayRef({1, 2}));
  EXPECT_EQ(valuesOf<int32_t>(packed), (std::vector<int32_t>{static_cast<int32_t>(0xCBA9F810u), 0xD}));
  EXPECT_TRUE(at::equal(unpackInt4(packed, 9), q));
}

TEST(QuantPack, Int4AlongDimZeroForZeroPoints) {
  // Zero points [out = 3, groups = 2] pack along out: column 0 u = 8, 9, 10 → 0xA98;
  // column 1 u = 7, 0, 15 → 0xF07.
  const at::Tensor zp = at::tensor(std::vector<int8_t>{0, -1, 1, -8, 2, 7}, at::kChar).reshape({3, 2});
  const at::Tensor packed = packInt4(zp, 0);
  EXPECT_EQ(packed.sizes(), at::IntArrayRef({1, 2}));
  EXPECT_EQ(valuesOf<int32_t>(packed), (std::vector<int32_t>{0xA98, 0xF07}));
  EXPECT_TRUE(at::equal(unpackInt4(packed, 3, 0), zp));
}

TEST(QuantPack, Int4RoundTripsRandom) {
  const at::Tensor q = at::randint(-8, 8, {5, 37}, at::kChar);
  EXPECT_EQ(packInt4(q).sizes(), at::IntArrayRef({5, 5}));
  EXPECT_TRUE(at::equal(unpackInt4(packInt4(q), 37), q));
  const at::Tensor whole = at::randint(-8, 8, {3, 64}, at::kChar);  // no partial word
  EXPECT_TRUE(at::equal(unpackInt4(packInt4(whole), 64), whole));
}

TEST(QuantPack, Int4UnpacksEveryNibbleAndIgnoresThePadding) {
  // u = 0..15 is q = -8..7; the second word has its top bit set (a negative int32). The last row
  // keeps 3 of 8 nibbles: the five padding nibbles (F) are not codes.
  const at::Tensor packed =
      at::tensor(std::vector<int32_t>{0x76543210, static_cast<int32_t>(0xFEDCBA98u)}, at::kInt).reshape({1, 2});
  EXPECT_EQ(valuesOf<int8_t>(unpackInt4(packed, 16)),
            (std::vector<int8_t>{-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7}));
  const at::Tensor padded =
      at::tensor(std::vector<int32_t>{static_cast<int32_t>(0xFFFFF08Fu)}, at::kInt).reshape({1, 1});
  EXPECT_EQ(valuesOf<int8_t>(unpackInt4(padded, 3)), (std::vector<int8_t>{7, 0, -8}));
  EXPECT_EQ(valuesOf<int8_t>(unpackInt4(padded.t(), 3, 0)), (std::vector<int8_t>{7, 0, -8}));
}

TEST(QuantPack, Int4RefusesCodesOutsideItsRange) {
  // In a whole word and in the last, partial one; 8 and -9 are the nearest, ±127 and -128 the
  // bytes whose top bit the word-at-a-time check flips.
  for (const int64_t column : {0, 5, 7, 33, 36}) {
    for (const int value : {8, -9, 127, -128}) {
      at::Tensor q = at::zeros({2, 37}, at::kChar);
      q[1][column] = value;
      EXPECT_NE(test::errorOf([&] { packInt4(q); }, ErrorCode::kInternal).find("packInt4 values must lie in [-8, 7]"),
                std::string::npos)
          << "column " << column << ", value " << value;
    }
  }
}

TEST(QuantSsz, HandComputedTwoChannels) {
  const QScheme s = scheme(QDtype::kInt4, QScope::kPerChannel);
  const at::Tensor w = floats({0.9, 2, 3, 7, 1, 2, -7, 0}, {2, 4});
  // Row 0: minmax scale 7/7 = 1, q = 1 2 3 7, mse = 0.1²/4 = 0.0025. Iteration 1:
  // s = Σwq/Σq² = (0.9 + 4 + 9 + 49)/(1 + 4 + 9 + 49) = 62.9/63; q unchanged (w/s ≈ 0.90, 2.003,
  // 3.005, 7.011); mse ≈ 0.00246 < 0.0025 → kept. Iteration 2 repeats it: no gain.
  // Row 1: minmax is exact (scale 1, mse 0) and the least-squares scale is 54/54 = 1.
  const QParams p = sszSearch(w, s);
  EXPECT_EQ(p.scale.sizes(), at::IntArrayRef({2, 1}));
  EXPECT_NEAR(p.scale[0].item<float>(), 62.9 / 63, 1e-6);
  EXPECT_EQ(p.scale[1].item<float>(), 1.0f);
  // Zero iterations: the minmax scales.
  EXPECT_EQ(valuesOf<float>(sszSearch(w, s, 0).scale), (std::vector<float>{1, 1}));
  EXPECT_EQ(test::errorOf([&] { sszSearch(w, scheme(QDtype::kInt4, QScope::kPerChannel, false)); }, ErrorCode::kConfig),
            "ssz supports int8/int4 per_channel symmetric weights only, got int4_per_channel_asym");
}

// The SSZ search as msmodelslim writes it, in tensor ops: the definition the cache-resident
// kernel of sszSearch must reproduce bit for bit.
at::Tensor sszReference(const at::Tensor& weight, const QScheme& scheme, int64_t iterations) {
  const at::Tensor w = weight.to(at::kFloat);
  const double lo = qmin(scheme.dtype), hi = qmax(scheme.dtype);
  at::Tensor scale = computeQParams(w, scheme).scale;
  at::Tensor q = at::round(w / scale).clamp(lo, hi);
  const auto mseOf = [&](const at::Tensor& s, const at::Tensor& qv) { return (w - qv * s).square().mean(1, true); };
  at::Tensor bestScale = scale;
  at::Tensor best = mseOf(scale, q);
  for (int64_t i = 0; i < iterations; ++i) {
    scale = (w * q).sum(1, true) / (q * q).sum(1, true).clamp_min(1e-30);
    q = at::round(w / scale).clamp(lo, hi);
    const at::Tensor mse = mseOf(scale, q);
    const at::Tensor gain = best - mse;
    if (((gain / best.clamp_min(1e-4) < 1e-10) | (gain.abs() < 1e-10)).all().item<bool>()) break;
    const at::Tensor better = mse < best;
    bestScale = at::where(better, scale, bestScale);
    best = at::where(better, mse, best);
  }
  return bestScale;
}

TEST(QuantSsz, KernelIsTheTensorFormulationBitForBit) {
  at::manual_seed(8);
  // SmolLM2's shapes (k/v, q/o, gate/up, down), short rows, and rows that stress the search: all
  // zero (its scale goes to NaN, so the global early break never comes), one outlier, all equal.
  std::vector<at::Tensor> weights{at::randn({192, 576}) * 0.05, at::randn({96, 1536}) * 0.02, at::randn({5, 7}),
                                  at::randn({33, 100}).to(at::kBFloat16)};
  at::Tensor edges = at::randn({6, 576});
  edges[0].zero_();
  edges[1][17] = 40;
  edges[2].fill_(0.3);
  weights.push_back(edges);
  weights.push_back(at::randn({576, 64}).t());  // not contiguous
  for (const QDtype dtype : {QDtype::kInt4, QDtype::kInt8}) {
    const QScheme s = scheme(dtype, QScope::kPerChannel);
    for (const at::Tensor& w : weights) {
      for (const int64_t iterations : {0, 1, 50}) {
        const at::Tensor expected = sszReference(w, s, iterations);
        const at::Tensor got = sszSearch(w, s, iterations).scale;
        EXPECT_TRUE(at::equal(got.view(at::kInt), expected.view(at::kInt)))
            << s.name() << " " << w.sizes() << " iterations " << iterations;
      }
    }
  }
}

}  // namespace
}  // namespace qpipe::quant
