// learnable_scale_qat (plugins/qat, docs/qat.md): the straight-through gradients on hand-computed
// cases (in range, saturated, at the clamp), QatLinear against the PTQ module it starts from and
// the module it deploys, LSQ learning a clipped scale, the schedules against HF's formulas, the
// processor on tiny checkpoints (a zero learning rate gives linear_quant's checkpoint bit for bit;
// training starts at the PTQ error and moves the deployed scales), its training log, and every
// configuration error.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fake_quant.h"
#include "losses.h"
#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/report.h"
#include "qpipe/host/runner.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/plugin.h"
#include "test_helpers.h"
#include "tiny_model.h"
#include "trainer.h"

QPIPE_DECLARE_STATIC_PLUGIN(linear_quant);
QPIPE_DECLARE_STATIC_PLUGIN(fa3);
QPIPE_DECLARE_STATIC_PLUGIN(qat);

namespace qpipe {
namespace {

namespace fs = std::filesystem;
using quant::QDtype;
using quant::QScheme;
using quant::QScope;

struct Gradients {
  at::Tensor value, x, scale;
};

// y = fakeQuantize(x, s); backward of Σy: ∂Σy/∂x per element and ∂Σy/∂s.
Gradients gradientsOf(const std::vector<float>& values, float scale, QDtype dtype, qat::Ste ste) {
  at::AutoGradMode gradients(true);
  at::Tensor x = at::tensor(values).requires_grad_(true);
  at::Tensor s = at::full({1}, scale).requires_grad_(true);
  const at::Tensor y = qat::fakeQuantize(x, s, {.dtype = dtype, .scope = QScope::kPerTensor}, ste);
  y.sum().backward();
  return {y.detach(), x.grad(), s.grad()};
}

std::vector<float> toVector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

// s = 0.5 divides exactly: u = x / s = 50.6, 127 (at the clamp), 127.4 (rounds onto it), 127.6
// (rounds past it), 200 (saturated), -20.4.
const std::vector<float> kIntInputs = {25.3f, 63.5f, 63.7f, 63.8f, 100.0f, -10.2f};

TEST(QatSte, AngelSlimPassesEveryGradientThroughRoundAndClamp) {
  const Gradients g = gradientsOf(kIntInputs, 0.5f, QDtype::kInt8, qat::Ste::kAngelSlim);
  const std::vector<float> q = {51, 127, 127, 127, 127, -20};
  double ds = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    EXPECT_EQ(toVector(g.value)[i], q[i] * 0.5f) << i;
    ds += q[i] - kIntInputs[i] / 0.5f;  // Q(u) − u, saturated elements included
  }
  EXPECT_EQ(toVector(g.x), std::vector<float>(6, 1.0f));
  EXPECT_NEAR(g.scale.item<double>(), ds, 1e-4);
}

TEST(QatSte, LsqStopsGradientsOutsideTheRangeAndScalesTheScaleGradient) {
  const Gradients g = gradientsOf(kIntInputs, 0.5f, QDtype::kInt8, qat::Ste::kLsq);
  // ∂y/∂x: 1 where round(u) lies in [-128, 127] (at the clamp too), 0 beyond it.
  EXPECT_EQ(toVector(g.x), (std::vector<float>{1, 1, 1, 0, 0, 1}));
  // ∂y/∂s: Q(u) − u inside, qmax outside, times 1/sqrt(N·qmax) with N = 6 elements per scale.
  const double inside = (51 - 50.6) + (127 - 127.0) + (127 - 127.4) + (-20 - -20.4);
  const double expected = (inside + 127 + 127) / std::sqrt(6.0 * 127);
  EXPECT_NEAR(g.scale.item<double>(), expected, 1e-5);
  // The forward is the same as AngelSlim's: only the backward differs.
  EXPECT_TRUE(at::equal(g.value, gradientsOf(kIntInputs, 0.5f, QDtype::kInt8, qat::Ste::kAngelSlim).value));
}

TEST(QatSte, Fp8RoundsToItsGridAndSaturatesAt448) {
  // u = 1.0625 (a tie: to even, 1.0), 300 (grid step 32 above 256: 288), 500 (saturated), -3.3 (-3.25).
  const std::vector<float> x = {1.0625f, 300.0f, 500.0f, -3.3f};
  const std::vector<float> q = {1.0f, 288.0f, 448.0f, -3.25f};
  const Gradients angel = gradientsOf(x, 1.0f, QDtype::kFp8E4m3, qat::Ste::kAngelSlim);
  EXPECT_EQ(toVector(angel.value), q);
  EXPECT_EQ(toVector(angel.x), std::vector<float>(4, 1.0f));
  double ds = 0;
  for (size_t i = 0; i < x.size(); ++i) ds += q[i] - x[i];
  EXPECT_NEAR(angel.scale.item<double>(), ds, 1e-4);
  const Gradients lsq = gradientsOf(x, 1.0f, QDtype::kFp8E4m3, qat::Ste::kLsq);
  EXPECT_EQ(toVector(lsq.x), (std::vector<float>{1, 1, 0, 1}));
  const double inside = (1.0 - 1.0625) + (288 - 300.0) + (-3.25 - static_cast<double>(-3.3f));
  EXPECT_NEAR(lsq.scale.item<double>(), (inside + 448) / std::sqrt(4.0 * 448), 1e-5);
}

// One block of FP4: values whose u = x / divisor are 6 (at the clamp), 3.2 (→ 3), −1.3 (→ −1.5),
// 0.2 (→ 0), 7 (saturated, → 6), and zeros. AngelSlim's gradient of the divisor: Σ(Q(u) − u) =
// −1.6; LSQ's: the in-range part −0.6 plus qmax = 6 for the saturated one, over sqrt(N · 6).
std::vector<float> fp4Block(int64_t width, float divisor) {
  std::vector<float> x(static_cast<size_t>(width), 0.0f);
  const std::vector<float> u = {6.0f, 3.2f, -1.3f, 0.2f, 7.0f};
  for (size_t i = 0; i < u.size(); ++i) x[i] = u[i] * divisor;
  return x;
}

TEST(QatSte, Fp4RoundsToTheE2m1GridWithTheStoredBlockScale) {
  for (const auto& [dtype, width, scale, global] : std::vector<std::tuple<QDtype, int64_t, float, float>>{
           {QDtype::kNvfp4, 16, 2.0f, 4.0f}, {QDtype::kMxfp4, 32, 2.0f, 0.0f}}) {
    SCOPED_TRACE(quant::qdtypeName(dtype));
    const QScheme scheme{.dtype = dtype, .scope = QScope::kPerGroup, .groupSize = width};
    // NVFP4 divides by block / global = 0.5, MXFP4 by its scale 2.
    const float divisor = dtype == QDtype::kNvfp4 ? scale / global : scale;
    for (const qat::Ste ste : {qat::Ste::kAngelSlim, qat::Ste::kLsq}) {
      at::AutoGradMode gradients(true);
      at::Tensor x = at::tensor(fp4Block(width, divisor)).reshape({1, width}).requires_grad_(true);
      at::Tensor s = at::full({1, 1}, scale).requires_grad_(true);
      const at::Tensor g = dtype == QDtype::kNvfp4 ? at::full({1}, global) : at::Tensor();
      const at::Tensor y = qat::fakeQuantize(x, s, scheme, ste, g);
      y.sum().backward();
      const std::vector<float> q = toVector(y.detach().narrow(1, 0, 5) / divisor);
      EXPECT_EQ(q, (std::vector<float>{6, 3, -1.5f, 0, 6}));
      // ∂/∂scale = ∂/∂divisor · ∂divisor/∂scale (1 / global for NVFP4).
      const double perScale = dtype == QDtype::kNvfp4 ? 1.0 / global : 1.0;
      if (ste == qat::Ste::kAngelSlim) {
        EXPECT_NEAR(s.grad().item<double>(), -1.6 * perScale, 1e-5);
        EXPECT_EQ(x.grad().sum().item<float>(), static_cast<float>(width));
      } else {
        EXPECT_NEAR(s.grad().item<double>(), (-0.6 + 6) / std::sqrt(width * 6.0) * perScale, 1e-5);
        EXPECT_EQ(x.grad()[0][4].item<float>(), 0.0f) << "saturated";
        EXPECT_EQ(x.grad()[0][0].item<float>(), 1.0f) << "at the clamp";
      }
    }
  }
}

TEST(QatSte, Fp4BlockScalesTrainContinuouslyAndAreStoredAsTheFormatStoresThem) {
  // NVFP4: E4M3 (1.1 → 1.125, 1e-3 → its smallest value 2^-9, 500 → 448); MXFP4: the nearest power
  // of two (3 → 4, 0.7 → 0.5, 2^-130 → 2^-127). The gradient passes as if unrounded.
  for (const auto& [dtype, in, out] : std::vector<std::tuple<QDtype, std::vector<float>, std::vector<float>>>{
           {QDtype::kNvfp4, {1.1f, 1e-3f, 500.0f}, {1.125f, 1.0f / 512, 448.0f}},
           {QDtype::kMxfp4, {3.0f, 0.7f, std::ldexp(1.0f, -130)}, {4.0f, 0.5f, std::ldexp(1.0f, -127)}}}) {
    at::AutoGradMode gradients(true);
    at::Tensor s = at::tensor(in).requires_grad_(true);
    const at::Tensor stored = qat::storedBlockScale(s, dtype);
    EXPECT_EQ(toVector(stored.detach()), out);
    stored.sum().backward();
    EXPECT_EQ(toVector(s.grad()), std::vector<float>(3, 1.0f));
  }
}

struct SchemeCase {
  std::string name;
  QScheme weight;
  std::optional<QScheme> act;  // none: weight-only
  int64_t in = 16;             // the Linear's input width
};

std::vector<SchemeCase> schemeCases() {
  const QScheme int8Channel{.dtype = QDtype::kInt8, .scope = QScope::kPerChannel};
  const QScheme int4Group{.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .groupSize = 8};
  const QScheme fp8Tensor{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor};
  const QScheme fp8Channel{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerChannel};
  const QScheme int8Tensor{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor};
  const QScheme int8Token{.dtype = QDtype::kInt8, .scope = QScope::kPerToken};
  const QScheme fp8Token{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerToken};
  const QScheme nvfp4{.dtype = QDtype::kNvfp4, .scope = QScope::kPerGroup, .groupSize = quant::kNvfp4GroupSize};
  const QScheme mxfp4{.dtype = QDtype::kMxfp4, .scope = QScope::kPerGroup, .groupSize = quant::kMxfp4GroupSize};
  return {{"w8a8_static", int8Channel, int8Tensor},
          {"w8a8_dynamic", int8Channel, int8Token},
          {"fp8_static", fp8Tensor, fp8Tensor},
          {"fp8_channel_static", fp8Channel, fp8Tensor},
          {"w4a16_group", int4Group, std::nullopt},
          {"w4a8_dynamic", int4Group, int8Token},
          {"w4afp8", int4Group, fp8Token},
          {"nvfp4a16", nvfp4, std::nullopt, 64},
          {"nvfp4", nvfp4, nvfp4, 64},
          {"mxfp4a16", mxfp4, std::nullopt, 64},
          {"mxfp4", mxfp4, mxfp4, 64}};
}

// The PTQ module of a random Linear [8, 16]: minmax weight scales, a static input scale from `x`.
std::shared_ptr<QuantLinear> ptqModule(const SchemeCase& c, const at::Tensor& w, const at::Tensor& b,
                                       const at::Tensor& x) {
  const quant::QParams params = quant::computeQParams(w, c.weight);
  std::optional<ActivationQuant> input;
  if (c.act && c.act->dtype == QDtype::kNvfp4) {
    input = ActivationQuant{*c.act, {.globalScale = quant::nvfp4GlobalScale(x.abs().amax())}};
  } else if (c.act) {
    input = ActivationQuant{*c.act, quant::isDynamic(*c.act) ? quant::QParams{} : quant::computeQParams(x, *c.act)};
  }
  return std::make_shared<QuantLinear>(quant::quantize(w, params, c.weight), params, c.weight, input, b, at::kFloat);
}

TEST(QatLinear, StartsWhereItsPtqModuleIsAndDeploysWhatItTrained) {
  for (const SchemeCase& c : schemeCases()) {
    SCOPED_TRACE(c.name);
    at::manual_seed(5);
    const at::Tensor w = at::randn({8, c.in}) * 0.3, b = at::randn({8}) * 0.1, x = at::randn({2, 5, c.in});
    const auto ptq = ptqModule(c, w, b, x);
    const at::Tensor global = ptq->weightParams().globalScale;
    qat::QatLinear module(w, b, *ptq, {.learnable = {.weightScale = true, .actScale = true}});
    // The weight the forward uses is the PTQ module's, bit for bit; the outputs agree to the
    // GEMMs' rounding. The PTQ module may run an integer GEMM, or for weight-only schemes a bf16x3
    // one, whose error is bounded by 3.05·2⁻¹⁶ of Σ|x·w| (docs/quantization.md).
    const auto sameGemm = [&](const at::Tensor& y, const at::Tensor& ref, QuantLinear& deployed) {
      if (c.act) return at::allclose(y, ref, 1e-5, 1e-6);
      const at::Tensor magnitude = at::matmul(x.abs(), deployed.dequantizedWeight().abs().t()) + b.abs();
      return ((y - ref).abs() <= ref.abs() * 1e-5 + magnitude * 5e-5).all().item<bool>();
    };
    EXPECT_TRUE(at::equal(qat::fakeQuantize(w, module.weightScale(), c.weight, qat::Ste::kAngelSlim, global),
                          ptq->dequantizedWeight()));
    const at::Tensor before = module.forward(x);
    EXPECT_TRUE(sameGemm(before, (*ptq)(x), *ptq));
    // Train by hand: every trainable tensor moves (by more than MXFP4's rounding to a power of two
    // undoes); the deployed module computes what it computes.
    for (auto& [name, tensor] : module.trainable()) {
      at::NoGradGuard noGrad;
      tensor.mul_(name == "input_scale" ? 0.9 : 1.5);
    }
    const auto deployed = module.deploy();
    EXPECT_TRUE(at::equal(qat::fakeQuantize(w, module.weightScale(), c.weight, qat::Ste::kAngelSlim, global),
                          deployed->dequantizedWeight()));
    const at::Tensor after = module.forward(x);
    EXPECT_FALSE(at::allclose(after, before));
    EXPECT_TRUE(sameGemm(after, (*deployed)(x), *deployed));
    const size_t expected = c.act && c.act->scope == QScope::kPerTensor ? 2 : 1;
    EXPECT_EQ(module.trainable().size(), expected);
  }
}

TEST(QatLinear, ScalesStayAboveAHundredthOfTheirStart) {
  at::manual_seed(6);
  const SchemeCase c = schemeCases().front();
  const at::Tensor w = at::randn({8, 16}), x = at::randn({3, 16});
  const auto ptq = ptqModule(c, w, {}, x);
  qat::QatLinear module(w, {}, *ptq, {.learnable = {.weightScale = true, .actScale = true}});
  const at::Tensor start = module.weightScale().clone();
  for (auto& [name, tensor] : module.trainable()) {
    at::NoGradGuard noGrad;
    tensor.fill_(-1.0);
  }
  module.project();
  EXPECT_TRUE(at::allclose(module.weightScale(), start * 0.01));
}

TEST(QatLinear, LearnableWeightClippingStartsAtSigmoidOfItsInitAndTrainsTheClipFactors) {
  at::manual_seed(7);
  const SchemeCase c = schemeCases()[4];  // int4 per_group
  const at::Tensor w = at::randn({8, 16});
  const auto ptq = ptqModule(c, w, {}, {});
  qat::QatLinear module(w, {}, *ptq, {.learnable = {.weightScale = false, .lwc = true}, .lwcInit = 4.0});
  const double sigmoid = 1 / (1 + std::exp(-4.0));
  EXPECT_TRUE(at::allclose(module.weightScale(), ptq->weightParams().scale * sigmoid, 1e-6, 0));
  std::set<std::string> names;
  for (const auto& [name, tensor] : module.trainable()) names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{"clip_max", "clip_min"}));
  at::AutoGradMode gradients(true);
  module.forward(at::randn({4, 16})).pow(2).sum().backward();
  for (const auto& [name, tensor] : module.trainable()) EXPECT_GT(tensor.grad().abs().sum().item<double>(), 0) << name;
}

// The target is the same Linear quantized with scales 0.7 of minmax (its largest weights clipped).
// LSQ's gradients lead the scales there from minmax; AngelSlim's pass the clamp straight through,
// so they do not see the clipping and stay put (docs/qat.md: why the practices use lsq).
TEST(QatLinear, LsqLearnsAClippedScaleFromAMinmaxStart) {
  at::manual_seed(8);
  const SchemeCase c = schemeCases()[1];  // int8 per_channel, dynamic activations
  const at::Tensor w = at::randn({16, 32}) * 0.2, x = at::randn({64, 32});
  const auto ptq = ptqModule(c, w, {}, x);
  const at::Tensor clipped = ptq->weightParams().scale * 0.7;
  const at::Tensor target =
      at::linear(qat::fakeQuantize(x, quant::computeQParams(x, *c.act).scale, *c.act, qat::Ste::kLsq),
                 qat::fakeQuantize(w, clipped, c.weight, qat::Ste::kLsq));
  qat::QatLinear module(w, {}, *ptq, {.ste = qat::Ste::kLsq});
  std::vector<at::Tensor> params;
  for (const auto& [name, tensor] : module.trainable()) params.push_back(tensor);
  qat::Optimizer optimizer({{.params = params, .learningRate = 1e-2}},
                           {.maxGradNorm = 0, .schedule = qat::Schedule::kConstant, .totalSteps = 60});
  at::AutoGradMode gradients(true);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    const at::Tensor loss = at::mse_loss(module.forward(x), target);
    (step == 0 ? first : last) = loss.item<double>();
    loss.backward();
    optimizer.step();
    module.project();
  }
  EXPECT_LT(last, 0.5 * first);
  const double ratio = (module.weightScale() / ptq->weightParams().scale).mean().item<double>();
  EXPECT_NEAR(ratio, 0.7, 0.1);
}

// An fa3_quant AttentionQuant under QAT: the same values bit for bit, gradients through the
// rounding to K and V (and so to k_proj and v_proj), and a trained static scale deployed.
TEST(QatAttentionQuant, ComputesItsAttentionQuantPassesGradientsAndDeploysTheTrainedScale) {
  at::manual_seed(9);
  const at::Tensor x = at::randn({2, 3, 5, 8});
  const QScheme perHead{.dtype = QDtype::kInt8, .scope = QScope::kPerHead};
  const QScheme fp8Tensor{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor};
  const QScheme perToken{.dtype = QDtype::kInt8, .scope = QScope::kPerToken};
  for (const QScheme& scheme : {perHead, fp8Tensor, perToken}) {
    SCOPED_TRACE(scheme.name());
    std::optional<quant::QParams> params;
    if (scheme.scope == QScope::kPerHead) {
      const at::Tensor s = x.abs().amax({0, 2, 3}, true) * 0.8 / 127;  // the largest values saturate
      params = quant::QParams{s, at::zeros_like(s, s.options().dtype(at::kInt))};
    } else if (scheme.scope == QScope::kPerTensor) {
      const at::Tensor s = x.abs().amax().reshape({1}) / 448;
      params = quant::QParams{s, at::zeros_like(s, s.options().dtype(at::kInt))};
    }
    AttentionQuant ptq(scheme, params);
    qat::QatAttentionQuant module(ptq, {}, /*trains=*/true);
    EXPECT_TRUE(at::equal(module.forward(x), ptq.forward(x)));
    const bool dynamic = scheme.scope == QScope::kPerToken;
    ASSERT_EQ(module.trainable().size(), dynamic ? 0U : 1U);
    at::AutoGradMode gradients(true);
    const at::Tensor input = x.clone().requires_grad_(true);
    module.forward(input).sum().backward();
    EXPECT_TRUE(at::equal(input.grad(), at::ones_like(x)));  // AngelSlim's straight-through estimator
    if (dynamic) continue;
    EXPECT_GT(module.trainable()[0].grad().abs().sum().item<double>(), 0);
    {
      at::NoGradGuard noGrad;
      module.trainable()[0].mul_(1.2);
    }
    const auto deployed = module.deploy();
    EXPECT_TRUE(at::equal(deployed->params().scale, module.scale()));
    EXPECT_TRUE(at::allclose(module.scale(), params->scale * 1.2));
    EXPECT_TRUE(at::equal(deployed->forward(x), module.forward(x).detach()));
    module.setBypassed(true);
    EXPECT_TRUE(at::equal(module.forward(x), x));
  }
  qat::QatAttentionQuant fixed(*std::make_shared<AttentionQuant>(
                                   perHead, quant::QParams{at::ones({1, 3, 1, 1}), at::zeros({1, 3, 1, 1}, at::kInt)}),
                               {}, /*trains=*/false);
  EXPECT_TRUE(fixed.trainable().empty());
  const QScheme asymmetric{.dtype = QDtype::kInt8, .scope = QScope::kPerToken, .symmetric = false};
  AttentionQuant ptq(asymmetric, std::nullopt);
  EXPECT_EQ(test::errorOf([&] { qat::QatAttentionQuant(ptq, {}, false); }, ErrorCode::kConfig),
            "learnable_scale_qat takes symmetric attention quantization, got int8_per_token_asym");
}

// Inside the guard a Linear's product is bf16 and the fake quantizer's arithmetic fp32; after it,
// everything is fp32 again. A disabled guard changes nothing.
TEST(QatBf16, TheGuardRunsProductsInBf16AndRestoresFp32) {
  const at::Tensor x = at::randn({4, 16}), w = at::randn({8, 16});
  {
    const qat::Bf16Autocast autocast(true, at::kCPU);
    EXPECT_EQ(at::linear(x, w).scalar_type(), at::kBFloat16);
    const QScheme int8{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor};
    EXPECT_EQ(qat::fakeQuantize(w, at::full({1}, 0.01), int8, qat::Ste::kAngelSlim).scalar_type(), at::kFloat);
  }
  EXPECT_EQ(at::linear(x, w).scalar_type(), at::kFloat);
  const qat::Bf16Autocast off(false, at::kCPU);
  EXPECT_EQ(at::linear(x, w).scalar_type(), at::kFloat);
}

// Rank 1 of two, whose rank 0 holds `reference` and, in the all-reduce, reports `peerIndex`.
class TwoRanks final : public ProcessGroup {
 public:
  TwoRanks(at::Tensor reference, int64_t peerIndex) : reference_(std::move(reference)), peerIndex_(peerIndex) {}
  int rank() const override { return 1; }
  int worldSize() const override { return 2; }
  void allReduce(at::Tensor& tensor, ReduceOp op) override {
    EXPECT_EQ(op, ReduceOp::kMin);
    tensor.clamp_max_(peerIndex_);
  }
  std::vector<at::Tensor> allGather(const at::Tensor&) override { return {}; }
  void broadcast(at::Tensor& tensor, int root) override {
    EXPECT_EQ(root, 0);
    tensor.copy_(reference_);
  }
  void barrier() override {}
  std::vector<std::string> allGatherBytes(const std::string&) override { return {}; }
  void reportFailure(const std::string&) noexcept override {}
  Traffic traffic() const override { return {}; }
  int64_t counterAdd(const std::string&, int64_t) override { return 0; }
  void storeSet(const std::string&, const std::string&) override {}
  std::string storeGet(const std::string&) override { return {}; }

 private:
  at::Tensor reference_;
  int64_t peerIndex_;
};

TEST(QatReplicas, TheFirstTensorThatDiffersFromRankZerosOnAnyRankIsNamedOnEvery) {
  const std::vector<at::Tensor> mine = {at::tensor({1.0f, 2.0f}), at::tensor({3.0f}), at::tensor({4.0f, 5.0f})};
  const at::Tensor same = at::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.0f});
  TwoRanks agreeing(same, 3);  // 3: no tensor differs on the peer either
  EXPECT_EQ(qat::firstReplicaDifference(mine, agreeing), -1);
  TwoRanks lastDiffers(at::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.5f}), 3);
  EXPECT_EQ(qat::firstReplicaDifference(mine, lastDiffers), 2);
  TwoRanks peerDiffersEarlier(at::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.5f}), 0);
  EXPECT_EQ(qat::firstReplicaDifference(mine, peerDiffersEarlier), 0);
  EXPECT_EQ(qat::firstReplicaDifference(mine, *ProcessGroup::single()), -1);
}

TEST(QatSchedule, FactorsAreHfLambdas) {
  using qat::Schedule;
  using qat::scheduleFactor;
  // 10 steps, 2 warming up: 0, 1/2, then decay over the remaining 8.
  EXPECT_EQ(scheduleFactor(Schedule::kCosine, 0, 10, 2), 0.0);
  EXPECT_EQ(scheduleFactor(Schedule::kCosine, 1, 10, 2), 0.5);
  EXPECT_DOUBLE_EQ(scheduleFactor(Schedule::kCosine, 2, 10, 2), 1.0);
  EXPECT_NEAR(scheduleFactor(Schedule::kCosine, 6, 10, 2), 0.5, 1e-12);
  EXPECT_NEAR(scheduleFactor(Schedule::kCosine, 9, 10, 2), 0.5 * (1 + std::cos(M_PI * 7 / 8)), 1e-12);
  EXPECT_DOUBLE_EQ(scheduleFactor(Schedule::kLinear, 6, 10, 2), 0.5);
  EXPECT_DOUBLE_EQ(scheduleFactor(Schedule::kLinear, 9, 10, 0), 0.1);
  EXPECT_EQ(scheduleFactor(Schedule::kConstantWithWarmup, 1, 10, 4), 0.25);
  EXPECT_EQ(scheduleFactor(Schedule::kConstantWithWarmup, 7, 10, 4), 1.0);
  EXPECT_EQ(scheduleFactor(Schedule::kConstant, 0, 10, 4), 1.0);
  EXPECT_EQ(test::errorOf([] { qat::parseSchedule("polynomial"); }, ErrorCode::kConfig),
            "unknown lr_scheduler_type 'polynomial'");
}

TEST(QatSchedule, EpochOrdersArePermutationsFixedBySeedAndEpoch) {
  const std::vector<int64_t> first = qat::epochOrder(20, 42, 0);
  std::vector<int64_t> sorted = first;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  EXPECT_EQ(first, qat::epochOrder(20, 42, 0));
  EXPECT_NE(first, qat::epochOrder(20, 42, 1));
  EXPECT_NE(first, qat::epochOrder(20, 7, 0));
}

TEST(QatLoss, TopKComesFromLossTopkThenTheNameThenIsAThousand) {
  EXPECT_EQ(qat::parseLoss("kl_top", 0).topK, 1000);
  EXPECT_EQ(qat::parseLoss("kl_top_64", 0).topK, 64);
  EXPECT_EQ(qat::parseLoss("kl_top_64", 8).topK, 8);
  EXPECT_EQ(qat::parseLoss("r_kl_top_5", 0).type, qat::LossType::kRklTopK);
  EXPECT_EQ(qat::parseLoss("rkl_top_7", 0).topK, 7);
  EXPECT_EQ(qat::parseLoss("cakld", 0).type, qat::LossType::kCakld);
  EXPECT_EQ(test::errorOf([] { qat::parseLoss("kl_top_x", 0); }, ErrorCode::kConfig),
            "'kl_top_x' is not a loss (origin, kl, rkl, mse, kd, cakld, kl_top[_K], r_kl_top[_K])");
}

// The loss applying an lm_head to a few positions at a time gives the terms and the hidden
// states' gradients of the loss on the whole logits, for every loss type.
TEST(QatLoss, AHeadAppliedAChunkAtATimeGivesTheLossOfTheWholeLogits) {
  at::manual_seed(11);
  constexpr int64_t kHidden = 16, kVocab = 300;
  const at::Tensor weight = at::randn({kVocab, kHidden}) * 0.5;
  const at::Tensor studentHidden = at::randn({2, 9, kHidden});
  const at::Tensor teacherHidden = studentHidden + 0.3 * at::randn({2, 9, kHidden});
  at::Tensor labels = at::randint(0, kVocab, {2, 9}, at::kLong);
  labels[0][4] = -100;
  labels[1][2] = -100;
  const qat::Head head{.apply = [&](const at::Tensor& rows) { return at::linear(rows, weight); }, .vocab = kVocab};
  at::AutoGradMode gradients(true);
  for (const std::string name : {"origin", "kl", "rkl", "mse", "kd", "cakld", "kl_top_7", "r_kl_top_7"}) {
    SCOPED_TRACE(name);
    qat::LossSpec spec = qat::parseLoss(name, 0);
    spec.kdWeight = name == "origin" ? 0 : 0.7;
    spec.temperature = 2;
    const at::Tensor wholeHidden = studentHidden.clone().requires_grad_(true);
    const qat::LossTerms whole =
        qat::computeLoss(at::linear(wholeHidden, weight), at::linear(teacherHidden, weight), labels, spec);
    whole.total.backward();
    const at::Tensor chunkedHidden = studentHidden.clone().requires_grad_(true);
    const qat::LossTerms chunked = qat::computeLoss(chunkedHidden * 1, teacherHidden, labels, spec, head, 4);
    chunked.total.backward();
    EXPECT_EQ(chunked.tokens, 14);
    // fp32 sums in another order (and another thread split): ~1e-5 apart; a wrong chunk is far more.
    EXPECT_NEAR(chunked.total.item<double>(), whole.total.item<double>(), 1e-4 * whole.total.item<double>());
    if (spec.distills()) {
      EXPECT_NEAR(chunked.kd.item<double>(), whole.kd.item<double>(), 1e-4 * whole.kd.item<double>());
      EXPECT_NEAR(chunked.forwardKl.item<double>(), whole.forwardKl.item<double>(),
                  1e-4 * whole.forwardKl.item<double>());
    }
    EXPECT_TRUE(at::allclose(chunkedHidden.grad(), wholeHidden.grad(), 1e-4, 1e-6));
    EXPECT_GT(chunkedHidden.grad().abs().sum().item<double>(), 0);
  }
}

TEST(QatLoss, OriginIsTheCrossEntropyOfTheSupervisedTokensAndNoneIsAnError) {
  at::manual_seed(3);
  const at::Tensor logits = at::randn({1, 5, 11});
  at::Tensor labels = at::randint(0, 11, {1, 5}, at::kLong);
  labels[0][3] = -100;
  const qat::LossSpec spec = qat::parseLoss("origin", 0);
  const qat::LossTerms terms = qat::computeLoss(logits, {}, labels, spec);
  EXPECT_EQ(terms.tokens, 3);
  EXPECT_FALSE(terms.kd.defined());
  const at::Tensor expected = at::cross_entropy_loss(logits[0].slice(0, 0, 4), labels[0].slice(0, 1), {}, 1, -100);
  EXPECT_NEAR(terms.total.item<double>(), expected.item<double>(), 1e-6);
  EXPECT_EQ(test::errorOf([&] { qat::computeLoss(logits, {}, at::full({1, 5}, -100, at::kLong), spec); },
                          ErrorCode::kInput),
            "a training sample has no supervised token (every label -100)");
}

class QatProcessor : public ::testing::Test {
 protected:
  QatProcessor() : logger_(std::make_shared<Logger>([](LogLevel, std::string_view) {})), loader_(registry_) {
    loader_.addStatic(qpipe_plugin_descriptor_linear_quant());
    loader_.addStatic(qpipe_plugin_descriptor_fa3());
    loader_.addStatic(qpipe_plugin_descriptor_qat());
  }

  std::vector<std::unique_ptr<Processor>> processors(const std::string& process, const std::string& savePath = "") {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("qat.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    return buildProcessors(pipeline, registry_, {.logger = logger_, .savePath = savePath});
  }

  // What building the steps warned about (ProcessorContext::warnIfSet).
  std::vector<std::string> configWarnings(const std::string& process) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("qat.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    const ProcessorContext context{.logger = logger_};
    buildProcessors(pipeline, registry_, context);
    return *context.configWarnings;
  }

  // Runs the pipeline on `dir`; the model and its report.
  std::pair<std::unique_ptr<CausalLM>, QuantReport> run(const std::string& process, const fs::path& dir,
                                                        const std::string& savePath = "") {
    auto steps = processors(process, savePath);
    auto model = CausalLM::open(dir);
    QuantReport report;
    LayerWiseRunner(*model, steps, {.mode = RunnerMode::kModelWise, .report = &report}).run(samples(), {});
    return {std::move(model), std::move(report)};
  }

  static std::vector<at::Tensor> samples() {
    std::vector<at::Tensor> s;
    for (int64_t i = 0; i < 6; ++i) {
      s.push_back(((at::arange(12, at::kLong) * (i + 5) + 3 * i) % test::kTinyVocab).unsqueeze(0));
    }
    return s;
  }

  std::string configError(const std::string& process) {
    return test::errorOf([&] { processors(process); }, ErrorCode::kConfig);
  }

  Registry registry_;
  std::shared_ptr<Logger> logger_;
  PluginLoader loader_;
};

constexpr const char* kW8a8Static =
    "        act: {dtype: int8, scope: per_tensor, symmetric: True, method: minmax}\n"
    "        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}\n";

std::string qatStep(const std::string& qconfig, const std::string& extra) {
  return "    - type: learnable_scale_qat\n"
         "      qconfig:\n" +
         qconfig + extra;
}

double reportValue(const LayerReport& layer, const std::string& key) {
  for (const ReportValue& value : layer.values) {
    if (value.key == key) return value.value;
  }
  ADD_FAILURE() << layer.name << " has no " << key;
  return 0;
}

TEST_F(QatProcessor, AZeroLearningRateGivesLinearQuantsCheckpointBitForBit) {
  const fs::path dir = test::tinyLlama("qat_zero_lr");
  auto [ptq, ptqReport] = run("    - type: linear_quant\n      qconfig:\n" + std::string(kW8a8Static), dir);
  auto [qat, qatReport] =
      run(qatStep(kW8a8Static,
                  "      learning_rate: 0\n      plugin_config: {quant_config: {learnable: {act_scale: True}}}\n"),
          dir);
  for (int64_t layer = 0; layer < test::kTinyLayers; ++layer) {
    for (const std::string& path : test::tinyLayerLinears()) {
      SCOPED_TRACE(path);
      auto& a = ptq->layer(layer).getSubmodule(path).as<QuantLinear>(path);
      auto& b = qat->layer(layer).getSubmodule(path).as<QuantLinear>(path);
      for (const char* name : {"weight", "weight_scale", "input_scale"}) {
        EXPECT_TRUE(at::equal(a.parameter(name), b.parameter(name))) << name;
      }
    }
  }
}

TEST_F(QatProcessor, TrainingStartsAtThePtqErrorMovesTheScalesAndLogsEachStep) {
  const fs::path dir = test::tinyLlama("qat_trains");
  const fs::path save = test::testDir() / "qat_trains_out";
  auto [ptq, ptqReport] = run("    - type: linear_quant\n      qconfig:\n" + std::string(kW8a8Static), dir);
  // One batch of all six samples per step: the first step's loss is the PTQ error of the layer.
  auto [model, report] =
      run(qatStep(kW8a8Static,
                  "      learning_rate: 1e-2\n      max_steps: 4\n      per_device_train_batch_size: 6\n"
                  "      ste: lsq\n      plugin_config: {quant_config: {learnable: {act_scale: True}}}\n"),
          dir, save.string());
  ASSERT_EQ(report.layers.size(), static_cast<size_t>(test::kTinyLayers));
  std::ifstream log(save.string() + ".qat_log.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(log, line)) {
    const auto entry = nlohmann::json::parse(line);
    const LayerReport& layer = report.layers[static_cast<size_t>(lines / 4)];
    EXPECT_EQ(entry["layer"], layer.name);
    EXPECT_EQ(entry["step"], lines % 4 + 1);
    EXPECT_DOUBLE_EQ(entry["epoch"].get<double>(), lines % 4 + 1.0);
    for (const char* key : {"loss", "grad_norm", "lr"}) EXPECT_TRUE(entry[key].is_number()) << key;
    if (lines % 4 == 0) {
      EXPECT_NEAR(entry["loss"].get<double>(), reportValue(layer, "qat:mse_ptq"), 1e-6 * entry["loss"].get<double>());
    }
    ++lines;
  }
  EXPECT_EQ(lines, 4 * test::kTinyLayers);
  for (const LayerReport& layer : report.layers) {
    EXPECT_EQ(reportValue(layer, "qat:steps"), 4);
    EXPECT_GT(reportValue(layer, "qat:mse_qat"), 0);
  }
  // The deployed modules carry the trained scales: the same codes' scales moved off the PTQ ones.
  for (const std::string& path : test::tinyLayerLinears()) {
    auto& trained = model->layer(0).getSubmodule(path).as<QuantLinear>(path);
    auto& start = ptq->layer(0).getSubmodule(path).as<QuantLinear>(path);
    EXPECT_FALSE(at::equal(trained.parameter("weight_scale"), start.parameter("weight_scale"))) << path;
    EXPECT_FALSE(at::equal(trained.parameter("input_scale"), start.parameter("input_scale"))) << path;
  }
}

TEST_F(QatProcessor, EverySchemeTrainsAndDeploys) {
  const fs::path dir = test::tinyLlama("qat_schemes");
  for (const auto& [name, qconfig, learnable] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"fp8_static",
            "        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}\n"
            "        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}\n",
            "{act_scale: True}"},
           {"w4a16_lwc",
            "        weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: 8}}\n",
            "{weight_scale: False, lwc: True}"},
           {"w4a8_dynamic_lsq",
            "        act: {dtype: int8, scope: per_token, symmetric: True}\n"
            "        weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: 8}}\n",
            "{}"}}) {
    SCOPED_TRACE(name);
    auto [model, report] = run(
        qatStep(qconfig, "      max_steps: 3\n      ste: " + std::string(name.ends_with("lsq") ? "lsq" : "angelslim") +
                             "\n      plugin_config: {quant_config: {learnable: " + learnable + "}}\n"),
        dir);
    for (const LayerReport& layer : report.layers) {
      EXPECT_EQ(reportValue(layer, "qat:steps"), 3) << layer.name;
      EXPECT_TRUE(std::isfinite(reportValue(layer, "qat:mse_qat"))) << layer.name;
    }
    for (const std::string& path : test::tinyLayerLinears()) {
      EXPECT_NO_THROW(model->layer(1).getSubmodule(path).as<QuantLinear>(path)) << path;
    }
  }
}

// NVFP4 (its fused shards' shared global scales too), MXFP4 and W4AFP8 on the tiny Qwen3, whose
// widths take their blocks: a zero learning rate is linear_quant's checkpoint bit for bit, and a
// few steps move the block scales.
TEST_F(QatProcessor, Fp4AndW4afp8StartFromLinearQuantAndTrainTheirBlockScales) {
  const fs::path dir = test::tinyQwen3("qat_fp4");
  for (const auto& [name, qconfig] : std::vector<std::pair<std::string, std::string>>{
           {"nvfp4",
            "        act: {dtype: nvfp4, scope: per_group, symmetric: True, method: minmax}\n"
            "        weight: {dtype: nvfp4, scope: per_group, symmetric: True, method: minmax}\n"},
           {"mxfp4",
            "        act: {dtype: mxfp4, scope: per_group, symmetric: True, method: minmax}\n"
            "        weight: {dtype: mxfp4, scope: per_group, symmetric: True, method: minmax}\n"},
           {"w4afp8",
            "        act: {dtype: fp8_e4m3, scope: per_token, symmetric: True}\n"
            "        weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: "
            "64}}\n"}}) {
    SCOPED_TRACE(name);
    auto [ptq, ptqReport] = run("    - type: linear_quant\n      qconfig:\n" + qconfig, dir);
    auto [still, stillReport] = run(qatStep(qconfig, "      learning_rate: 0\n"), dir);
    // An MXFP4 scale moves by powers of two: α must pass √2 or 1/√2, which AdamW's steps of about
    // the learning rate take many steps to do at 5e-2.
    const std::string rate = name == "mxfp4" ? "0.3" : "5e-2";
    auto [trained, report] =
        run(qatStep(qconfig, "      learning_rate: " + rate + "\n      max_steps: 3\n      ste: lsq\n"), dir);
    int moved = 0;
    for (const std::string& path : test::tinyLayerLinears()) {
      SCOPED_TRACE(path);
      auto& a = ptq->layer(1).getSubmodule(path).as<QuantLinear>(path);
      auto& b = still->layer(1).getSubmodule(path).as<QuantLinear>(path);
      for (const auto& [key, tensor] : a.namedParameters()) EXPECT_TRUE(at::equal(*tensor, b.parameter(key))) << key;
      EXPECT_EQ(a.namedParameters().size(), b.namedParameters().size());
      auto& c = trained->layer(1).getSubmodule(path).as<QuantLinear>(path);
      moved += !at::equal(a.parameter("weight_scale"), c.parameter("weight_scale"));
      if (name == "nvfp4") {
        EXPECT_TRUE(at::equal(a.parameter("weight_global_scale"), c.parameter("weight_global_scale")));
      }
    }
    EXPECT_GT(moved, 0);
    for (const LayerReport& layer : report.layers) {
      EXPECT_TRUE(std::isfinite(reportValue(layer, "qat:mse_qat"))) << layer.name;
    }
  }
}

constexpr const char* kW4a16 =
    "        weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: 8}}\n";

const LayerReport& wholeModelReport(const QuantReport& report) {
  for (const LayerReport& layer : report.layers) {
    if (layer.name == "(whole model)") return layer;
  }
  throw std::runtime_error("the report has no whole-model unit");
}

TEST_F(QatProcessor, End2endAtAZeroLearningRateIsLinearQuantsCheckpoint) {
  const fs::path dir = test::tinyLlama("qat_e2e_zero_lr");
  for (const std::string& qconfig :
       {std::string(kW4a16), std::string("        act: {dtype: int8, scope: per_token, symmetric: True}\n"
                                         "        weight: {dtype: int8, scope: per_channel, symmetric: True}\n")}) {
    SCOPED_TRACE(qconfig);
    auto [ptq, ptqReport] = run("    - type: linear_quant\n      qconfig:\n" + qconfig, dir);
    auto [qat, qatReport] =
        run(qatStep(qconfig, "      training_mode: end2end\n      learning_rate: 0\n      loss_type: kl\n"), dir);
    EXPECT_EQ(reportValue(wholeModelReport(qatReport), "qat:total_loss_qat"),
              reportValue(wholeModelReport(qatReport), "qat:total_loss_ptq"));
    for (int64_t layer = 0; layer < test::kTinyLayers; ++layer) {
      for (const std::string& path : test::tinyLayerLinears()) {
        SCOPED_TRACE(path);
        auto& a = ptq->layer(layer).getSubmodule(path).as<QuantLinear>(path);
        auto& b = qat->layer(layer).getSubmodule(path).as<QuantLinear>(path);
        for (const char* name : {"weight", "weight_scale"}) EXPECT_TRUE(at::equal(a.parameter(name), b.parameter(name)));
      }
    }
  }
}

// The trained model, deployed, computes the loss the training reported for its fake-quantized
// self: the scales were baked, not approximated. The teacher is the float model.
TEST_F(QatProcessor, End2endTrainsOnTheLogitsAndItsDeployedModelComputesTheTrainedLoss) {
  const fs::path dir = test::tinyLlama("qat_e2e");
  const fs::path save = test::testDir() / "qat_e2e_out";
  auto [ptq, ptqReport] = run("    - type: linear_quant\n      qconfig:\n" + std::string(kW8a8Static), dir);
  auto [model, report] =
      run(qatStep(kW8a8Static,
                  "      training_mode: end2end\n      loss_type: cakld\n      lm_loss_weight: 0.5\n"
                  "      learning_rate: 1e-2\n      max_steps: 3\n      per_device_train_batch_size: 6\n"
                  "      lazy_init_samples: 6\n      ste: lsq\n"
                  "      plugin_config: {quant_config: {learnable: {act_scale: True}}}\n"),
          dir, save.string());
  const LayerReport& whole = wholeModelReport(report);
  EXPECT_EQ(reportValue(whole, "qat:steps"), 3);
  std::ifstream log(save.string() + ".qat_log.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(log, line)) {
    const auto entry = nlohmann::json::parse(line);
    EXPECT_FALSE(entry.contains("layer"));
    EXPECT_EQ(entry["step"], lines + 1);
    for (const char* key : {"lm_loss", "kd/cakld", "kd/forward_kl", "kd/backward_kl", "total_loss", "grad_norm", "lr"}) {
      EXPECT_TRUE(entry[key].is_number()) << key;
    }
    const double total = entry["total_loss"].get<double>();
    EXPECT_NEAR(total, 0.5 * entry["lm_loss"].get<double>() + entry["kd/cakld"].get<double>(), 1e-6 * total);
    // One batch of every sample per step: the first step's loss is the start's.
    if (lines == 0) {
      EXPECT_NEAR(total, reportValue(whole, "qat:total_loss_ptq"), 1e-6 * total);
    }
    ++lines;
  }
  EXPECT_EQ(lines, 3);
  for (const std::string& path : test::tinyLayerLinears()) {
    auto& trained = model->layer(1).getSubmodule(path).as<QuantLinear>(path);
    auto& start = ptq->layer(1).getSubmodule(path).as<QuantLinear>(path);
    EXPECT_FALSE(at::equal(trained.parameter("weight_scale"), start.parameter("weight_scale"))) << path;
  }
  auto teacher = CausalLM::open(dir);
  qat::LossSpec spec = qat::parseLoss("cakld", 0);
  spec.lmWeight = 0.5;
  spec.kdWeight = 1;
  double sum = 0;
  for (const at::Tensor& ids : samples()) {
    sum += qat::computeLoss(model->forward(ids), teacher->forward(ids), ids, spec).total.item<double>();
  }
  const double deployed = sum / static_cast<double>(samples().size());
  EXPECT_NEAR(deployed, reportValue(whole, "qat:total_loss_qat"), 1e-5 * deployed);
  EXPECT_NE(reportValue(whole, "qat:total_loss_qat"), reportValue(whole, "qat:total_loss_ptq"));
}

// learnable.norm: the RMSNorm weights train too, and the teacher keeps the float ones: the loss
// reported for the trained model is its KL to a freshly loaded float model.
TEST_F(QatProcessor, End2endTrainsNormsAndItsTeacherKeepsTheFloatNorms) {
  const fs::path dir = test::tinyLlama("qat_e2e_norm");
  auto [model, report] =
      run(qatStep(kW8a8Static,
                  "      training_mode: end2end\n      loss_type: kl\n      lm_loss_weight: 0\n"
                  "      learning_rate: 5e-2\n      max_steps: 4\n      per_device_train_batch_size: 6\n"
                  "      lr_scheduler_type: constant\n"
                  "      plugin_config: {quant_config: {learnable: {norm: True}}}\n"),
          dir);
  auto teacher = CausalLM::open(dir);
  for (int64_t layer = 0; layer < test::kTinyLayers; ++layer) teacher->layer(layer);
  for (const std::string path : {"model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm",
                                 "model.norm"}) {
    const at::Tensor trained = model->root().getSubmodule(path).parameter("weight");
    EXPECT_FALSE(trained.requires_grad()) << path;
    EXPECT_FALSE(at::equal(trained, teacher->root().getSubmodule(path).parameter("weight"))) << path;
  }
  qat::LossSpec spec = qat::parseLoss("kl", 0);
  spec.lmWeight = 0;
  spec.kdWeight = 1;
  double sum = 0;
  for (const at::Tensor& ids : samples()) {
    sum += qat::computeLoss(model->forward(ids), teacher->forward(ids), ids, spec).total.item<double>();
  }
  const double deployed = sum / static_cast<double>(samples().size());
  // A large rate moves the norms far (the KL grows from 6e-7 to 6e-4): a teacher that moved with
  // them would report far less. The deployed int8 GEMM and the fake-quantized forward differ by
  // fp32 rounding, which a KL this small feels at the 1e-5 level.
  EXPECT_NEAR(deployed, reportValue(wholeModelReport(report), "qat:total_loss_qat"), 1e-4 * deployed);
}

// bf16: True trains under bf16 autocast: the losses move by bf16's rounding from the fp32 run's,
// not more, and the deployed modules compute in fp32 again.
TEST_F(QatProcessor, Bf16TrainsUnderAutocastAndDeploysFp32Modules) {
  const fs::path dir = test::tinyLlama("qat_bf16");
  const std::string qat = qatStep(kW8a8Static,
                                  "      training_mode: end2end\n      loss_type: kl\n      learning_rate: 1e-2\n"
                                  "      max_steps: 3\n      lazy_init_samples: 6\n");
  auto [fp32, fp32Report] = run(qat, dir);
  auto [bf16, bf16Report] = run(qat + "      bf16: True\n", dir);
  for (const char* key : {"qat:total_loss_ptq", "qat:total_loss_qat"}) {
    const double a = reportValue(wholeModelReport(fp32Report), key);
    const double b = reportValue(wholeModelReport(bf16Report), key);
    EXPECT_NE(a, b) << key;                     // the products ran in bf16
    EXPECT_NEAR(a, b, 2e-2 * a + 1e-3) << key;  // and no worse than its rounding
  }
  for (const std::string& path : test::tinyLayerLinears()) {
    EXPECT_EQ(bf16->layer(1).getSubmodule(path).as<QuantLinear>(path).computeDtype(), at::kFloat) << path;
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

// linear_quant → learnable_scale_qat in one pipeline: the QAT step starts from the scales the
// PTQ step deployed (its float weights from a fresh copy of the layer), so at a zero learning rate
// either mode gives linear_quant's checkpoint; with one, the scales move from there.
TEST_F(QatProcessor, ALinearQuantStepBeforeHandsItsScalesOn) {
  const fs::path dir = test::tinyLlama("qat_handoff");
  const std::string ptqStep =
      "    - type: linear_quant\n      qconfig:\n" + std::string(kW8a8Static) + "      exclude: [\"lm_head\"]\n";
  auto [ptq, ptqReport] = run(ptqStep, dir);
  const std::string learnable = "      plugin_config: {quant_config: {learnable: {act_scale: True}}}\n";
  for (const std::string mode : {"blockwise", "end2end"}) {
    SCOPED_TRACE(mode);
    const std::string qat = qatStep(kW8a8Static, "      training_mode: " + mode + "\n" + learnable);
    auto [still, stillReport] = run(ptqStep + qat + "      learning_rate: 0\n", dir);
    auto [trained, trainedReport] = run(ptqStep + qat + "      learning_rate: 1.0e-2\n      max_steps: 2\n", dir);
    for (const std::string& path : test::tinyLayerLinears()) {
      SCOPED_TRACE(path);
      auto& a = ptq->layer(1).getSubmodule(path).as<QuantLinear>(path);
      auto& b = still->layer(1).getSubmodule(path).as<QuantLinear>(path);
      auto& c = trained->layer(1).getSubmodule(path).as<QuantLinear>(path);
      for (const char* name : {"weight", "weight_scale", "input_scale"}) {
        EXPECT_TRUE(at::equal(a.parameter(name), b.parameter(name))) << name;
      }
      EXPECT_FALSE(at::equal(a.parameter("weight_scale"), c.parameter("weight_scale")));
    }
  }
  const std::string fp8 =
      "        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}\n";
  auto steps = processors(ptqStep + qatStep(fp8, ""));
  auto model = CausalLM::open(dir);
  EXPECT_EQ(test::errorOf([&] { LayerWiseRunner(*model, steps).run(samples(), {}); }, ErrorCode::kConfig),
            "processor 'learnable_scale_qat' (plugin 'qat') failed in process(model.layers.0): learnable_scale_qat: "
            "model.layers.0.self_attn.q_proj is quantized by an earlier step as w int8_per_channel_sym, a "
            "int8_per_tensor_sym, but the qconfig asks for w fp8_e4m3_per_tensor_sym, a float");
  // lm_head quantized with its inputs by the PTQ step, and not trained by end2end: no gradient.
  auto headToo = processors("    - type: linear_quant\n      qconfig:\n" + std::string(kW8a8Static) +
                            qatStep(kW8a8Static, "      training_mode: end2end\n"));
  EXPECT_EQ(test::errorOf([&] { LayerWiseRunner(*model, headToo).run(samples(), {}); }, ErrorCode::kConfig),
            "processor 'learnable_scale_qat' (plugin 'qat') failed in process(whole model): learnable_scale_qat: "
            "lm_head is quantized with its activations (w int8_per_channel_sym, a int8_per_tensor_sym) and not "
            "trained here, so no gradient passes it; keep it float in the earlier step (exclude) or match it here");
}

// linear_quant → fa3_quant (int8 per-head K and V) → learnable_scale_qat in one pipeline. The K/V
// quantizers pass gradients (k_proj and v_proj train even with kv_scale off) and, with kv_scale,
// their scales train from fa3_quant's and deploy as AttentionQuant; at a zero learning rate
// everything is the PTQ pipeline's.
TEST_F(QatProcessor, KvScalesTrainFromAnFa3StepAndKAndVPassGradients) {
  const fs::path dir = test::tinyLlama("qat_kv");
  const std::string ptqSteps = "    - type: linear_quant\n      qconfig:\n" + std::string(kW8a8Static) +
                               "      exclude: [\"lm_head\"]\n"
                               "    - type: fa3_quant\n"
                               "      details:\n"
                               "        fa_k: {dtype: int8, scope: per_head, symmetric: True, method: minmax}\n"
                               "        fa_v: {dtype: int8, scope: per_head, symmetric: True, method: minmax}\n";
  auto [ptq, ptqReport] = run(ptqSteps, dir);
  // Layer 0: blockwise, a later layer's fa3_quant calibrates on the stream the trained layers before it left.
  const auto scaleOf = [](CausalLM& model, const std::string& hook) {
    return model.layer(0).getSubmodule("self_attn." + hook).as<AttentionQuant>(hook).params().scale;
  };
  for (const std::string mode : {"blockwise", "end2end"}) {
    SCOPED_TRACE(mode);
    const std::string qat = qatStep(kW8a8Static, "      training_mode: " + mode + "\n      max_steps: 3\n");
    const std::string kv = "      plugin_config: {quant_config: {learnable: {kv_scale: True}}}\n";
    auto [still, stillReport] = run(ptqSteps + qat + kv + "      learning_rate: 0\n", dir);
    auto [weights, weightsReport] = run(ptqSteps + qat + "      learning_rate: 1.0e-2\n", dir);
    auto [trained, trainedReport] = run(ptqSteps + qat + kv + "      learning_rate: 1.0e-2\n", dir);
    for (const std::string hook : {"k_hook", "v_hook"}) {
      SCOPED_TRACE(hook);
      EXPECT_TRUE(at::equal(scaleOf(*ptq, hook), scaleOf(*still, hook)));
      EXPECT_TRUE(at::equal(scaleOf(*ptq, hook), scaleOf(*weights, hook)));
      EXPECT_FALSE(at::equal(scaleOf(*ptq, hook), scaleOf(*trained, hook)));
    }
    for (const std::string path : {"self_attn.k_proj", "self_attn.v_proj"}) {
      SCOPED_TRACE(path);
      auto& a = ptq->layer(0).getSubmodule(path).as<QuantLinear>(path);
      auto& b = weights->layer(0).getSubmodule(path).as<QuantLinear>(path);
      EXPECT_FALSE(at::equal(a.parameter("weight_scale"), b.parameter("weight_scale")));
    }
  }
  // Without an fa3_quant step there is nothing for kv_scale to train.
  auto steps = processors(qatStep(kW8a8Static, "      plugin_config: {quant_config: {learnable: {kv_scale: True}}}\n"));
  auto model = CausalLM::open(dir);
  EXPECT_EQ(test::errorOf([&] { LayerWiseRunner(*model, steps).run(samples(), {}); }, ErrorCode::kConfig),
            "processor 'learnable_scale_qat' (plugin 'qat') failed in process(model.layers.0): learnable_scale_qat: "
            "kv_scale is on, but model.layers.0 has no static K/V quantization to train; put fa3_quant (details fa_k "
            "and fa_v, per_head or per_tensor) before this step");
}

// A static module no calibration sample reached, an MoE expert no token was routed to: every
// sample is one token repeated, so each layer routes every position to the same two of its four
// experts. Without activation_scale_init_value that is an error naming the module; with it the
// other two start from it.
TEST_F(QatProcessor, AModuleNoSampleReachedStartsFromActivationScaleInitValue) {
  const fs::path dir = test::tinyMoe("qat_moe_unreached");
  const std::vector<at::Tensor> same(2, at::full({1, 8}, 7, at::kLong));
  const auto runOn = [&](const std::string& extra) {
    auto steps = processors(qatStep(kW8a8Static, "      max_steps: 1\n" + extra));
    auto model = CausalLM::open(dir);
    LayerWiseRunner(*model, steps, {.mode = RunnerMode::kModelWise}).run(same, {});
    return model;
  };
  EXPECT_NE(test::errorOf([&] { runOn(""); }, ErrorCode::kInput)
                .find(": no calibration data reached this module, so its static activation scale is unknown"),
            std::string::npos);
  auto model = runOn("      activation_scale_init_value: 0.05\n");
  int initialized = 0;
  for (int64_t e = 0; e < 4; ++e) {
    const std::string path = "mlp.experts." + std::to_string(e) + ".up_proj";
    initialized +=
        model->layer(0).getSubmodule(path).as<QuantLinear>(path).parameter("input_scale").item<float>() == 0.05f;
  }
  EXPECT_EQ(initialized, 2);
}

// `qpipe check` builds the steps without a save path; a run without one fails as it starts.
TEST_F(QatProcessor, SaveStepsWithoutASavePathFailsWhenTheRunStartsNotWhenTheStepIsBuilt) {
  std::vector<std::unique_ptr<Processor>> steps =
      processors(qatStep(kW8a8Static, "      training_mode: end2end\n      save_steps: 1\n"));
  ASSERT_EQ(steps.size(), 1u);
  const std::string message = test::errorOf([&] { steps[0]->preRun(); }, ErrorCode::kConfig);
  EXPECT_NE(message.find("spec.process[0].save_steps: a training state is saved beside --save_path; give one"),
            std::string::npos)
      << message;
  steps = processors(qatStep(kW8a8Static, "      training_mode: end2end\n      save_steps: 1\n"),
                     (test::testDir() / "qat_save_steps").string());
  EXPECT_NO_THROW(steps[0]->preRun());
}

// A field that this configuration makes of no effect warns where the file sets it; a default does not.
TEST_F(QatProcessor, FieldsWithoutEffectWarnWhereTheFileSetsThem) {
  EXPECT_TRUE(
      configWarnings(qatStep(kW8a8Static, "      plugin_config: {quant_config: {learnable: {act_scale: True}}}\n"))
          .empty());
  constexpr const char* kDynamic =
      "        act: {dtype: int8, scope: per_token, symmetric: True, method: minmax}\n"
      "        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}\n";
  const std::string file = (test::testDir() / "qat.yaml").string();
  EXPECT_EQ(configWarnings(qatStep(kDynamic,
                                   "      loss_type: kd\n"
                                   "      lwc_lr: 0.1\n"
                                   "      plugin_config: {quant_config: {learnable: {act_scale: True}}}\n")),
            (std::vector<std::string>{
                file + ":8:18: spec.process[0].loss_type: has no effect in blockwise training (training_mode: "
                       "end2end uses it)",
                file + ":9:15: spec.process[0].lwc_lr: has no effect without "
                       "plugin_config.quant_config.learnable.lwc",
                file + ":10:61: spec.process[0].plugin_config.quant_config.learnable.act_scale: has no effect: the "
                       "qconfig has no static activations, so there is no input scale to train"}));
  EXPECT_EQ(configWarnings(qatStep(kW8a8Static,
                                   "      training_mode: end2end\n"
                                   "      target: layer\n"
                                   "      kd_temperature: 2\n")),
            (std::vector<std::string>{
                file + ":9:15: spec.process[0].target: has no effect in end2end training (training_mode: blockwise "
                       "uses it)",
                file + ":10:23: spec.process[0].kd_temperature: has no effect with loss_type origin (loss_type kd "
                       "uses it)"}));
}

TEST_F(QatProcessor, ConfigurationErrorsNameTheField) {
  const auto message = [&](const std::string& extra, const std::string& qconfig = kW8a8Static) {
    return configError(qatStep(qconfig, extra));
  };
  EXPECT_NE(message("      training_mode: end2end\n      loss_type: jsd\n")
                .find("spec.process[0].loss_type: 'jsd' is not a loss (origin, kl, rkl, mse, kd, cakld, kl_top[_K], "
                      "r_kl_top[_K])"),
            std::string::npos);
  EXPECT_NE(message("      loss_type: kl_top_0\n").find("spec.process[0].loss_type: 'kl_top_0': K must be at least 1"),
            std::string::npos);
  EXPECT_NE(message("      warmup_ratio: 2\n").find("spec.process[0].warmup_ratio: must be <= 1, got 2"),
            std::string::npos);
  EXPECT_NE(message("      training_mode: end2end\n      loss_type: kl\n      lm_loss_weight: 0\n      kd_loss_weight: 0\n")
                .find("spec.process[0].lm_loss_weight: nothing to minimise: lm_loss_weight and kd_loss_weight are "
                      "both 0"),
            std::string::npos);
  EXPECT_NE(message("      training_mode: end2end\n      lm_loss_weight: 0\n      loss_type: origin\n")
                .find("spec.process[0].lm_loss_weight: nothing to minimise: it is 0, and loss_type origin has no "
                      "distillation term"),
            std::string::npos);
  EXPECT_NE(message("", "        weight: {dtype: int8, scope: per_channel, symmetric: False}\n")
                .find("spec.process[0].qconfig: learnable scales take symmetric schemes (symmetric: True)"),
            std::string::npos);
  EXPECT_NE(message("      plugin_config: {quant_config: {learnable: {weight_scale: False}}}\n")
                .find("spec.process[0].plugin_config.quant_config.learnable: nothing to train: enable weight_scale, "
                      "lwc, kv_scale, or act_scale with static activations"),
            std::string::npos);
  EXPECT_NE(message("      plugin_config: {quant_config: {learnable: {lwc: True}}}\n",
                    "        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True}\n")
                .find("spec.process[0].plugin_config.quant_config.learnable.lwc: learnable weight clipping takes "
                      "per_channel or per_group weights"),
            std::string::npos);
  constexpr const char* kNvfp4 =
      "        act: {dtype: nvfp4, scope: per_group, symmetric: True}\n"
      "        weight: {dtype: nvfp4, scope: per_group, symmetric: True}\n";
  EXPECT_NE(message("      plugin_config: {quant_config: {learnable: {lwc: True}}}\n", kNvfp4)
                .find("spec.process[0].plugin_config.quant_config.learnable.lwc: learnable weight clipping takes int "
                      "and fp8_e4m3 weights; nvfp4 and mxfp4 train their block scales (weight_scale)"),
            std::string::npos);
  EXPECT_NE(message("      activation_scale_init_value: 1.0\n", kNvfp4)
                .find("spec.process[0].activation_scale_init_value: applies to int8 and fp8_e4m3 static "
                      "activations; nvfp4 activations have no input scale"),
            std::string::npos);
  EXPECT_NE(message("      num_train_epochs: 0\n")
                .find("spec.process[0].num_train_epochs: no training: set num_train_epochs > 0 or max_steps > 0"),
            std::string::npos);
  EXPECT_NE(message("      lr_scheduler_type: polynomial\n").find("spec.process[0].lr_scheduler_type"),
            std::string::npos);
  EXPECT_NE(message("      per_device_train_batch_size: 0\n").find("spec.process[0].per_device_train_batch_size"),
            std::string::npos);
  auto steps = processors(qatStep(kW8a8Static, "      logging_file: /nonexistent/qat.jsonl\n"));
  EXPECT_EQ(test::errorOf([&] { steps.front()->preRun(); }, ErrorCode::kIo),
            "processor 'learnable_scale_qat' (plugin 'qat') failed in preRun: learnable_scale_qat: cannot write its "
            "training log '/nonexistent/qat.jsonl'");
}

}  // namespace
}  // namespace qpipe
