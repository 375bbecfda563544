// NVFP4 (E2M1 codes, E4M3 block scales of 16, an fp32 global scale) and MXFP4 (E2M1 codes, E8M0
// power-of-two scales of 32) against hand-computed cases: the rounding at every tie, saturation,
// zero and subnormal block scales, packing bytes, and bit-exact round trips. The arithmetic is in
// the comments.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "qpipe/observer.h"
#include "qpipe/quant.h"

namespace qpipe::quant {
namespace {

const QScheme kNvfp4{.dtype = QDtype::kNvfp4, .scope = QScope::kPerGroup, .groupSize = kNvfp4GroupSize};
const QScheme kMxfp4{.dtype = QDtype::kMxfp4, .scope = QScope::kPerGroup, .groupSize = kMxfp4GroupSize};

template <typename T>
std::vector<T> valuesOf(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return {c.data_ptr<T>(), c.data_ptr<T>() + c.numel()};
}

TEST(QuantNvfp4, E2m1RoundsToNearestTiesToEvenAndSaturates) {
  // Ties: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4 (the even code each
  // time); just past them the other way. Beyond 6 and ±inf saturate to ±6.
  const std::vector<float> x{0.25f,
                             0.26f,
                             0.74f,
                             0.75f,
                             1.25f,
                             1.26f,
                             1.75f,
                             2.5f,
                             2.51f,
                             3.5f,
                             5.0f,
                             5.01f,
                             7.0f,
                             -3.0f,
                             -0.1f,
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity()};
  const at::Tensor codes = toFp4E2m1(at::tensor(x));
  EXPECT_EQ(codes.scalar_type(), at::kByte);
  // Magnitude index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3 (also for -0.1 → -0, as
  // compressed-tensors' signbit packs it).
  EXPECT_EQ(valuesOf<uint8_t>(codes),
            (std::vector<uint8_t>{0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 0x8 | 5, 0x8, 7, 0x8 | 7}));
}

TEST(QuantNvfp4, CodesDecodeToTheE2m1GridAndEveryGridValueRoundTrips) {
  const at::Tensor all = at::arange(16, at::kByte);
  const std::vector<float> values = valuesOf<float>(fromFp4E2m1(all));
  EXPECT_EQ(values, (std::vector<float>{0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6}));
  EXPECT_TRUE(std::signbit(values[8]));
  EXPECT_TRUE(at::equal(toFp4E2m1(fromFp4E2m1(all)), all));
}

TEST(QuantNvfp4, PacksTwoCodesPerByteEvenElementLow) {
  const at::Tensor codes = at::tensor({1, 2, 3, 15, 0, 7}, at::kByte).reshape({2, 3}).t().contiguous();  // [3, 2]
  // Rows (1, 15), (2, 0), (3, 7) → bytes 0xF1, 0x02, 0x73.
  const at::Tensor packed = packFp4(codes);
  EXPECT_EQ(packed.sizes(), at::IntArrayRef({3, 1}));
  EXPECT_EQ(valuesOf<uint8_t>(packed), (std::vector<uint8_t>{0xF1, 0x02, 0x73}));
  EXPECT_TRUE(at::equal(unpackFp4(packed), codes));
}

TEST(QuantNvfp4, TwoLevelScalesHandComputed) {
  // Four blocks of 16. The tensor's absmax 6 gives the global scale 448·6/6 = 448.
  at::Tensor w = at::zeros({1, 64});
  const std::vector<float> block0{6, -6, 0.3f, 1.3f, 2.6f, -0.8f};
  for (size_t i = 0; i < block0.size(); ++i) w[0][static_cast<int64_t>(i)] = block0[i];
  w[0][16] = 1.0f;  // block 1: absmax 1
  w[0][17] = 0.5f;
  // block 2: zeros
  w[0][48] = 1e-4f;  // block 3: absmax 1e-4
  w[0][49] = -5e-5f;
  const QParams p = computeQParams(w, kNvfp4);
  EXPECT_EQ(p.globalScale.item<float>(), 448.0f);
  // Block scales E4M3(448 · absmax / 6):
  //   block 0: 448 exactly;
  //   block 1: 74.67 = 1.1667·2^6, between 72 (1.125·2^6) and 80 (1.25·2^6): 72;
  //   block 2: 0 → compressed-tensors' eps 0.125;
  //   block 3: 0.0074667, below 2^-6: a subnormal, 3.82·2^-9 → 4·2^-9 = 2^-7.
  EXPECT_EQ(valuesOf<float>(p.scale), (std::vector<float>{448, 72, 0.125f, 0.0078125f}));
  EXPECT_EQ(p.scale.sizes(), at::IntArrayRef({1, 4}));

  const at::Tensor q = quantize(w, p, kNvfp4);
  const std::vector<uint8_t> codes = valuesOf<uint8_t>(q);
  // Block 0 divides by 448/448 = 1: 6, -6, 0.3 → 0.5, 1.3 → 1.5, 2.6 → 3, -0.8 → -1.
  EXPECT_EQ(std::vector<uint8_t>(codes.begin(), codes.begin() + 6), (std::vector<uint8_t>{7, 0xF, 1, 3, 5, 0xA}));
  // Block 1 divides by d = 72/448: 1/d = 6.22 saturates to 6; 0.5/d = 3.11 → 3.
  EXPECT_EQ(codes[16], 7);
  EXPECT_EQ(codes[17], 5);
  // Block 3 divides by 2^-7/448: 1e-4 → 5.73 → 6; -5e-5 → -2.87 → -3.
  EXPECT_EQ(codes[48], 7);
  EXPECT_EQ(codes[49], 0x8 | 5);
  const at::Tensor deq = dequantize(q, p, kNvfp4);
  const float d1 = 72.0f / 448.0f, d3 = 0.0078125f / 448.0f;
  EXPECT_EQ(deq[0][16].item<float>(), 6 * d1);
  EXPECT_EQ(deq[0][17].item<float>(), 3 * d1);
  EXPECT_EQ(deq[0][48].item<float>(), 6 * d3);
  EXPECT_EQ(deq[0][49].item<float>(), -3 * d3);
  EXPECT_EQ(valuesOf<float>(deq.narrow(1, 0, 6)), (std::vector<float>{6, -6, 0.5, 1.5, 3, -1}));
  EXPECT_EQ(deq.narrow(1, 32, 16).abs().max().item<float>(), 0.0f);
}

TEST(QuantNvfp4, AllZeroTensorHasGlobalScaleOne) {
  // 448·6 / FLT_MIN overflows to inf, which compressed-tensors replaces by 1.
  const QParams p = computeQParams(at::zeros({2, 32}), kNvfp4);
  EXPECT_EQ(p.globalScale.item<float>(), 1.0f);
  EXPECT_EQ(valuesOf<float>(p.scale), (std::vector<float>(4, 0.125f)));
}

TEST(QuantNvfp4, RoundTripsBitForBit) {
  at::manual_seed(3);
  const at::Tensor w = at::randn({24, 96}) * at::rand({24, 1}) * 3;
  const QParams p = computeQParams(w, kNvfp4);
  const at::Tensor q = quantize(w, p, kNvfp4);
  EXPECT_TRUE(at::equal(unpackFp4(packFp4(q)), q));
  const at::Tensor deq = dequantize(q, p, kNvfp4);
  EXPECT_TRUE(at::equal(fakeQuantize(w, p, kNvfp4), deq));
  // A dequantized weight is on the grid: it quantizes to the same codes, and the block scales
  // stored as E4M3 are exact.
  EXPECT_TRUE(at::equal(quantize(deq, p, kNvfp4), q));
  EXPECT_TRUE(at::equal(toFp8E4m3(p.scale).to(at::kFloat), p.scale));
  // The error is at most half the widest grid gap (4 to 6) in units of a block's divisor, which
  // is at most absmax / 6 · 17/16 (E4M3 rounding); a block whose scale rounded down saturates by less.
  EXPECT_LE((w - deq).abs().max().item<float>(), (w.abs().max() / 6).item<float>() * 17 / 16);
}

TEST(QuantNvfp4, ActivationsScaleBlocksPerInputUnderAGivenGlobalScale) {
  at::manual_seed(5);
  const at::Tensor x = at::randn({2, 3, 32});
  const at::Tensor global = nvfp4GlobalScale(at::full({1}, 8.0f));  // 336
  EXPECT_EQ(global.item<float>(), 336.0f);
  const QParams p = computeQParams(x, kNvfp4, global);
  EXPECT_EQ(p.scale.sizes(), at::IntArrayRef({2, 3, 2}));
  EXPECT_TRUE(at::equal(p.globalScale, global));
  // Each block's scale from its own absmax: E4M3(336 · absmax / 6).
  const at::Tensor absmax = x.reshape({2, 3, 2, 16}).abs().amax(-1);
  EXPECT_TRUE(at::equal(p.scale, toFp8E4m3(global * (absmax / 6)).to(at::kFloat)));
  EXPECT_EQ(fakeQuantize(x, p, kNvfp4).sizes(), x.sizes());
}

TEST(QuantNvfp4, ObserverKeepsTheGlobalScaleOnly) {
  MinMaxObserver observer(kNvfp4);
  observer.update(at::tensor({-3.0f, 1.0f}).repeat({8}).reshape({1, 1, 16}));
  observer.update(at::full({2, 16}, 1.5f));
  const QParams p = observer.qparams();
  EXPECT_FALSE(p.scale.defined());
  EXPECT_EQ(p.globalScale.item<float>(), 448.0f * 6.0f / 3.0f);
}

TEST(QuantMxfp4, ScalesArePowersOfTwoFromTheBlockAbsmaxRoundedAtOnePointSevenFive) {
  // scale = 2^(e - 2), e the exponent of absmax after rounding up mantissas ≥ 0.75:
  //   6 = 1.5·2^2 → 2^0 = 1;  7 = 1.75·2^2 → 2^3 → 2;  1.7499 = 1.7499·2^0 → 2^-2;
  //   1 → 2^-2;  0.75 = 1.5·2^-1 → 2^-3;  0 → the smallest E8M0 scale, 2^-127;
  //   3·2^-140 (subnormal) → 2^-127;  2^127 → 2^125.
  const at::Tensor absmax =
      at::tensor({6.0f, 7.0f, 1.7499f, 1.0f, 0.75f, 0.0f, std::ldexp(3.0f, -140), std::ldexp(1.0f, 127)});
  const at::Tensor scale = mxfp4Scale(absmax);
  const std::vector<float> expected{
      1.0f, 2.0f, 0.25f, 0.25f, 0.125f, std::ldexp(1.0f, -127), std::ldexp(1.0f, -127), std::ldexp(1.0f, 125)};
  EXPECT_EQ(valuesOf<float>(scale), expected);
  EXPECT_EQ(valuesOf<uint8_t>(toE8m0(scale)), (std::vector<uint8_t>{127, 128, 125, 125, 124, 0, 0, 252}));
}

TEST(QuantMxfp4, E8m0BytesRoundTripExactly) {
  const at::Tensor bytes = at::arange(255, at::kInt).to(at::kByte);
  const at::Tensor scale = fromE8m0(bytes);
  EXPECT_EQ(scale[127].item<float>(), 1.0f);
  EXPECT_EQ(scale[0].item<float>(), std::ldexp(1.0f, -127));
  EXPECT_EQ(scale[254].item<float>(), std::ldexp(1.0f, 127));
  EXPECT_TRUE(at::equal(toE8m0(scale), bytes));
  EXPECT_TRUE(at::equal(at::log2(scale.to(at::kDouble)), (bytes.to(at::kDouble) - 127)));
}

TEST(QuantMxfp4, BlocksQuantizeHandComputed) {
  // Two blocks of 32. Block 0: absmax 6, scale 1: 6, -3, 0.7 → 0.5, 0.25 → 0 (tie to even),
  // -5.5 → -6. Block 1: absmax 7 → scale 2: 7 → 3.5 → 4 (tie to even) = 8; 1.2 → 0.6 → 0.5 = 1.
  at::Tensor w = at::zeros({1, 64});
  const std::vector<float> block0{6, -3, 0.7f, 0.25f, -5.5f};
  for (size_t i = 0; i < block0.size(); ++i) w[0][static_cast<int64_t>(i)] = block0[i];
  w[0][32] = 7.0f;
  w[0][33] = 1.2f;
  const QParams p = computeQParams(w, kMxfp4);
  EXPECT_FALSE(p.globalScale.defined());
  EXPECT_EQ(valuesOf<float>(p.scale), (std::vector<float>{1.0f, 2.0f}));
  const at::Tensor q = quantize(w, p, kMxfp4);
  EXPECT_EQ(q.scalar_type(), at::kByte);
  const std::vector<uint8_t> codes = valuesOf<uint8_t>(q);
  EXPECT_EQ(std::vector<uint8_t>(codes.begin(), codes.begin() + 5), (std::vector<uint8_t>{7, 0x8 | 5, 1, 0, 0x8 | 7}));
  EXPECT_EQ(codes[32], 6);
  EXPECT_EQ(codes[33], 1);
  const at::Tensor deq = dequantize(q, p, kMxfp4);
  EXPECT_EQ(valuesOf<float>(deq.narrow(1, 0, 5)), (std::vector<float>{6, -3, 0.5, 0, -6}));
  EXPECT_EQ(deq[0][32].item<float>(), 8.0f);
  EXPECT_EQ(deq[0][33].item<float>(), 1.0f);
}

TEST(QuantMxfp4, RoundTripsBitForBitAndActivationsScalePerInput) {
  at::manual_seed(7);
  const at::Tensor w = at::randn({16, 128}) * at::rand({16, 1}) * 5;
  const QParams p = computeQParams(w, kMxfp4);
  const at::Tensor q = quantize(w, p, kMxfp4);
  const at::Tensor deq = dequantize(q, p, kMxfp4);
  EXPECT_TRUE(at::equal(fakeQuantize(w, p, kMxfp4), deq));
  EXPECT_TRUE(at::equal(quantize(deq, p, kMxfp4), q));
  EXPECT_TRUE(at::equal(fromE8m0(toE8m0(p.scale)), p.scale));
  // The block's largest element lands in [3, 6] · scale (up to saturation at 7 · scale): the
  // scale never leaves more than a factor 2 of the grid unused.
  const at::Tensor ratio = w.reshape({16, 4, 32}).abs().amax(-1) / p.scale;
  EXPECT_GE(ratio.min().item<float>(), 3.0f);
  EXPECT_LT(ratio.max().item<float>(), 7.0f);

  const at::Tensor x = at::randn({2, 3, 64});
  EXPECT_TRUE(isDynamic(kMxfp4));
  EXPECT_FALSE(isDynamic(kNvfp4));
  const QParams a = computeQParams(x, kMxfp4);
  EXPECT_EQ(a.scale.sizes(), at::IntArrayRef({2, 3, 2}));
  EXPECT_TRUE(at::equal(a.scale, mxfp4Scale(x.reshape({2, 3, 2, 32}).abs().amax(-1))));
}

// The one-pass kernels against a scalar oracle written apart from them: a block's divisor from the
// largest |v| of its non-NaN inputs (0 for none; the format's scale arithmetic), then each input's
// nearest E2M1 grid value by distance (a tie to the even code, 6 from there up), with the input's
// sign (a NaN is a zero of its sign). Blocks of -0 (the signs kept), NaN, ±inf, subnormals, exact
// ties and saturation, compared bit for bit.
TEST(QuantFp4, SpecialInputsGiveTheScalarOraclesBits) {
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  const std::vector<float> specials{-0.0f, kNan,  -kNan, 1.0f,  -2.0f, 0.3f, kInf,   -kInf,   1e-40f, -3e-41f, 6.0f,
                                    0.25f, 0.75f, 1.25f, 1.75f, 2.5f,  3.5f, 5.0f,   -0.25f,  -1.25f, -2.5f,   -5.0f,
                                    7.0f,  -0.1f, 0.5f,  4.0f,  -3.0f, 2.9f, 1e-39f, -1e-45f, 0.0f,   -6.5f};
  // Every tie of the grid, in blocks whose largest is 6: a divisor of 1 for both formats here.
  const std::vector<float> ties{6.0f,   0.25f,  0.75f,  1.25f,  1.75f, 2.5f,  3.5f,  5.0f,
                                -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -5.0f, -6.0f};
  at::Tensor x = at::empty({5, 64});
  x[0].fill_(-0.0f);                                              // blocks of -0 only
  x[1].copy_(at::tensor(specials).repeat({2}));                   // every special, in each block
  x[2].copy_(at::tensor(specials).repeat({2}) * 1e-39f);          // subnormal magnitudes
  x[3].copy_(at::tensor(specials).repeat({2}).flip({0}) * 3.0f);  // other divisors, other places
  x[3][5] = kNan;
  x[4].copy_(at::tensor(ties).repeat({4}));
  const std::array<float, 8> grid{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const auto nearest = [&](float u) {
    if (std::isnan(u)) return std::copysign(0.0f, u);
    const float a = std::abs(u);
    size_t best = grid.size() - 1;
    if (a < grid.back()) {
      for (size_t i = 0; i + 1 < grid.size(); ++i) {
        const float below = a - grid[i], above = grid[i + 1] - a;
        if (below >= 0 && above >= 0) {
          best = below < above || (below == above && i % 2 == 0) ? i : i + 1;
          break;
        }
      }
    }
    return std::copysign(grid[best], u);
  };
  const float global = 0.75f;
  for (const QScheme& scheme : {kNvfp4, kMxfp4}) {
    SCOPED_TRACE(scheme.name());
    const bool nv = scheme.dtype == QDtype::kNvfp4;
    const int64_t group = scheme.groupSize;
    at::Tensor values = at::empty_like(x), codes = at::empty(x.sizes(), at::kChar), halves = at::empty({5, 64 / group});
    for (int64_t r = 0; r < 5; ++r) {
      for (int64_t b = 0; b < 64 / group; ++b) {
        float absmax = 0.0f;
        for (int64_t i = b * group; i < (b + 1) * group; ++i) {
          const float v = x[r][i].item<float>();
          if (!std::isnan(v)) absmax = std::max(absmax, std::abs(v));
        }
        float divisor = 0;
        if (nv) {
          const float scaled = std::min(global * (absmax / 6.0f), 448.0f);
          const float block = static_cast<float>(c10::Float8_e4m3fn(scaled));
          divisor = (block == 0.0f ? 0.125f : block) / global;
        } else {
          divisor = mxfp4Scale(at::tensor({absmax})).item<float>();
        }
        halves[r][b] = divisor / 2;
        for (int64_t i = b * group; i < (b + 1) * group; ++i) {
          const float e = nearest(x[r][i].item<float>() / divisor);
          values[r][i] = e * divisor;
          codes[r][i] = static_cast<int8_t>(2 * e);
        }
      }
    }
    const at::Tensor globalScale = nv ? at::tensor({global}) : at::Tensor();
    const at::Tensor fake = fakeQuantizeFp4Dynamic(x, scheme, globalScale);
    EXPECT_TRUE(at::equal(fake.view(at::kInt), values.view(at::kInt)))
        << "first difference at " << (fake.view(at::kInt) != values.view(at::kInt)).nonzero()[0];
    EXPECT_TRUE(std::signbit(fake[0][3].item<float>()));
    EXPECT_EQ(halves[4][0].item<float>(), 0.5f);
    const Fp4Codes computed = fp4CodesDynamic(x, scheme, globalScale);
    EXPECT_TRUE(at::equal(computed.codes, codes));
    EXPECT_TRUE(at::equal(computed.halfDivisors.view(at::kInt), halves.view(at::kInt)));
  }
}

TEST(QuantFp4, TheOnePassActivationKernelGivesTheTensorOpsBits) {
  at::manual_seed(11);
  // Magnitudes over many binades, zero blocks, ties on the E2M1 grid (multiples of 0.25).
  at::Tensor x = at::randn({3, 7, 256}) *
                 at::exp2(at::randint(-12, 12, {3, 7, 8, 1}).to(at::kFloat)).repeat({1, 1, 1, 32}).reshape({3, 7, 256});
  x.narrow(-1, 0, 32).zero_();
  x.narrow(-1, 64, 32).copy_(at::round(x.narrow(-1, 64, 32) * 4) / 4);
  const at::Tensor global = nvfp4GlobalScale(x.abs().amax());
  for (const QScheme& scheme : {kNvfp4, kMxfp4}) {
    SCOPED_TRACE(scheme.name());
    const bool nv = scheme.dtype == QDtype::kNvfp4;
    const at::Tensor expected =
        fakeQuantize(x, nv ? computeQParams(x, scheme, global) : computeQParams(x, scheme), scheme);
    EXPECT_TRUE(at::equal(fakeQuantizeFp4Dynamic(x, scheme, nv ? global : at::Tensor()), expected));
    // The same numbers as integer codes (twice the E2M1 value) and half divisors, exactly.
    const Fp4Codes codes = fp4CodesDynamic(x.reshape({21, 256}), scheme, nv ? global : at::Tensor());
    EXPECT_EQ(codes.codes.scalar_type(), at::kChar);
    EXPECT_LE(codes.codes.abs().max().item<int>(), 12);
    const at::Tensor product =
        (codes.codes.to(at::kFloat).view({21, -1, scheme.groupSize}) * codes.halfDivisors.unsqueeze(2))
            .view({3, 7, 256});
    EXPECT_TRUE(at::equal(product, expected));
  }
  try {
    fp4CodesDynamic(x, kMxfp4);
    ADD_FAILURE() << "a 3-D input";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fp4CodesDynamic takes fp32 CPU x [M, K] with K a multiple of the group, got "
                                         "[3, 7, 256] Float of mxfp4_per_group_sym"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace qpipe::quant
