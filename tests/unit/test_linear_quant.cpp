// linear_quant and its calibration module: a hand-computed static W8A8 case, dynamic and
// weight-only deployment, and the plugin driven by the runner over a tiny Llama.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qpipe/linear_quantizer.h"
#include "qpipe/log.h"
#include "qpipe/pipeline.h"
#include "qpipe/plugin.h"
#include "qpipe/plugin_loader.h"
#include "qpipe/qconfig.h"
#include "qpipe/registry.h"
#include "qpipe/report.h"
#include "qpipe/runner.h"
#include "qpipe/schema.h"
#include "test_helpers.h"
#include "tiny_model.h"

QPIPE_DECLARE_STATIC_PLUGIN(linear_quant);

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
  const at::Tensor fakeW = at::tensor({32.f * 4 / 127, -64.f * 4 / 127, 16.f * 4 / 127, 4.f, 16.f * 2 / 127,
                                       32.f * 2 / 127, -64.f * 2 / 127, 2.f})
                               .reshape({2, 4});
  // First batch: range [-1, 2] → scale 3/255, zero point round(85) - 128 = -43;
  // x/s = [42.5, -85, 170, 0] → q - zp = [42, -85, 170, 0] → x̂ = [42·3/255, -1, 2, 0].
  const at::Tensor y1 = quantizer(row({0.5f, -1.f, 2.f, 0.f}));
  const at::Tensor x1 = row({42.f * 3 / 255, -1.f, 2.f, 0.f});
  EXPECT_TRUE(at::allclose(y1, at::linear(x1, fakeW), 1e-6, 1e-6)) << y1 << at::linear(x1, fakeW);
  quantizer(row({3.f, 0.f, -0.5f, 1.f}));

  // Both batches: range [-1, 3] → scale 3/255 + 1/255, zero point round(63.75) - 128 = -64.
  const auto deployed = quantizer.deploy("m");
  EXPECT_TRUE(at::equal(deployed->parameter("weight"),
                        at::tensor({32, -64, 16, 127, 16, 32, -64, 127}, at::kChar).reshape({2, 4})));
  EXPECT_TRUE(at::allclose(deployed->parameter("weight_scale"), at::tensor({4.f / 127, 2.f / 127}).reshape({2, 1})));
  EXPECT_FLOAT_EQ(deployed->parameter("input_scale").item<float>(), 3.f / 255 + 1.f / 255);
  EXPECT_EQ(deployed->parameter("input_zero_point").item<int>(), -64);
  EXPECT_FALSE(deployed->hasParameter("weight_zero_point"));
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
  EXPECT_EQ(test::errorOf([&] { quantizer.deploy("model.layers.0.mlp.experts.7.up_proj"); }, ErrorCode::kInput),
            "model.layers.0.mlp.experts.7.up_proj: no calibration data reached this module, so its static "
            "activation scale is unknown; add calibration samples or exclude it");
}

class LinearQuantPlugin : public ::testing::Test {
 protected:
  LinearQuantPlugin()
      : logger_(std::make_shared<Logger>([this](LogLevel, std::string_view m) { logs_.emplace_back(m); })),
        loader_(registry_) {
    loader_.addStatic(qpipe_plugin_descriptor_linear_quant());
  }

  // Runs `process` (a spec.process list in YAML) over the tiny Llama; returns the module type
  // names of layer 0 at the sink, by path.
  std::map<std::string, std::string> run(const std::string& process, QuantReport* report = nullptr) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("p.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    auto processors = buildProcessors(pipeline, registry_, {.logger = logger_});
    auto model = CausalLM::open(test::tinyLlama("linear_quant"));
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

  ProcessorRegistry registry_;
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

TEST_F(LinearQuantPlugin, UnmatchedPatternsWarnAtTheEnd) {
  run("    - {type: linear_quant, qconfig: {weight: {}}, include: ['*q_proj', '*experts*'], exclude: ['*lm_head']}\n");
  EXPECT_NE(std::find(logs_.begin(), logs_.end(), "linear_quant: include '*experts*' matched no Linear module"),
            logs_.end());
  EXPECT_NE(std::find(logs_.begin(), logs_.end(), "linear_quant: exclude '*lm_head' matched no Linear module"),
            logs_.end());
}

}  // namespace
}  // namespace qpipe
