// fa3_quant (plugins/fa3, docs/attention.md): the recall-window observer on hand-built cases, the
// per-head scales it gives, the processor on tiny checkpoints (Q, K and V of every attention
// quantized where they enter attention, scales equal to windows this test computes itself from
// its own hooks), the data-free per_token mode, and every configuration error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "qpipe/attention_quant.h"
#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/runner.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/observer.h"
#include "qpipe/plugin.h"
#include "qpipe/safetensors.h"
#include "save_checkpoint.h"
#include "test_helpers.h"
#include "tiny_model.h"

QPIPE_DECLARE_STATIC_PLUGIN(linear_quant);
QPIPE_DECLARE_STATIC_PLUGIN(fa3);

namespace qpipe {
namespace {

namespace fs = std::filesystem;
using quant::RecallWindowObserver;

// The narrowest window holding T = max(1, ⌊ratio·N⌋) of the sorted values, by brute force.
std::pair<double, double> bruteWindow(std::vector<double> values, double ratio) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const size_t t = std::max<size_t>(1, static_cast<size_t>(ratio * static_cast<double>(n)));
  size_t best = 0;
  for (size_t i = 1; i + t <= n; ++i) {
    if (values[i + t - 1] - values[i] < values[best + t - 1] - values[best]) best = i;
  }
  return {values[best], values[best + t - 1]};
}

std::vector<double> headValues(const at::Tensor& x, int64_t head) {
  const at::Tensor flat = x.select(1, head).reshape({-1}).to(at::kDouble).contiguous();
  return {flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()};
}

TEST(RecallWindow, RatioOneIsMinAndMaxPerHead) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, 3, 5, 4}) * at::tensor({1.0f, 5.0f, 0.1f}).view({1, 3, 1, 1});
  RecallWindowObserver observer(1.0);
  observer.update(x);
  EXPECT_TRUE(at::equal(observer.state().min, x.amin({0, 2, 3}, true)));
  EXPECT_TRUE(at::equal(observer.state().max, x.amax({0, 2, 3}, true)));
}

TEST(RecallWindow, AnOutlierFallsOutsideTheWindowOfItsHeadOnly) {
  // Head 0: 0, 1, …, 99 and one outlier 1000; head 1: the same without the outlier, shifted.
  std::vector<float> h0(101), h1(101);
  for (int i = 0; i < 100; ++i) {
    h0[i] = static_cast<float>(i);
    h1[i] = static_cast<float>(i) - 50;
  }
  h0[100] = 1000;
  h1[100] = 50;
  const at::Tensor x = at::stack({at::tensor(h0), at::tensor(h1)}).view({1, 2, 101, 1});
  RecallWindowObserver observer(0.99);  // T = 99 of 101
  const auto [start, end] = observer.window(x);
  EXPECT_EQ(start.sizes(), (std::vector<int64_t>{1, 2, 1, 1}));
  // Head 0: the outlier is dropped, [0, 98] and [1, 99] are equally narrow, the first wins.
  EXPECT_EQ(start[0][0].item<float>(), 0.0f);
  EXPECT_EQ(end[0][0].item<float>(), 98.0f);
  EXPECT_EQ(start[0][1].item<float>(), -50.0f);
  EXPECT_EQ(end[0][1].item<float>(), 48.0f);
}

TEST(RecallWindow, RandomHeadsMatchABruteForceAndBatchesAccumulate) {
  at::manual_seed(11);
  const at::Tensor a = at::randn({1, 4, 37, 8}) * at::tensor({1.0f, 3.0f, 0.5f, 20.0f}).view({1, 4, 1, 1});
  const at::Tensor b = at::randn({1, 4, 21, 8}) * 2;
  RecallWindowObserver observer(0.9999);
  observer.update(a);
  observer.update(b);
  for (int64_t h = 0; h < 4; ++h) {
    const auto [a0, a1] = bruteWindow(headValues(a, h), 0.9999);
    const auto [b0, b1] = bruteWindow(headValues(b, h), 0.9999);
    EXPECT_EQ(observer.state().min[0][h].item<float>(), static_cast<float>(std::min(a0, b0))) << h;
    EXPECT_EQ(observer.state().max[0][h].item<float>(), static_cast<float>(std::max(a1, b1))) << h;
  }
  // A batch of two samples: head h's values are x[:, h], both samples'.
  const at::Tensor both = at::cat({a.slice(2, 0, 21), b}, 0);
  const auto [start, end] = observer.window(both);
  for (int64_t h = 0; h < 4; ++h) {
    const auto [lo, hi] = bruteWindow(headValues(both, h), 0.9999);
    EXPECT_EQ(start[0][h].item<float>(), static_cast<float>(lo));
    EXPECT_EQ(end[0][h].item<float>(), static_cast<float>(hi));
  }
  EXPECT_EQ(test::errorOf([] { RecallWindowObserver bad(1.5); }, ErrorCode::kConfig),
            "recall window observer: ratio 1.5 is not in (0, 1]");
}

class Fa3 : public ::testing::Test {
 protected:
  Fa3() : logger_(std::make_shared<Logger>([](LogLevel, std::string_view) {})), loader_(registry_) {
    loader_.addStatic(qpipe_plugin_descriptor_linear_quant());
    loader_.addStatic(qpipe_plugin_descriptor_fa3());
  }

  std::vector<std::unique_ptr<Processor>> processors(const std::string& process) {
    const Pipeline pipeline = loadPipeline(
        test::writeTempFile("fa3.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry_);
    return buildProcessors(pipeline, registry_, {.logger = logger_});
  }

  std::unique_ptr<CausalLM> quantized(const std::string& process, const fs::path& dir) {
    auto steps = processors(process);
    auto model = CausalLM::open(dir);
    LayerWiseRunner(*model, steps, {.mode = RunnerMode::kModelWise}).run(samples(), {});
    return model;
  }

  static std::vector<at::Tensor> samples() {
    std::vector<at::Tensor> s;
    for (int64_t i = 0; i < 4; ++i) {
      s.push_back(((at::arange(9 + 2 * i, at::kLong) * (i + 5) + 3 * i) % test::kTinyVocab).unsqueeze(0));
    }
    return s;
  }

  Registry registry_;
  std::shared_ptr<Logger> logger_;
  PluginLoader loader_;
};

// Qwen3 (q/k norms before RoPE: the hooks come after both) calibrates in one staged forward,
// Qwen3-MoE in two (observe, settle, propagate): the same windows either way.
class Fa3Scales : public Fa3, public ::testing::WithParamInterface<std::string> {};

TEST_P(Fa3Scales, PerHeadScalesAreTheRecallWindowsOfQkvWhereTheyEnterAttention) {
  const fs::path dir = GetParam() == "qwen3" ? test::tinyQwen3("fa3_scales") : test::tinyMoe("fa3_scales_moe");
  // This test's own hooks on an unquantized model: layer 0's Q, K and V of every sample.
  std::map<std::string, std::vector<at::Tensor>> seen;
  {
    auto model = CausalLM::open(dir);
    for (const char* hook : {"q_hook", "k_hook", "v_hook"}) {
      model->layer(0)
          .getSubmodule(std::string("self_attn.") + hook)
          .addForwardHook([&seen, hook](Module&, const at::Tensor&, const at::Tensor& out) {
            seen[hook].push_back(out.clone());
            return at::Tensor();
          });
    }
    for (const at::Tensor& ids : samples()) model->forward(ids);
  }
  auto model = quantized("    - {type: fa3_quant}\n", dir);
  for (const auto& [hook, ratio] :
       std::vector<std::pair<std::string, double>>{{"q_hook", 0.9999}, {"k_hook", 0.9999}, {"v_hook", 1.0}}) {
    SCOPED_TRACE(hook);
    auto& quant = model->layer(0).getSubmodule("self_attn." + hook).as<AttentionQuant>(hook);
    const at::Tensor scale = quant.parameter("scale");
    const int64_t heads = seen[hook].front().size(1);
    ASSERT_EQ(scale.sizes(), (std::vector<int64_t>{1, heads, 1, 1}));
    for (int64_t h = 0; h < heads; ++h) {
      double lo = 1e300, hi = -1e300;
      for (const at::Tensor& x : seen[hook]) {
        const auto [a, b] = bruteWindow(headValues(x, h), ratio);
        lo = std::min(lo, a);
        hi = std::max(hi, b);
      }
      EXPECT_FLOAT_EQ(scale[0][h].item<float>(), static_cast<float>(std::max(std::abs(lo), std::abs(hi)) / 127.0));
    }
    EXPECT_TRUE(at::equal(quant.parameter("zero_point"), at::zeros_like(quant.parameter("zero_point"))));
  }
  // GQA: Q has the heads, K and V the KV heads.
  EXPECT_GT(model->layer(0).getSubmodule("self_attn.q_hook").parameter("scale").size(1),
            model->layer(0).getSubmodule("self_attn.k_hook").parameter("scale").size(1));
}

INSTANTIATE_TEST_SUITE_P(Families, Fa3Scales, ::testing::Values("qwen3", "qwen3_moe"));

TEST_F(Fa3, QuantizedAttentionChangesTheLogitsALittleInEveryFamily) {
  // The bound: int8 or fp8 Q/K/V move a dense tiny model's logits by under 5 %; the tiny MoE's
  // router flips experts for a few tokens on such a change, so its logits move up to 15 %.
  for (const auto& [family, make, bound] : std::vector<std::tuple<std::string, std::function<fs::path()>, double>>{
           {"llama", [] { return test::tinyLlama("fa3_llama"); }, 0.05},
           {"qwen3", [] { return test::tinyQwen3("fa3_qwen3"); }, 0.05},
           {"qwen3_moe", [] { return test::tinyMoe("fa3_moe"); }, 0.2}}) {
    SCOPED_TRACE(family);
    const fs::path dir = make();
    const at::Tensor ids = samples().back();
    const at::Tensor expected = CausalLM::open(dir)->forward(ids);
    for (const char* step :
         {"    - {type: fa3_quant}\n", "    - {type: fa3_quant, qconfig: {dtype: fp8_e4m3, scope: per_head}}\n",
          "    - {type: fa3_quant, qconfig: {dtype: int8, scope: per_token}}\n"}) {
      SCOPED_TRACE(step);
      const at::Tensor actual = quantized(step, dir)->forward(ids);
      const double error = (actual - expected).abs().max().item<double>() / expected.abs().max().item<double>();
      EXPECT_GT(error, 0.0);
      EXPECT_LT(error, bound);
    }
  }
}

TEST_F(Fa3, DetailsQuantizeOnlyTheInputsTheyName) {
  const fs::path dir = test::tinyLlama("fa3_details");
  auto model = quantized(
      "    - type: fa3_quant\n"
      "      details:\n"
      "        fa_k: {dtype: fp8_e4m3, scope: per_head}\n"
      "        fa_v: {dtype: fp8_e4m3, scope: per_head}\n",
      dir);
  Module& attention = model->layer(1).getSubmodule("self_attn");
  EXPECT_EQ(attention.getSubmodule("q_hook").typeName(), "HookPoint");
  EXPECT_EQ(attention.getSubmodule("k_hook").as<AttentionQuant>("k").scheme().dtype, quant::QDtype::kFp8E4m3);
  EXPECT_EQ(attention.getSubmodule("v_hook").typeName(), "AttentionQuant");
  // include/exclude match msmodelslim's placeholder names.
  auto excluded = quantized("    - {type: fa3_quant, exclude: [\"model.layers.0.*\", \"*.fa_q\"]}\n", dir);
  EXPECT_EQ(excluded->layer(0).getSubmodule("self_attn.k_hook").typeName(), "HookPoint");
  EXPECT_EQ(excluded->layer(1).getSubmodule("self_attn.q_hook").typeName(), "HookPoint");
  EXPECT_EQ(excluded->layer(1).getSubmodule("self_attn.k_hook").typeName(), "AttentionQuant");
}

// Saves layer by layer as the runner's sink does; returns the saved folder.
fs::path saveAll(CausalLM& model, const std::string& name, const std::string& format = "compressed_tensors") {
  const fs::path out = test::testDir() / name;
  fs::remove_all(out);
  test::saveCheckpoint(model, out, {.format = format});
  return out;
}

TEST_F(Fa3, KvCacheRoundTripsThroughCompressedTensorsKvCacheScheme) {
  const fs::path dir = test::tinyQwen3("fa3_kv");
  const at::Tensor ids = samples().back();
  for (const auto& [scope, strategy, shape] : std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>{
           {"per_tensor", "tensor", {1}}, {"per_head", "attn_head", {test::kTinyQwen3KvHeads, 1, 1}}}) {
    SCOPED_TRACE(scope);
    const std::string kv = "{dtype: fp8_e4m3, scope: " + scope + "}";
    auto model = quantized(
        "    - type: linear_quant\n"
        "      qconfig:\n"
        "        act: {dtype: int8, scope: per_token}\n"
        "        weight: {dtype: int8, scope: per_channel}\n"
        "    - {type: fa3_quant, details: {fa_k: " +
            kv + ", fa_v: " + kv + "}}\n",
        dir);
    const at::Tensor expected = model->forward(ids);
    const fs::path out = saveAll(*model, "fa3_kv_" + scope);
    const auto config = nlohmann::json::parse(test::slurp(out / "config.json"))["quantization_config"];
    const auto& kvScheme = config["kv_cache_scheme"];
    EXPECT_EQ(kvScheme["strategy"], strategy);
    EXPECT_EQ(kvScheme["type"], "float");
    EXPECT_EQ(kvScheme["num_bits"], 8);
    EXPECT_EQ(kvScheme["dynamic"], false);
    EXPECT_EQ(kvScheme["symmetric"], true);
    const auto checkpoint = safetensors::Checkpoint::open(out, "model");
    EXPECT_EQ(checkpoint.info("model.layers.1.self_attn.k_scale").shape, shape);
    EXPECT_EQ(checkpoint.info("model.layers.1.self_attn.v_scale").dtype, "F32");
    EXPECT_FALSE(checkpoint.contains("model.layers.0.self_attn.k_hook.scale"));
    // qpipe loads the scales back to the same attention: the same logits, bit for bit.
    auto loaded = CausalLM::open(out);
    EXPECT_TRUE(at::equal(loaded->forward(ids), expected));
    EXPECT_EQ(loaded->layer(0).getSubmodule("self_attn.v_hook").typeName(), "AttentionQuant");
    EXPECT_EQ(loaded->layer(0).getSubmodule("self_attn.q_hook").typeName(), "HookPoint");
  }
  // Q, K and V (FA3): Q's scales go to a weightless config group on the attention modules.
  auto fa3 = quantized("    - {type: fa3_quant}\n", dir);
  const fs::path fa3Out = saveAll(*fa3, "fa3_qkv");
  const auto fa3Config = nlohmann::json::parse(test::slurp(fa3Out / "config.json"))["quantization_config"];
  const auto& group = fa3Config["config_groups"]["group_0"];
  EXPECT_EQ(group["targets"], nlohmann::json::array({"re:.*self_attn$"}));
  EXPECT_TRUE(group["weights"].is_null());
  EXPECT_EQ(group["input_activations"], fa3Config["kv_cache_scheme"]);
  EXPECT_EQ(safetensors::Checkpoint::open(fa3Out, "model").info("model.layers.0.self_attn.q_scale").shape,
            (std::vector<int64_t>{test::kTinyQwen3Heads, 1, 1}));
  auto fa3Loaded = CausalLM::open(fa3Out);
  EXPECT_EQ(fa3Loaded->layer(1).getSubmodule("self_attn.q_hook").typeName(), "AttentionQuant");
  EXPECT_TRUE(at::equal(fa3Loaded->forward(ids), fa3->forward(ids)));
  // The KV cache alone: a quantization_config with no config groups.
  auto kvOnly = quantized("    - {type: fa3_quant, exclude: [\"*.fa_q\"]}\n", dir);
  const fs::path out = saveAll(*kvOnly, "fa3_kv_only");
  EXPECT_EQ(nlohmann::json::parse(test::slurp(out / "config.json"))["quantization_config"]["kv_cache_scheme"]["type"],
            "int");
  EXPECT_TRUE(at::equal(CausalLM::open(out)->forward(ids), kvOnly->forward(ids)));
}

TEST_F(Fa3, WhatAFormatCannotHoldIsAnErrorNamingTheModuleNotASilentDrop) {
  const fs::path dir = test::tinyLlama("fa3_save");
  const auto saveError = [&](const std::string& step, const std::string& format) {
    auto model = quantized(step, dir);
    const std::string error = test::errorOf([&] { saveAll(*model, "fa3_refused", format); }, ErrorCode::kConfig);
    EXPECT_FALSE(fs::exists(test::testDir() / "fa3_refused"));
    return error;
  };
  EXPECT_EQ(saveError("    - {type: fa3_quant, details: {fa_q: {dtype: int8}}}\n", "compressed_tensors"),
            "compressed_tensors: model.layers.0.self_attn has Q quantized but not K and V; compressed-tensors "
            "quantizes K and V together (and Q with their scheme)");
  EXPECT_EQ(saveError("    - {type: fa3_quant, exclude: [\"model.layers.0.self_attn.fa_q\"]}\n", "compressed_tensors"),
            "compressed_tensors: Q is quantized in some attentions and not in others; compressed-tensors' attention "
            "group takes all of them or none");
  EXPECT_EQ(saveError("    - {type: fa3_quant, details: {fa_k: {scope: per_token}, fa_v: {scope: per_token}}}\n",
                      "compressed_tensors"),
            "compressed_tensors: model.layers.0.self_attn.k_hook is per_token (dynamic); compressed-tensors' "
            "attention scales are static: use per_tensor or per_head");
  EXPECT_EQ(saveError("    - {type: fa3_quant, details: {fa_k: {dtype: int8}, fa_v: {dtype: fp8_e4m3}}}\n",
                      "compressed_tensors"),
            "compressed_tensors: model.layers.0.self_attn.v_hook is fp8_e4m3_per_head_sym but "
            "model.layers.0.self_attn.k_hook is not; compressed-tensors quantizes every K and V (and Q) with one "
            "scheme");
  EXPECT_EQ(saveError("    - {type: fa3_quant, details: {fa_k: {dtype: int8}}}\n", "compressed_tensors"),
            "compressed_tensors: model.layers.0.self_attn has K quantized but not V; compressed-tensors quantizes K "
            "and V together (and Q with their scheme)");
  EXPECT_EQ(
      saveError("    - {type: fa3_quant, details: {fa_q: {dtype: int8}, fa_k: {dtype: int8}}}\n", "ascendv1_saver"),
      "ascendv1_saver: model.layers.0.self_attn has K quantized but not V; ascendv1 quantizes K and V together "
      "(C8), or Q, K and V (FAQuant)");
  EXPECT_EQ(saveError("    - {type: fa3_quant, qconfig: {scope: per_token}}\n", "ascendv1_saver"),
            "ascendv1_saver: model.layers.0.self_attn.q_hook is per_token (dynamic); ascendv1's FAQuant and C8 "
            "entries hold static scales: use per_head or per_tensor");
  EXPECT_EQ(saveError("    - {type: fa3_quant, details: {fa_k: {dtype: fp8_e4m3}, fa_v: {dtype: fp8_e4m3}}}\n",
                      "ascendv1_saver"),
            "ascendv1_saver: model.layers.0.self_attn.k_hook is fp8_e4m3_per_head_sym; ascendv1's C8 KV cache is "
            "int8 (fp8 K and V only with Q, as FAQuant): use int8, or compressed_tensors for an fp8 KV cache");
}

// ascendv1: Q, K and V as msmodelslim's FAQuant entries, K and V alone as its C8 KV cache; both
// load back to the same attention.
TEST_F(Fa3, AttentionRoundTripsThroughAscendV1FaQuantAndC8Entries) {
  const fs::path dir = test::tinyQwen3("fa3_ascend");
  const at::Tensor ids = samples().back();
  const std::string attention = "model.layers.1.self_attn";
  struct Case {
    std::string step, name;
    bool faQuant;
    std::string offsetDtype;  // FAQuant's offset dtype
  };
  for (const Case& c :
       std::vector<Case>{{"{type: fa3_quant}", "fa_int8", true, "I8"},
                         {"{type: fa3_quant, qconfig: {dtype: fp8_e4m3, scope: per_tensor}}", "fa_fp8", true, "F32"},
                         {"{type: fa3_quant, exclude: [\"*.fa_q\"]}", "c8", false, ""},
                         {"{type: fa3_quant, details: {fa_k: {symmetric: False}, fa_v: {scope: per_tensor}}}",
                          "c8_asym", false, ""}}) {
    SCOPED_TRACE(c.step);
    auto model = quantized("    - " + c.step + "\n", dir);
    const at::Tensor expected = model->forward(ids);
    const fs::path out = saveAll(*model, "fa3_ascend_" + c.name, "ascendv1_saver");
    const auto description = nlohmann::json::parse(test::slurp(out / "quant_model_description.json"));
    const auto checkpoint = safetensors::Checkpoint::open(out, "quant_model_weights");
    EXPECT_FALSE(checkpoint.contains(attention + ".k_hook.scale"));
    if (c.faQuant) {
      EXPECT_EQ(description["fa_quant_type"], "FAKQuant");
      EXPECT_FALSE(description.contains("kv_cache_type"));
      for (const auto& [input, heads] : std::vector<std::pair<std::string, int64_t>>{
               {"fa_q", test::kTinyQwen3Heads}, {"fa_k", test::kTinyQwen3KvHeads}, {"fa_v", test::kTinyQwen3KvHeads}}) {
        const std::string prefix = attention + "." + input;
        EXPECT_EQ(description[prefix + ".scale"], "FAQuant");
        EXPECT_EQ(checkpoint.info(prefix + ".scale").shape, (std::vector<int64_t>{heads, 1}));
        EXPECT_EQ(checkpoint.info(prefix + ".scale").dtype, "F32");
        EXPECT_EQ(checkpoint.info(prefix + ".offset").dtype, c.offsetDtype);
      }
    } else {
      EXPECT_EQ(description["kv_cache_type"], "C8");
      EXPECT_EQ(description["kv_quant_type"], "C8");
      EXPECT_FALSE(description.contains("fa_quant_type"));
      const std::vector<int64_t> channels{test::kTinyQwen3KvHeads * test::kTinyQwen3HeadDim};
      for (const char* projection : {".k_proj", ".v_proj"}) {
        for (const char* key : {".kv_cache_scale", ".kv_cache_offset"}) {
          EXPECT_EQ(description[attention + projection + key], "C8");
          EXPECT_EQ(checkpoint.info(attention + projection + key).shape, channels);
        }
      }
      // Every channel of a head holds that head's scale and zero point.
      const auto hook = model->layer(1).getSubmodule("self_attn.k_hook").as<AttentionQuant>("k_hook").params();
      const at::Tensor scale =
          checkpoint.tensor(attention + ".k_proj.kv_cache_scale").reshape({test::kTinyQwen3KvHeads, -1});
      const at::Tensor offset =
          checkpoint.tensor(attention + ".k_proj.kv_cache_offset").reshape({test::kTinyQwen3KvHeads, -1});
      EXPECT_TRUE(at::equal(scale, hook.scale.reshape({-1, 1}).expand_as(scale)));
      EXPECT_TRUE(at::equal(offset, hook.zeroPoint.reshape({-1, 1}).expand_as(offset).to(at::kFloat)));
      EXPECT_EQ(c.name == "c8_asym", offset.ne(0).any().item<bool>());
    }
    auto loaded = CausalLM::open(out);
    EXPECT_EQ(loaded->layer(0).getSubmodule("self_attn.q_hook").typeName(), c.faQuant ? "AttentionQuant" : "HookPoint");
    EXPECT_EQ(loaded->layer(0).getSubmodule("self_attn.v_hook").typeName(), "AttentionQuant");
    EXPECT_TRUE(at::equal(loaded->forward(ids), expected));
  }
}

// A C8 entry qpipe cannot run is refused in one line, never run as something else.
TEST_F(Fa3, AscendV1C8ScalesThatDifferWithinAHeadAreRefused) {
  const fs::path dir = test::tinyQwen3("fa3_ascend_channel");
  auto model = quantized("    - {type: fa3_quant, exclude: [\"*.fa_q\"]}\n", dir);
  const fs::path out = saveAll(*model, "fa3_ascend_channel_out", "ascendv1_saver");
  const std::string name = "model.layers.0.self_attn.v_proj.kv_cache_scale";
  {
    const auto checkpoint = safetensors::Checkpoint::open(out, "quant_model_weights");
    safetensors::Writer writer(out, {.filePrefix = "quant_model_weights"});
    for (const std::string& tensor : checkpoint.names()) {
      at::Tensor value = checkpoint.tensor(tensor).clone();
      if (tensor == name) value[1] *= 2;
      writer.add(tensor, value);
    }
    writer.finish();
  }
  EXPECT_EQ(test::errorOf([&] { CausalLM::open(out)->layer(0); }, ErrorCode::kInput),
            "checkpoint " + out.string() + ": '" + name +
                "' differs within a KV head (per-channel C8); qpipe runs C8 with one value per head, as it writes "
                "them");
}

TEST_F(Fa3, PerTokenIsDataFree) {
  auto steps = processors("    - {type: fa3_quant, qconfig: {dtype: int8, scope: per_token}}\n");
  EXPECT_TRUE(steps.front()->isDataFree());
  EXPECT_FALSE(processors("    - {type: fa3_quant}\n").front()->isDataFree());
}

TEST_F(Fa3, ConfigurationErrorsNameTheField) {
  const auto error = [&](const std::string& step) {
    return test::errorOf([&] { processors(step); }, ErrorCode::kConfig);
  };
  const auto expectIn = [](const std::string& text, const std::string& part) {
    EXPECT_NE(text.find(part), std::string::npos) << text;
  };
  expectIn(error("    - {type: fa3_quant, qconfig: {dtype: int8}, details: {fa_q: {dtype: int8}}}\n"),
           "spec.process[0].details: qconfig and details are mutually exclusive; give one of them");
  expectIn(error("    - {type: fa3_quant, qconfig: {scope: per_block}}\n"),
           "spec.process[0].qconfig.scope: per_block (msmodelslim's dynamic blocks of tokens) is not supported yet; "
           "use per_head or per_token");
  expectIn(error("    - {type: fa3_quant, qconfig: {scope: per_channel}}\n"),
           "spec.process[0].qconfig.scope: attention is quantized per_head or per_tensor (static, calibrated) or "
           "per_token (dynamic)");
  expectIn(error("    - {type: fa3_quant, details: {fa_k: {dtype: int4}}}\n"),
           "spec.process[0].details.fa_k.dtype: attention is quantized to int8 or fp8_e4m3");
  expectIn(error("    - {type: fa3_quant, details: {fa_x: {dtype: int8}}}\n"), "spec.process[0].details");
  expectIn(error("    - {type: fa3_quant, qconfig: {dtype: fp8_e4m3, symmetric: False}}\n"),
           "spec.process[0].qconfig.symmetric: fp8_e4m3 is symmetric only; set symmetric: True");
}

}  // namespace
}  // namespace qpipe
