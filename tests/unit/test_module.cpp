#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fused_rows.h"
#include "qpipe/model.h"
#include "qpipe/module.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

const at::Tensor& sampleIds() {
  static const at::Tensor ids = at::arange(10, at::kLong).remainder(test::kTinyVocab).unsqueeze(0);
  return ids;
}

// A LibTorch error in a module's forward is one line naming the module and its input, without the
// C++ backtrace (which the log has at debug level).
TEST(ModuleTree, ALibTorchErrorInAForwardIsOneLineNamingTheModule) {
  Linear linear(at::zeros({4, 3}));
  EXPECT_EQ(test::errorOf(
                [&] {
                  linear(at::zeros({2, 5}));
                },
                ErrorCode::kInternal),
            "Linear forward of [2, 5] Float: mat1 and mat2 shapes cannot be multiplied (2x5 and 3x4)");
  // In a tree, by its path from the root, through a replacement too.
  auto model = CausalLM::open(test::tinyLlama("forward_error"));
  Module& mlp = model->layer(0).getSubmodule("mlp");
  model->root().replace("model.layers.0.mlp.down_proj", std::make_shared<Linear>(at::zeros({16, 3})));
  EXPECT_EQ(test::errorOf(
                [&] {
                  mlp.getSubmodule("down_proj")(at::zeros({2, 24}));
                },
                ErrorCode::kInternal),
            "model.layers.0.mlp.down_proj (Linear) forward of [2, 24] Float: mat1 and mat2 shapes cannot be "
            "multiplied (2x24 and 3x16)");
}

// What Linear computes for an input of at most 64 rows on a CPU with AVX-512 (core/model/src/
// small_gemm.h): per output, 16 fused lanes over k ≡ lane (mod 16) in order, summed in pairs.
float smallGemmOutput(const float* x, const float* w, int64_t k) {
  std::array<float, 16> lanes{};
  for (int64_t p = 0; p < k; p += 16) {
    for (int64_t l = 0; l < 16; ++l) {
      lanes[l] = p + l < k ? std::fma(x[p + l], w[p + l], lanes[l]) : std::fma(0.0f, 0.0f, lanes[l]);
    }
  }
  for (int width = 8; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  }
  return lanes[0];
}

TEST(Linear, FewRowsUnderTheirScopeAreTheDocumentedFusedSumsBitForBitOnAnyThreadCount) {
  __builtin_cpu_init();
  const bool kernel = __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("fma") != 0;
  at::manual_seed(5);
  const FewRowsGemm fewRows;
  for (const int64_t m : {1, 5, 6, 7, 13, 64}) {
    for (const int64_t n : {1, 3, 4, 5, 37}) {
      for (const int64_t k : {1, 15, 16, 17, 100}) {
        const at::Tensor x = at::randn({m, k}), w = at::randn({n, k}), bias = at::randn({n});
        Linear plain(w), biased(w, bias);
        at::Tensor expected = at::empty({m, n});
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            expected[i][j] = smallGemmOutput(x[i].data_ptr<float>(), w[j].data_ptr<float>(), k);
          }
        }
        if (!kernel) expected = at::linear(x, w);
        const std::string shape = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
        for (const int threads : {1, 2}) {
          at::set_num_threads(threads);
          EXPECT_TRUE(at::equal(plain(x), expected)) << shape << ", " << threads << " threads";
          EXPECT_TRUE(at::equal(biased(x), kernel ? expected + bias : at::linear(x, w, bias))) << shape;
          EXPECT_TRUE(at::equal(plain(x.reshape({1, m, k})), expected.reshape({1, m, n}))) << shape;
          EXPECT_TRUE(at::equal(plain(x.t().contiguous().t()), expected)) << shape << ", strided input";
        }
      }
    }
  }
  at::set_num_threads(2);
  // Beyond 64 rows, where autograd records the graph, and outside the scope, LibTorch's GEMM.
  const at::Tensor x = at::randn({65, 24}), w = at::randn({8, 24});
  EXPECT_TRUE(at::equal(Linear(w)(x), at::linear(x, w)));
  std::thread([&] { EXPECT_TRUE(at::equal(Linear(w)(x.slice(0, 0, 4)), at::linear(x.slice(0, 0, 4), w))); }).join();
  const at::Tensor trained = w.clone().requires_grad_();
  const at::Tensor y = Linear(trained)(x.slice(0, 0, 4));
  EXPECT_TRUE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, at::linear(x.slice(0, 0, 4), trained)));
}

// What RMSNorm computes for fp32 (core/model/src/fused_rows.h): the sum of squares in 16 lanes over
// the elements ≡ lane (mod 16) in order, summed in pairs, then ATen's operations in ATen's order.
at::Tensor rmsNormRows(const at::Tensor& x, const at::Tensor& w, float eps) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t n = rows.size(1);
  at::Tensor out = at::empty_like(rows);
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const float* v = rows[r].data_ptr<float>();
    std::array<float, 16> lanes{};
    for (int64_t j = 0; j < n; ++j) {
      const float square = v[j] * v[j];
      lanes[j % 16] = lanes[j % 16] + square;
    }
    for (int width = 8; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
    }
    const float scale = 1.0f / std::sqrt(lanes[0] / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) {
      const float normed = v[j] * scale;
      out[r][j] = w[j].item<float>() * normed;
    }
  }
  return out.view(x.sizes());
}

at::Tensor atenRmsNorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean(-1, true) + eps));
}

TEST(RMSNorm, Fp32IsTheDocumentedLaneSumBitForBitOnAnyThreadCountAndLayout) {
  at::manual_seed(11);
  const double eps = 1e-6;
  for (const int64_t n : {1, 15, 16, 17, 64, 576}) {
    const at::Tensor w = at::randn({n});
    RMSNorm norm(w, eps);
    // Rows of a wider tensor (a narrow view, as q_norm reads its heads), of a 4-d one, contiguous.
    const at::Tensor wide = at::randn({2, 3, 5, 2 * n});
    for (const at::Tensor& x : {wide.narrow(-1, 1, n), wide.narrow(-1, 0, n).contiguous().reshape({30, n}),
                                wide.narrow(-1, n, n).select(0, 1)}) {
      const at::Tensor expected = rmsNormRows(x, w, static_cast<float>(eps));
      for (const int threads : {1, 2}) {
        at::set_num_threads(threads);
        const at::Tensor y = norm(x);
        EXPECT_TRUE(y.is_contiguous());
        EXPECT_TRUE(at::equal(y, expected)) << "n " << n << ", " << threads << " threads";
        EXPECT_TRUE(at::allclose(y, atenRmsNorm(x, w, eps), 1e-6, 1e-6)) << n;
      }
      // A row's bits do not depend on the rows beside it.
      EXPECT_TRUE(at::equal(norm(x.reshape({-1, n}).slice(0, 3, 4)), expected.reshape({-1, n}).slice(0, 3, 4)));
    }
  }
  // Rows enough for two threads to split them (a task takes about 32,768 values).
  const at::Tensor many = at::randn({300, 576}), w = at::randn({576});
  const at::Tensor oneThread = [&] {
    at::set_num_threads(1);
    return RMSNorm(w, eps)(many);
  }();
  at::set_num_threads(2);
  EXPECT_TRUE(at::equal(RMSNorm(w, eps)(many), oneThread));
  EXPECT_TRUE(at::equal(oneThread, rmsNormRows(many, w, static_cast<float>(eps))));
  // Where autograd records the graph, in another dtype, with a bias: ATen's operations.
  const at::Tensor x = at::randn({4, 32}), w32 = at::randn({32});
  const at::Tensor trained = w32.clone().requires_grad_();
  const at::Tensor y = RMSNorm(trained, eps)(x);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, atenRmsNorm(x, trained, eps)));
  const at::Tensor half = x.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(RMSNorm(w32, eps)(half),
                        w32 * atenRmsNorm(half.to(at::kFloat), at::ones({32}), eps).to(at::kBFloat16)));
  const at::Tensor bias = at::randn({32});
  EXPECT_TRUE(at::equal(RMSNorm(w32, eps, bias)(x), rmsNormRows(x, w32, static_cast<float>(eps)) + bias));
}

at::Tensor atenRotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor h = t.transpose(1, 2);
  const int64_t half = h.size(-1) / 2;
  const at::Tensor rotated = at::cat({-h.slice(-1, half), h.slice(-1, 0, half)}, -1);
  return h * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

TEST(Rotary, Fp32IsAtensOperationsBitForBitAsContiguousHeads) {
  at::manual_seed(12);
  const int64_t batch = 2, seq = 7, heads = 3;
  for (const int64_t dim : {2, 8, 64, 128}) {
    // A projection's output narrowed to q's columns, viewed as heads, as the attention reads it.
    const at::Tensor projected = at::randn({batch, seq, heads * dim + 5});
    const at::Tensor t = projected.narrow(-1, 5, heads * dim).view({batch, seq, heads, dim});
    for (const int64_t cosBatch : {int64_t{1}, batch}) {
      const at::Tensor cos = at::randn({cosBatch, seq, dim}), sin = at::randn({cosBatch, seq, dim});
      for (const int threads : {1, 2}) {
        at::set_num_threads(threads);
        const std::optional<at::Tensor> y = detail::rotary(t, cos, sin);
        ASSERT_TRUE(y.has_value()) << dim;
        EXPECT_TRUE(y->is_contiguous());
        EXPECT_EQ(y->sizes(), (std::vector<int64_t>{batch, heads, seq, dim}));
        EXPECT_TRUE(at::equal(*y, atenRotary(t, cos, sin))) << "dim " << dim << ", " << threads << " threads";
      }
    }
  }
  // Rows enough for two threads to split them.
  const at::Tensor manyHeads = at::randn({2, 300, 4, 64}), cos64 = at::randn({2, 300, 64}),
                   sin64 = at::randn({2, 300, 64});
  at::set_num_threads(1);
  const at::Tensor oneThread = *detail::rotary(manyHeads, cos64, sin64);
  at::set_num_threads(2);
  EXPECT_TRUE(at::equal(*detail::rotary(manyHeads, cos64, sin64), oneThread));
  EXPECT_TRUE(at::equal(oneThread, atenRotary(manyHeads, cos64, sin64)));
  const at::Tensor t = at::randn({1, 4, 2, 6}), cos = at::randn({1, 4, 6}), sin = at::randn({1, 4, 6});
  EXPECT_FALSE(detail::rotary(t.clone().requires_grad_(), cos, sin).has_value());
  EXPECT_FALSE(detail::rotary(t.to(at::kBFloat16), cos, sin).has_value());
  EXPECT_FALSE(detail::rotary(t.narrow(-1, 0, 5), cos.narrow(-1, 0, 5), sin.narrow(-1, 0, 5)).has_value());
}

TEST(ModuleTree, LayersLoadOnDemandUnderHuggingFaceNames) {
  auto model = CausalLM::open(test::tinyLlama("names"));
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
  auto model = CausalLM::open(test::tinyLlama("release"));
  const at::Tensor before = model->forward(sampleIds());
  int64_t layerBytes = 0;
  for (const auto& [name, tensor] : model->layer(0).namedParameters())
    layerBytes += static_cast<int64_t>(tensor->nbytes());
  EXPECT_EQ(model->releaseLayer(0), static_cast<uint64_t>(layerBytes));  // fp32, as stored
  EXPECT_FALSE(model->isLoaded(0));
  EXPECT_TRUE(at::equal(model->forward(sampleIds()), before));
}

TEST(ModuleTree, TiedHeadSharesTheEmbeddingWeight) {
  auto model = CausalLM::open(test::tinyLlama("tied"));
  EXPECT_EQ(model->root().getSubmodule("lm_head").parameter("weight").data_ptr(),
            model->root().getSubmodule("model.embed_tokens").parameter("weight").data_ptr());
}

TEST(ModuleTree, ReplaceTakesEffectInTheNextForward) {
  auto model = CausalLM::open(test::tinyLlama("replace"));
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
  auto model = CausalLM::open(test::tinyLlama("hooks"));
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
  const fs::path dir = test::tinyLlama("errors");
  auto model = CausalLM::open(dir);
  EXPECT_EQ(test::errorOf([&] { model->root().getSubmodule("model.layers.7.mlp"); }, ErrorCode::kInput),
            "no module 'model.layers.7.mlp' (no child '7' in Layers)");
  const fs::path missing = test::tinyLlama("missing", {"model.layers.1.mlp.up_proj.weight"});
  // At open, before any layer loads (issue 17's validation).
  EXPECT_EQ(test::errorOf([&] { CausalLM::open(missing); }, ErrorCode::kInput),
            "checkpoint " + missing.string() + ": missing tensor 'model.layers.1.mlp.up_proj.weight'");
  const fs::path unsupported = test::writeTempFile("config.json", R"({"model_type": "gpt2"})");
  EXPECT_EQ(test::errorOf([&] { ModelConfig::fromFile(unsupported); }, ErrorCode::kInput),
            unsupported.string() + ": model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3, qwen3_moe");
  // Token ids past the embedding (a tokenizer of another model) are named, not an index error.
  const int64_t rows = model->config().vocabSize;
  for (const int64_t id : {rows, int64_t{-1}}) {
    EXPECT_EQ(test::errorOf(
                  [&] {
                    model->embed(at::tensor({int64_t{0}, id}, at::kLong).unsqueeze(0));
                  },
                  ErrorCode::kInput),
              "token id " + std::to_string(id) + " is outside the model's " + std::to_string(rows) +
                  " embedding rows (vocab_size in " + dir.string() +
                  "/config.json); does tokenizer.json belong to this model?");
  }
  EXPECT_EQ(model->embed(at::tensor({int64_t{0}, rows - 1}, at::kLong).unsqueeze(0)).size(1), 2);
}

TEST(AllFinite, FindsEveryNonFinitePatternInBodiesAndTailsOfEachDtype) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 70,007 elements: more than one block, vector bodies and a scalar tail.
  at::Tensor x = at::randn({70007}) * 1e3;
  x[5] = -0.0f;
  x[6] = 3.0e38f;  // finite, near the top of fp32's and bf16's range
  for (const at::ScalarType dtype :
       {at::kFloat, at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kDouble}) {
    const double max = dtype == at::kHalf            ? 6e4
                       : dtype == at::kFloat8_e4m3fn ? 448
                       : dtype == at::kFloat8_e5m2   ? 5e4
                                                     : std::numeric_limits<float>::max();
    const at::Tensor finite = x.clamp(-max, max).to(dtype);
    EXPECT_TRUE(allFinite(finite)) << dtype;
    EXPECT_TRUE(allFinite(finite.slice(0, 0, 0))) << dtype;
    for (const int64_t at : {int64_t{0}, int64_t{17}, int64_t{65536}, int64_t{70006}}) {
      for (const float bad : {inf, -inf, nan}) {
        at::Tensor t = finite.clone();
        t[at] = bad;
        EXPECT_FALSE(allFinite(t)) << dtype << " " << bad << " at " << at;
        EXPECT_FALSE(allFinite(t.view({7, 10001}).t())) << dtype;  // not contiguous
      }
    }
  }
  // Every fp8 pattern alone, against LibTorch's reading of it.
  const at::Tensor bytes = at::arange(0, 256, at::kInt).to(at::kByte);
  for (const at::ScalarType dtype : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    for (int64_t b = 0; b < 256; ++b) {
      const at::Tensor one = bytes.slice(0, b, b + 1).view(dtype);
      EXPECT_EQ(allFinite(one), at::isfinite(one.to(at::kFloat)).item<bool>()) << dtype << " pattern " << b;
    }
  }
}

}  // namespace
}  // namespace qpipe
