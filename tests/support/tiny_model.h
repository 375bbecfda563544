// Tiny random checkpoints written with qpipe's own writer, for tests of the module tree, the runner
// and the `qpipe quant`/`qpipe eval` command line (numerical agreement with transformers is the
// oracle tests' job). Each folder holds config.json, model.safetensors and a 32-token
// tokenizer.json, so that the command line can calibrate and evaluate on real text.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe::test {

constexpr int64_t kTinyHidden = 16, kTinyInter = 24, kTinyVocab = 32, kTinyLayers = 2;

// Tiny Qwen3: head_dim (64) is explicit and differs from hidden / heads (32), as in the real
// models; every in_features (128 or 256) is a multiple of 8, 16 and of the practices' group 128.
constexpr int64_t kTinyQwen3Hidden = 128, kTinyQwen3Inter = 256, kTinyQwen3Heads = 4, kTinyQwen3KvHeads = 2,
                  kTinyQwen3HeadDim = 64;

// The Linear modules of one decoder layer, by path below `model.layers.N.`.
inline const std::vector<std::string>& tinyLayerLinears() {
  static const std::vector<std::string> linears = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                   "mlp.down_proj"};
  return linears;
}

// A BPE tokenizer.json of kTinyVocab ids that both qpipe and HF tokenizers read: <unk>, space,
// a-z, '.', ',' and the merges t+h, h+e, with text split at spaces (BPE runs per word, so long
// texts stay fast). Any other character (capitals, digits, newlines) is <unk>, so every text
// tokenizes to ids below kTinyVocab.
inline void writeTinyTokenizer(const std::filesystem::path& dir) {
  std::vector<std::string> tokens = {"<unk>", " "};
  for (char c = 'a'; c <= 'z'; ++c) tokens.emplace_back(1, c);
  for (const char* extra : {".", ",", "th", "he"}) tokens.emplace_back(extra);
  std::string vocab;
  for (size_t id = 0; id < tokens.size(); ++id) {
    vocab += (id == 0 ? "" : ", ") + ("\"" + tokens[id] + "\": " + std::to_string(id));
  }
  std::ofstream(dir / "tokenizer.json")
      << R"({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
  "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated", "invert": false},
  "post_processor": null, "decoder": null,
  "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
    "vocab": {)"
      << vocab << R"(}, "merges": [["t", "h"], ["h", "e"]]}})";
}

namespace detail {

// The shape of a tiny decoder-only checkpoint; both families share one writer so that the random
// values of a family never depend on the other's options.
struct TinySpec {
  std::string modelType;
  int64_t hidden, intermediate, heads, kvHeads, headDim;
  bool explicitHeadDim, qkNorm, tied;
  bool qkvBias = false;  // qwen2's q/k/v projection biases
};

inline std::string tinyConfigJson(const TinySpec& s) {
  std::string json = R"({"model_type": ")" + s.modelType + R"(", "vocab_size": )" + std::to_string(kTinyVocab) +
                     R"(, "hidden_size": )" + std::to_string(s.hidden) + R"(, "intermediate_size": )" +
                     std::to_string(s.intermediate) + R"(, "num_hidden_layers": )" + std::to_string(kTinyLayers) +
                     R"(, "num_attention_heads": )" + std::to_string(s.heads) + R"(, "num_key_value_heads": )" +
                     std::to_string(s.kvHeads);
  if (s.explicitHeadDim) json += R"(, "head_dim": )" + std::to_string(s.headDim);
  json += R"(, "rms_norm_eps": 1e-6, "tie_word_embeddings": )" + std::string(s.tied ? "true" : "false") +
          R"(, "torch_dtype": "float32"})";
  return json;
}

// Writes config.json, model.safetensors (seed 3, N(0, 0.2²) values drawn in a fixed order; tensors
// named in `skip` are left out without drawing) and tokenizer.json under the test's folder.
inline std::filesystem::path writeTinyCheckpoint(const std::string& name, const TinySpec& s,
                                                 const std::vector<std::string>& skip) {
  const std::filesystem::path dir = testDir() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << tinyConfigJson(s);
  writeTinyTokenizer(dir);
  at::manual_seed(3);
  safetensors::Writer writer(dir);
  const auto add = [&](const std::string& tensor, std::vector<int64_t> shape) {
    if (std::find(skip.begin(), skip.end(), tensor) == skip.end()) writer.add(tensor, at::randn(shape) * 0.2);
  };
  const int64_t qOut = s.heads * s.headDim, kvOut = s.kvHeads * s.headDim;
  add("model.embed_tokens.weight", {kTinyVocab, s.hidden});
  add("model.norm.weight", {s.hidden});
  for (int64_t i = 0; i < kTinyLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {s.hidden});
    add(p + "post_attention_layernorm.weight", {s.hidden});
    add(p + "self_attn.q_proj.weight", {qOut, s.hidden});
    add(p + "self_attn.k_proj.weight", {kvOut, s.hidden});
    add(p + "self_attn.v_proj.weight", {kvOut, s.hidden});
    add(p + "self_attn.o_proj.weight", {s.hidden, qOut});
    if (s.qkvBias) {
      add(p + "self_attn.q_proj.bias", {qOut});
      add(p + "self_attn.k_proj.bias", {kvOut});
      add(p + "self_attn.v_proj.bias", {kvOut});
    }
    add(p + "mlp.gate_proj.weight", {s.intermediate, s.hidden});
    add(p + "mlp.up_proj.weight", {s.intermediate, s.hidden});
    add(p + "mlp.down_proj.weight", {s.hidden, s.intermediate});
    if (s.qkNorm) {
      add(p + "self_attn.q_norm.weight", {s.headDim});
      add(p + "self_attn.k_norm.weight", {s.headDim});
    }
  }
  if (!s.tied) add("lm_head.weight", {kTinyVocab, s.hidden});
  writer.finish();
  return dir;
}

// Llama's tiny shape: 2 layers, hidden 16, 4 heads of 4, 2 KV heads, tied embeddings.
inline TinySpec tinyLlamaSpec() {
  return {.modelType = "llama",
          .hidden = kTinyHidden,
          .intermediate = kTinyInter,
          .heads = 4,
          .kvHeads = 2,
          .headDim = kTinyHidden / 4,
          .explicitHeadDim = false,
          .qkNorm = false,
          .tied = true};
}

}  // namespace detail

inline std::filesystem::path tinyLlama(const std::string& name, const std::vector<std::string>& skip = {}) {
  return detail::writeTinyCheckpoint(name, detail::tinyLlamaSpec(), skip);
}

// Qwen3, 2 layers: q_norm/k_norm per layer, explicit head_dim, untied lm_head.
inline std::filesystem::path tinyQwen3(const std::string& name, const std::vector<std::string>& skip = {}) {
  return detail::writeTinyCheckpoint(name,
                                     {.modelType = "qwen3",
                                      .hidden = kTinyQwen3Hidden,
                                      .intermediate = kTinyQwen3Inter,
                                      .heads = kTinyQwen3Heads,
                                      .kvHeads = kTinyQwen3KvHeads,
                                      .headDim = kTinyQwen3HeadDim,
                                      .explicitHeadDim = true,
                                      .qkNorm = true,
                                      .tied = false},
                                     skip);
}

// Qwen2, 2 layers: the Llama shapes with q/k/v biases, untied lm_head.
inline std::filesystem::path tinyQwen2(const std::string& name) {
  detail::TinySpec spec = detail::tinyLlamaSpec();
  spec.modelType = "qwen2";
  spec.tied = false;
  spec.qkvBias = true;
  return detail::writeTinyCheckpoint(name, spec, {});
}

// Qwen3-MoE, 2 layers of 4 experts (top 2, renormalised), hidden 16, 4 heads of 4, 2 KV heads,
// tied embeddings, unit norms.
inline std::filesystem::path tinyMoe(const std::string& name = "tiny_moe") {
  const std::filesystem::path dir = testDir() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const int64_t hidden = 16, heads = 4, kvHeads = 2, headDim = 4, experts = 4, inter = 8;
  std::ofstream(dir / "config.json") << R"({"model_type": "qwen3_moe", "vocab_size": )" << kTinyVocab
                                     << R"(, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": true, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "norm_topk_prob": true, "torch_dtype": "float32"})";
  at::manual_seed(4);
  safetensors::Writer writer(dir);
  writer.add("model.embed_tokens.weight", at::randn({kTinyVocab, hidden}) * 0.2);
  writer.add("model.norm.weight", at::ones({hidden}));
  for (int64_t i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    writer.add(p + "input_layernorm.weight", at::ones({hidden}));
    writer.add(p + "post_attention_layernorm.weight", at::ones({hidden}));
    writer.add(p + "self_attn.q_proj.weight", at::randn({heads * headDim, hidden}) * 0.2);
    writer.add(p + "self_attn.k_proj.weight", at::randn({kvHeads * headDim, hidden}) * 0.2);
    writer.add(p + "self_attn.v_proj.weight", at::randn({kvHeads * headDim, hidden}) * 0.2);
    writer.add(p + "self_attn.o_proj.weight", at::randn({hidden, heads * headDim}) * 0.2);
    writer.add(p + "self_attn.q_norm.weight", at::ones({headDim}));
    writer.add(p + "self_attn.k_norm.weight", at::ones({headDim}));
    writer.add(p + "mlp.gate.weight", at::randn({experts, hidden}) * 0.2);
    for (int64_t e = 0; e < experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      writer.add(x + "gate_proj.weight", at::randn({inter, hidden}) * 0.2);
      writer.add(x + "up_proj.weight", at::randn({inter, hidden}) * 0.2);
      writer.add(x + "down_proj.weight", at::randn({hidden, inter}) * 0.2);
    }
  }
  writer.finish();
  writeTinyTokenizer(dir);
  return dir;
}

}  // namespace qpipe::test
