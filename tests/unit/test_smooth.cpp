// The smoothing processors (plugins/smooth, docs/smoothing.md) over tiny checkpoints of every
// family: smoothing alone leaves the float model's logits unchanged, the scales are the formulas
// recomputed here from statistics collected independently (hooks on an unsmoothed model), the ov
// reduction keeps one scale per KV-group channel, and every misuse is a one-line error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/report.h"
#include "qpipe/host/runner.h"
#include "qpipe/linear_quantizer.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/plugin.h"
#include "qpipe/qconfig.h"
#include "qpipe/quant.h"
#include "qpipe/quant_linear.h"
#include "qpipe/schema.h"
#include "save_checkpoint.h"
#include "smoothing.h"
#include "test_helpers.h"
#include "tiny_model.h"

QPIPE_DECLARE_STATIC_PLUGIN(linear_quant);
QPIPE_DECLARE_STATIC_PLUGIN(smooth);

namespace qpipe {
namespace {

namespace fs = std::filesystem;

std::vector<at::Tensor> samples() {
  std::vector<at::Tensor> s;
  for (int64_t i = 0; i < 5; ++i) {
    s.push_back(((at::arange(6 + 3 * i, at::kLong) * (i + 3) + 7 * i) % test::kTinyVocab).unsqueeze(0));
  }
  return s;
}

at::Tensor probeIds() {
  return ((at::arange(12, at::kLong) * 5 + 1) % test::kTinyVocab).unsqueeze(0);
}

double relativeError(const at::Tensor& actual, const at::Tensor& expected) {
  return (actual - expected).abs().max().item<double>() / expected.abs().max().item<double>();
}

class Smoothing : public ::testing::Test {
 protected:
  Smoothing()
      : logger_(std::make_shared<Logger>([this](LogLevel, std::string_view m) { logs_.emplace_back(m); })),
        loader_(registry_) {
    loader_.addStatic(qpipe_plugin_descriptor_linear_quant());
    loader_.addStatic(qpipe_plugin_descriptor_smooth());
  }

  std::vector<std::unique_ptr<Processor>> processors(const std::string& process) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("p.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    return buildProcessors(pipeline, registry_, {.logger = logger_});
  }

  // The model of `dir` after running `process` over samples(), every layer kept loaded.
  std::unique_ptr<CausalLM> smoothed(const std::string& process, const fs::path& dir, QuantReport* report = nullptr) {
    auto steps = processors(process);
    auto model = CausalLM::open(dir);
    LayerWiseRunner(*model, steps, {.mode = RunnerMode::kModelWise, .report = report}).run(samples(), {});
    return model;
  }

  // Per channel of the input of `path` in layer 0 of an unsmoothed model: min and max over every
  // token of samples(), from a hook of this test's own.
  static std::pair<at::Tensor, at::Tensor> inputRange(const fs::path& dir, const std::string& path) {
    auto model = CausalLM::open(dir);
    at::Tensor lo, hi;
    model->layer(0).getSubmodule(path).addForwardPreHook([&](Module&, const at::Tensor& x) {
      const at::Tensor flat = x.reshape({-1, x.size(-1)});
      lo = lo.defined() ? at::minimum(lo, flat.amin(0)) : flat.amin(0);
      hi = hi.defined() ? at::maximum(hi, flat.amax(0)) : flat.amax(0);
      return at::Tensor();
    });
    for (const at::Tensor& ids : samples()) model->forward(ids);
    return {lo, hi};
  }

  Registry registry_;
  std::vector<std::string> logs_;
  std::shared_ptr<Logger> logger_;
  PluginLoader loader_;
};

struct Family {
  std::string name;
  std::function<fs::path()> make;
  std::vector<std::string> producers;  // parameters of layer 0 that smoothing must change
};

std::vector<Family> families() {
  const std::vector<std::string> dense = {"input_layernorm.weight", "post_attention_layernorm.weight",
                                          "self_attn.v_proj.weight", "mlp.up_proj.weight"};
  return {
      {"llama", [] { return test::tinyLlama("smooth_llama"); }, dense},
      {"qwen2", [] { return test::tinyQwen2("smooth_qwen2"); }, {"self_attn.v_proj.bias", "mlp.up_proj.weight"}},
      {"qwen3", [] { return test::tinyQwen3("smooth_qwen3"); }, dense},
      {"qwen3_moe",
       [] { return test::tinyMoe("smooth_moe"); },
       {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.v_proj.weight",
        "mlp.experts.0.up_proj.weight", "mlp.experts.3.up_proj.weight"}},
  };
}

struct Step {
  std::string yaml;
  bool searched;  // a search may choose no smoothing (α = 0) for a subgraph
};

const std::vector<Step>& smoothingSteps() {
  static const std::vector<Step> steps = {
      {"    - {type: smooth_quant, enable_subgraph_type: [norm-linear, ov, up-down]}\n", false},
      {"    - {type: iter_smooth}\n", false},
      {"    - {type: iter_smooth, symmetric: False}\n", false},
      {"    - {type: flex_smooth_quant}\n", true},
      {"    - {type: flex_awq_ssz, qconfig: {act: {dtype: int8, scope: per_token}, weight: {dtype: int4, method: ssz, "
       "ext: {step: 3}}}}\n",
       true},
  };
  return steps;
}

TEST_F(Smoothing, LeavesTheFloatLogitsOfEveryFamilyUnchanged) {
  for (const Family& family : families()) {
    const fs::path dir = family.make();
    const at::Tensor expected = CausalLM::open(dir)->forward(probeIds());
    auto reference = CausalLM::open(dir);
    for (const Step& step : smoothingSteps()) {
      SCOPED_TRACE(family.name + ": " + step.yaml);
      auto model = smoothed(step.yaml, dir);
      EXPECT_LE(relativeError(model->forward(probeIds()), expected), 1e-5);
      if (step.searched) continue;
      for (const std::string& name : family.producers) {
        const std::string module = name.substr(0, name.rfind('.'));
        const std::string param = name.substr(name.rfind('.') + 1);
        EXPECT_FALSE(at::allclose(model->layer(0).getSubmodule(module).parameter(param),
                                  reference->layer(0).getSubmodule(module).parameter(param)))
            << name << " was not smoothed";
      }
    }
  }
}

TEST_F(Smoothing, SmoothQuantScalesAreLlmCompressorsFormula) {
  // s = range(X)^α / (2·max|W|)^(1−α) over q, k and v, floored at 1e-5; the norm is divided by it.
  const fs::path dir = test::tinyLlama("smooth_formula");
  const auto [lo, hi] = inputRange(dir, "self_attn.q_proj");
  auto reference = CausalLM::open(dir);
  DecoderLayer& layer = reference->layer(0);
  const at::Tensor w = 2.0 * at::cat({layer.getSubmodule("self_attn.q_proj").parameter("weight"),
                                      layer.getSubmodule("self_attn.k_proj").parameter("weight"),
                                      layer.getSubmodule("self_attn.v_proj").parameter("weight")})
                                 .abs()
                                 .amax(0);
  const double alpha = 0.3;
  const at::Tensor expected = ((hi - lo).pow(alpha) / w.pow(1 - alpha)).clamp_min(1e-5);
  auto model = smoothed("    - {type: smooth_quant, alpha: 0.3}\n", dir);
  const at::Tensor actual = layer.getSubmodule("input_layernorm").parameter("weight") /
                            model->layer(0).getSubmodule("input_layernorm").parameter("weight");
  EXPECT_LE(relativeError(actual, expected), 1e-6);
  // The consumers' columns carry the same scales.
  const at::Tensor q = model->layer(0).getSubmodule("self_attn.q_proj").parameter("weight") /
                       layer.getSubmodule("self_attn.q_proj").parameter("weight");
  EXPECT_LE(relativeError(q[0], expected), 1e-6);
  // smooth_quant's default is llm-compressor's mappings, the norms only: no ov, no up-down.
  for (const char* unchanged : {"self_attn.o_proj", "mlp.down_proj"}) {
    EXPECT_TRUE(at::equal(model->layer(0).getSubmodule(unchanged).parameter("weight"),
                          layer.getSubmodule(unchanged).parameter("weight")))
        << unchanged;
  }
}

TEST_F(Smoothing, IterSmoothOvAveragesEachKvGroupsHeadScales) {
  // Tiny Llama: 4 heads of 4, 2 KV heads. Per o_proj input channel s = max|X|^0.9 / max|W|^0.1;
  // v_proj's row (k, d) is divided by the mean of s over heads 2k and 2k+1 at d, and o_proj's
  // columns of both heads are multiplied by it.
  const fs::path dir = test::tinyLlama("smooth_ov");
  const auto [lo, hi] = inputRange(dir, "self_attn.o_proj");
  auto reference = CausalLM::open(dir);
  DecoderLayer& layer = reference->layer(0);
  const at::Tensor wo = layer.getSubmodule("self_attn.o_proj").parameter("weight");
  const at::Tensor perHead = (at::maximum(lo.abs(), hi.abs()).pow(0.9) / wo.abs().amax(0).pow(0.1)).clamp_min(1e-5);
  const at::Tensor group = perHead.view({2, 2, 4}).mean(1).reshape({-1});
  auto model = smoothed("    - {type: iter_smooth, enable_subgraph_type: [ov]}\n", dir);
  const at::Tensor v = layer.getSubmodule("self_attn.v_proj").parameter("weight") /
                       model->layer(0).getSubmodule("self_attn.v_proj").parameter("weight");
  EXPECT_LE(relativeError(v.select(1, 0), group), 1e-6);
  const at::Tensor o = model->layer(0).getSubmodule("self_attn.o_proj").parameter("weight") / wo;
  EXPECT_LE(relativeError(o[0], group.view({2, 1, 4}).expand({2, 2, 4}).reshape({-1})), 1e-6);
  // Only ov was enabled: the norms are untouched.
  EXPECT_TRUE(at::equal(model->layer(0).getSubmodule("input_layernorm").parameter("weight"),
                        layer.getSubmodule("input_layernorm").parameter("weight")));
}

// Symmetric int8 fake quantization per row (absmax / 127), in double.
at::Tensor fakeQuantRows(const at::Tensor& x) {
  const at::Tensor scale = x.abs().amax(1, true) / 127.0;
  return at::round(x / scale).clamp(-128, 127) * scale;
}

// The q/k/v inputs of layer 0 over samples() (every token, in sample order) and q, k and v's
// weights stacked, from an unsmoothed model, in double.
struct QkvCalibration {
  at::Tensor inputs;
  at::Tensor weight;
};

QkvCalibration qkvCalibration(const fs::path& dir) {
  auto reference = CausalLM::open(dir);
  std::vector<at::Tensor> rows;
  reference->layer(0).getSubmodule("self_attn.q_proj").addForwardPreHook([&](Module&, const at::Tensor& x) {
    rows.push_back(x.reshape({-1, x.size(-1)}).to(at::kDouble));
    return at::Tensor();
  });
  for (const at::Tensor& ids : samples()) reference->forward(ids);
  DecoderLayer& layer = reference->layer(0);
  const at::Tensor w = at::cat({layer.getSubmodule("self_attn.q_proj").parameter("weight"),
                                layer.getSubmodule("self_attn.k_proj").parameter("weight"),
                                layer.getSubmodule("self_attn.v_proj").parameter("weight")});
  return {at::cat(rows), w.to(at::kDouble)};
}

TEST_F(Smoothing, FlexSmoothQuantPicksTheLowestInt8LossOfTheTwoPhaseGrid) {
  // Recomputed here in double from the q/k/v inputs of layer 0: phase 1 tries α = 0, 0.05, …, 1
  // with β = 1 − α, phase 2 β = 0, …, 1 with the best α; a later value wins a tie. The 16-channel
  // model's search computes its float product itself; the 384-channel one gets it from the
  // processor's product tasks (kSharedProductChannels), which the report lists.
  test::detail::TinySpec wide = test::detail::tinyLlamaSpec();
  wide.hidden = 384;
  wide.headDim = wide.hidden / wide.heads;
  for (const auto& [dir, shared] : {std::pair(test::tinyLlama("smooth_flex"), false),
                                    std::pair(test::detail::writeTinyCheckpoint("smooth_flex_wide", wide, {}), true)}) {
    SCOPED_TRACE(dir.string());
    const auto [x, w] = qkvCalibration(dir);
    const at::Tensor xMax = x.abs().amax(0), wMax = w.abs().amax(0);
    const at::Tensor y = at::matmul(x, w.t());
    const auto loss = [&](double alpha, double beta) {
      const at::Tensor s = (xMax.pow(alpha) / wMax.pow(beta)).clamp_min(1e-5);
      const at::Tensor yq = at::matmul(fakeQuantRows(x / s), fakeQuantRows(w * s).t());
      return ((yq - y).square().mean().sqrt() / y.square().mean().sqrt()).item<double>();
    };
    double best = std::numeric_limits<double>::infinity(), alpha = 0, beta = 0;
    const auto consider = [&](double a, double b) {
      if (const double l = loss(a, b); l <= best) std::tie(best, alpha, beta) = std::tuple(l, a, b);
    };
    for (int i = 0; i <= 20; ++i) consider(i * 0.05, 1.0 - i * 0.05);
    const double phaseOne = alpha;
    for (int i = 0; i <= 20; ++i) consider(phaseOne, i * 0.05);

    QuantReport report;
    smoothed("    - {type: flex_smooth_quant, enable_subgraph_type: [norm-linear], include: ['*.0.input_layernorm']}\n",
             dir, &report);
    std::map<std::string, double> values;
    for (const ReportValue& v : report.layers.front().values) values[v.key] = v.value;
    EXPECT_DOUBLE_EQ(values.at("alpha"), alpha);
    EXPECT_DOUBLE_EQ(values.at("beta"), beta);
    // qpipe's fp32 against this test's double: the loss, rms(y_q − y) about 1 % of rms(y), scales
    // the products' rounding by 100, which 384-channel sums carry more of than 16-channel ones.
    EXPECT_NEAR(values.at("loss"), best, (shared ? 1e-4 : 1e-5) * best);
    EXPECT_EQ(values.count("dts:flex_smooth_quant.product#p0:seconds"), shared ? 1U : 0U);
  }
}

TEST_F(Smoothing, FlexAwqSszPicksTheAlphaOfTheLowestQuantizedError) {
  // s = mean|X|^α over the q/k/v inputs of layer 0; the error is that of q, k and v quantized as
  // the qconfig says, recomputed here in double for α = 0, 0.05, …, 1; a later α wins a tie.
  // Dynamic per-token activations with int8 per-channel weights (min-max) or int4 ones (SSZ)
  // take the search's int8 path (the loss from the codes); static per-tensor activations,
  // calibrated on X/s, the deployed QuantLinear.
  const fs::path dir = test::tinyLlama("smooth_awq");
  const auto [x, w] = qkvCalibration(dir);
  const at::Tensor mean = x.abs().mean(0), y = at::matmul(x, w.t());
  const quant::QScheme int4{quant::QDtype::kInt4, quant::QScope::kPerChannel, true, 0};
  const auto sszRows = [&](const at::Tensor& scaled) {
    const at::Tensor rows = scaled.to(at::kFloat);
    const at::Tensor scale = quant::sszSearch(rows, int4, 10).scale.to(at::kDouble);
    return at::round(rows.to(at::kDouble) / scale).clamp(-8, 7) * scale;
  };
  const auto perTensor = [](const at::Tensor& t) {
    const at::Tensor scale = t.abs().max() / 127.0;
    return at::round(t / scale).clamp(-128, 127) * scale;
  };
  using Quantized = std::function<at::Tensor(const at::Tensor&)>;
  const std::vector<std::tuple<std::string, Quantized, Quantized>> qconfigs = {
      {"{act: {dtype: int8, scope: per_token}, weight: {dtype: int8}}", fakeQuantRows, fakeQuantRows},
      {"{act: {dtype: int8, scope: per_token}, weight: {dtype: int4, method: ssz, ext: {step: 10}}}", fakeQuantRows,
       sszRows},
      {"{act: {dtype: int8, scope: per_tensor}, weight: {dtype: int8}}", perTensor, fakeQuantRows}};
  for (const auto& [qconfig, act, weight] : qconfigs) {
    SCOPED_TRACE(qconfig);
    std::vector<double> losses;
    for (int i = 0; i <= 20; ++i) {
      const at::Tensor s = mean.pow(i * 0.05).clamp_min(1e-5);
      const at::Tensor yq = at::matmul(act(x / s), weight(w * s).t());
      losses.push_back(((yq - y).square().mean().sqrt() / y.square().mean().sqrt()).item<double>());
    }
    const double best = *std::min_element(losses.begin(), losses.end());
    QuantReport report;
    smoothed(
        "    - {type: flex_awq_ssz, enable_subgraph_type: [norm-linear], include: ['*.0.input_layernorm'], "
        "qconfig: " +
            qconfig + "}\n",
        dir, &report);
    std::map<std::string, double> values;
    for (const ReportValue& v : report.layers.front().values) values[v.key] = v.value;
    // The chosen α is one whose loss here is the lowest to this test's precision (fp32 against
    // double: an α within 1e-5 of the best may win a near-tie).
    const double alpha = values.at("alpha");
    const auto step = static_cast<size_t>(std::lround(alpha / 0.05));
    ASSERT_LT(step, losses.size());
    EXPECT_DOUBLE_EQ(alpha, static_cast<double>(step) * 0.05);
    EXPECT_LE(losses[step], best * (1 + 1e-5)) << "α " << alpha;
    EXPECT_NEAR(values.at("loss"), best, 1e-5 * best);
  }
}

// A candidate split into pieces of whole blocks of outputs (search_split; tasks that other ranks
// may run) gives the one-piece losses bit for bit, so the same choices and weights: on a model
// whose projections span several blocks of 128 outputs, every subgraph type, both searches
// (flex_awq_ssz with int8 min-max weights per channel). A weight scale per tensor reads every row,
// and an SSZ solve stops every row of a weight at once: those losses stay whole.
TEST_F(Smoothing, SplitCandidatesGiveTheWholeCandidatesLossesBitForBit) {
  test::detail::TinySpec wide = test::detail::tinyLlamaSpec();
  wide.hidden = 384;
  wide.intermediate = 320;
  wide.headDim = wide.hidden / wide.heads;
  const fs::path dir = test::detail::writeTinyCheckpoint("smooth_split", wide, {});
  const std::vector<std::string> steps = {
      "{type: flex_smooth_quant",
      "{type: flex_awq_ssz, qconfig: {act: {dtype: int8, scope: per_token}, weight: {dtype: int4, method: ssz, ext: "
      "{step: 10}}}",
      "{type: flex_awq_ssz, qconfig: {act: {dtype: int8, scope: per_token}, weight: {dtype: int8}}",
      "{type: flex_awq_ssz, qconfig: {act: {dtype: int8, scope: per_token}, weight: {dtype: int8, scope: "
      "per_tensor}}"};
  for (const std::string& step : steps) {
    SCOPED_TRACE(step);
    std::map<std::string, double> values[2];
    std::unique_ptr<CausalLM> models[2];
    for (int split = 0; split < 2; ++split) {
      QuantReport report;
      models[split] =
          smoothed("    - " + step + ", search_tokens: 32, search_split: " + (split ? "3" : "1") + "}\n", dir, &report);
      for (const ReportValue& v : report.layers.front().values) {
        if (v.key.find("dts:") == std::string::npos && v.key.find("seconds") == std::string::npos) {
          values[split][v.module + " " + v.key] = v.value;
        }
      }
      const bool pieces =
          std::any_of(report.layers.front().values.begin(), report.layers.front().values.end(),
                      [](const ReportValue& v) { return v.key.find("c0b0:seconds") != std::string::npos; });
      EXPECT_EQ(pieces, split == 1 && step.find("per_tensor") == std::string::npos &&
                            step.find("method: ssz") == std::string::npos);
    }
    ASSERT_FALSE(values[0].empty());
    EXPECT_EQ(values[0], values[1]);  // α, β and the loss of every subgraph, exactly
    const auto others = models[1]->root().namedParameters("");
    const auto mine = models[0]->root().namedParameters("");
    ASSERT_EQ(mine.size(), others.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(mine[i].first, others[i].first);
      EXPECT_TRUE(at::equal(*mine[i].second, *others[i].second)) << mine[i].first;
    }
  }
}

// flex_awq_ssz's codes path (smooth.cpp, AlphaSearch::loss) rests on these: for the qconfigs it
// takes, the weight's and the divided tokens' codes through Int8Linear, row by row, are the
// product of the QuantLinear a LinearQuantizer of the scaled weight deploys, bit for bit.
TEST(SmoothingCodesPath, IsTheDeployedQuantLinearsProductBitForBit) {
  at::manual_seed(3);
  const at::Tensor w = at::randn({96, 64}) * 0.05;
  at::Tensor tokens = at::randn({40, 64});
  tokens.select(1, 5).mul_(30);  // an outlier channel, as smoothing sees them
  const at::Tensor s = at::rand({64}) * 2 + 0.1;
  for (const char* yaml :
       {"act: {dtype: int8, scope: per_token}\nweight: {dtype: int8}\n",
        "act: {dtype: int8, scope: per_token}\nweight: {dtype: int4, method: ssz, ext: {step: 10}}\n",
        "act: {dtype: int8, scope: per_token, symmetric: False}\nweight: {dtype: int8, method: ssz}\n"}) {
    SCOPED_TRACE(yaml);
    const quant::LinearQConfig q = quant::parseLinearQConfig(
        quant::linearQConfigSchema().validate(ConfigNode::parseYaml(yaml, "q.yaml"), "qconfig"), "qconfig");
    const at::Tensor scaled = w * s.unsqueeze(0);
    Linear linear(scaled);
    const at::Tensor expected = LinearQuantizer(linear, q).deploy("m")->forward(tokens / s.unsqueeze(0));

    quant::QParams params;
    at::Tensor codes;
    if (q.weight.method == quant::QMethod::kSsz) {
      params = quant::sszSearch(scaled, q.weight.scheme, q.weight.sszSteps);
      codes = quant::quantize(scaled, params, q.weight.scheme);
    } else {
      std::tie(params, codes) = quant::quantizeScaledWeight(w, s, q.weight.scheme);
    }
    const Int8Linear int8(codes, params.scale);
    const auto [tokenParams, tokenCodes] = quant::quantizeDividedTokens(tokens, s, q.act.scheme);
    EXPECT_TRUE(at::equal(int8.forwardCodes(tokenCodes, tokenParams, at::Tensor()), expected));
    at::Tensor rows = at::empty_like(expected);
    int8.forwardCodesRows(tokenCodes, tokenParams, at::Tensor(), [&](int64_t m, const float* y) {
      std::copy(y, y + rows.size(1), rows[m].data_ptr<float>());
    });
    EXPECT_TRUE(at::equal(rows, expected));
  }
}

TEST_F(Smoothing, AsymmetricIterSmoothCentresNormLinearInputsByHand) {
  // Per q/k/v input channel: shift = (max + min) / 2, s = ((max − min) / 2)^0.9 / max|W|^0.1. The
  // norm becomes (w / s)·x̂ − shift / s, so q/k/v see (X − shift) / s; each of them gains the
  // bias W·shift (W unscaled) and its columns are multiplied by s.
  const fs::path dir = test::tinyLlama("smooth_asymmetric");
  const auto [lo, hi] = inputRange(dir, "self_attn.q_proj");
  auto reference = CausalLM::open(dir);
  DecoderLayer& layer = reference->layer(0);
  const auto weightOf = [](DecoderLayer& l, const char* path) { return l.getSubmodule(path).parameter("weight"); };
  const std::vector<const char*> consumers = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"};
  at::Tensor w = weightOf(layer, consumers[0]).abs().amax(0);
  for (const char* c : consumers) w = at::maximum(w, weightOf(layer, c).abs().amax(0));
  const at::Tensor shift = (hi + lo) / 2;
  const at::Tensor s = (((hi - lo) / 2).pow(0.9) / w.pow(0.1)).clamp_min(1e-5);

  auto model = smoothed("    - {type: iter_smooth, symmetric: False, enable_subgraph_type: [norm-linear]}\n", dir);
  DecoderLayer& smoothedLayer = model->layer(0);
  Module& norm = smoothedLayer.getSubmodule("input_layernorm");
  EXPECT_LE(relativeError(weightOf(layer, "input_layernorm") / norm.parameter("weight"), s), 1e-6);
  EXPECT_LE(relativeError(norm.parameter("bias"), -shift / s), 1e-6);
  for (const char* c : consumers) {
    SCOPED_TRACE(c);
    Module& consumer = smoothedLayer.getSubmodule(c);
    EXPECT_LE(relativeError(consumer.parameter("bias"), at::mv(weightOf(layer, c), shift)), 1e-6);
    EXPECT_LE(relativeError(consumer.parameter("weight")[1] / weightOf(layer, c)[1], s), 1e-6);
  }
  // The smoothed input is centred: every channel's range is symmetric about 0.
  const auto [newLo, newHi] = [&] {
    at::Tensor l, h;
    smoothedLayer.getSubmodule("self_attn.q_proj").addForwardPreHook([&](Module&, const at::Tensor& x) {
      const at::Tensor flat = x.reshape({-1, x.size(-1)});
      l = l.defined() ? at::minimum(l, flat.amin(0)) : flat.amin(0);
      h = h.defined() ? at::maximum(h, flat.amax(0)) : flat.amax(0);
      return at::Tensor();
    });
    for (const at::Tensor& ids : samples()) model->forward(ids);
    return std::make_pair(l, h);
  }();
  EXPECT_LE((newHi + newLo).abs().max().item<double>(), 1e-4 * newHi.abs().max().item<double>());
  // ov and up-down stay symmetric in msmodelslim's asymmetric mode: no bias appears there.
  auto all = smoothed("    - {type: iter_smooth, symmetric: False}\n", dir);
  EXPECT_FALSE(all->layer(0).getSubmodule("self_attn.o_proj").hasParameter("bias"));
  EXPECT_FALSE(all->layer(0).getSubmodule("mlp.down_proj").hasParameter("bias"));
}

TEST_F(Smoothing, AsymmetricNormBiasesSaveAsAscendV1AndAreRefusedByCompressedTensors) {
  const fs::path dir = test::tinyLlama("smooth_asymmetric_save");
  const at::Tensor floatLogits = CausalLM::open(dir)->forward(probeIds());
  const auto saveAll = [](CausalLM& lm, const fs::path& out, const std::string& format) {
    fs::remove_all(out);
    test::saveCheckpoint(lm, out, {.format = format});
  };
  const std::string asymmetric = "    - {type: iter_smooth, symmetric: False}\n";
  // Smoothing alone: the ascendv1 checkpoint holds the norms' and the projections' new biases
  // (msmodelslim's FLOAT entries), and qpipe loads them back: the float model's logits.
  auto smoothedOnly = smoothed(asymmetric, dir);
  const fs::path floatOut = test::testDir() / "smooth_asymmetric_float";
  saveAll(*smoothedOnly, floatOut, "ascendv1_saver");
  const std::string description = test::slurp(floatOut / "quant_model_description.json");
  for (const char* key : {"\"model.layers.0.input_layernorm.bias\": \"FLOAT\"",
                          "\"model.layers.1.post_attention_layernorm.bias\": \"FLOAT\"",
                          "\"model.layers.0.self_attn.q_proj.bias\": \"FLOAT\""}) {
    EXPECT_NE(description.find(key), std::string::npos) << key;
  }
  EXPECT_LE(relativeError(CausalLM::open(floatOut)->forward(probeIds()), floatLogits), 1e-5);
  // Then W8A8 dynamic: the quantized projections keep their biases through the round trip.
  auto quantized = smoothed(asymmetric +
                                "    - type: linear_quant\n"
                                "      qconfig:\n"
                                "        act: {dtype: int8, scope: per_token, symmetric: True, method: minmax}\n"
                                "        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}\n",
                            dir);
  const at::Tensor expected = quantized->forward(probeIds());
  const fs::path quantOut = test::testDir() / "smooth_asymmetric_w8a8";
  saveAll(*quantized, quantOut, "ascendv1_saver");
  EXPECT_TRUE(at::equal(CausalLM::open(quantOut)->forward(probeIds()), expected));
  // compressed-tensors (and a plain HF checkpoint) cannot hold a norm bias: one line, nothing saved.
  const fs::path refused = test::testDir() / "smooth_asymmetric_ct";
  EXPECT_EQ(test::errorOf([&] { saveAll(*smoothedOnly, refused, "compressed_tensors"); }, ErrorCode::kConfig),
            "compressed_tensors: model.layers.0.input_layernorm has a bias (from iter_smooth with symmetric: False), "
            "which the RMSNorm of transformers and vLLM lacks and would drop; save with ascendv1_saver, or smooth "
            "with symmetric: True");
  EXPECT_FALSE(fs::exists(refused));
}

TEST_F(Smoothing, ItsForwardStopsAtTheLastConsumerInputWhenALaterStepForwardsAgain) {
  // The forwards of layer 0's modules as the checkpoint loads them, counted when they complete:
  // linear_quant replaces the modules in its own preprocess, so these count the smoothing
  // forward's alone.
  const fs::path dir = test::tinyLlama("smooth_stops");
  const std::string quant =
      "    - type: linear_quant\n"
      "      qconfig:\n"
      "        act: {dtype: int8, scope: per_tensor, symmetric: False}\n"
      "        weight: {dtype: int8, scope: per_channel}\n";
  const auto callsDuring = [&](const std::string& process, const std::vector<std::string>& paths) {
    auto steps = processors(process);
    auto model = CausalLM::open(dir);
    std::vector<int> calls(paths.size());
    for (size_t i = 0; i < paths.size(); ++i) {
      model->layer(0).getSubmodule(paths[i]).addForwardHook([&calls, i](Module&, const at::Tensor&, const at::Tensor&) {
        ++calls[i];
        return at::Tensor();
      });
    }
    LayerWiseRunner(*model, steps, {.mode = RunnerMode::kModelWise}).run(samples(), {});
    return calls;
  };
  const std::vector<std::string> paths = {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"};
  const int n = static_cast<int>(samples().size());
  // smooth_quant watches q_proj's and gate_proj's inputs: nothing from gate_proj on runs.
  EXPECT_EQ(callsDuring("    - {type: smooth_quant}\n" + quant, paths), (std::vector<int>{n, n, 0, 0}));
  // iter_smooth watches down_proj's input too: only down_proj itself is skipped.
  EXPECT_EQ(callsDuring("    - {type: iter_smooth}\n" + quant, paths), (std::vector<int>{n, n, n, 0}));
  EXPECT_EQ(callsDuring("    - {type: iter_smooth, enable_subgraph_type: [ov]}\n" + quant, paths),
            (std::vector<int>{n, 0, 0, 0}));
  // Alone, smoothing's forward is the one whose outputs feed the next layer: it runs whole.
  EXPECT_EQ(callsDuring("    - {type: smooth_quant}\n", paths), (std::vector<int>{n, n, n, n}));
}

TEST(SmoothingGroups, ReduceAndExpandByHand) {
  // 4 heads of 2 channels in 2 KV groups: heads 0, 1 → group 0; heads 2, 3 → group 1.
  const at::Tensor perHead = at::tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f});
  EXPECT_TRUE(at::equal(smooth::reduceGroups(perHead, 2, 2, /*mean=*/true), at::tensor({2.f, 3.f, 6.f, 7.f})));
  EXPECT_TRUE(at::equal(smooth::reduceGroups(perHead, 2, 2, /*mean=*/false), at::tensor({3.f, 4.f, 7.f, 8.f})));
  EXPECT_TRUE(at::equal(smooth::expandGroups(at::tensor({2.f, 3.f, 6.f, 7.f}), 4, 2, 2),
                        at::tensor({2.f, 3.f, 2.f, 3.f, 6.f, 7.f, 6.f, 7.f})));
}

TEST_F(Smoothing, ReportsTheScaleRangeOfEverySubgraph) {
  QuantReport report;
  smoothed("    - {type: iter_smooth, include: ['*input_layernorm']}\n", test::tinyLlama("smooth_report"), &report);
  ASSERT_FALSE(report.layers.empty());
  // The scheduler's figures (docs/scheduler.md) come with the smoothing's own values.
  std::vector<ReportValue> values, scheduled;
  for (const ReportValue& v : report.layers.front().values)
    (v.key.rfind("dts:", 0) == 0 ? scheduled : values).push_back(v);
  const auto has = [&](const std::string& module, const std::string& key) {
    return std::any_of(scheduled.begin(), scheduled.end(),
                       [&](const ReportValue& v) { return v.module == module && v.key == key; });
  };
  EXPECT_TRUE(has("model.layers.0.input_layernorm", "dts:iter_smooth.subgraph:seconds"));
  EXPECT_TRUE(has("model.layers.0", "dts:iter_smooth:wall_seconds"));
  ASSERT_EQ(values.size(), 3u);
  EXPECT_EQ(values[0].module, "model.layers.0.input_layernorm");
  EXPECT_EQ(values[0].key, "scale_min");
  EXPECT_EQ(values[1].key, "scale_max");
  EXPECT_GE(values[1].value, values[0].value);
  EXPECT_EQ(values[2].key, "alpha");
  EXPECT_DOUBLE_EQ(values[2].value, 0.9);
}

TEST_F(Smoothing, AfterQuantizationIsAnErrorNamingTheSubgraphAndTheModule) {
  const std::string process =
      "    - {type: linear_quant, qconfig: {weight: {dtype: int8}}}\n"
      "    - {type: iter_smooth}\n";
  EXPECT_EQ(test::errorOf([&] { smoothed(process, test::tinyLlama("smooth_after_quant")); }, ErrorCode::kConfig),
            "processor 'iter_smooth' (plugin 'smooth') failed in preprocess(model.layers.0): subgraph norm-linear "
            "model.layers.0.input_layernorm → self_attn.q_proj, self_attn.k_proj, "
            "self_attn.v_proj: module 'model.layers.0.self_attn.q_proj' is a QuantLinear, not a qpipe::Linear (did "
            "an earlier processor of the pipeline replace it?)");
}

TEST_F(Smoothing, AFamilyWithoutDeclaredSubgraphsIsAnError) {
  auto steps = processors("    - {type: smooth_quant}\n");
  Module layer("DecoderLayer");
  LayerRequest request{.name = "model.layers.0", .module = &layer};
  request.family = "gemma2";
  EXPECT_EQ(test::errorOf([&] { steps.front()->preprocess(request); }, ErrorCode::kConfig),
            "processor 'smooth_quant' (plugin 'smooth') failed in preprocess(model.layers.0): model family 'gemma2' "
            "declares no smoothing subgraphs (model.layers.0), so there is "
            "nothing to smooth; docs/smoothing.md lists the families that do");
}

TEST_F(Smoothing, ConfigurationErrorsNameTheField) {
  const std::string unknown = test::errorOf(
      [&] { processors("    - {type: iter_smooth, enable_subgraph_type: [norm-linear, qk]}\n"); }, ErrorCode::kConfig);
  EXPECT_NE(unknown.find("spec.process[0].enable_subgraph_type: unknown subgraph type 'qk'; expected one of "
                         "norm-linear, linear-linear, ov, up-down"),
            std::string::npos)
      << unknown;
  const std::string empty =
      test::errorOf([&] { processors("    - {type: smooth_quant, enable_subgraph_type: []}\n"); }, ErrorCode::kConfig);
  EXPECT_NE(empty.find("spec.process[0].enable_subgraph_type: an empty list smooths nothing; list some of "
                       "norm-linear, linear-linear, ov, up-down, or remove the step"),
            std::string::npos)
      << empty;
  const std::string alpha =
      test::errorOf([&] { processors("    - {type: smooth_quant, alpha: 1.5}\n"); }, ErrorCode::kConfig);
  EXPECT_NE(alpha.find("spec.process[0].alpha"), std::string::npos) << alpha;
}

}  // namespace
}  // namespace qpipe
