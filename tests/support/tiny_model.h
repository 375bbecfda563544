// A tiny random Llama checkpoint written with qpipe's own writer, for tests of the module tree
// and the runner (numerical agreement with transformers is the oracle tests' job).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe::test {

constexpr int64_t kTinyHidden = 16, kTinyInter = 24, kTinyVocab = 32, kTinyLayers = 2;

// Writes the checkpoint under the test's folder; tensors named in `skip` are left out.
inline std::filesystem::path tinyLlama(const std::string& name, const std::vector<std::string>& skip = {}) {
  const std::filesystem::path dir = testDir() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "torch_dtype": "float32"})";
  at::manual_seed(3);
  safetensors::Writer writer(dir);
  const auto add = [&](const std::string& tensor, std::vector<int64_t> shape) {
    if (std::find(skip.begin(), skip.end(), tensor) == skip.end()) writer.add(tensor, at::randn(shape) * 0.2);
  };
  add("model.embed_tokens.weight", {kTinyVocab, kTinyHidden});
  add("model.norm.weight", {kTinyHidden});
  for (int64_t i = 0; i < kTinyLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {kTinyHidden});
    add(p + "post_attention_layernorm.weight", {kTinyHidden});
    add(p + "self_attn.q_proj.weight", {kTinyHidden, kTinyHidden});
    add(p + "self_attn.k_proj.weight", {kTinyHidden / 2, kTinyHidden});
    add(p + "self_attn.v_proj.weight", {kTinyHidden / 2, kTinyHidden});
    add(p + "self_attn.o_proj.weight", {kTinyHidden, kTinyHidden});
    add(p + "mlp.gate_proj.weight", {kTinyInter, kTinyHidden});
    add(p + "mlp.up_proj.weight", {kTinyInter, kTinyHidden});
    add(p + "mlp.down_proj.weight", {kTinyHidden, kTinyInter});
  }
  writer.finish();
  return dir;
}

}  // namespace qpipe::test
