// learnable_scale_qat's QatLinear and Optimizer against the same training written in plain
// PyTorch (tests/oracle/qat_oracle.py): the first step's scale gradients and the scales after
// three steps of MSE, gradient clipping and AdamW, for int8, fp8 and int4 schemes under both
// straight-through estimators and both scale parametrizations; every training loss, its terms
// and its gradient against tests/oracle/qat_loss_oracle.py; and two steps of end2end training of
// a transformers Llama against tests/oracle/qat_e2e_oracle.py.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fake_quant.h"
#include "losses.h"
#include "qpipe/model.h"
#include "qpipe/quant.h"
#include "qpipe/safetensors.h"
#include "run_pipeline.h"
#include "test_helpers.h"
#include "trainer.h"

namespace qpipe {
namespace {

at::Tensor fromHex(const std::string& hex, std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  std::vector<uint8_t> bytes(hex.size() / 2);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return at::from_blob(bytes.data(), shape, dtype).clone();
}

double relativeError(const at::Tensor& actual, const at::Tensor& expected) {
  return ((actual - expected).abs().max() / expected.abs().max()).item<double>();
}

TEST(QatOracle, GradientsAndThreeAdamWStepsMatchPyTorch) {
  constexpr int64_t kOut = 8, kIn = 16, kTokens = 6;
  std::istringstream lines(test::runOracle("qat_oracle.py", ""));
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string name, dtype, scope, ste, act, param, wHex, xHex, yHex, sw0Hex, sa0Hex, gwHex, gaHex, swHex, saHex;
    int64_t group = 0;
    double loss0 = 0;
    in >> name >> dtype >> scope >> group >> ste >> act >> param >> wHex >> xHex >> yHex >> sw0Hex >> sa0Hex >> gwHex >>
        gaHex >> swHex >> saHex >> loss0;
    SCOPED_TRACE(name);
    const quant::QScheme weight{
        .dtype = quant::parseQDtype(dtype, name), .scope = quant::parseQScope(scope, name), .groupSize = group};
    const std::vector<int64_t> scaleShape = scope == "per_tensor"    ? std::vector<int64_t>{1}
                                            : scope == "per_channel" ? std::vector<int64_t>{kOut, 1}
                                                                     : std::vector<int64_t>{kOut, kIn / group};
    const at::Tensor w = fromHex(wHex, {kOut, kIn}), x = fromHex(xHex, {kTokens, kIn}),
                     y = fromHex(yHex, {kTokens, kOut});
    const quant::QParams wParams{fromHex(sw0Hex, scaleShape), at::zeros(scaleShape, at::kInt)};
    std::optional<ActivationQuant> input;
    if (act != "float") {
      input = ActivationQuant{{.dtype = quant::parseQDtype(act, name), .scope = quant::QScope::kPerTensor},
                              {fromHex(sa0Hex, {1}), at::zeros({1}, at::kInt)}};
    }
    QuantLinear ptq(quant::quantize(w, wParams, weight), wParams, weight, input, {}, at::kFloat);
    qat::QatLinear module(w, {}, ptq,
                          {.learnable = {.weightScale = true, .actScale = true},
                           .ste = ste == "lsq" ? qat::Ste::kLsq : qat::Ste::kAngelSlim,
                           .param = param == "relative" ? qat::ScaleParam::kRelative : qat::ScaleParam::kAbsolute});
    std::vector<at::Tensor> params;
    for (const auto& [tensorName, tensor] : module.trainable()) params.push_back(tensor);
    ASSERT_EQ(params.size(), act == "float" ? 1u : 2u);
    qat::Optimizer optimizer({{.params = params, .learningRate = param == "relative" ? 1e-2 : 1e-4}},
                             {.maxGradNorm = 5e-3, .schedule = qat::Schedule::kConstant, .totalSteps = 3});
    at::AutoGradMode gradients(true);
    for (int step = 0; step < 3; ++step) {
      const at::Tensor loss = at::mse_loss(module.forward(x), y);
      loss.backward();
      if (step == 0) {
        EXPECT_NEAR(loss.item<double>(), loss0, 1e-6 * loss0);
        EXPECT_LE(relativeError(params[0].grad(), fromHex(gwHex, scaleShape)), 1e-5);
        if (act != "float") {
          EXPECT_LE(relativeError(params[1].grad(), fromHex(gaHex, {1})), 1e-5);
        }
      }
      optimizer.step();
      module.project();
    }
    EXPECT_LE(relativeError(module.weightScale(), fromHex(swHex, scaleShape)), 1e-5);
    if (act != "float") {
      EXPECT_LE(relativeError(module.deploy()->inputQuant()->params.scale, fromHex(saHex, {1})), 1e-5);
    }
    ++cases;
  }
  EXPECT_EQ(cases, 9);
}

TEST(QatOracle, LossesTermsAndGradientsMatchPyTorch) {
  constexpr int64_t kBatch = 2, kSeq = 7, kVocab = 50;
  std::istringstream lines(test::runOracle("qat_loss_oracle.py", ""));
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string name, type, studentHex, teacherHex, labelsHex, totalHex, lmHex, kdHex, fklHex, bklHex, gradHex;
    int64_t topK = 0;
    double temperature = 0, lmWeight = 0, kdWeight = 0;
    in >> name >> type >> topK >> temperature >> lmWeight >> kdWeight >> studentHex >> teacherHex >> labelsHex >>
        totalHex >> lmHex >> kdHex >> fklHex >> bklHex >> gradHex;
    SCOPED_TRACE(name);
    qat::LossSpec spec = qat::parseLoss(type, topK);
    spec.temperature = temperature;
    spec.lmWeight = lmWeight;
    spec.kdWeight = kdWeight;
    const std::vector<int64_t> shape{kBatch, kSeq, kVocab};
    at::AutoGradMode gradients(true);
    // Whole, and with the logits as hidden states of an identity head, 3 positions at a time.
    for (const int64_t chunkRows : {int64_t{0}, int64_t{3}}) {
      SCOPED_TRACE(chunkRows);
      const at::Tensor student = fromHex(studentHex, shape).requires_grad_(true);
      const qat::Head head{.apply = chunkRows > 0 ? [](const at::Tensor& rows) { return rows * 1; }
                                                  : std::function<at::Tensor(const at::Tensor&)>(),
                           .vocab = kVocab};
      const qat::LossTerms terms =
          qat::computeLoss(student, spec.distills() ? fromHex(teacherHex, shape) : at::Tensor(),
                           fromHex(labelsHex, {kBatch, kSeq}, at::kLong), spec, head, chunkRows);
      terms.total.backward();
      EXPECT_EQ(terms.tokens, kBatch * (kSeq - 1) - 3);
      const auto expectTerm = [](const at::Tensor& actual, const std::string& hex, const char* what) {
        SCOPED_TRACE(what);
        ASSERT_EQ(actual.defined(), hex != "-");
        if (hex != "-") {
          EXPECT_LE(relativeError(actual.reshape({1}), fromHex(hex, {1})), 1e-6);
        }
      };
      expectTerm(terms.total, totalHex, "total");
      expectTerm(terms.lm, lmHex, "lm");
      expectTerm(terms.kd, kdHex, "kd");
      expectTerm(terms.forwardKl, fklHex, "forward_kl");
      expectTerm(terms.backwardKl, bklHex, "backward_kl");
      EXPECT_LE(relativeError(student.grad(), fromHex(gradHex, shape)), 1e-6);
    }
    ++cases;
  }
  EXPECT_EQ(cases, 11);
}

TEST(QatOracle, TwoEnd2endStepsMatchPyTorch) {
  const std::filesystem::path dir = test::testDir() / "qat_e2e_src";
  const std::filesystem::path reference = test::testDir() / "qat_e2e_reference.safetensors";
  std::filesystem::remove_all(dir);
  test::runOracle("quantized_checkpoint_oracle.py", "make " + dir.string());
  test::runOracle("qat_e2e_oracle.py", dir.string() + " " + reference.string());
  const auto expected = safetensors::File::open(reference);

  auto model = CausalLM::open(dir);
  const at::Tensor ids = expected->tensor("ids");
  std::vector<at::Tensor> samples;
  for (int64_t row = 0; row < ids.size(0); ++row) samples.push_back(ids.slice(0, row, row + 1));
  const QuantReport report = test::runPipeline(*model, R"(    - type: learnable_scale_qat
      training_mode: end2end
      qconfig:
        weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: 32}}
      include: ["model.layers.*"]
      loss_type: cakld
      ste: lsq
      learning_rate: 1.0e-2
      lr_scheduler_type: constant
      max_steps: 2
      per_device_train_batch_size: 4
)",
                                               samples);
  const double loss0 = expected->tensor("loss0").item<double>();
  bool found = false;
  for (const LayerReport& layer : report.layers) {
    for (const ReportValue& value : layer.values) {
      if (value.key != "qat:total_loss_ptq") continue;
      EXPECT_NEAR(value.value, loss0, 1e-6 * loss0);
      found = true;
    }
  }
  EXPECT_TRUE(found);
  auto start = CausalLM::open(dir);
  const quant::QScheme scheme{.dtype = quant::QDtype::kInt4, .scope = quant::QScope::kPerGroup, .groupSize = 32};
  int modules = 0;
  double worst = 0;
  for (int64_t layer = 0; layer < model->config().numLayers; ++layer) {
    for (auto& [name, module] : model->layer(layer).namedModules(model->layerName(layer))) {
      auto* linear = dynamic_cast<QuantLinear*>(module);
      if (linear == nullptr) continue;
      const at::Tensor theirs = expected->tensor(name + ".weight_scale");
      const at::Tensor ours = linear->parameter("weight_scale").reshape(theirs.sizes());
      worst = std::max(worst, ((ours - theirs).abs() / theirs.abs()).max().item<double>());
      // The steps moved the scales off their minmax start: Adam's first steps are ±lr each.
      const std::string path = name.substr(model->layerName(layer).size() + 1);
      const at::Tensor initial =
          quant::computeQParams(start->layer(layer).getSubmodule(path).as<Linear>(path).weight(), scheme).scale;
      EXPECT_GT((ours / initial.reshape(ours.sizes()) - 1).abs().mean().item<double>(), 5e-3) << name;
      ++modules;
    }
  }
  EXPECT_EQ(modules, 7 * model->config().numLayers);
  EXPECT_LE(worst, 1e-5);
  std::cout << "end2end: " << modules << " modules, worst relative scale difference " << worst << "\n";
}

}  // namespace
}  // namespace qpipe
