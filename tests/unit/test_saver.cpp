// Savers and quantized checkpoint loading: save a quantized tiny Llama, open it again, and get the
// in-memory model's logits bit for bit; file layouts, sharding, atomicity and every user error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <optional>

#include "qpipe/model.h"
#include "qpipe/quant_linear.h"
#include "qpipe/saver.h"
#include "replace_linears.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using quant::QDtype;
using quant::QScheme;
using quant::QScope;

struct Spec {
  QScheme weight;
  std::optional<QScheme> input;  // per_token: dynamic; per_tensor: static with a fixed range
};

ActivationQuant activation(const QScheme& scheme) {
  if (scheme.scope == QScope::kPerToken) return {scheme, {}};
  return {scheme, quant::computeQParams(at::tensor({-1.5f}), at::tensor({2.5f}), scheme)};
}

// Replaces every Linear for which `specFor` names a spec, as linear_quant does.
void quantize(CausalLM& lm, const std::function<std::optional<Spec>(const std::string&)>& specFor) {
  test::replaceLinears(lm, [&](const std::string& name, Linear& linear) -> std::shared_ptr<Module> {
    const auto spec = specFor(name);
    if (!spec) return nullptr;
    std::optional<ActivationQuant> input;
    if (spec->input) input = activation(*spec->input);
    return QuantLinear::fromLinear(linear, quant::computeQParams(linear.weight(), spec->weight), spec->weight, input);
  });
}

at::Tensor ids() {
  at::manual_seed(5);
  return at::randint(0, test::kTinyVocab, {2, 7}, at::kLong);
}

void saveAll(CausalLM& lm, const fs::path& out, SaverOptions options = {}) {
  auto saver = CheckpointSaver::create(options, lm, out);
  for (int64_t i = 0; i < lm.config().numLayers; ++i) saver->writeLayer(i, lm.layerName(i), lm.layer(i));
  saver->finish();
}

Json readJson(const fs::path& path) {
  return Json::parse(test::slurp(path));
}

// Saves the tiny model quantized by `spec`, reopens it and compares logits bit for bit.
// Returns the saved folder.
fs::path roundTrip(const std::string& name, const std::function<std::optional<Spec>(const std::string&)>& specFor,
                   SaverOptions options = {}) {
  auto lm = CausalLM::open(test::tinyLlama(name + "-src"));
  quantize(*lm, specFor);
  const at::Tensor expected = lm->forward(ids());
  const fs::path out = test::testDir() / (name + "-out");
  fs::remove_all(out);
  saveAll(*lm, out, options);
  const at::Tensor loaded = CausalLM::open(out)->forward(ids());
  EXPECT_TRUE(at::equal(loaded, expected)) << name << ": max |diff| " << (loaded - expected).abs().max().item<float>();
  return out;
}

std::function<std::optional<Spec>(const std::string&)> everywhere(Spec spec) {
  return [spec](const std::string&) { return spec; };
}

const QScheme kInt8Channel{.dtype = QDtype::kInt8, .scope = QScope::kPerChannel};
const QScheme kInt8Tensor{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor};
const QScheme kInt8Token{.dtype = QDtype::kInt8, .scope = QScope::kPerToken};
const QScheme kFp8Tensor{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor};
const QScheme kFp8Channel{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerChannel};
const QScheme kFp8Token{.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerToken};
const QScheme kInt4Group{.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .groupSize = 8};

std::string dtypeOf(const fs::path& dir, const std::string& tensor, const std::string& prefix = "model") {
  return safetensors::Checkpoint::open(dir, prefix).info(tensor).dtype;
}

std::vector<int64_t> shapeOf(const fs::path& dir, const std::string& tensor, const std::string& prefix = "model") {
  return safetensors::Checkpoint::open(dir, prefix).info(tensor).shape;
}

// ---------------------------------------------------------------------------------------------
// compressed_tensors

TEST(CompressedTensorsSaver, W8A8StaticRoundTripAndConfig) {
  const fs::path out = roundTrip("w8a8-static", everywhere({kInt8Channel, kInt8Tensor}));
  const Json q = readJson(out / "config.json")["quantization_config"];
  const Json args = {{"actorder", nullptr},
                     {"block_structure", nullptr},
                     {"dynamic", false},
                     {"group_size", nullptr},
                     {"num_bits", 8},
                     {"observer", "minmax"},
                     {"observer_kwargs", Json::object()}};
  Json weights = args, input = args;
  weights.update({{"strategy", "channel"}, {"symmetric", true}, {"type", "int"}});
  input.update({{"strategy", "tensor"}, {"symmetric", true}, {"type", "int"}});
  const Json expected = {
      {"config_groups",
       {{"group_0",
         {{"format", "int-quantized"},
          {"input_activations", input},
          {"output_activations", nullptr},
          {"targets", {"Linear"}},
          {"weights", weights}}}}},
      {"format", "int-quantized"},
      {"global_compression_ratio", nullptr},
      {"ignore", {"lm_head"}},
      {"kv_cache_scheme", nullptr},
      {"quant_method", "compressed-tensors"},
      {"quantization_status", "compressed"},
      {"sparsity_config", Json::object()},
      {"transform_config", Json::object()},
      {"version", "0.20.0"},
  };
  EXPECT_EQ(q, expected) << q.dump(2);
  // The source config is kept, key order included.
  const std::string text = test::slurp(out / "config.json");
  EXPECT_LT(text.find("\"model_type\""), text.find("\"vocab_size\""));
  EXPECT_EQ(readJson(out / "config.json")["tie_word_embeddings"], true);

  const std::string p = "model.layers.1.mlp.down_proj.";
  EXPECT_EQ(dtypeOf(out, p + "weight"), "I8");
  EXPECT_EQ(dtypeOf(out, p + "weight_scale"), "F32");
  EXPECT_EQ(shapeOf(out, p + "weight_scale"), (std::vector<int64_t>{test::kTinyHidden, 1}));
  EXPECT_EQ(dtypeOf(out, p + "input_scale"), "F32");
  EXPECT_EQ(shapeOf(out, p + "input_scale"), (std::vector<int64_t>{1}));
  EXPECT_EQ(dtypeOf(out, "model.norm.weight"), "F32");
  const auto ckpt = safetensors::Checkpoint::open(out);
  EXPECT_FALSE(ckpt.contains("lm_head.weight"));  // tied: the embedding is the head
  EXPECT_FALSE(ckpt.contains(p + "weight_zero_point"));
  EXPECT_FALSE(ckpt.contains(p + "input_zero_point"));
}

TEST(CompressedTensorsSaver, W8A8DynamicRoundTrip) {
  const fs::path out = roundTrip("w8a8-dynamic", everywhere({kInt8Channel, kInt8Token}));
  const Json input =
      readJson(out / "config.json")["quantization_config"]["config_groups"]["group_0"]["input_activations"];
  EXPECT_EQ(input["strategy"], "token");
  EXPECT_EQ(input["dynamic"], true);
  EXPECT_EQ(input["observer"], nullptr);
  EXPECT_FALSE(safetensors::Checkpoint::open(out).contains("model.layers.0.self_attn.q_proj.input_scale"));
}

TEST(CompressedTensorsSaver, Int8AsymmetricZeroPointsAreInt8) {
  const QScheme weight{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor, .symmetric = false};
  const QScheme input{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor, .symmetric = false};
  const fs::path out = roundTrip("int8-asym", everywhere({weight, input}));
  const std::string p = "model.layers.0.self_attn.o_proj.";
  EXPECT_EQ(dtypeOf(out, p + "weight_zero_point"), "I8");
  EXPECT_EQ(shapeOf(out, p + "weight_zero_point"), (std::vector<int64_t>{1}));
  EXPECT_EQ(dtypeOf(out, p + "input_zero_point"), "I8");
}

TEST(CompressedTensorsSaver, Int4GroupSymmetricPacked) {
  const fs::path out = roundTrip("w4-sym", everywhere({kInt4Group, std::nullopt}));
  const Json group = readJson(out / "config.json")["quantization_config"]["config_groups"]["group_0"];
  EXPECT_EQ(group["format"], "pack-quantized");
  EXPECT_EQ(group["input_activations"], nullptr);
  EXPECT_EQ(group["weights"]["strategy"], "group");
  EXPECT_EQ(group["weights"]["group_size"], 8);
  EXPECT_EQ(group["weights"]["num_bits"], 4);
  const std::string p = "model.layers.0.mlp.down_proj.";  // [16, 24]
  EXPECT_EQ(dtypeOf(out, p + "weight_packed"), "I32");
  EXPECT_EQ(shapeOf(out, p + "weight_packed"), (std::vector<int64_t>{16, 3}));
  EXPECT_EQ(dtypeOf(out, p + "weight_shape"), "I64");
  EXPECT_TRUE(at::equal(safetensors::Checkpoint::open(out).tensor(p + "weight_shape"), at::tensor({16L, 24L})));
  EXPECT_EQ(shapeOf(out, p + "weight_scale"), (std::vector<int64_t>{16, 3}));
}

TEST(CompressedTensorsSaver, Int4AsymmetricZeroPointsPackedAlongOutputs) {
  const QScheme group{.dtype = QDtype::kInt4, .scope = QScope::kPerGroup, .symmetric = false, .groupSize = 8};
  const fs::path out = roundTrip("w4-asym", everywhere({group, std::nullopt}));
  const std::string p = "model.layers.0.mlp.up_proj.";  // [24, 16]: 2 groups, 24 rows → 3 words
  EXPECT_EQ(dtypeOf(out, p + "weight_zero_point"), "I32");
  EXPECT_EQ(shapeOf(out, p + "weight_zero_point"), (std::vector<int64_t>{3, 2}));
  const QScheme channel{.dtype = QDtype::kInt4, .scope = QScope::kPerChannel, .symmetric = false};
  const fs::path channelOut = roundTrip("w4-asym-channel", everywhere({channel, std::nullopt}));
  EXPECT_EQ(shapeOf(channelOut, p + "weight_zero_point"), (std::vector<int64_t>{3, 1}));
}

TEST(CompressedTensorsSaver, Int8WeightOnlyPackedFourPerWord) {
  const fs::path out = roundTrip("w8a16", everywhere({kInt8Channel, std::nullopt}));
  EXPECT_EQ(readJson(out / "config.json")["quantization_config"]["format"], "pack-quantized");
  EXPECT_EQ(shapeOf(out, "model.layers.0.mlp.down_proj.weight_packed"), (std::vector<int64_t>{16, 6}));
  // Hand-checked layout: u = q + 128, element k of a word in bits 8k..8k+7.
  auto lm = CausalLM::open(out);
  auto& linear = dynamic_cast<QuantLinear&>(lm->layer(0).getSubmodule("mlp.down_proj"));
  const at::Tensor q = linear.parameter("weight").to(at::kLong) + 128;
  const at::Tensor word = safetensors::Checkpoint::open(out).tensor("model.layers.0.mlp.down_proj.weight_packed");
  const int64_t expected = q[0][0].item<int64_t>() | q[0][1].item<int64_t>() << 8 | q[0][2].item<int64_t>() << 16 |
                           q[0][3].item<int64_t>() << 24;
  EXPECT_EQ(static_cast<uint32_t>(word[0][0].item<int32_t>()), static_cast<uint32_t>(expected));
}

TEST(CompressedTensorsSaver, Fp8StaticAndDynamicRoundTrip) {
  const fs::path out = roundTrip("fp8-static", everywhere({kFp8Tensor, kFp8Tensor}));
  const Json group = readJson(out / "config.json")["quantization_config"]["config_groups"]["group_0"];
  EXPECT_EQ(group["format"], "float-quantized");
  EXPECT_EQ(group["weights"]["type"], "float");
  EXPECT_EQ(dtypeOf(out, "model.layers.0.self_attn.q_proj.weight"), "F8_E4M3");
  EXPECT_EQ(shapeOf(out, "model.layers.0.self_attn.q_proj.weight_scale"), (std::vector<int64_t>{1}));
  roundTrip("fp8-dynamic", everywhere({kFp8Channel, kFp8Token}));
}

TEST(CompressedTensorsSaver, Fp8WeightOnlyIsNaiveQuantized) {
  const fs::path out = roundTrip("fp8-weight-only", everywhere({kFp8Channel, std::nullopt}));
  EXPECT_EQ(readJson(out / "config.json")["quantization_config"]["format"], "naive-quantized");
}

TEST(CompressedTensorsSaver, MixedSchemesGetRegexTargetsAndIgnore) {
  const auto specFor = [](const std::string& name) -> std::optional<Spec> {
    if (name == "model.layers.1.mlp.down_proj") return std::nullopt;  // one kind split: float here
    if (name.find("self_attn") != std::string::npos) return Spec{kInt8Channel, kInt8Token};
    return Spec{kInt4Group, std::nullopt};
  };
  const fs::path out = roundTrip("mixed", specFor);
  const Json q = readJson(out / "config.json")["quantization_config"];
  EXPECT_EQ(q["format"], "mixed-precision");
  EXPECT_EQ(q["config_groups"]["group_0"]["format"], "int-quantized");
  EXPECT_EQ(q["config_groups"]["group_0"]["targets"],
            Json({"re:.*\\.self_attn\\.k_proj$", "re:.*\\.self_attn\\.o_proj$", "re:.*\\.self_attn\\.q_proj$",
                  "re:.*\\.self_attn\\.v_proj$"}));
  EXPECT_EQ(q["config_groups"]["group_1"]["format"], "pack-quantized");
  EXPECT_EQ(q["config_groups"]["group_1"]["targets"],
            Json({"re:.*\\.mlp\\.gate_proj$", "re:.*\\.mlp\\.up_proj$", "model.layers.0.mlp.down_proj"}));
  EXPECT_EQ(q["ignore"], Json({"lm_head", "model.layers.1.mlp.down_proj"}));
  EXPECT_EQ(dtypeOf(out, "model.layers.1.mlp.down_proj.weight"), "F32");
}

TEST(CompressedTensorsSaver, CopiesSideFilesAndAddedFiles) {
  auto lm = CausalLM::open(test::tinyLlama("side-src"));
  std::ofstream(lm->directory() / "tokenizer.json") << "{}";
  std::ofstream(lm->directory() / "generation_config.json") << "{\"do_sample\": false}";
  std::ofstream(lm->directory() / "chat_template.jinja") << "{{ messages }}";
  std::ofstream(lm->directory() / "notes.bin") << "not copied";
  quantize(*lm, everywhere({kInt8Channel, std::nullopt}));
  const fs::path out = test::testDir() / "side-out";
  fs::remove_all(out);
  auto saver = CheckpointSaver::create({}, *lm, out);
  for (int64_t i = 0; i < lm->config().numLayers; ++i) saver->writeLayer(i, lm->layerName(i), lm->layer(i));
  saver->addFile("quant_report.json", "{\"layers\": 2}");
  saver->finish();
  EXPECT_EQ(test::slurp(out / "tokenizer.json"), "{}");
  EXPECT_EQ(test::slurp(out / "generation_config.json"), "{\"do_sample\": false}");
  EXPECT_EQ(test::slurp(out / "chat_template.jinja"), "{{ messages }}");
  EXPECT_EQ(test::slurp(out / "quant_report.json"), "{\"layers\": 2}");
  EXPECT_FALSE(fs::exists(out / "notes.bin"));
}

TEST(CompressedTensorsSaver, ShardsWithIndexHoldEveryTensorOnce) {
  // ~2.1 kB per shard: the tiny model's tensors spread over several files.
  const fs::path out = roundTrip("sharded", everywhere({kInt8Channel, kInt8Token}), {.partFileSizeGb = 2e-6});
  const Json index = readJson(out / "model.safetensors.index.json");
  std::set<std::string> shards;
  for (const auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_GT(shards.size(), 2u);
  std::map<std::string, int> seen;
  uint64_t bytes = 0;
  for (const auto& shard : shards) {
    const auto file = safetensors::File::open(out / shard);
    for (const auto& info : file->tensors()) {
      ++seen[info.name];
      bytes += info.end - info.begin;
      EXPECT_EQ(index["weight_map"][info.name], shard) << info.name;
    }
  }
  EXPECT_EQ(seen.size(), index["weight_map"].size());
  for (const auto& [name, count] : seen) EXPECT_EQ(count, 1) << name;
  EXPECT_EQ(index["metadata"]["total_size"], bytes);
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  // 2 layers × (7 linears × 2 tensors + 2 norms) + embedding + final norm.
  EXPECT_EQ(seen.size(), 2u * (7 * 2 + 2) + 2);
}

// ---------------------------------------------------------------------------------------------
// Atomicity and user errors

TEST(SaverAtomicity, FolderAppearsOnlyAtFinish) {
  auto lm = CausalLM::open(test::tinyLlama("atomic-src"));
  const fs::path out = test::testDir() / "atomic-out";
  fs::remove_all(out);
  auto saver = CheckpointSaver::create({}, *lm, out);
  saver->writeLayer(0, lm->layerName(0), lm->layer(0));
  EXPECT_FALSE(fs::exists(out));
  saver->writeLayer(1, lm->layerName(1), lm->layer(1));
  EXPECT_FALSE(fs::exists(out));
  saver->finish();
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(test::testDir() / ".atomic-out.qpipe-partial"));
}

TEST(SaverAtomicity, AbandonedSaveLeavesNothing) {
  auto lm = CausalLM::open(test::tinyLlama("abandon-src"));
  const fs::path out = test::testDir() / "abandon-out";
  fs::remove_all(out);
  try {
    auto saver = CheckpointSaver::create({}, *lm, out);
    saver->writeLayer(0, lm->layerName(0), lm->layer(0));
    throw std::runtime_error("calibration failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(test::testDir() / ".abandon-out.qpipe-partial"));
}

TEST(SaverAtomicity, StaleTemporaryFolderIsReplaced) {
  auto lm = CausalLM::open(test::tinyLlama("stale-src"));
  const fs::path out = test::testDir() / "stale-out";
  fs::remove_all(out);
  const fs::path stale = test::testDir() / ".stale-out.qpipe-partial";
  fs::create_directories(stale);
  std::ofstream(stale / "model-00001-of-00009.safetensors") << "killed mid-write";
  saveAll(*lm, out);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(out / "model-00001-of-00009.safetensors"));
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

TEST(SaverAtomicity, EmptyExistingFolderIsUsed) {
  auto lm = CausalLM::open(test::tinyLlama("empty-src"));
  const fs::path out = test::testDir() / "empty-out";
  fs::remove_all(out);
  fs::create_directories(out);
  saveAll(*lm, out);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

TEST(SaverErrors, RefusesNonEmptyFolderAndFile) {
  auto lm = CausalLM::open(test::tinyLlama("refuse-src"));
  const fs::path out = test::testDir() / "refuse-out";
  fs::remove_all(out);
  fs::create_directories(out);
  std::ofstream(out / "keep.txt") << "mine";
  EXPECT_EQ(test::errorOf([&] { CheckpointSaver::create({}, *lm, out); }, ErrorCode::kInput),
            "save folder '" + out.string() + "' exists and is not empty; choose another --save_path or remove it");
  EXPECT_EQ(test::slurp(out / "keep.txt"), "mine");
  EXPECT_EQ(test::errorOf([&] { CheckpointSaver::create({}, *lm, out / "keep.txt"); }, ErrorCode::kInput),
            "save path '" + (out / "keep.txt").string() + "' exists and is not a folder; choose another --save_path");
}

TEST(SaverErrors, OptionsAreChecked) {
  auto lm = CausalLM::open(test::tinyLlama("options-src"));
  const fs::path out = test::testDir() / "options-out";
  EXPECT_EQ(test::errorOf([&] { CheckpointSaver::create({.format = "gguf"}, *lm, out); }, ErrorCode::kConfig),
            "save format 'gguf' is unknown; expected compressed_tensors or ascendv1_saver");
  EXPECT_EQ(test::errorOf([&] { CheckpointSaver::create({.partFileSizeGb = -1}, *lm, out); }, ErrorCode::kConfig),
            "part_file_size -1 is negative; give the shard size in GB, or 0 for one file");
  EXPECT_FALSE(fs::exists(out));
}

TEST(SaverErrors, UnsavableSchemes) {
  auto lm = CausalLM::open(test::tinyLlama("unsavable-src"));
  quantize(*lm, everywhere({kInt4Group, kInt8Token}));
  const fs::path out = test::testDir() / "unsavable-out";
  fs::remove_all(out);
  auto saver = CheckpointSaver::create({.format = "ascendv1_saver"}, *lm, out);
  EXPECT_EQ(test::errorOf([&] { saver->writeLayer(0, lm->layerName(0), lm->layer(0)); }, ErrorCode::kConfig),
            "ascendv1_saver: model.layers.0.self_attn.q_proj has weights int4_per_group_sym and activations "
            "int8_per_token_sym; ascendv1 defines W8A8 (int8 weights, static per_tensor int8 activations), "
            "W8A8_DYNAMIC (per_token int8), W8A16 and WFP8AFP8_DYNAMIC (per_token fp8); use compressed_tensors for "
            "others");
}

// ---------------------------------------------------------------------------------------------
// Loading errors: one message naming the file and the field

std::string openError(const std::function<void(Json&)>& edit) {
  auto lm = CausalLM::open(test::tinyLlama("load-src"));
  quantize(*lm, everywhere({kInt8Channel, kInt8Tensor}));
  const fs::path out = test::testDir() / "load-out";
  fs::remove_all(out);
  saveAll(*lm, out);
  Json config = readJson(out / "config.json");
  edit(config["quantization_config"]);
  std::ofstream(out / "config.json") << config.dump();
  return test::errorOf([&] { CausalLM::open(out)->forward(ids()); }, ErrorCode::kInput);
}

TEST(QuantizedLoadErrors, UnsupportedConfigsNameFileAndField) {
  const std::string file = (test::testDir() / "load-out" / "config.json").string();
  EXPECT_EQ(openError([](Json& q) { q["quant_method"] = "gptq"; }),
            file +
                ": quantization_config.quant_method \"gptq\" is not supported; qpipe loads compressed-tensors "
                "and ascendv1 checkpoints");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"; }),
            file +
                ": quantization_config.config_groups.group_0.format \"nvfp4-pack-quantized\" is not supported; "
                "qpipe loads int-quantized, float-quantized, naive-quantized and pack-quantized");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "block"; }),
            file +
                ": quantization_config.config_groups.group_0.weights.strategy {\"group_size\":null,\"strategy\":"
                "\"block\"} is not supported; qpipe loads tensor, channel and group (group_size > 0) weights");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["weights"]["actorder"] = "group"; }),
            file +
                ": quantization_config.config_groups.group_0.weights.actorder \"group\" is not supported; qpipe "
                "loads schemes without blocks or activation-order indices");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 2; }),
            file +
                ": quantization_config.config_groups.group_0.weights.num_bits {\"num_bits\":2,\"type\":\"int\"} "
                "is not supported; qpipe loads int8, int4 and fp8 weights");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["input_activations"]["dynamic"] = true; }),
            file +
                ": quantization_config.config_groups.group_0.input_activations {\"dynamic\":true,\"strategy\":"
                "\"tensor\"} is not supported; qpipe loads static per-tensor and dynamic per-token activations");
  EXPECT_EQ(openError([](Json& q) {
              q["kv_cache_scheme"] = {{"num_bits", 8}};
            }),
            file +
                ": quantization_config.kv_cache_scheme {\"num_bits\":8} is not supported; qpipe loads "
                "checkpoints without KV-cache quantization");
  EXPECT_EQ(openError([](Json& q) { q["quantization_status"] = "frozen"; }),
            file +
                ": quantization_config.quantization_status \"frozen\" is not supported; qpipe loads "
                "\"compressed\" checkpoints");
  EXPECT_EQ(openError([](Json& q) {
              q["config_groups"]["group_0"]["output_activations"] = {{"num_bits", 8}};
            }),
            file +
                ": quantization_config.config_groups.group_0.output_activations {\"num_bits\":8} is not "
                "supported; qpipe loads no output quantization");
}

TEST(QuantizedLoadErrors, TensorOfTheWrongShape) {
  auto lm = CausalLM::open(test::tinyLlama("shape-src"));
  quantize(*lm, everywhere({kInt8Channel, std::nullopt}));
  const fs::path out = test::testDir() / "shape-out";
  fs::remove_all(out);
  saveAll(*lm, out);
  Json config = readJson(out / "config.json");
  config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor";
  std::ofstream(out / "config.json") << config.dump();
  EXPECT_EQ(test::errorOf([&] { CausalLM::open(out)->forward(ids()); }, ErrorCode::kInput),
            "checkpoint " + out.string() +
                ": 'model.layers.0.self_attn.q_proj.weight_scale' has shape [16, 1], "
                "expected [1]");
}

// ---------------------------------------------------------------------------------------------
// ascendv1

fs::path saveAscend(const std::string& name, const std::function<std::optional<Spec>(const std::string&)>& specFor,
                    at::Tensor* expected = nullptr, SaverOptions options = {.format = "ascendv1_saver"}) {
  auto lm = CausalLM::open(test::tinyLlama(name + "-src"));
  quantize(*lm, specFor);
  if (expected) *expected = lm->forward(ids());
  const fs::path out = test::testDir() / (name + "-out");
  fs::remove_all(out);
  saveAll(*lm, out, options);
  return out;
}

TEST(AscendV1Saver, DynamicTypesRoundTripBitForBit) {
  for (const auto& [name, spec] : std::vector<std::pair<std::string, Spec>>{
           {"w8a8-dynamic", {kInt8Channel, kInt8Token}},
           {"w8a16-group-asym",
            {{.dtype = QDtype::kInt8, .scope = QScope::kPerGroup, .symmetric = false, .groupSize = 8}, std::nullopt}},
           {"wfp8afp8", {kFp8Channel, kFp8Token}}}) {
    at::Tensor expected;
    const fs::path out = saveAscend("ascend-" + name, everywhere(spec), &expected);
    EXPECT_TRUE(at::equal(CausalLM::open(out)->forward(ids()), expected)) << name;
  }
}

TEST(AscendV1Saver, W8A8StaticDescriptionAndTensors) {
  const QScheme asymInput{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor, .symmetric = false};
  const auto specFor = [&](const std::string& name) -> std::optional<Spec> {
    if (name.find("mlp") != std::string::npos) return Spec{kInt8Channel, kInt8Token};
    return Spec{kInt8Channel, asymInput};
  };
  at::Tensor expected;
  const fs::path out = saveAscend("ascend-w8a8", specFor, &expected);
  const Json description = readJson(out / "quant_model_description.json");
  const std::string q = "model.layers.0.self_attn.q_proj";
  const std::string up = "model.layers.1.mlp.up_proj";
  EXPECT_EQ(description[q + ".weight"], "W8A8");
  for (const char* key : {".input_scale", ".input_offset", ".deq_scale", ".quant_bias"}) {
    EXPECT_EQ(description[q + key], "W8A8") << key;
  }
  EXPECT_FALSE(description.contains(q + ".weight_scale"));
  EXPECT_EQ(description[up + ".weight"], "W8A8_DYNAMIC");
  EXPECT_EQ(description[up + ".weight_scale"], "W8A8_DYNAMIC");
  EXPECT_EQ(description[up + ".weight_offset"], "W8A8_DYNAMIC");
  EXPECT_EQ(description["model.layers.0.input_layernorm.weight"], "FLOAT");
  EXPECT_EQ(description["model.embed_tokens.weight"], "FLOAT");
  EXPECT_EQ(description["lm_head.weight"], "FLOAT");  // msmodelslim writes the tied head too
  EXPECT_EQ(description["model_quant_type"], "W8A8");
  EXPECT_EQ(description["version"], "1.0.0");
  EXPECT_EQ(description["group_size"], 0);
  EXPECT_EQ(description["metadata"], Json::object());
  EXPECT_EQ(description["optional"], Json::object());
  // 2 layers × (4 W8A8 × 5 + 3 W8A8_DYNAMIC × 3 + 2 norms) + embedding, norm, lm_head + 5 globals.
  EXPECT_EQ(description.size(), 2u * (4 * 5 + 3 * 3 + 2) + 3 + 5);
  EXPECT_FALSE(readJson(out / "config.json").contains("quantization_config"));

  // Hand-checked: input range [-1.5, 2.5] asymmetric int8 gives scale 4/255 and offset
  // round(1.5 / scale) - 128 = -32; deq_scale = input_scale · weight_scale as the int64 of the
  // fp32 bits (a float32 model); quant_bias = round(0 / deq - offset · Σ_k W_q[n, k]).
  const auto ckpt = safetensors::Checkpoint::open(out, "quant_model_weights");
  const at::Tensor inputScale = ckpt.tensor(q + ".input_scale");
  EXPECT_FLOAT_EQ(inputScale.item<float>(), 4.0f / 255.0f);
  EXPECT_EQ(ckpt.tensor(q + ".input_offset").item<float>(), -32.0f);
  EXPECT_EQ(ckpt.info(q + ".deq_scale").dtype, "I64");
  EXPECT_EQ(ckpt.info(q + ".quant_bias").dtype, "I32");
  EXPECT_EQ(ckpt.info(q + ".weight").dtype, "I8");
  const at::Tensor weight =
      CausalLM::open(test::tinyLlama("ascend-w8a8-src"))->layer(0).getSubmodule("self_attn.q_proj").parameter("weight");
  const at::Tensor weightScale = weight.abs().amax(1) / 127;
  const at::Tensor deq = ckpt.tensor(q + ".deq_scale").to(at::kInt).view(at::kFloat);
  EXPECT_TRUE(at::allclose(deq, weightScale * inputScale, 1e-6, 0));
  const at::Tensor wq = ckpt.tensor(q + ".weight").to(at::kFloat);
  EXPECT_TRUE(at::equal(ckpt.tensor(q + ".quant_bias"), (wq.sum(1) * 32).to(at::kInt)));

  // The static weight scale comes back as deq_scale / input_scale: equal up to fp32 rounding.
  const at::Tensor loaded = CausalLM::open(out)->forward(ids());
  EXPECT_LE((loaded - expected).abs().max().item<float>() / expected.abs().max().item<float>(), 1e-5);
}

TEST(AscendV1Saver, ShardsFollowMsmodelslimNames) {
  const fs::path out = saveAscend("ascend-shards", everywhere({kInt8Channel, kInt8Token}), nullptr,
                                  {.format = "ascendv1_saver", .partFileSizeGb = 2e-6});
  const Json index = readJson(out / "quant_model_weights.safetensors.index.json");
  std::set<std::string> shards;
  for (const auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  ASSERT_GT(shards.size(), 2u);
  const std::string count = std::to_string(shards.size());
  EXPECT_EQ(*shards.begin(), "quant_model_weights-00001-of-0000" + count + ".safetensors");
  for (const auto& shard : shards) EXPECT_TRUE(fs::exists(out / shard)) << shard;
  EXPECT_EQ(index["weight_map"].size(), readJson(out / "quant_model_description.json").size() - 5);
  EXPECT_NO_THROW(CausalLM::open(out)->forward(ids()));
}

TEST(AscendV1Saver, UnknownTypeIsRefusedAtLoad) {
  const fs::path out = saveAscend("ascend-unknown", everywhere({kInt8Channel, kInt8Token}));
  Json description = readJson(out / "quant_model_description.json");
  description["model.layers.0.self_attn.q_proj.weight"] = "W4A8_DYNAMIC";
  std::ofstream(out / "quant_model_description.json") << description.dump();
  EXPECT_EQ(test::errorOf([&] { CausalLM::open(out)->forward(ids()); }, ErrorCode::kInput),
            (out / "quant_model_description.json").string() +
                ": 'model.layers.0.self_attn.q_proj.weight' is W4A8_DYNAMIC; qpipe loads FLOAT, W8A8, "
                "W8A8_DYNAMIC, W8A16 and WFP8AFP8_DYNAMIC");
}

}  // namespace
}  // namespace qpipe
