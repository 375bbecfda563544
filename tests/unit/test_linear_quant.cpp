// linear_quant and its calibration module: a hand-computed static W8A8 case in two phases
// (observe, freeze, quantize with the final parameters), dynamic and weight-only deployment, and
// the plugin driven by the runner over a tiny Llama: the deployed tensors do not depend on the
// order of the calibration samples, a `group` calibrates in the same two phases, and lm_head (the
// non-layer unit) is quantized when include/exclude select it, left float by every practice.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "qpipe/dist/observer_sync.h"
#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/report.h"
#include "qpipe/host/runner.h"
#include "qpipe/linear_quantizer.h"
#include "qpipe/log.h"
#include "qpipe/plugin.h"
#include "qpipe/qconfig.h"
#include "qpipe/quant_linear.h"
#include "qpipe/safetensors.h"
#include "qpipe/schema.h"
#include "qpipe/staged.h"
#include "test_helpers.h"
#include "tiny_model.h"

QPIPE_DECLARE_STATIC_PLUGIN(linear_quant);
QPIPE_DECLARE_STATIC_PLUGIN(smooth);
QPIPE_DECLARE_STATIC_PLUGIN(fa3);

namespace qpipe {
namespace {

quant::LinearQConfig qconfig(const std::string& yaml) {
  const ConfigNode node = ConfigNode::parseYaml(yaml, "q.yaml");
  return quant::parseLinearQConfig(quant::linearQConfigSchema().validate(node, "qconfig"), "qconfig");
}

at::Tensor row(std::vector<float> values) {
  return at::tensor(values).reshape({1, 1, static_cast<int64_t>(values.size())});
}

// W [2, 4]; int8 per-channel symmetric scales absmax/127: 4/127 and 2/127.
//   W / s = [[31.75, -63.5, 15.875, 127], [15.875, 31.75, -63.5, 127]]
//   q     = [[32, -64, 16, 127], [16, 32, -64, 127]]  (round half to even)
std::shared_ptr<Linear> handLinear() {
  return std::make_shared<Linear>(at::tensor({1.f, -2.f, 0.5f, 4.f, 0.25f, 0.5f, -1.f, 2.f}).reshape({2, 4}));
}

TEST(LinearQuantizer, StaticW8A8ByHand) {
  LinearQuantizer quantizer(*handLinear(), qconfig("act: {dtype: int8, scope: per_tensor, symmetric: False}\n"
                                                   "weight: {dtype: int8, scope: per_channel}\n"));
  EXPECT_TRUE(quantizer.observes());
  const at::Tensor fakeW = at::tensor({32.f * 4 / 127, -64.f * 4 / 127, 16.f * 4 / 127, 4.f, 16.f * 2 / 127,
                                       32.f * 2 / 127, -64.f * 2 / 127, 2.f})
                               .reshape({2, 4});
  // Observing: the activations pass unquantized (only the weight is fake-quantized).
  const at::Tensor x1 = row({0.5f, -1.f, 2.f, 0.f});
  EXPECT_TRUE(at::equal(quantizer(x1), at::linear(x1, fakeW)));
  EXPECT_TRUE(at::equal(quantizer(row({3.f, 0.f, -0.5f, 1.f})), at::linear(row({3.f, 0.f, -0.5f, 1.f}), fakeW)));
  EXPECT_FALSE(quantizer.frozen());

  // Both batches: range [-1, 3] → scale s = 3/255 + 1/255, zero point round(63.75) - 128 = -64.
  quantizer.freeze();
  EXPECT_TRUE(quantizer.frozen() && quantizer.calibrated());
  // Frozen: x is fake-quantized with those final parameters, the first batch too.
  // x/s + zp = [31.875, -63.75, 191.25, 0] - 64 → q = [-32, -128, 127, -64] → x̂ = [32s, -64s, 191s, 0].
  const float s = 3.f / 255 + 1.f / 255;
  const at::Tensor x3 = row({0.5f, -1.f, 3.f, 0.f});
  const at::Tensor y3 = quantizer(x3);
  const at::Tensor xq = row({32 * s, -64 * s, 191 * s, 0.f});
  EXPECT_TRUE(at::allclose(y3, at::linear(xq, fakeW), 1e-6, 1e-6)) << y3 << at::linear(xq, fakeW);
  // It observes no more: the parameters stay those of the first two batches.
  quantizer(row({100.f, 0.f, 0.f, 0.f}));
  const auto deployed = quantizer.deploy("m");
  EXPECT_TRUE(at::equal(deployed->parameter("weight"),
                        at::tensor({32, -64, 16, 127, 16, 32, -64, 127}, at::kChar).reshape({2, 4})));
  EXPECT_TRUE(at::allclose(deployed->parameter("weight_scale"), at::tensor({4.f / 127, 2.f / 127}).reshape({2, 1})));
  EXPECT_FLOAT_EQ(deployed->parameter("input_scale").item<float>(), s);
  EXPECT_EQ(deployed->parameter("input_zero_point").item<int>(), -64);
  EXPECT_FALSE(deployed->hasParameter("weight_zero_point"));
  // The frozen forward is what the deployed module computes.
  EXPECT_TRUE(at::equal((*deployed)(x3), y3));
}

TEST(LinearQuantizer, HistogramActivationsInTwoPhases) {
  LinearQuantizer quantizer(*handLinear(), qconfig("act: {dtype: int8, method: histogram}\nweight: {}\n"));
  const at::Tensor x = at::linspace(-3, 5, 4096).reshape({1, 1024, 4});
  const at::Tensor before = quantizer(x);
  quantizer.freeze();
  // The same search over the same data, on its own: the frozen parameters are the observer's.
  quant::HistogramObserver reference({quant::QDtype::kInt8, quant::QScope::kPerTensor, true, 0});
  reference.update(x);
  const quant::QParams expected = reference.qparams();
  const auto deployed = quantizer.deploy("m");
  EXPECT_TRUE(at::equal(deployed->parameter("input_scale"), expected.scale));
  const quant::QScheme perChannel{.scope = quant::QScope::kPerChannel};
  const at::Tensor weight = handLinear()->weight();
  const at::Tensor fakeW = quant::fakeQuantize(weight, quant::computeQParams(weight, perChannel), perChannel);
  EXPECT_TRUE(at::allclose(before, at::linear(x, fakeW), 1e-5, 1e-5));
  const at::Tensor xq = quant::fakeQuantize(x, expected, {quant::QDtype::kInt8, quant::QScope::kPerTensor, true, 0});
  EXPECT_FALSE(at::equal(xq, x));
  EXPECT_TRUE(at::allclose(quantizer(x), at::linear(xq, fakeW), 1e-5, 1e-5));
}

TEST(LinearQuantizer, DynamicActivationsAreQuantizedPerToken) {
  LinearQuantizer quantizer(*handLinear(), qconfig("act: {dtype: int8, scope: per_token}\nweight: {}\n"));
  // Token absmax 2 and 127: scales 2/127 and 1; both tokens are exact on their int8 grid.
  const at::Tensor x = at::tensor({0.f, 2.f, -2.f, 0.f, 127.f, -3.f, 5.f, 0.f}).reshape({1, 2, 4});
  const at::Tensor fakeW = quant::fakeQuantize(
      handLinear()->weight(), quant::computeQParams(handLinear()->weight(), {.scope = quant::QScope::kPerChannel}),
      {.scope = quant::QScope::kPerChannel});
  EXPECT_TRUE(at::allclose(quantizer(x), at::linear(x, fakeW), 1e-5, 1e-5));
  const auto deployed = quantizer.deploy("m");
  EXPECT_FALSE(deployed->hasParameter("input_scale"));
  ASSERT_TRUE(deployed->inputQuant().has_value());
  EXPECT_TRUE(deployed->inputQuant()->isDynamic());
  EXPECT_TRUE(at::allclose((*deployed)(x), at::linear(x, fakeW), 1e-5, 1e-5));
}

TEST(LinearQuantizer, StaticActivationsWithoutDataAreAnError) {
  LinearQuantizer quantizer(*handLinear(), qconfig("act: {dtype: int8}\nweight: {}\n"));
  EXPECT_FALSE(quantizer.calibrated());
  // No observing forward reached it: frozen without parameters, its forward leaves x as it is.
  dist::synchronize(*ProcessGroup::single(), quantizer);
  EXPECT_TRUE(quantizer.frozen());
  EXPECT_FALSE(quantizer.calibrated());
  EXPECT_EQ(test::errorOf([&] { quantizer.deploy("model.layers.0.mlp.experts.7.up_proj"); }, ErrorCode::kInput),
            "model.layers.0.mlp.experts.7.up_proj: no calibration data reached this module, so its static "
            "activation scale is unknown; add calibration samples or exclude it");
}

// q/k/v-shaped siblings: three Linears reading one input, quantized as a group and one by one.
struct Siblings {
  std::vector<std::shared_ptr<LinearQuantizer>> quantizers;
  std::vector<Module*> modules;
  int settles = 0;
  // Whether the last sibling had observed its input when the first one settled: one settle point.
  bool settledTogether = false;

  Siblings(const quant::LinearQConfig& config, bool staged, const std::vector<bool>& bias) {
    at::manual_seed(5);
    for (size_t i = 0; i < bias.size(); ++i) {
      const int64_t n = i == 0 ? 48 : 16;
      Linear linear(at::randn({n, 64}), bias[i] ? at::randn({n}) : at::Tensor());
      quantizers.push_back(std::make_shared<LinearQuantizer>(linear, config));
      if (staged) {
        quantizers.back()->settleInForward([this](LinearQuantizer& q) {
          if (&q == quantizers.front().get()) settledTogether = !quantizers.back()->minMaxObserver()->empty();
          ++settles;
          q.freeze();
        });
      }
      modules.push_back(quantizers.back().get());
    }
  }
};

// Each sample's outputs, one forward of every sample at a time through `forward`, staged.
std::vector<std::vector<at::Tensor>> stagedOutputs(
    const std::vector<at::Tensor>& samples, const std::function<std::vector<at::Tensor>(const at::Tensor&)>& forward) {
  std::vector<std::vector<at::Tensor>> outputs(samples.size());
  runStaged(static_cast<int64_t>(samples.size()),
            [&](int64_t s) { outputs[static_cast<size_t>(s)] = forward(samples[static_cast<size_t>(s)]); });
  return outputs;
}

// A group settles at one point and shares the work (FP8: one GEMM, its outputs views of one
// tensor), giving each sibling's own observers and checkpoint tensors bit for bit, and its
// outputs: bit for bit from the exact int8 sums, within fp32 rounding from FP8's (the same bits
// under MKL's strict mode). Where the group cannot share (a hook, other schemes, a bias on some),
// each runs alone.
TEST(LinearQuantizer, SiblingsReadingOneInputShareTheirWorkAndGiveTheirOwnForwardsOutputs) {
  const quant::LinearQConfig staticInt8 =
      qconfig("act: {dtype: int8, scope: per_tensor, symmetric: False}\nweight: {dtype: int8, scope: per_channel}\n");
  const quant::LinearQConfig dynamicInt8 =
      qconfig("act: {dtype: int8, scope: per_token}\nweight: {dtype: int8, scope: per_channel}\n");
  const quant::LinearQConfig staticFp8 =
      qconfig("act: {dtype: fp8_e4m3, scope: per_tensor}\nweight: {dtype: fp8_e4m3, scope: per_tensor}\n");
  std::vector<at::Tensor> samples;
  for (int s = 0; s < 3; ++s) samples.push_back(at::randn({1, 5 + s, 64}) * (s + 1));
  struct Expected {
    bool together = false;  // one settle point
    bool views = false;     // one stacked GEMM
  };
  const auto expectSame = [&](const quant::LinearQConfig& config, bool staged, const std::vector<bool>& bias,
                              Expected expected, const std::function<void(Siblings&)>& prepare = nullptr) {
    Siblings group(config, staged, bias), alone(config, staged, bias);
    if (prepare) prepare(group);
    const auto grouped =
        stagedOutputs(samples, [&](const at::Tensor& x) { return forwardSharingInput(x, group.modules); });
    const auto single = stagedOutputs(samples, [&](const at::Tensor& x) {
      std::vector<at::Tensor> y;
      for (Module* module : alone.modules) y.push_back((*module)(x));
      return y;
    });
    EXPECT_EQ(group.settles, alone.settles);
    EXPECT_EQ(group.settledTogether, expected.together);
    EXPECT_FALSE(alone.settledTogether);
    const bool fp8 = config.weight.scheme.dtype == quant::QDtype::kFp8E4m3;
    for (size_t s = 0; s < samples.size(); ++s) {
      for (size_t i = 0; i < bias.size(); ++i) {
        const std::string what = "sample " + std::to_string(s) + " sibling " + std::to_string(i);
        if (fp8) {
          EXPECT_LE((grouped[s][i] - single[s][i]).abs().max().item<float>(),
                    1e-5f * single[s][i].abs().max().item<float>())
              << what;
        } else {
          EXPECT_TRUE(at::equal(grouped[s][i], single[s][i])) << what;
        }
        EXPECT_EQ(grouped[s][i].is_contiguous(), !expected.views) << what;
      }
    }
    for (size_t i = 0; i < bias.size(); ++i) {
      if (!staged) {
        group.quantizers[i]->freeze();
        alone.quantizers[i]->freeze();
      }
      const auto deployed = group.quantizers[i]->deploy("g"), reference = alone.quantizers[i]->deploy("a");
      for (const auto& [name, value] : reference->ownParameters()) {
        EXPECT_TRUE(at::equal(deployed->parameter(name), value)) << name << " of sibling " << i;
      }
    }
  };
  expectSame(staticInt8, true, {false, false, false}, {.together = true});
  expectSame(staticInt8, true, {true, true, true}, {.together = true});
  expectSame(dynamicInt8, false, {true, true, true}, {});
  expectSame(staticFp8, true, {false, false, false}, {.together = true, .views = true});
  expectSame(staticFp8, true, {true, true, true}, {.together = true, .views = true});
  // A bias on some: observed and settled together, then each GEMM alone.
  expectSame(staticFp8, true, {true, false, true}, {.together = true});
  // A hook on one: its hook sees its own input and output, so every sibling runs alone.
  int hooked = 0;
  expectSame(staticInt8, true, {false, false, false}, {}, [&](Siblings& group) {
    group.modules[1]->addForwardHook([&](Module&, const at::Tensor&, const at::Tensor&) {
      ++hooked;
      return at::Tensor();
    });
  });
  EXPECT_EQ(hooked, 3);
  // Static activations outside a staged run observe in two phases: each sibling alone.
  expectSame(staticInt8, false, {false, false, false}, {});
  // Other schemes among them: each alone.
  Siblings mixed(staticInt8, true, {false, false});
  Linear other(at::randn({16, 64}));
  auto dynamic = std::make_shared<LinearQuantizer>(other, dynamicInt8);
  mixed.modules.push_back(dynamic.get());
  const auto outputs =
      stagedOutputs(samples, [&](const at::Tensor& x) { return forwardSharingInput(x, mixed.modules); });
  EXPECT_EQ(mixed.settles, 2);
  EXPECT_TRUE(at::equal(outputs[0][2], (*dynamic)(samples[0])));
}

class LinearQuantPlugin : public ::testing::Test {
 protected:
  LinearQuantPlugin()
      : logger_(std::make_shared<Logger>([this](LogLevel, std::string_view m) { logs_.emplace_back(m); })),
        loader_(registry_) {
    loader_.addStatic(qpipe_plugin_descriptor_linear_quant());
    loader_.addStatic(qpipe_plugin_descriptor_smooth());  // the practices that smooth first
    loader_.addStatic(qpipe_plugin_descriptor_fa3());     // and those that quantize the KV cache
  }

  // Runs `process` (a spec.process list in YAML) over the tiny Llama; returns the module type
  // names of layer 0 at the sink, by path.
  // The model stays in model_ (its root holds what the non-layer unit deployed).
  std::map<std::string, std::string> run(const std::string& process, QuantReport* report = nullptr) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("p.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    auto processors = buildProcessors(pipeline, registry_, {.logger = logger_});
    model_ = CausalLM::open(test::tinyLlama("linear_quant"));
    auto& model = model_;
    std::vector<at::Tensor> samples{at::arange(6, at::kLong).unsqueeze(0), at::arange(3, 9, at::kLong).unsqueeze(0)};
    std::map<std::string, std::string> types;
    LayerWiseRunner(*model, processors, {.report = report})
        .run(samples, [&](int64_t index, const std::string&, Module& layer) {
          if (index != 0) return;
          for (auto& [name, module] : layer.namedModules()) {
            if (module->children().empty() && name.find("proj") != std::string::npos) types[name] = module->typeName();
          }
        });
    return types;
  }

  // Runs `process` over the tiny Llama with these calibration samples; returns every tensor of
  // every QuantLinear the processors deployed, by full name.
  std::map<std::string, at::Tensor> deployed(const std::string& process, const std::vector<at::Tensor>& samples,
                                             const std::filesystem::path& modelDir = {}) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("p.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    auto processors = buildProcessors(pipeline, registry_, {.logger = logger_});
    auto model = CausalLM::open(modelDir.empty() ? test::tinyLlama("linear_quant") : modelDir);
    std::map<std::string, at::Tensor> tensors;
    LayerWiseRunner(*model, processors, {}).run(samples, [&](int64_t, const std::string& name, Module& layer) {
      for (auto& [module, child] : layer.namedModules(name)) {
        if (child->typeName() != "QuantLinear") continue;
        for (auto& [param, tensor] : child->namedParameters(module)) tensors[param] = tensor->clone();
      }
    });
    return tensors;
  }

  static void expectSameTensors(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                                const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (const auto& [name, tensor] : a) {
      ASSERT_TRUE(b.count(name)) << what << ": " << name;
      EXPECT_TRUE(at::equal(tensor, b.at(name))) << what << ": " << name;
    }
  }

  std::unique_ptr<CausalLM> model_;
  Registry registry_;
  std::vector<std::string> logs_;
  std::shared_ptr<Logger> logger_;
  PluginLoader loader_;
};

TEST_F(LinearQuantPlugin, IncludeExcludeSelectLinearModules) {
  const auto types =
      run("    - type: linear_quant\n"
          "      qconfig: {act: {dtype: int8, scope: per_tensor}, weight: {dtype: int8}}\n"
          "      include: ['*self_attn*']\n"
          "      exclude: ['*o_proj']\n");
  EXPECT_EQ(types, (std::map<std::string, std::string>{{"mlp.down_proj", "Linear"},
                                                       {"mlp.gate_proj", "Linear"},
                                                       {"mlp.up_proj", "Linear"},
                                                       {"self_attn.k_proj", "QuantLinear"},
                                                       {"self_attn.o_proj", "Linear"},
                                                       {"self_attn.q_proj", "QuantLinear"},
                                                       {"self_attn.v_proj", "QuantLinear"}}));
  EXPECT_EQ(logs_.back(),
            "linear_quant: 6 Linear modules quantized (w int8 per_channel sym minmax, a int8 per_tensor "
            "sym minmax)");
}

TEST_F(LinearQuantPlugin, GroupRunsSeveralSchemesOverOneForward) {
  QuantReport report;
  const auto types =
      run("    - type: group\n"
          "      configs:\n"
          "        - {type: linear_quant, qconfig: {act: {dtype: int8}, weight: {}}, include: ['*self_attn*']}\n"
          "        - {type: linear_quant, qconfig: {act: {dtype: int8, scope: per_token}, weight: {dtype: int4, "
          "scope: per_group, ext: {group_size: 8}}}, include: ['*mlp*']}\n",
          &report);
  for (const auto& [name, type] : types) EXPECT_EQ(type, "QuantLinear") << name;
  ASSERT_EQ(report.layers.size(), 2u);
  ASSERT_EQ(report.layers[0].modules.size(), 7u);
  EXPECT_EQ(report.layers[0].processorSeconds.size(), 1u);  // one group, one forward
  for (const auto& module : report.layers[0].modules) {
    const bool mlp = module.name.find(".mlp.") != std::string::npos;
    EXPECT_EQ(module.scheme, mlp ? "w int4_per_group_sym, a int8_per_token_sym dynamic"
                                 : "w int8_per_channel_sym, a int8_per_tensor_sym static")
        << module.name;
    EXPECT_GT(module.relativeMse, 0);
    EXPECT_LT(module.relativeMse, mlp ? 0.05 : 0.01) << module.name;
  }
  EXPECT_GT(report.layers[0].relativeMse, 0);
}

// Five calibration samples of different lengths and tokens.
std::vector<at::Tensor> tinySamples() {
  std::vector<at::Tensor> samples;
  for (int64_t i = 0; i < 5; ++i) {
    samples.push_back(((at::arange(4 + 3 * i, at::kLong) * (i + 3) + 7 * i) % test::kTinyVocab).unsqueeze(0));
  }
  return samples;
}

TEST_F(LinearQuantPlugin, SampleOrderDoesNotChangeTheCheckpoint) {
  // Static activations calibrate in two phases, so the next layer's inputs are the same per
  // sample whatever the order, and every observer's state depends on the multiset of samples
  // only: the deployed tensors are equal bit for bit. (Dynamic and weight-only qconfigs are
  // data-free: no forward at all.)
  const std::vector<at::Tensor> samples = tinySamples();
  const std::vector<at::Tensor> reversed(samples.rbegin(), samples.rend());
  const std::vector<at::Tensor> rotated{samples[2], samples[4], samples[0], samples[3], samples[1]};
  for (const std::string act :
       {"{dtype: int8, symmetric: False}", "{dtype: int8, ext: {aggregation_type: mean}}",
        "{dtype: int8, symmetric: False, method: histogram}",
        "{dtype: int8, method: histogram, ext: {search_method: kl_divergence}}", "{dtype: fp8_e4m3}"}) {
    const std::string weight = act == "{dtype: fp8_e4m3}" ? "{dtype: fp8_e4m3}" : "{dtype: int8}";
    const std::string process = "    - {type: linear_quant, qconfig: {act: " + act + ", weight: " + weight + "}}\n";
    const auto reference = deployed(process, samples);
    ASSERT_GE(reference.size(), 2 * 7 * 3u) << act;  // weight, weight_scale, input_scale per Linear (+ zp)
    expectSameTensors(deployed(process, reversed), reference, act + " reversed");
    expectSameTensors(deployed(process, rotated), reference, act + " rotated");
  }
}

TEST_F(LinearQuantPlugin, OnePassCalibrationDoesNotDependOnHowThePipelineSplitsTheLayer) {
  // The staged forward settles each quantizer once every sample reached it, before anything
  // downstream runs: the MLP is observed with the attention's quantization final, whether one
  // linear_quant covers the layer or a group of two shares one forward.
  const std::string q = "qconfig: {act: {dtype: int8, symmetric: False}, weight: {dtype: int8}}";
  const auto one = deployed("    - {type: linear_quant, " + q + "}\n", tinySamples());
  const auto group =
      deployed("    - type: group\n      configs:\n        - {type: linear_quant, " + q +
                   ", include: ['*self_attn*']}\n        - {type: linear_quant, " + q + ", include: ['*mlp*']}\n",
               tinySamples());
  expectSameTensors(group, one, "group");
  // The definition of the one-pass statistics: one step per Linear, in forward order, each
  // calibrating with every module before it deployed.
  std::string steps;
  for (const std::string& linear : test::tinyLayerLinears()) {
    steps += "    - {type: linear_quant, " + q + ", include: ['*" + linear + "']}\n";
  }
  expectSameTensors(deployed(steps, tinySamples()), one, "one step per Linear");
}

TEST_F(LinearQuantPlugin, MoeLayersCalibrateInTwoForwardsWhateverTheSampleOrder) {
  // Routing sends each token to some experts only, so MoE layers do not run staged: observe,
  // sync and freeze every quantizer, propagate. The statistics are still those of the set of
  // samples: reversing them changes no tensor.
  const std::string process =
      "    - {type: linear_quant, qconfig: {act: {dtype: int8, symmetric: False}, weight: {dtype: int8}}, "
      "exclude: ['*mlp.gate']}\n";
  const std::vector<at::Tensor> samples = tinySamples();
  const std::vector<at::Tensor> reversed(samples.rbegin(), samples.rend());
  const auto forward = deployed(process, samples, test::tinyMoe());
  EXPECT_EQ(forward.count("model.layers.1.mlp.experts.3.down_proj.input_scale"), 1u);
  expectSameTensors(deployed(process, reversed, test::tinyMoe()), forward, "reversed");
}

TEST(Calibrate, ObservesRunsTheStepsThenForwardsAgain) {
  std::vector<std::string> events;
  LayerRequest request{.name = "model.layers.0", .inputs = {{at::ones({1})}, {at::zeros({1})}}};
  request.forward = [&](LayerRequest& r) {
    events.push_back("forward");
    r.outputs.assign(r.inputs.size(), {at::full({1}, static_cast<double>(events.size()))});
  };
  calibrate(request);
  EXPECT_EQ(events, std::vector<std::string>{"forward"});
  request.betweenForwards.emplace_back([&] { events.push_back("sync a"); });
  request.betweenForwards.emplace_back([&] { events.push_back("sync b"); });
  calibrate(request);
  EXPECT_EQ(events, (std::vector<std::string>{"forward", "forward", "sync a", "sync b", "forward"}));
  EXPECT_TRUE(request.betweenForwards.empty());
  EXPECT_EQ(request.outputs[1][0].item<double>(), 5.0);
}

TEST_F(LinearQuantPlugin, UnmatchedPatternsWarnAtTheEnd) {
  run("    - {type: linear_quant, qconfig: {weight: {}}, include: ['*q_proj', '*experts*'], exclude: ['*lm_head', "
      "'*.9.*']}\n");
  EXPECT_NE(
      std::find(logs_.begin(), logs_.end(), "linear_quant (spec.process[0]): include '*experts*' matched no module"),
      logs_.end());
  EXPECT_NE(std::find(logs_.begin(), logs_.end(), "linear_quant (spec.process[0]): exclude '*.9.*' matched no module"),
            logs_.end());
  // lm_head is offered with the non-layer modules: the pattern matched it.
  EXPECT_EQ(
      std::find(logs_.begin(), logs_.end(), "linear_quant (spec.process[0]): exclude '*lm_head' matched no module"),
      logs_.end());
}

// ---- lm_head, offered in the non-layer unit

// The runner probes the non-layer unit (the float lm_head's output on the probe) only when a step
// may act on it (Processor::actsOn, through the host's wrappers and groups).
TEST_F(LinearQuantPlugin, TheNonLayerUnitIsProbedOnlyWhereAStepSelectsLmHead) {
  const std::string w8a8 = "{type: linear_quant, qconfig: {act: {dtype: int8, scope: per_token}, weight: {}}";
  const std::vector<std::pair<std::string, int>> cases = {
      {"    - " + w8a8 + ", exclude: ['lm_head']}\n", 0},
      {"    - " + w8a8 + "}\n", 1},
      {"    - type: group\n      configs:\n        - " + w8a8 + ", exclude: ['lm_head', '*mlp*']}\n        - " + w8a8 +
           ", include: ['*mlp*']}\n",
       0},
      {"    - type: group\n      configs:\n        - " + w8a8 + ", exclude: ['lm_head', '*mlp*']}\n        - " + w8a8 +
           ", include: ['*mlp*', 'lm_head']}\n",
       1},
  };
  for (const auto& [process, probes] : cases) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("p.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    auto processors = buildProcessors(pipeline, registry_, {.logger = logger_});
    auto model = CausalLM::open(test::tinyLlama("linear_quant-probe"));
    int floatHeadCalls = 0;
    model->root().getSubmodule("lm_head").addForwardHook([&](Module&, const at::Tensor&, const at::Tensor&) {
      ++floatHeadCalls;
      return at::Tensor();
    });
    QuantReport report;
    LayerWiseRunner(*model, processors, {.report = &report}).run({at::arange(6, at::kLong).unsqueeze(0)}, nullptr);
    EXPECT_EQ(floatHeadCalls, probes) << process;
    EXPECT_EQ(report.layers.size(), test::kTinyLayers + static_cast<size_t>(probes)) << process;
  }
}

TEST_F(LinearQuantPlugin, IncludeLmHeadQuantizesOnlyLmHeadWithCalibratedStaticActivations) {
  QuantReport report;
  const auto types =
      run("    - {type: linear_quant, qconfig: {act: {dtype: int8}, weight: {}}, include: ['lm_head']}\n", &report);
  for (const auto& [name, type] : types) EXPECT_EQ(type, "Linear") << name;
  auto* head = dynamic_cast<QuantLinear*>(&model_->root().getSubmodule("lm_head"));
  ASSERT_NE(head, nullptr) << model_->root().getSubmodule("lm_head").typeName();
  EXPECT_EQ(model_->root().getSubmodule("model.norm").typeName(), "RMSNorm");
  EXPECT_EQ(logs_.back(),
            "linear_quant: 1 Linear modules quantized (w int8 per_channel sym minmax, a int8 per_tensor sym minmax)");

  // Reference: the range of lm_head's input over the same two samples, seen by a hook on the float
  // model's own forward.
  auto reference = CausalLM::open(test::tinyLlama("linear_quant-reference"));
  at::Tensor lo, hi;
  reference->root().getSubmodule("lm_head").addForwardPreHook([&](Module&, const at::Tensor& x) {
    lo = lo.defined() ? at::minimum(lo, x.min()) : x.min();
    hi = hi.defined() ? at::maximum(hi, x.max()) : x.max();
    return at::Tensor();
  });
  for (int64_t start : {0, 3}) reference->forward(at::arange(start, start + 6, at::kLong).unsqueeze(0));
  const quant::QScheme perTensor{.dtype = quant::QDtype::kInt8, .scope = quant::QScope::kPerTensor};
  const quant::QParams expected = quant::computeQParams(lo.reshape({1}), hi.reshape({1}), perTensor);
  EXPECT_TRUE(at::allclose(head->parameter("input_scale"), expected.scale, 1e-6, 0))
      << head->parameter("input_scale") << expected.scale;
  const at::Tensor weight = reference->root().getSubmodule("lm_head").parameter("weight");
  EXPECT_TRUE(at::allclose(head->parameter("weight_scale"), weight.abs().amax(1, true) / 127, 1e-6, 0));

  // The report lists the non-layer unit after the layers, with lm_head's error on the probe.
  ASSERT_EQ(report.layers.size(), 3u);
  EXPECT_EQ(report.layers[2].name, "(non-layer modules)");
  ASSERT_EQ(report.layers[2].modules.size(), 1u);
  EXPECT_EQ(report.layers[2].modules[0].name, "lm_head");
  EXPECT_EQ(report.layers[2].modules[0].scheme, "w int8_per_channel_sym, a int8_per_tensor_sym static");
  EXPECT_GT(report.layers[2].modules[0].relativeMse, 0);
  EXPECT_LT(report.layers[2].modules[0].relativeMse, 0.01);
  EXPECT_GT(report.layers[2].relativeMse, 0);
}

TEST_F(LinearQuantPlugin, ExcludeLmHeadKeepsItFloat) {
  QuantReport report;
  const auto types =
      run("    - {type: linear_quant, qconfig: {act: {dtype: int8}, weight: {}}, exclude: ['lm_head']}\n", &report);
  for (const auto& [name, type] : types) EXPECT_EQ(type, "QuantLinear") << name;
  EXPECT_EQ(model_->root().getSubmodule("lm_head").typeName(), "Linear");
  EXPECT_EQ(report.layers.size(), 2u);  // the non-layer unit replaced nothing: not listed
  EXPECT_EQ(logs_.back(),
            "linear_quant: 14 Linear modules quantized (w int8 per_channel sym minmax, a int8 per_tensor sym minmax)");
}

TEST_F(LinearQuantPlugin, GroupSizeThatDoesNotDivideLmHeadNamesIt) {
  EXPECT_EQ(test::errorOf(
                [&] {
                  run("    - {type: linear_quant, qconfig: {weight: {dtype: int4, scope: per_group, ext: {group_size: "
                      "32}}}, include: ['lm_head']}\n");
                },
                ErrorCode::kConfig),
            "processor 'linear_quant' (plugin 'linear_quant') failed in preprocess(non-layer modules): lm_head: "
            "in_features 16 is not a "
            "multiple of group_size 32; give the weight's qconfig an ext: {group_size: N} that divides it (in a "
            "--config_path pipeline) or exclude the module");
}

// Every shipped practice on the tiny Qwen3 (whose widths fit every group size): the layers are
// quantized, lm_head stays float.
TEST_F(LinearQuantPlugin, DefaultPracticesLeaveLmHeadFloat) {
  const std::filesystem::path configs = std::filesystem::path(QPIPE_SOURCE_DIR) / "configs" / "default";
  const std::vector<at::Tensor> samples{at::arange(6, at::kLong).unsqueeze(0),
                                        at::arange(3, 9, at::kLong).unsqueeze(0)};
  int practices = 0;
  for (const auto& entry : std::filesystem::directory_iterator(configs)) {
    if (entry.path().extension() != ".yaml") continue;
    ++practices;
    const Pipeline pipeline = loadPipeline(entry.path(), registry_);
    auto processors = buildProcessors(pipeline, registry_, {.logger = logger_});
    auto model = CausalLM::open(test::tinyQwen3("practice-" + entry.path().stem().string()));
    std::set<std::string> layerTypes;
    LayerWiseRunner(*model, processors).run(samples, [&](int64_t, const std::string& name, Module& layer) {
      for (auto& [path, module] : layer.namedModules(name)) {
        if (path.ends_with("_proj")) layerTypes.insert(module->typeName());
      }
    });
    EXPECT_EQ(layerTypes, std::set<std::string>{"QuantLinear"}) << entry.path();
    EXPECT_EQ(model->root().getSubmodule("lm_head").typeName(), "Linear") << entry.path();
    EXPECT_EQ(std::find_if(logs_.begin(), logs_.end(),
                           [](const std::string& log) {
                             return log.find("exclude 'lm_head' matched no module") != std::string::npos;
                           }),
              logs_.end())
        << entry.path();
  }
  EXPECT_GE(practices, 8);
}

}  // namespace
}  // namespace qpipe
