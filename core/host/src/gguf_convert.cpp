// GGUF (Llama) -> Hugging Face folder. Names and metadata keys: gguf-py constants.py (llama.cpp);
// the Q/K row permutation: convert_hf_to_gguf.py, LlamaModel.permute; the tokenizer.json layout:
// Hugging Face tokenizers' serialisation of a byte-level BPE tokenizer.
#include "qpipe/host/gguf_convert.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <regex>

#include "qpipe/error.h"
#include "qpipe/host/gguf.h"
#include "qpipe/log.h"
#include "qpipe/safetensors.h"

namespace qpipe::gguf {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// llama.cpp's token types (llama_token_type in llama.h / gguf-py TokenType).
constexpr int64_t kTokenControl = 3;
constexpr int64_t kTokenUserDefined = 4;

// What a Llama GGUF needs to become a LlamaConfig, read once with the file's own errors.
struct Hyper {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t heads = 0;
  int64_t kvHeads = 0;
  int64_t headDim = 0;
  int64_t contextLength = 0;
  int64_t vocabSize = 0;
  double rmsEps = 0;
  double ropeTheta = 0;
  json ropeScaling;  // null when absent
  bool tied = false;
};

// A float32 metadata value as the short decimal it was written from (1e-05, not
// 9.999999747378752e-06): the shortest text that reads back to the same float, read as a double.
double cleanNumber(const File& file, const std::string& key, double fallback) {
  const Value* value = file.find(key);
  if (value == nullptr) return fallback;
  const double number = *file.getOptional<double>(key);
  // JSON has no NaN or Inf (config.json would say null), and none of these values may be 0 or less.
  QPIPE_REQUIRE(std::isfinite(number) && number > 0, ErrorCode::kInput, file.path().string(), ": metadata '", key,
                "' is ", number, "; expected a positive number");
  if (value->type != ValueType::kFloat32) return number;
  char text[64];
  const auto [end, ec] = std::to_chars(std::begin(text), std::end(text), static_cast<float>(number));
  QPIPE_CHECK(ec == std::errc(), "to_chars failed for ", number);
  double shortest = number;
  std::from_chars(text, end, shortest);
  return shortest;
}

Hyper readHyper(const File& file) {
  const std::string name = file.path().string();
  const auto arch = file.get<std::string>("general.architecture");
  QPIPE_REQUIRE(arch == "llama", ErrorCode::kInput, name, ": metadata 'general.architecture' is '", arch,
                "' (only 'llama' can be converted)");
  Hyper h;
  h.layers = file.get<int64_t>("llama.block_count");
  h.hidden = file.get<int64_t>("llama.embedding_length");
  h.intermediate = file.get<int64_t>("llama.feed_forward_length");
  h.heads = file.get<int64_t>("llama.attention.head_count");
  h.kvHeads = file.getOptional<int64_t>("llama.attention.head_count_kv").value_or(h.heads);
  QPIPE_REQUIRE(h.heads > 0 && h.kvHeads > 0 && h.heads % h.kvHeads == 0, ErrorCode::kInput, name,
                ": metadata 'llama.attention.head_count_kv' is ", h.kvHeads,
                " (expected a positive divisor of head_count ", h.heads, ")");
  QPIPE_REQUIRE(h.hidden % h.heads == 0 || file.find("llama.attention.key_length") != nullptr, ErrorCode::kInput, name,
                ": metadata 'llama.embedding_length' ", h.hidden, " is not a multiple of head_count ", h.heads,
                " and 'llama.attention.key_length' is missing");
  h.headDim = file.getOptional<int64_t>("llama.attention.key_length").value_or(h.hidden / h.heads);
  const int64_t valueDim = file.getOptional<int64_t>("llama.attention.value_length").value_or(h.headDim);
  QPIPE_REQUIRE(valueDim == h.headDim, ErrorCode::kInput, name, ": metadata 'llama.attention.value_length' is ",
                valueDim, " but key_length is ", h.headDim, " (Llama needs them equal)");
  const int64_t ropeDim = file.getOptional<int64_t>("llama.rope.dimension_count").value_or(h.headDim);
  QPIPE_REQUIRE(ropeDim == h.headDim, ErrorCode::kInput, name, ": metadata 'llama.rope.dimension_count' is ", ropeDim,
                " but the head dimension is ", h.headDim, " (partial rotary is not Llama)");
  h.contextLength = file.get<int64_t>("llama.context_length");
  QPIPE_REQUIRE(file.find("llama.attention.layer_norm_rms_epsilon") != nullptr, ErrorCode::kInput, name,
                ": metadata 'llama.attention.layer_norm_rms_epsilon' is missing");
  h.rmsEps = cleanNumber(file, "llama.attention.layer_norm_rms_epsilon", 0);
  h.ropeTheta = cleanNumber(file, "llama.rope.freq_base", 10000.0);

  const auto scaling = file.getOptional<std::string>("llama.rope.scaling.type").value_or("none");
  if (scaling == "linear" || scaling == "yarn") {
    h.ropeScaling = {{"rope_type", scaling}, {"factor", cleanNumber(file, "llama.rope.scaling.factor", 1.0)}};
    if (scaling == "yarn") {
      h.ropeScaling["original_max_position_embeddings"] =
          file.get<int64_t>("llama.rope.scaling.original_context_length");
    }
  } else {
    QPIPE_REQUIRE(scaling == "none", ErrorCode::kInput, name, ": metadata 'llama.rope.scaling.type' is '", scaling,
                  "' (supported: none, linear, yarn)");
  }
  QPIPE_REQUIRE(file.findTensor("rope_freqs.weight") == nullptr, ErrorCode::kInput, name,
                ": tensor 'rope_freqs.weight' (Llama 3 rope scaling) is not supported");

  const TensorInfo& embedding = file.tensor("token_embd.weight");
  const auto tokens = file.getOptional<std::vector<std::string>>("tokenizer.ggml.tokens");
  h.vocabSize = file.getOptional<int64_t>("llama.vocab_size")
                    .value_or(tokens ? static_cast<int64_t>(tokens->size()) : static_cast<int64_t>(embedding.ne[1]));
  QPIPE_REQUIRE(embedding.ne.size() == 2 && static_cast<int64_t>(embedding.ne[0]) == h.hidden &&
                    static_cast<int64_t>(embedding.ne[1]) == h.vocabSize,
                ErrorCode::kInput, name, ": tensor 'token_embd.weight' has ne ", embedding.ne[0], " x ",
                embedding.ne.size() > 1 ? embedding.ne[1] : 1, " (expected ", h.hidden, " x ", h.vocabSize, ")");
  h.tied = file.findTensor("output.weight") == nullptr;
  return h;
}

// Every tensor's HF name, with the shape HF expects, checked before anything is written.
struct Planned {
  const TensorInfo* info;
  std::string hfName;
  int64_t permuteHeads;  // 0: no row permutation to undo
};

std::vector<Planned> plan(const File& file, const Hyper& h) {
  const std::string name = file.path().string();
  std::map<std::string, std::vector<int64_t>> expected{
      {"model.embed_tokens.weight", {h.vocabSize, h.hidden}},
      {"model.norm.weight", {h.hidden}},
  };
  if (!h.tied) expected["lm_head.weight"] = {h.vocabSize, h.hidden};
  for (int64_t i = 0; i < h.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    expected[p + "self_attn.q_proj.weight"] = {h.heads * h.headDim, h.hidden};
    expected[p + "self_attn.k_proj.weight"] = {h.kvHeads * h.headDim, h.hidden};
    expected[p + "self_attn.v_proj.weight"] = {h.kvHeads * h.headDim, h.hidden};
    expected[p + "self_attn.o_proj.weight"] = {h.hidden, h.heads * h.headDim};
    expected[p + "mlp.gate_proj.weight"] = {h.intermediate, h.hidden};
    expected[p + "mlp.up_proj.weight"] = {h.intermediate, h.hidden};
    expected[p + "mlp.down_proj.weight"] = {h.hidden, h.intermediate};
    expected[p + "input_layernorm.weight"] = {h.hidden};
    expected[p + "post_attention_layernorm.weight"] = {h.hidden};
  }

  std::vector<Planned> planned;
  for (const TensorInfo& info : file.tensors()) {
    const std::string hfName = hfTensorName(info.name);
    QPIPE_REQUIRE(!hfName.empty(), ErrorCode::kInput, name, ": tensor '", info.name,
                  "' has no Llama equivalent in Hugging Face (not a tensor LlamaForCausalLM has)");
    const auto it = expected.find(hfName);
    QPIPE_REQUIRE(it != expected.end(), ErrorCode::kInput, name, ": tensor '", info.name, "' is beyond the ", h.layers,
                  " layers of 'llama.block_count'");
    QPIPE_REQUIRE(info.shape() == it->second, ErrorCode::kInput, name, ": tensor '", info.name, "' has shape ",
                  c10::IntArrayRef(info.shape()), " (expected ", c10::IntArrayRef(it->second), ")");
    QPIPE_REQUIRE(canDequantize(info.type), ErrorCode::kInput, name, ": tensor '", info.name, "': ggml type ",
                  ggmlTypeName(info.type), " cannot be dequantized");
    int64_t heads = 0;
    if (hfName.ends_with("q_proj.weight")) heads = h.heads;
    if (hfName.ends_with("k_proj.weight")) heads = h.kvHeads;
    planned.push_back({&info, hfName, heads});
    expected.erase(it);
  }
  QPIPE_REQUIRE(expected.empty(), ErrorCode::kInput, name, ": ", expected.size(),
                " tensors of the model are missing, first '", expected.empty() ? "" : expected.begin()->first, "'");
  return planned;
}

// The pre-tokenizers of llama.cpp's BPE pre-types whose Hugging Face form is known here
// (convert_hf_to_gguf.py get_vocab_base_pre maps the HF tokenizer to the pre name).
std::optional<json> preTokenizerFor(const std::string& pre) {
  const json byteLevel = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  // SmolLM / SmolLM2 and StarCoder: single digits, then GPT-2's byte-level split.
  if (pre == "smollm" || pre == "starcoder") {
    return json{{"type", "Sequence"},
                {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}}, byteLevel})}};
  }
  if (pre == "gpt-2") return byteLevel;
  return std::nullopt;
}

struct SpecialIds {
  std::optional<int64_t> bos, eos, unk, pad;
};

json buildTokenizer(const File& file, const SpecialIds& ids, std::vector<std::string>& tokens, json& addedDecoder) {
  const std::string name = file.path().string();
  const auto model = file.get<std::string>("tokenizer.ggml.model");
  QPIPE_REQUIRE(model == "gpt2", ErrorCode::kInput, name, ": metadata 'tokenizer.ggml.model' is '", model,
                "' (only 'gpt2', byte-level BPE, can be converted)");
  const auto pre = file.getOptional<std::string>("tokenizer.ggml.pre").value_or("default");
  const auto preTokenizer = preTokenizerFor(pre);
  QPIPE_REQUIRE(preTokenizer.has_value(), ErrorCode::kInput, name, ": metadata 'tokenizer.ggml.pre' is '", pre,
                "' (supported pre-tokenizers: gpt-2, smollm, starcoder)");

  tokens = file.get<std::vector<std::string>>("tokenizer.ggml.tokens");
  const auto merges = file.get<std::vector<std::string>>("tokenizer.ggml.merges");
  auto types = file.getOptional<std::vector<int64_t>>("tokenizer.ggml.token_type")
                   .value_or(std::vector<int64_t>(tokens.size(), 1));
  QPIPE_REQUIRE(types.size() == tokens.size(), ErrorCode::kInput, name, ": metadata 'tokenizer.ggml.token_type' has ",
                types.size(), " entries but 'tokenizer.ggml.tokens' has ", tokens.size());
  for (const auto& [key, id] :
       {std::pair{"bos", ids.bos}, {"eos", ids.eos}, {"unknown", ids.unk}, {"padding", ids.pad}}) {
    QPIPE_REQUIRE(!id || (*id >= 0 && *id < static_cast<int64_t>(tokens.size())), ErrorCode::kInput, name,
                  ": metadata 'tokenizer.ggml.", key, "_token_id' is ", *id, " (the vocabulary has ", tokens.size(),
                  " tokens)");
  }

  json vocab = json::object();
  json added = json::array();
  addedDecoder = json::object();
  for (size_t id = 0; id < tokens.size(); ++id) {
    auto [it, inserted] = vocab.emplace(tokens[id], id);
    QPIPE_REQUIRE(inserted, ErrorCode::kInput, name, ": metadata 'tokenizer.ggml.tokens': token ", id, " '", tokens[id],
                  "' repeats token ", it.value().get<int64_t>());
    if (types[id] != kTokenControl && types[id] != kTokenUserDefined) continue;
    const bool special = types[id] == kTokenControl;
    json entry = {{"content", tokens[id]}, {"single_word", false},   {"lstrip", false},
                  {"rstrip", false},       {"normalized", !special}, {"special", special}};
    addedDecoder[std::to_string(id)] = entry;
    entry["id"] = id;
    added.push_back(std::move(entry));
  }

  json postProcessor = {
      {"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  const bool addBos = file.getOptional<bool>("tokenizer.ggml.add_bos_token").value_or(false);
  const bool addEos = file.getOptional<bool>("tokenizer.ggml.add_eos_token").value_or(false);
  if (addBos || addEos) {
    QPIPE_REQUIRE(!addBos || ids.bos, ErrorCode::kInput, name,
                  ": 'tokenizer.ggml.add_bos_token' is set but 'tokenizer.ggml.bos_token_id' is missing");
    QPIPE_REQUIRE(!addEos || ids.eos, ErrorCode::kInput, name,
                  ": 'tokenizer.ggml.add_eos_token' is set but 'tokenizer.ggml.eos_token_id' is missing");
    // The special tokens llama.cpp puts around each sequence when it tokenizes.
    json specials = json::object();
    auto around = [&](json& pieces, const char* sequence, int typeId) {
      auto special = [&](int64_t id) {
        specials[tokens[id]] = {{"id", tokens[id]}, {"ids", {id}}, {"tokens", {tokens[id]}}};
        pieces.push_back({{"SpecialToken", {{"id", tokens[id]}, {"type_id", typeId}}}});
      };
      if (addBos) special(*ids.bos);
      pieces.push_back({{"Sequence", {{"id", sequence}, {"type_id", typeId}}}});
      if (addEos) special(*ids.eos);
    };
    json single = json::array();
    around(single, "A", 0);
    json pair = single;
    around(pair, "B", 1);
    postProcessor = {
        {"type", "Sequence"},
        {"processors",
         {postProcessor,
          {{"type", "TemplateProcessing"}, {"single", single}, {"pair", pair}, {"special_tokens", specials}}}}};
  }

  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", *preTokenizer},
      {"post_processor", postProcessor},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", ids.unk ? json(tokens[*ids.unk]) : json(nullptr)},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", std::move(vocab)},
        {"merges", merges}}},
  };
}

std::string dtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      QPIPE_CHECK(false, "unsupported output dtype ", dtype);
  }
}

void writeJson(const fs::path& path, const json& value) {
  std::ofstream out(path);
  std::string text;
  try {
    text = value.dump(2);
  } catch (const json::type_error& e) {
    // Only text that is not UTF-8 fails to serialise: a token or the chat template.
    throw Error(ErrorCode::kInput, concat(path.filename().string(), ": metadata is not valid UTF-8 (", e.what(), ")"));
  }
  out << text << "\n";
  QPIPE_REQUIRE(out.good(), ErrorCode::kIo, path.string(), ": cannot write");
}

}  // namespace

std::string hfTensorName(std::string_view ggufName) {
  static const std::map<std::string, std::string, std::less<>> kGlobal{
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  static const std::map<std::string, std::string, std::less<>> kLayer{
      {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},
      {"attn_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
  };
  if (const auto it = kGlobal.find(ggufName); it != kGlobal.end()) return it->second;
  static const std::regex kBlock(R"(blk\.(0|[1-9][0-9]*)\.(.+))");
  std::match_results<std::string_view::const_iterator> match;
  if (!std::regex_match(ggufName.begin(), ggufName.end(), match, kBlock)) return {};
  const auto it = kLayer.find(match[2].str());
  if (it == kLayer.end()) return {};
  return "model.layers." + match[1].str() + "." + it->second;
}

at::Tensor unpermuteRotary(const at::Tensor& weight, int64_t heads) {
  const int64_t rows = weight.size(0);
  QPIPE_CHECK(rows % (2 * heads) == 0, rows, " rows are not whole rotary heads of ", heads);
  std::vector<int64_t> split{heads, rows / heads / 2, 2};
  for (int64_t d = 1; d < weight.dim(); ++d) split.push_back(weight.size(d));
  return weight.reshape(split).transpose(1, 2).reshape(weight.sizes()).contiguous();
}

ConvertSummary convertToHf(const fs::path& input, const fs::path& outputDir, const ConvertOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  QPIPE_REQUIRE(options.dtype == at::kFloat || options.dtype == at::kBFloat16 || options.dtype == at::kHalf,
                ErrorCode::kUsage, "output dtype ", options.dtype, " is not one of float32, bfloat16, float16");
  const auto file = File::open(input);
  const std::string name = input.string();
  const Hyper h = readHyper(*file);
  const auto tensors = plan(*file, h);

  SpecialIds ids{file->getOptional<int64_t>("tokenizer.ggml.bos_token_id"),
                 file->getOptional<int64_t>("tokenizer.ggml.eos_token_id"),
                 file->getOptional<int64_t>("tokenizer.ggml.unknown_token_id"),
                 file->getOptional<int64_t>("tokenizer.ggml.padding_token_id")};
  std::vector<std::string> tokens;
  json addedDecoder;
  const json tokenizer = buildTokenizer(*file, ids, tokens, addedDecoder);
  QPIPE_REQUIRE(static_cast<int64_t>(tokens.size()) <= h.vocabSize, ErrorCode::kInput, name,
                ": metadata 'tokenizer.ggml.tokens' has ", tokens.size(), " tokens, more than the ", h.vocabSize,
                " rows of 'token_embd.weight'");

  fs::path target = fs::absolute(outputDir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();  // "out/" and "." name the folder
  QPIPE_REQUIRE(options.overwrite || !fs::exists(target), ErrorCode::kIo, target.string(),
                ": already exists (remove it, or pass --overwrite)");
  // --overwrite removes the output: never the input, nor a folder that holds it. Compared as files
  // (device and inode), along the input's path as written and as resolved, so that neither a link
  // nor a bind mount of a folder on the way hides it.
  if (fs::exists(target)) {
    std::error_code ec;
    const fs::path written = fs::absolute(input).lexically_normal(), real = fs::canonical(input, ec);
    for (const fs::path& path : {written, ec ? written : real}) {
      for (fs::path at = path;; at = at.parent_path()) {
        std::error_code unreadable;
        QPIPE_REQUIRE(!fs::equivalent(at, target, unreadable), ErrorCode::kUsage, "--output '", target.string(), "' ",
                      at == path ? "is" : "holds", " the input '", name,
                      "', which --overwrite would remove; choose another --output");
        if (!at.has_relative_path()) break;
      }
    }
  }
  const fs::path partial =
      target.parent_path() / ("." + target.filename().string() + ".partial-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(partial, ec);
  fs::create_directories(partial, ec);
  QPIPE_REQUIRE(!ec, ErrorCode::kIo, "cannot write --output '", target.string(), "': creating the folder '",
                partial.string(), "' beside it failed: ", ec.message());

  ConvertSummary summary;
  try {
    const std::string dtype = dtypeName(options.dtype);
    json config = {
        {"architectures", {"LlamaForCausalLM"}},
        {"model_type", "llama"},
        {"hidden_size", h.hidden},
        {"intermediate_size", h.intermediate},
        {"num_hidden_layers", h.layers},
        {"num_attention_heads", h.heads},
        {"num_key_value_heads", h.kvHeads},
        {"head_dim", h.headDim},
        {"hidden_act", "silu"},
        {"rms_norm_eps", h.rmsEps},
        {"rope_theta", h.ropeTheta},
        {"rope_scaling", h.ropeScaling},
        {"max_position_embeddings", h.contextLength},
        {"vocab_size", h.vocabSize},
        {"tie_word_embeddings", h.tied},
        {"attention_bias", false},
        {"attention_dropout", 0.0},
        {"mlp_bias", false},
        {"initializer_range", 0.02},
        {"pretraining_tp", 1},
        {"use_cache", true},
        {"torch_dtype", dtype},
    };
    json generation = json::object();
    json tokenizerConfig = {
        {"tokenizer_class", "PreTrainedTokenizerFast"},
        {"clean_up_tokenization_spaces", false},
        {"model_max_length", h.contextLength},
        {"add_bos_token", file->getOptional<bool>("tokenizer.ggml.add_bos_token").value_or(false)},
        {"add_eos_token", file->getOptional<bool>("tokenizer.ggml.add_eos_token").value_or(false)},
        {"added_tokens_decoder", addedDecoder},
    };
    for (const auto& [key, id] : {std::pair{"bos", ids.bos}, {"eos", ids.eos}, {"pad", ids.pad}, {"unk", ids.unk}}) {
      if (!id) continue;
      tokenizerConfig[std::string(key) + "_token"] = tokens[*id];
      if (std::string(key) == "unk") continue;
      config[std::string(key) + "_token_id"] = *id;
      generation[std::string(key) + "_token_id"] = *id;
    }
    if (const auto chatTemplate = file->getOptional<std::string>("tokenizer.chat_template")) {
      tokenizerConfig["chat_template"] = *chatTemplate;
    }

    safetensors::Writer writer(partial, {.filePrefix = "model", .maxShardBytes = 0, .metadata = {}});
    for (const Planned& t : tensors) {
      at::Tensor weight = file->dequantize(*t.info);
      if (t.permuteHeads > 0) weight = unpermuteRotary(weight, t.permuteHeads);
      weight = weight.to(options.dtype);
      writer.add(t.hfName, weight);
      ++summary.tensors;
      summary.parameters += weight.numel();
      summary.weightBytes += weight.nbytes();
    }
    writer.finish();

    writeJson(partial / "config.json", config);
    writeJson(partial / "generation_config.json", generation);
    writeJson(partial / "tokenizer.json", tokenizer);
    writeJson(partial / "tokenizer_config.json", tokenizerConfig);

    // A replaced folder goes only now, with the new one complete beside it.
    if (fs::exists(target)) fs::remove_all(target, ec);
    QPIPE_REQUIRE(!ec, ErrorCode::kIo, target.string(), ": cannot remove the old folder: ", ec.message());
    fs::rename(partial, target, ec);
    QPIPE_REQUIRE(!ec, ErrorCode::kIo, partial.string(), ": cannot rename to ", target.string(), ": ", ec.message());
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(partial, ignored);
    throw;
  }
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::logger()->info(name, ": converted to ", target.string(), " (", summary.tensors, " tensors, ", summary.parameters,
                      " parameters, ", dtypeName(options.dtype), ", ", summary.weightBytes, " bytes of weights, ",
                      summary.seconds, " s)");
  return summary;
}

}  // namespace qpipe::gguf
