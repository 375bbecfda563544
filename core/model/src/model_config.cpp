#include <nlohmann/json.hpp>

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"
#include "qpipe/model.h"

namespace qpipe {

namespace {

using Json = nlohmann::json;

class ConfigReader {
 public:
  // `object`: where `json` sits in the file ("rope_parameters."), for messages.
  ConfigReader(const std::filesystem::path& file, const Json& json, std::string object = "")
      : file_(file), json_(json), object_(std::move(object)) {}

  template <typename T>
  T required(const char* key) const {
    QPIPE_REQUIRE(json_.contains(key) && !json_[key].is_null(), ErrorCode::kInput, file_.string(), ": missing field '",
                  object_, key, "'");
    return get<T>(key);
  }
  template <typename T>
  T optional(const char* key, T fallback) const {
    return json_.contains(key) && !json_[key].is_null() ? get<T>(key) : fallback;
  }
  // A field transformers has a default for when it is absent, but cannot use as null.
  template <typename T>
  T optionalNotNull(const char* key, T fallback) const {
    QPIPE_REQUIRE(!json_.contains(key) || !json_[key].is_null(), ErrorCode::kInput, file_.string(), ": ", object_, key,
                  " is null; give a number or leave the field out");
    return optional<T>(key, fallback);
  }
  const Json& json() const { return json_; }

 private:
  template <typename T>
  T get(const char* key) const {
    // nlohmann converts 2.5 to 2 for an integer: a count must be written as one.
    const Json& value = json_[key];
    const bool fits = std::is_same_v<T, bool>       ? value.is_boolean()
                      : std::is_integral_v<T>       ? value.is_number_integer()
                      : std::is_floating_point_v<T> ? value.is_number()
                                                    : true;
    QPIPE_REQUIRE(fits, ErrorCode::kInput, file_.string(), ": field '", key, "' has the wrong type (", value.dump(),
                  ")");
    try {
      return value.get<T>();
    } catch (const Json::exception&) {
      throw Error(ErrorCode::kInput,
                  concat(file_.string(), ": field '", key, "' has the wrong type (", json_[key].dump(), ")"));
    }
  }
  const std::filesystem::path& file_;
  const Json& json_;
  std::string object_;
};

at::ScalarType dtypeOf(const std::string& name, const std::filesystem::path& file) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw Error(ErrorCode::kInput, concat(file.string(), ": unsupported dtype '", name, "'"));
}

}  // namespace

ModelConfig ModelConfig::fromFile(const std::filesystem::path& file) {
  const std::string text = readInputFile(file);
  Json json;
  try {
    json = Json::parse(text, jsonDepthLimit<Json>(file.string()));
  } catch (const Json::exception& e) {
    throw Error(ErrorCode::kInput, concat(file.string(), ": not valid JSON (", e.what(), ")"));
  }
  QPIPE_REQUIRE(json.is_object(), ErrorCode::kInput, file.string(), ": not a JSON object");
  const ConfigReader r(file, json);

  ModelConfig c;
  c.modelType = r.required<std::string>("model_type");
  QPIPE_REQUIRE(
      c.modelType == "llama" || c.modelType == "qwen2" || c.modelType == "qwen3" || c.modelType == "qwen3_moe",
      ErrorCode::kInput, file.string(), ": model_type '", c.modelType,
      "' is not supported; supported: llama, qwen2, qwen3, qwen3_moe");
  // The families above all use SiLU (transformers' "silu", or "swish", the same function) in the
  // MLP; another would be computed as SiLU all the same.
  const std::string act = r.optional<std::string>("hidden_act", "silu");
  QPIPE_REQUIRE(act == "silu" || act == "swish", ErrorCode::kInput, file.string(), ": hidden_act '", act,
                "' is not supported; qpipe's llama, qwen2 and qwen3 families compute silu");
  c.vocabSize = r.required<int64_t>("vocab_size");
  c.hiddenSize = r.required<int64_t>("hidden_size");
  c.intermediateSize = r.required<int64_t>("intermediate_size");
  c.numLayers = r.required<int64_t>("num_hidden_layers");
  c.numHeads = r.required<int64_t>("num_attention_heads");
  c.numKvHeads = r.optional<int64_t>("num_key_value_heads", c.numHeads);
  const auto positive = [&](const char* key, int64_t value) {
    QPIPE_REQUIRE(value > 0, ErrorCode::kInput, file.string(), ": ", key, " must be at least 1 (found ", value, ")");
  };
  positive("vocab_size", c.vocabSize);
  positive("hidden_size", c.hiddenSize);
  positive("intermediate_size", c.intermediateSize);
  positive("num_hidden_layers", c.numLayers);
  positive("num_attention_heads", c.numHeads);
  positive("num_key_value_heads", c.numKvHeads);
  QPIPE_REQUIRE(c.numHeads % c.numKvHeads == 0, ErrorCode::kInput, file.string(), ": num_attention_heads (", c.numHeads,
                ") must be a multiple of num_key_value_heads (", c.numKvHeads, ")");
  QPIPE_REQUIRE(json.contains("head_dim") || c.hiddenSize % c.numHeads == 0, ErrorCode::kInput, file.string(),
                ": hidden_size (", c.hiddenSize, ") is not a multiple of num_attention_heads (", c.numHeads,
                ") and no head_dim is given");
  c.headDim = r.optional<int64_t>("head_dim", c.hiddenSize / c.numHeads);
  positive("head_dim", c.headDim);
  c.rmsNormEps = r.optionalNotNull<double>("rms_norm_eps", 1e-6);
  QPIPE_REQUIRE(c.rmsNormEps > 0 && std::isfinite(c.rmsNormEps), ErrorCode::kInput, file.string(),
                ": rms_norm_eps must be a positive number (found ", c.rmsNormEps, ")");
  c.tieWordEmbeddings = r.optional<bool>("tie_word_embeddings", false);
  c.attentionBias = c.modelType == "qwen2" || r.optional<bool>("attention_bias", false);
  c.mlpBias = r.optional<bool>("mlp_bias", false);
  c.qkNorm = c.modelType == "qwen3" || c.modelType == "qwen3_moe";
  const std::string dtype = r.optional<std::string>("torch_dtype", r.optional<std::string>("dtype", "float32"));
  c.checkpointDtype = dtypeOf(dtype, file);

  // transformers 5 writes rope_parameters; older files write rope_theta and rope_scaling.
  const char* ropeObject = json.contains("rope_parameters") && json["rope_parameters"].is_object() ? "rope_parameters"
                           : json.contains("rope_scaling") && json["rope_scaling"].is_object()     ? "rope_scaling"
                                                                                                   : nullptr;
  const Json rope = ropeObject != nullptr ? json[ropeObject] : Json::object();
  const ConfigReader ropeReader(file, rope, ropeObject != nullptr ? std::string(ropeObject) + "." : "");
  c.rope.theta = rope.contains("rope_theta") ? ropeReader.optionalNotNull<double>("rope_theta", 0.0)
                                             : r.optionalNotNull<double>("rope_theta", 10000.0);
  c.rope.type = ropeReader.optional<std::string>("rope_type", ropeReader.optional<std::string>("type", "default"));
  QPIPE_REQUIRE(c.rope.type == "default" || c.rope.type == "llama3", ErrorCode::kInput, file.string(), ": rope type '",
                c.rope.type, "' is not supported; supported: default, llama3");
  QPIPE_REQUIRE(c.rope.theta > 0 && std::isfinite(c.rope.theta), ErrorCode::kInput, file.string(),
                ": rope_theta must be a positive number (found ", c.rope.theta, ")");
  if (c.rope.type == "llama3") {
    c.rope.factor = ropeReader.required<double>("factor");
    c.rope.lowFreqFactor = ropeReader.required<double>("low_freq_factor");
    c.rope.highFreqFactor = ropeReader.required<double>("high_freq_factor");
    c.rope.originalMaxPositions = ropeReader.required<int64_t>("original_max_position_embeddings");
  }

  if (c.modelType == "qwen3_moe") {
    // transformers 5 writes num_local_experts; earlier versions num_experts.
    c.numExperts = r.optional<int64_t>("num_local_experts", 0);
    if (c.numExperts == 0) c.numExperts = r.required<int64_t>("num_experts");
    c.expertsPerToken = r.required<int64_t>("num_experts_per_tok");
    c.moeIntermediateSize = r.required<int64_t>("moe_intermediate_size");
    c.normTopkProb = r.optional<bool>("norm_topk_prob", false);
    c.decoderSparseStep = r.optional<int64_t>("decoder_sparse_step", 1);
    c.mlpOnlyLayers = r.optional<std::vector<int64_t>>("mlp_only_layers", {});
    positive("num_experts", c.numExperts);
    positive("moe_intermediate_size", c.moeIntermediateSize);
    positive("decoder_sparse_step", c.decoderSparseStep);
    QPIPE_REQUIRE(c.expertsPerToken >= 1 && c.expertsPerToken <= c.numExperts, ErrorCode::kInput, file.string(),
                  ": num_experts_per_tok (", c.expertsPerToken, ") must be between 1 and num_experts (", c.numExperts,
                  ")");
  }
  return c;
}

bool ModelConfig::isMoeLayer(int64_t layer) const {
  if (numExperts == 0) return false;
  if (std::find(mlpOnlyLayers.begin(), mlpOnlyLayers.end(), layer) != mlpOnlyLayers.end()) return false;
  return decoderSparseStep > 0 && (layer + 1) % decoderSparseStep == 0;
}

}  // namespace qpipe
