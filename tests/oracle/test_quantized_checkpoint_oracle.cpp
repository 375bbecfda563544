// qpipe's compressed_tensors checkpoints loaded by the Python stack vLLM and transformers use:
// compressed-tensors decompresses them inside transformers, the safetensors library sees the
// names, dtypes and shapes of formats_and_peers.md §A1.5, and transformers' logits match qpipe's
// quantized forward. Asymmetric int4 goes through compressed-tensors' decompressor without
// transformers, whose loader (5.23 with compressed-tensors 0.20) expects the zero points unpacked.
// The model is quantized here as linear_quant deploys it: every projection replaced by
// QuantLinear::fromLinear, static activation ranges from a calibration forward; one case quantizes
// lm_head of the tied model too, which the saved checkpoint unties; and one is trained by
// learnable_scale_qat (end2end), whose baked scales must load the same way.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <optional>

#include "qpipe/host/savers.h"
#include "qpipe/model.h"
#include "qpipe/quant_linear.h"
#include "replace_linears.h"
#include "run_pipeline.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;
using quant::QDtype;
using quant::QScheme;
using quant::QScope;

struct Case {
  QScheme weight;
  std::optional<QScheme> input;
  bool compareLogits = true;
  bool head = false;  // lm_head quantized too
  // When set, spec.process entries that quantize the model (test::runPipeline) in place of the
  // deployment above, on four random windows of 24 tokens.
  std::string pipeline;
};

constexpr int64_t kVocab = 97;
const QScheme kNvfp4Weights{.dtype = QDtype::kNvfp4, .scope = QScope::kPerGroup, .groupSize = quant::kNvfp4GroupSize};
const QScheme kMxfp4Weights{.dtype = QDtype::kMxfp4, .scope = QScope::kPerGroup, .groupSize = quant::kMxfp4GroupSize};

// Per-tensor min/max of each projection's (and lm_head's) input over a calibration forward of the
// float model.
std::map<std::string, std::pair<at::Tensor, at::Tensor>> calibrate(CausalLM& lm) {
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> ranges;
  std::vector<std::pair<Module*, Module::HookHandle>> hooks;
  std::vector<std::pair<std::string, Module*>> linears{{"lm_head", &lm.root().getSubmodule("lm_head")}};
  for (int64_t i = 0; i < lm.config().numLayers; ++i) {
    for (auto& [name, module] : lm.layer(i).namedModules(lm.layerName(i))) {
      if (dynamic_cast<Linear*>(module) != nullptr) linears.emplace_back(name, module);
    }
  }
  for (auto& [name, module] : linears) {
    hooks.emplace_back(module, module->addForwardPreHook([&ranges, name = name](Module&, const at::Tensor& x) {
      auto& [lo, hi] = ranges[name];
      lo = lo.defined() ? at::minimum(lo, x.min().reshape({1})) : x.min().reshape({1});
      hi = hi.defined() ? at::maximum(hi, x.max().reshape({1})) : x.max().reshape({1});
      return at::Tensor();
    }));
  }
  at::manual_seed(17);
  lm.forward(at::randint(0, kVocab, {4, 24}, at::kLong));
  for (auto& [module, handle] : hooks) module->removeHook(handle);
  return ranges;
}

void quantize(CausalLM& lm, const Case& c) {
  const auto ranges = c.input && c.input->scope == QScope::kPerTensor ? calibrate(lm) : decltype(calibrate(lm)){};
  const auto deploy = [&](const std::string& name, Linear& linear) {
    std::optional<ActivationQuant> input;
    if (c.input && c.input->scope == QScope::kPerToken) input = ActivationQuant{*c.input, {}};
    if (c.input && c.input->scope == QScope::kPerTensor) {
      const auto& [lo, hi] = ranges.at(name);
      input = ActivationQuant{*c.input, quant::computeQParams(lo, hi, *c.input)};
    }
    return QuantLinear::fromLinear(linear, quant::computeQParams(linear.weight(), c.weight), c.weight, input);
  };
  test::replaceLinears(lm, deploy);
  if (c.head) {
    lm.prepareHead();
    lm.root().replace("lm_head", deploy("lm_head", dynamic_cast<Linear&>(lm.root().getSubmodule("lm_head"))));
  }
}

void runCase(const std::string& name, const Case& c) {
  const fs::path dir = test::testDir();
  const fs::path src = dir / "src", out = dir / "out";
  fs::remove_all(src);
  fs::remove_all(out);
  test::runOracle("quantized_checkpoint_oracle.py", "make " + src.string());
  auto lm = CausalLM::open(src);
  if (c.pipeline.empty()) {
    quantize(*lm, c);
  } else {
    at::manual_seed(5);
    std::vector<at::Tensor> samples;
    for (int i = 0; i < 4; ++i) samples.push_back(at::randint(0, kVocab, {1, 24}, at::kLong));
    test::runPipeline(*lm, c.pipeline, samples);
  }
  at::manual_seed(29);
  const at::Tensor ids = at::randint(0, kVocab, {2, 19}, at::kLong);
  const at::Tensor ours = lm->forward(ids);
  {
    safetensors::Writer writer(dir, {.filePrefix = "ids"});
    writer.add("ids", ids);
    writer.finish();
  }
  auto saver = createBuiltinSaver({}, *lm, out);
  for (int64_t i = 0; i < lm->config().numLayers; ++i) saver->writeLayer(i, lm->layerName(i), lm->layer(i));
  saver->finish();
  test::runOracle("quantized_checkpoint_oracle.py", "check " + src.string() + " " + out.string() + " " +
                                                        (dir / "ids.safetensors").string() + " " +
                                                        (dir / "reference.safetensors").string());
  const auto reference = safetensors::File::open(dir / "reference.safetensors");

  double worstWeight = 0;
  std::vector<std::pair<std::string, Module*>> modules{{"lm_head", &lm->root().getSubmodule("lm_head")}};
  for (int64_t i = 0; i < lm->config().numLayers; ++i) {
    for (auto& entry : lm->layer(i).namedModules(lm->layerName(i))) modules.push_back(entry);
  }
  for (auto& [module, child] : modules) {
    auto* linear = dynamic_cast<QuantLinear*>(child);
    if (linear == nullptr) continue;
    const at::Tensor theirs = reference->tensor(module + ".weight");
    worstWeight = std::max(worstWeight, (theirs - linear->dequantizedWeight()).abs().max().item<double>());
  }
  EXPECT_EQ(worstWeight, 0.0) << name << ": decompressed weights differ";
  const at::Tensor logits = reference->tensor("logits");
  const double relative = (logits - ours).abs().max().item<double>() / logits.abs().max().item<double>();
  std::cout << name << ": max|diff|/max|ref| of logits " << relative << ", of weights " << worstWeight << "\n";
  if (c.compareLogits) {
    EXPECT_LE(relative, 1e-3) << name;
  }
}

TEST(QuantizedCheckpointOracle, W8A8Int8Static) {
  runCase("w8a8 int8 static", {{.dtype = QDtype::kInt8, .scope = QScope::kPerChannel},
                               QScheme{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor}});
}

// compressed-tensors scales dynamic int8 by absmax/127.5, qpipe (like vLLM's kernel) by
// absmax/127: only the loaded weights are compared.
TEST(QuantizedCheckpointOracle, W8A8Int8DynamicWeights) {
  runCase("w8a8 int8 dynamic", {{.dtype = QDtype::kInt8, .scope = QScope::kPerChannel},
                                QScheme{.dtype = QDtype::kInt8, .scope = QScope::kPerToken},
                                /*compareLogits=*/false});
}

TEST(QuantizedCheckpointOracle, Fp8Static) {
  runCase("fp8 static", {{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor},
                         QScheme{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor}});
}

TEST(QuantizedCheckpointOracle, Fp8Dynamic) {
  runCase("fp8 dynamic", {{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerChannel},
                          QScheme{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerToken}});
}

// lm_head quantized too: the checkpoint is untied, lm_head is not in `ignore`, and transformers
// builds it as a compressed Linear beside the float embedding.
TEST(QuantizedCheckpointOracle, W8A8Int8StaticWithQuantizedLmHead) {
  runCase("w8a8 int8 static + lm_head", {{.dtype = QDtype::kInt8, .scope = QScope::kPerChannel},
                                         QScheme{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor},
                                         /*compareLogits=*/true,
                                         /*head=*/true});
}

TEST(QuantizedCheckpointOracle, W4A16Group32Symmetric) {
  runCase("w4a16 g32 sym", {{.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .groupSize = 32}, std::nullopt});
}

TEST(QuantizedCheckpointOracle, W4A16Group128Symmetric) {
  runCase("w4a16 g128 sym", {{.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .groupSize = 128}, std::nullopt});
}

TEST(QuantizedCheckpointOracle, W4A16Group128Asymmetric) {
  runCase("w4a16 g128 asym",
          {{.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .symmetric = false, .groupSize = 128}, std::nullopt});
}

// NVFP4 or MXFP4 through linear_quant, as a practice runs it (NVFP4's fused shards share one
// global scale; the layout check asserts it), weight-only or with the activations (W4A4).
void runFp4Case(const QScheme& weight, bool w4a4) {
  const std::string dtype(quant::qdtypeName(weight.dtype));
  const std::string side = "{dtype: " + dtype + ", scope: per_group, symmetric: True, method: minmax}\n";
  runCase(dtype + (w4a4 ? " w4a4" : "a16"),
          {.weight = weight,
           .pipeline = "    - type: linear_quant\n      qconfig:\n" + (w4a4 ? "        act: " + side : "") +
                       "        weight: " + side});
}

TEST(QuantizedCheckpointOracle, Nvfp4WeightOnly) {
  runFp4Case(kNvfp4Weights, false);
}
TEST(QuantizedCheckpointOracle, Nvfp4W4A4) {
  runFp4Case(kNvfp4Weights, true);
}
TEST(QuantizedCheckpointOracle, Mxfp4WeightOnly) {
  runFp4Case(kMxfp4Weights, false);
}
TEST(QuantizedCheckpointOracle, Mxfp4W4A4) {
  runFp4Case(kMxfp4Weights, true);
}

// W4AFP8 written pack-quantized (as vLLM's W4A8Fp8 scheme allocates it) with fp8 per-token inputs.
TEST(QuantizedCheckpointOracle, W4afp8) {
  runCase("w4afp8", {.weight = {.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .groupSize = 128},
                     .input = QScheme{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerToken}});
}

TEST(QuantizedCheckpointOracle, Fp8StaticTrainedByEnd2endQat) {
  runCase("fp8 static, end2end QAT",
          {.weight = {.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor},
           .pipeline = R"(    - type: learnable_scale_qat
      training_mode: end2end
      qconfig:
        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
      plugin_config: {quant_config: {learnable: {act_scale: True}}}
      loss_type: kl
      ste: lsq
      learning_rate: 1.0e-2
      max_steps: 3
)"});
}

}  // namespace
}  // namespace qpipe
