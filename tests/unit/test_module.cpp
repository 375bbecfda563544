#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>

#include "qpipe/model.h"
#include "qpipe/module.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kHidden = 16, kInter = 24, kVocab = 32, kLayers = 2;

// A tiny random Llama checkpoint written with qpipe's own writer (the oracle tests cover
// numerical agreement with transformers; these tests cover the tree).
fs::path tinyLlama(const std::string& name, const std::vector<std::string>& skip = {}) {
  const fs::path dir = test::writeTempFile("x", "").parent_path() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "torch_dtype": "float32"})";
  at::manual_seed(3);
  safetensors::Writer writer(dir);
  const auto add = [&](const std::string& tensor, std::vector<int64_t> shape) {
    if (std::find(skip.begin(), skip.end(), tensor) == skip.end()) writer.add(tensor, at::randn(shape) * 0.2);
  };
  add("model.embed_tokens.weight", {kVocab, kHidden});
  add("model.norm.weight", {kHidden});
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {kHidden});
    add(p + "post_attention_layernorm.weight", {kHidden});
    add(p + "self_attn.q_proj.weight", {kHidden, kHidden});
    add(p + "self_attn.k_proj.weight", {kHidden / 2, kHidden});
    add(p + "self_attn.v_proj.weight", {kHidden / 2, kHidden});
    add(p + "self_attn.o_proj.weight", {kHidden, kHidden});
    add(p + "mlp.gate_proj.weight", {kInter, kHidden});
    add(p + "mlp.up_proj.weight", {kInter, kHidden});
    add(p + "mlp.down_proj.weight", {kHidden, kInter});
  }
  writer.finish();
  return dir;
}

const at::Tensor& sampleIds() {
  static const at::Tensor ids = at::arange(10, at::kLong).remainder(kVocab).unsqueeze(0);
  return ids;
}

TEST(ModuleTree, LayersLoadOnDemandUnderHuggingFaceNames) {
  auto model = CausalLM::open(tinyLlama("names"));
  EXPECT_FALSE(model->isLoaded(0));
  model->layer(1);
  EXPECT_TRUE(model->isLoaded(1));
  std::vector<std::string> names;
  for (const auto& [name, module] : model->root().namedModules()) names.push_back(name);
  for (const char* expected :
       {"model.embed_tokens", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_hook",
        "model.layers.1.mlp.down_proj", "model.norm", "lm_head"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  std::vector<std::string> parameters;
  for (const auto& [name, tensor] : model->root().namedParameters()) parameters.push_back(name);
  EXPECT_NE(std::find(parameters.begin(), parameters.end(), "model.layers.1.mlp.up_proj.weight"), parameters.end());
  EXPECT_EQ(&model->root().getSubmodule("model.layers.1.self_attn.q_proj"),
            &model->layer(1).getSubmodule("self_attn.q_proj"));
}

TEST(ModuleTree, ReleasedLayersReloadAndGiveTheSameOutput) {
  auto model = CausalLM::open(tinyLlama("release"));
  const at::Tensor before = model->forward(sampleIds());
  model->releaseLayer(0);
  EXPECT_FALSE(model->isLoaded(0));
  EXPECT_TRUE(at::equal(model->forward(sampleIds()), before));
}

TEST(ModuleTree, TiedHeadSharesTheEmbeddingWeight) {
  auto model = CausalLM::open(tinyLlama("tied"));
  EXPECT_EQ(model->root().getSubmodule("lm_head").parameter("weight").data_ptr(),
            model->root().getSubmodule("model.embed_tokens").parameter("weight").data_ptr());
}

TEST(ModuleTree, ReplaceTakesEffectInTheNextForward) {
  auto model = CausalLM::open(tinyLlama("replace"));
  const at::Tensor before = model->forward(sampleIds());
  Module& layer = model->layer(0);
  auto& original = static_cast<Linear&>(layer.getSubmodule("mlp.down_proj"));
  auto old = layer.replace("mlp.down_proj", std::make_shared<Linear>(original.weight().clone()));
  EXPECT_TRUE(at::allclose(model->forward(sampleIds()), before));  // same weights: same output
  layer.replace("mlp.down_proj", std::make_shared<Linear>(at::zeros_like(original.weight())));
  EXPECT_FALSE(at::allclose(model->forward(sampleIds()), before));
  layer.replace("mlp.down_proj", old);
  EXPECT_TRUE(at::equal(model->forward(sampleIds()), before));
}

TEST(ModuleTree, HooksObserveAndRewriteTensors) {
  auto model = CausalLM::open(tinyLlama("hooks"));
  const at::Tensor before = model->forward(sampleIds());
  Module& k = model->layer(0).getSubmodule("self_attn.k_hook");
  std::vector<int64_t> seen;
  const auto observe = k.addForwardHook([&](Module&, const at::Tensor& in, const at::Tensor&) {
    seen = in.sizes().vec();
    return at::Tensor();
  });
  model->forward(sampleIds());
  EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 10, 4}));  // [batch, kv heads, seq, head dim] after RoPE
  k.removeHook(observe);

  Module& q = model->layer(0).getSubmodule("self_attn.q_proj");
  const auto scale = q.addForwardPreHook([](Module&, const at::Tensor& x) { return x * 0; });
  EXPECT_FALSE(at::allclose(model->forward(sampleIds()), before));
  q.removeHook(scale);
  EXPECT_TRUE(at::equal(model->forward(sampleIds()), before));
}

TEST(ModuleTree, ToChangesFloatingPointTensorsOnly) {
  Module parent("Parent");
  parent.addChild("fc", std::make_shared<Linear>(at::randn({3, 2})));
  parent.addBuffer("steps", at::zeros({1}, at::kLong));
  parent.to(at::kCPU, at::kBFloat16);
  EXPECT_EQ(parent.getSubmodule("fc").parameter("weight").scalar_type(), at::kBFloat16);
  EXPECT_EQ(parent.namedBuffers()[0].second->scalar_type(), at::kLong);
}

TEST(ModuleTree, ErrorsNameTheModuleOrTensor) {
  auto model = CausalLM::open(tinyLlama("errors"));
  EXPECT_EQ(test::errorOf([&] { model->root().getSubmodule("model.layers.7.mlp"); }, ErrorCode::kInput),
            "no module 'model.layers.7.mlp' (no child '7' in Layers)");
  const fs::path missing = tinyLlama("missing", {"model.layers.1.mlp.up_proj.weight"});
  auto broken = CausalLM::open(missing);
  EXPECT_EQ(test::errorOf([&] { broken->layer(1); }, ErrorCode::kInput),
            "checkpoint " + missing.string() + ": missing tensor 'model.layers.1.mlp.up_proj.weight'");
  const fs::path unsupported = test::writeTempFile("config.json", R"({"model_type": "gpt2"})");
  EXPECT_EQ(test::errorOf([&] { ModelConfig::fromFile(unsupported); }, ErrorCode::kInput),
            unsupported.string() + ": model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3, qwen3_moe");
}

}  // namespace
}  // namespace qpipe
