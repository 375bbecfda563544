// Savers and quantized checkpoint loading: save a quantized tiny Llama, open it again, and get the
// in-memory model's logits bit for bit; file layouts, sharding, atomicity and every user error; a
// quantized lm_head of the tied tiny Llama is written with its quantized tensors and unties it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <tuple>

#include "qpipe/host/registry.h"
#include "qpipe/host/savers.h"
#include "qpipe/model.h"
#include "qpipe/quant_linear.h"
#include "qpipe/safetensors.h"
#include "replace_linears.h"
#include "save_checkpoint.h"
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

// Replaces lm_head by a QuantLinear, as linear_quant does in the non-layer unit.
void quantizeHead(CausalLM& lm, const Spec& spec) {
  lm.prepareHead();
  auto& head = dynamic_cast<Linear&>(lm.root().getSubmodule("lm_head"));
  std::optional<ActivationQuant> input;
  if (spec.input) input = activation(*spec.input);
  lm.root().replace(
      "lm_head", QuantLinear::fromLinear(head, quant::computeQParams(head.weight(), spec.weight), spec.weight, input));
}

at::Tensor ids() {
  at::manual_seed(5);
  return at::randint(0, test::kTinyVocab, {2, 7}, at::kLong);
}

Json readJson(const fs::path& path) {
  return Json::parse(test::slurp(path));
}

// Saves the tiny model quantized by `spec`, reopens it and compares logits bit for bit.
// Returns the saved folder.
// `head`: lm_head's spec, float when unset.
fs::path roundTrip(const std::string& name, const std::function<std::optional<Spec>(const std::string&)>& specFor,
                   SaverOptions options = {}, std::optional<Spec> head = std::nullopt) {
  auto lm = CausalLM::open(test::tinyLlama(name + "-src"));
  quantize(*lm, specFor);
  if (head) quantizeHead(*lm, *head);
  const at::Tensor expected = lm->forward(ids());
  const fs::path out = test::testDir() / (name + "-out");
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out, options);
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
const QScheme kInt4Channel{.dtype = QDtype::kInt4, .scope = QScope::kPerChannel};

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

// A W4A4 NVFP4 checkpoint (of the tiny Qwen3, whose widths are whole groups) opened to infer
// (ModelOptions::inferenceOnly: qpipe eval) holds inference-only QuantLinears, whose forward is the
// in-memory model's once its QuantLinears are inference-only, bit for bit: Fp4Linear's where it
// runs, and then not fake quantization's, which the quantization run computed. Opened as qpipe
// quant opens it, and deployed by a quantizer, they keep fake quantization's forward.
TEST(CompressedTensorsSaver, W4a4Nvfp4LoadsAsInferenceOnlyLinearsOnlyToInfer) {
  const QScheme nvfp4{.dtype = QDtype::kNvfp4, .scope = QScope::kPerGroup, .groupSize = quant::kNvfp4GroupSize};
  auto lm = CausalLM::open(test::tinyQwen3("w4a4-nvfp4-src"));
  std::vector<QuantLinear*> linears;
  test::replaceLinears(*lm, [&](const std::string&, Linear& linear) -> std::shared_ptr<Module> {
    ActivationQuant input{nvfp4, {}};
    input.params.globalScale = quant::nvfp4GlobalScale(at::tensor({2.5f}));
    auto deployed = QuantLinear::fromLinear(linear, quant::computeQParams(linear.weight(), nvfp4), nvfp4, input);
    linears.push_back(deployed.get());
    return deployed;
  });
  const at::Tensor fake = lm->forward(ids());
  const fs::path out = test::testDir() / "w4a4-nvfp4-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out);
  const auto toInfer = CausalLM::open(out, {.inferenceOnly = true});
  const auto toCalibrate = CausalLM::open(out);
  const at::Tensor inferred = toInfer->forward(ids());
  EXPECT_TRUE(at::equal(toCalibrate->forward(ids()), fake));
  for (QuantLinear* linear : linears) {
    EXPECT_FALSE(linear->inferenceOnly());
    linear->setInferenceOnly();
  }
  EXPECT_TRUE(at::equal(inferred, lm->forward(ids())));
  EXPECT_EQ(at::equal(inferred, fake), !test::fp4LinearRuns());
  for (const auto& [loaded, inferenceOnly] : {std::pair{toInfer.get(), true}, std::pair{toCalibrate.get(), false}}) {
    size_t quantized = 0;
    for (int64_t i = 0; i < loaded->config().numLayers; ++i) {
      for (const auto& [name, module] : loaded->layer(i).namedModules(loaded->layerName(i))) {
        if (const auto* linear = dynamic_cast<const QuantLinear*>(module)) {
          EXPECT_EQ(linear->inferenceOnly(), inferenceOnly) << name;
          ++quantized;
        }
      }
    }
    EXPECT_EQ(quantized, linears.size());
  }
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
  auto saver = createBuiltinSaver({}, *lm, out);
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

TEST(CompressedTensorsSaver, QuantizedHeadOfATiedModelIsWrittenAndUntiesIt) {
  const Spec w8a8{kInt8Channel, kInt8Tensor};
  const fs::path out = roundTrip("head-w8a8", everywhere(w8a8), {}, w8a8);
  const Json config = readJson(out / "config.json");
  EXPECT_EQ(config["tie_word_embeddings"], false);
  const Json q = config["quantization_config"];
  EXPECT_EQ(q["ignore"], Json::array()) << q.dump(2);
  EXPECT_EQ(q["config_groups"]["group_0"]["targets"], Json({"Linear"}));
  // lm_head as any other Linear; the embedding stays float, as in the source.
  EXPECT_EQ(dtypeOf(out, "lm_head.weight"), "I8");
  EXPECT_EQ(shapeOf(out, "lm_head.weight"), (std::vector<int64_t>{test::kTinyVocab, test::kTinyHidden}));
  EXPECT_EQ(shapeOf(out, "lm_head.weight_scale"), (std::vector<int64_t>{test::kTinyVocab, 1}));
  EXPECT_EQ(shapeOf(out, "lm_head.input_scale"), (std::vector<int64_t>{1}));
  EXPECT_EQ(dtypeOf(out, "model.embed_tokens.weight"), "F32");
  const fs::path src = test::testDir() / "head-w8a8-src";
  EXPECT_TRUE(at::equal(safetensors::Checkpoint::open(out).tensor("model.embed_tokens.weight"),
                        safetensors::Checkpoint::open(src).tensor("model.embed_tokens.weight")));
  // Read back as a QuantLinear next to the float embedding (roundTrip compared the logits).
  auto loaded = CausalLM::open(out);
  EXPECT_FALSE(loaded->config().tieWordEmbeddings);
  auto* head = dynamic_cast<QuantLinear*>(&loaded->root().getSubmodule("lm_head"));
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->weightScheme().name(), "int8_per_channel_sym");
  ASSERT_TRUE(head->inputQuant().has_value());
  EXPECT_FALSE(head->inputQuant()->isDynamic());
}

TEST(CompressedTensorsSaver, QuantizedHeadAloneAndPacked) {
  // Only lm_head quantized: the layers' Linears are ignored, lm_head is not.
  const fs::path alone = roundTrip(
      "head-alone", [](const std::string&) { return std::nullopt; }, {}, Spec{kInt8Channel, kInt8Token});
  const Json q = readJson(alone / "config.json")["quantization_config"];
  EXPECT_EQ(q["config_groups"]["group_0"]["targets"], Json({"Linear"}));
  for (const auto& entry : q["ignore"]) EXPECT_NE(entry, "lm_head");
  EXPECT_EQ(q["ignore"].size(), 7u) << q.dump(2);  // one regex per layer projection kind
  EXPECT_EQ(dtypeOf(alone, "model.layers.0.mlp.up_proj.weight"), "F32");
  // int4 weight-only: lm_head.weight_packed, no lm_head.weight.
  const Spec w4{kInt4Group, std::nullopt};
  const fs::path packed = roundTrip("head-w4", everywhere(w4), {}, w4);
  EXPECT_EQ(dtypeOf(packed, "lm_head.weight_packed"), "I32");
  EXPECT_EQ(shapeOf(packed, "lm_head.weight_packed"), (std::vector<int64_t>{test::kTinyVocab, 2}));
  EXPECT_FALSE(safetensors::Checkpoint::open(packed).contains("lm_head.weight"));
  EXPECT_EQ(readJson(packed / "config.json")["tie_word_embeddings"], false);
}

TEST(CompressedTensorsSaver, FloatHeadOfATiedModelStaysTied) {
  // lm_head converted for the runner (prepareHead) but left float: still the embedding.
  auto lm = CausalLM::open(test::tinyLlama("head-float-src"));
  lm->prepareHead();
  quantize(*lm, everywhere({kInt8Channel, kInt8Token}));
  const fs::path out = test::testDir() / "head-float-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out);
  EXPECT_EQ(readJson(out / "config.json")["tie_word_embeddings"], true);
  EXPECT_EQ(readJson(out / "config.json")["quantization_config"]["ignore"], Json({"lm_head"}));
  EXPECT_FALSE(safetensors::Checkpoint::open(out).contains("lm_head.weight"));
}

// ---------------------------------------------------------------------------------------------
// Segments (split layers, docs/scheduler.md)

// Every file of `dir`, name → bytes.
std::map<std::string, std::string> filesOf(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(dir))
    files[entry.path().filename().string()] = test::slurp(entry.path());
  return files;
}

// Layers written by a segment saver into the folder's data files, each laid out after the one
// before through the chain, then adopted in layer order by the saver of the folder, give the
// folder writeLayer gives, byte for byte: shards, index, the config's groups (numbered in order of
// first use) or the ascendv1 description. `nonLayerFirst`: the non-layer modules come first on
// both paths, as the segment before layer 0 (CheckpointSaver::kNonLayer).
void expectSegmentsWriteTheSameFolder(const std::string& name, const SaverOptions& options,
                                      const std::function<std::optional<Spec>(const std::string&)>& specFor,
                                      bool nonLayerFirst) {
  auto lm = CausalLM::open(test::tinyLlama(name + "-src"));
  quantize(*lm, specFor);
  const fs::path direct = test::testDir() / (name + "-direct"), adopted = test::testDir() / (name + "-adopted");
  fs::remove_all(direct);
  fs::remove_all(adopted);
  // The units in the order they are written: their index, name and module.
  std::vector<std::tuple<int64_t, std::string, Module*>> units;
  if (nonLayerFirst) units.emplace_back(CheckpointSaver::kNonLayer, "", &lm->root());
  for (int64_t i = 0; i < lm->config().numLayers; ++i) units.emplace_back(i, lm->layerName(i), &lm->layer(i));

  auto directSaver = createBuiltinSaver(options, *lm, direct);
  for (const auto& [index, unitName, module] : units) directSaver->writeLayer(index, unitName, *module);
  directSaver->finish();

  auto saver = createBuiltinSaver(options, *lm, adopted);
  SaverOptions segmentOptions = options;
  segmentOptions.segmentsOnly = true;
  auto segments = createBuiltinSaver(segmentOptions, *lm, adopted);
  std::vector<std::string> written(units.size()), chain(units.size() + 1);
  for (size_t k = 0; k < units.size(); ++k) {
    const auto& [index, unitName, module] = units[k];
    written[k] = segments->writeSegment(index, unitName, *module,
                                        {.start = [&chain, k] { return chain[k]; },
                                         .passOn = [&chain, k](const std::string& end) { chain[k + 1] = end; }});
    EXPECT_FALSE(chain[k + 1].empty()) << "unit " << index << " passed nothing on";
  }
  for (size_t k = 0; k < units.size(); ++k) saver->adoptSegment(std::get<0>(units[k]), written[k]);
  saver->finish();
  EXPECT_EQ(filesOf(adopted), filesOf(direct));  // no data file is left over either
}

std::optional<Spec> mixedCompressedTensors(const std::string& name) {
  if (name == "model.layers.1.mlp.down_proj") return std::nullopt;
  if (name.starts_with("model.layers.1.mlp")) return Spec{kInt8Channel, kInt8Token};
  if (name.find("self_attn") != std::string::npos) return Spec{kInt4Group, std::nullopt};
  return Spec{kFp8Channel, kFp8Token};
}

std::optional<Spec> mixedAscendV1(const std::string& name) {
  if (name == "model.layers.0.mlp.up_proj") return std::nullopt;
  if (name.find("self_attn") != std::string::npos) return Spec{kInt8Channel, kInt8Token};
  return Spec{kInt8Channel, std::nullopt};
}

TEST(SaverSegments, CompressedTensorsMixedAndShardedFromSegments) {
  for (const bool nonLayerFirst : {false, true}) {
    SCOPED_TRACE(nonLayerFirst);
    expectSegmentsWriteTheSameFolder("segments-ct", {.partFileSizeGb = 2e-6}, mixedCompressedTensors, nonLayerFirst);
  }
}

TEST(SaverSegments, AscendV1MixedFromSegments) {
  for (const bool nonLayerFirst : {false, true}) {
    SCOPED_TRACE(nonLayerFirst);
    expectSegmentsWriteTheSameFolder("segments-ascend", {.format = "ascendv1_saver"}, mixedAscendV1, nonLayerFirst);
  }
}

// The non-layer modules written first lie before layer 0 in the data, and load as when they come
// last; after a layer they are a bug of the caller.
TEST(SaverSegments, NonLayerModulesFirst) {
  auto lm = CausalLM::open(test::tinyLlama("non-layer-first-src"));
  quantize(*lm, mixedCompressedTensors);
  const at::Tensor expected = lm->forward(ids());
  const fs::path out = test::testDir() / "non-layer-first";
  fs::remove_all(out);
  auto saver = createBuiltinSaver({}, *lm, out);
  EXPECT_TRUE(saver->writesNonLayerFirst());
  saver->writeLayer(CheckpointSaver::kNonLayer, "", lm->root());
  for (int64_t i = 0; i < lm->config().numLayers; ++i) saver->writeLayer(i, lm->layerName(i), lm->layer(i));
  saver->finish();
  const auto file = safetensors::File::open(out / "model.safetensors");
  uint64_t embedding = 0, firstLayer = UINT64_MAX;
  for (const auto& info : file->tensors()) {
    if (info.name == "model.embed_tokens.weight") embedding = info.begin;
    if (info.name.starts_with("model.layers.")) firstLayer = std::min(firstLayer, info.begin);
  }
  EXPECT_LT(embedding, firstLayer);
  EXPECT_TRUE(at::equal(CausalLM::open(out)->forward(ids()), expected));

  const fs::path late = test::testDir() / "non-layer-late";
  fs::remove_all(late);
  auto lateSaver = createBuiltinSaver({}, *lm, late);
  lateSaver->writeLayer(0, lm->layerName(0), lm->layer(0));
  EXPECT_NE(
      test::errorOf([&] { lateSaver->writeLayer(CheckpointSaver::kNonLayer, "", lm->root()); }, ErrorCode::kInternal)
          .find("the non-layer modules after a decoder layer"),
      std::string::npos);

  // A tied model whose lm_head is no longer the embedding when they are written first: written
  // untied, as at finish().
  auto untied = CausalLM::open(test::tinyLlama("non-layer-first-untied-src"));
  const at::Tensor doubled = untied->root().getSubmodule("model.embed_tokens").parameter("weight") * 2;
  untied->root().replace("lm_head", std::make_shared<Linear>(doubled));
  const at::Tensor untiedLogits = untied->forward(ids());
  const fs::path untiedOut = test::testDir() / "non-layer-first-untied";
  fs::remove_all(untiedOut);
  auto untiedSaver = createBuiltinSaver({}, *untied, untiedOut);
  untiedSaver->writeLayer(CheckpointSaver::kNonLayer, "", untied->root());
  for (int64_t i = 0; i < untied->config().numLayers; ++i) {
    untiedSaver->writeLayer(i, untied->layerName(i), untied->layer(i));
  }
  untiedSaver->finish();
  EXPECT_FALSE(readJson(untiedOut / "config.json").at("tie_word_embeddings").get<bool>());
  EXPECT_TRUE(at::equal(CausalLM::open(untiedOut)->forward(ids()), untiedLogits));
}

TEST(SaverSegments, OnlyTheirOwnRole) {
  auto lm = CausalLM::open(test::tinyLlama("segments-roles-src"));
  const fs::path out = test::testDir() / "segments-roles";
  fs::remove_all(out);
  auto segments = createBuiltinSaver({.segmentsOnly = true}, *lm, out);
  EXPECT_FALSE(fs::exists(CheckpointSaver::partialDir(out)));  // the folder is rank 0's saver's
  EXPECT_NE(test::errorOf([&] { segments->writeLayer(0, lm->layerName(0), lm->layer(0)); }, ErrorCode::kInternal)
                .find("writeLayer after finish or on a segment saver"),
            std::string::npos);
  auto saver = createBuiltinSaver({}, *lm, out);
  EXPECT_NE(test::errorOf([&] { saver->writeSegment(0, lm->layerName(0), lm->layer(0), {}); }, ErrorCode::kInternal)
                .find("on the saver that owns the folder"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Atomicity and user errors

TEST(SaverAtomicity, FolderAppearsOnlyAtFinish) {
  auto lm = CausalLM::open(test::tinyLlama("atomic-src"));
  const fs::path out = test::testDir() / "atomic-out";
  fs::remove_all(out);
  auto saver = createBuiltinSaver({}, *lm, out);
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
    auto saver = createBuiltinSaver({}, *lm, out);
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
  test::saveCheckpoint(*lm, out);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(out / "model-00001-of-00009.safetensors"));
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

TEST(SaverAtomicity, EmptyExistingFolderIsUsed) {
  auto lm = CausalLM::open(test::tinyLlama("empty-src"));
  const fs::path out = test::testDir() / "empty-out";
  fs::remove_all(out);
  fs::create_directories(out);
  test::saveCheckpoint(*lm, out);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

TEST(SaverErrors, RefusesNonEmptyFolderAndFile) {
  auto lm = CausalLM::open(test::tinyLlama("refuse-src"));
  const fs::path out = test::testDir() / "refuse-out";
  fs::remove_all(out);
  fs::create_directories(out);
  std::ofstream(out / "keep.txt") << "mine";
  EXPECT_EQ(test::errorOf([&] { createBuiltinSaver({}, *lm, out); }, ErrorCode::kInput),
            "save folder '" + out.string() + "' exists and is not empty; choose another --save_path or remove it");
  EXPECT_EQ(test::slurp(out / "keep.txt"), "mine");
  EXPECT_EQ(test::errorOf([&] { createBuiltinSaver({}, *lm, out / "keep.txt"); }, ErrorCode::kInput),
            "save path '" + (out / "keep.txt").string() + "' exists and is not a folder; choose another --save_path");
}

// The schemes msmodelslim's ascendv1 saver has no handler for (save/ascendv1.py): per-group or
// asymmetric W4A8 (its W4A8_DYNAMIC is int4_per_channel_sym), int4 weight-only (no W4A16) and
// static fp8 activations (only WFP8AFP8_DYNAMIC).
// A plugin's saver is guarded like a processor: its exceptions become one line naming it, and a
// qpipe::Error keeps its code and message.
TEST(SaverErrors, APluginSaversExceptionsBecomeOneLineNamingIt) {
  struct Throwing final : CheckpointSaver {
    void writeLayer(int64_t, const std::string&, Module&) override { throw Error(ErrorCode::kIo, "disk full"); }
    void addFile(const std::string&, const std::string&) override {}
    void finish() override { throw std::runtime_error("the format is on fire"); }
  };
  Registry registry;
  registry.add({}, {{{nullptr, "mine", "static:mine"},
                     {.type = "throwing", .factory = [](const ConfigNode&, CausalLM&, const fs::path&) {
                        return std::make_unique<Throwing>();
                      }}}});
  auto lm = CausalLM::open(test::tinyLlama("guarded-src"));
  auto saver = registry.createSaver("throwing", ConfigNode::map(), *lm, test::testDir() / "out");
  EXPECT_EQ(test::errorOf([&] { saver->finish(); }, ErrorCode::kPlugin),
            "saver 'throwing' (plugin 'mine') failed in finish: the format is on fire");
  EXPECT_EQ(test::errorOf([&] { saver->writeLayer(0, "model.layers.0", lm->layer(0)); }, ErrorCode::kIo), "disk full");
}

TEST(SaverErrors, UnsavableSchemes) {
  const QScheme int4ChannelAsym{.dtype = QDtype::kInt4, .scope = QScope::kPerChannel, .symmetric = false};
  for (const auto& [spec, weights, activations] : std::vector<std::tuple<Spec, std::string, std::string>>{
           {{kInt4Group, kInt8Token}, "int4_per_group_sym", "int8_per_token_sym"},
           {{int4ChannelAsym, kInt8Token}, "int4_per_channel_asym", "int8_per_token_sym"},
           {{kInt4Channel, std::nullopt}, "int4_per_channel_sym", "none"},
           {{kFp8Tensor, kFp8Tensor}, "fp8_e4m3_per_tensor_sym", "fp8_e4m3_per_tensor_sym"},
       }) {
    auto lm = CausalLM::open(test::tinyLlama("unsavable-src"));
    quantize(*lm, everywhere(spec));
    const fs::path out = test::testDir() / "unsavable-out";
    fs::remove_all(out);
    auto saver = createBuiltinSaver({.format = "ascendv1_saver"}, *lm, out);
    EXPECT_EQ(test::errorOf([&] { saver->writeLayer(0, lm->layerName(0), lm->layer(0)); }, ErrorCode::kConfig),
              "ascendv1_saver: model.layers.0.self_attn.q_proj has weights " + weights + " and activations " +
                  activations +
                  "; ascendv1 defines W8A8 (int8 weights, static per_tensor int8 activations), W8A8_DYNAMIC "
                  "(per_token int8), W4A8_DYNAMIC (int4 per_channel symmetric weights, per_token int8), W8A16 and "
                  "WFP8AFP8_DYNAMIC (per_token fp8); use compressed_tensors for others");
  }
}

// ---------------------------------------------------------------------------------------------
// Loading errors: one message naming the file and the field

std::string openError(const std::function<void(Json&)>& edit) {
  auto lm = CausalLM::open(test::tinyLlama("load-src"));
  quantize(*lm, everywhere({kInt8Channel, kInt8Tensor}));
  const fs::path out = test::testDir() / "load-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out);
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
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["format"] = "mxfp6-pack-quantized"; }),
            file +
                ": quantization_config.config_groups.group_0.format \"mxfp6-pack-quantized\" is not supported; "
                "qpipe loads int-quantized, float-quantized, naive-quantized, pack-quantized, nvfp4-pack-quantized "
                "and mxfp4-pack-quantized");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["format"] = "mxfp4-pack-quantized"; }),
            file +
                ": quantization_config.config_groups.group_0.format \"mxfp4-pack-quantized\" holds mxfp4 weights, "
                "but quantization_config.config_groups.group_0.weights describes int8 weights");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"; }),
            file +
                ": quantization_config.config_groups.group_0.format \"nvfp4-pack-quantized\" holds nvfp4 weights, "
                "but quantization_config.config_groups.group_0.weights describes int8 weights");
  // MXFP4 weights relabelled with NVFP4's format: the message used to contradict itself.
  EXPECT_EQ(openError([](Json& q) {
              auto& group = q["config_groups"]["group_0"];
              group["format"] = "nvfp4-pack-quantized";
              group["weights"].update({{"num_bits", 4}, {"type", "float"}, {"strategy", "group"}, {"group_size", 32}});
            }),
            file +
                ": quantization_config.config_groups.group_0.format \"nvfp4-pack-quantized\" holds nvfp4 weights, "
                "but quantization_config.config_groups.group_0.weights describes mxfp4 weights, whose format is "
                "mxfp4-pack-quantized");
  EXPECT_EQ(openError([](Json& q) {
              q["config_groups"]["group_0"]["weights"].update(
                  {{"num_bits", 4}, {"type", "float"}, {"strategy", "group"}, {"group_size", 32}});
            }),
            file +
                ": quantization_config.config_groups.group_0.format \"int-quantized\" holds no fp4 weights, but "
                "quantization_config.config_groups.group_0.weights describes mxfp4 weights, whose format is "
                "mxfp4-pack-quantized");
  EXPECT_EQ(openError([](Json& q) {
              auto& w = q["config_groups"]["group_0"]["weights"];
              w["num_bits"] = 4;
              w["type"] = "float";
              w["strategy"] = "group";
              w["group_size"] = 16;
            }),
            file +
                ": quantization_config.config_groups.group_0.weights {\"dynamic\":false,\"group_size\":16,"
                "\"strategy\":\"group\",\"symmetric\":true} is not supported; qpipe loads nvfp4 weights as "
                "symmetric tensor_group, group_size 16, static, and mxfp4 ones as symmetric group, group_size 32, "
                "static");
  // Asymmetric fp8 is refused as the description is read, for activations as for weights: its
  // zero point was dropped, or named only as the tensors loaded.
  for (const char* args : {"weights", "input_activations"}) {
    EXPECT_EQ(openError([&](Json& q) {
                q["config_groups"]["group_0"][args].update({{"type", "float"}, {"symmetric", false}});
              }),
              file + ": quantization_config.config_groups.group_0." + args + ".symmetric is false; fp8 " +
                  (std::string(args) == "weights" ? "weights" : "activations") + " are symmetric");
  }
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
                "is not supported; qpipe loads int8, int4, fp8, nvfp4 and mxfp4 weights");
  EXPECT_EQ(openError([](Json& q) { q["config_groups"]["group_0"]["input_activations"]["dynamic"] = true; }),
            file +
                ": quantization_config.config_groups.group_0.input_activations {\"dynamic\":true,\"strategy\":"
                "\"tensor\"} is not supported; qpipe loads static per-tensor and dynamic per-token activations");
  EXPECT_EQ(openError([](Json& q) {
              q["config_groups"]["group_0"].erase("weights");
              q["config_groups"]["group_0"]["input_activations"]["dynamic"] = true;
            }),
            file +
                ": quantization_config.config_groups.group_0.input_activations {\"dynamic\":true,\"strategy\":"
                "\"tensor\",\"symmetric\":true} is not supported; qpipe loads static symmetric tensor and attn_head "
                "KV-cache schemes (config_groups.group_0 has no 'weights', so it is read as attention's Q, K and V "
                "scheme; a Linear scheme needs its 'weights')");
  EXPECT_EQ(openError([](Json& q) {
              q["kv_cache_scheme"] = {{"num_bits", 8}, {"dynamic", true}};
            }),
            file +
                ": quantization_config.kv_cache_scheme {\"dynamic\":true,\"strategy\":\"tensor\",\"symmetric\":true} "
                "is not supported; qpipe loads static symmetric tensor and attn_head KV-cache schemes");
  // A valid kv_cache_scheme whose scales the checkpoint lacks.
  EXPECT_EQ(
      openError([](Json& q) {
        q["kv_cache_scheme"] = {{"num_bits", 8}};
      }),
      "checkpoint " + (test::testDir() / "load-out").string() + ": missing tensor 'model.layers.0.self_attn.k_scale'");
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
  test::saveCheckpoint(*lm, out);
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
  test::saveCheckpoint(*lm, out, options);
  return out;
}

TEST(AscendV1Saver, QuantizedHeadOfATiedModelHasItsDescriptionAndUntiesIt) {
  auto lm = CausalLM::open(test::tinyLlama("ascend-head-src"));
  quantize(*lm, everywhere({kInt8Channel, kInt8Token}));
  quantizeHead(*lm, {kInt8Channel, kInt8Tensor});
  const at::Tensor expected = lm->forward(ids());
  const fs::path out = test::testDir() / "ascend-head-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out, {.format = "ascendv1_saver"});
  const Json description = readJson(out / "quant_model_description.json");
  for (const char* key : {".weight", ".quant_bias", ".input_scale", ".input_offset", ".deq_scale"}) {
    EXPECT_EQ(description[std::string("lm_head") + key], "W8A8") << key;
  }
  EXPECT_EQ(description["model.embed_tokens.weight"], "FLOAT");
  EXPECT_EQ(description["model_quant_type"], "W8A8");
  EXPECT_EQ(readJson(out / "config.json")["tie_word_embeddings"], false);
  const auto ckpt = safetensors::Checkpoint::open(out, "quant_model_weights");
  EXPECT_EQ(ckpt.info("lm_head.weight").dtype, "I8");
  EXPECT_EQ(ckpt.info("model.embed_tokens.weight").dtype, "F32");
  auto loaded = CausalLM::open(out);
  EXPECT_EQ(loaded->root().getSubmodule("lm_head").typeName(), "QuantLinear");
  // W8A8's weight scale comes back as deq_scale / input_scale: equal up to fp32 rounding.
  const at::Tensor logits = loaded->forward(ids());
  EXPECT_LE((logits - expected).abs().max().item<float>() / expected.abs().max().item<float>(), 1e-5);
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
  description["model.layers.0.self_attn.q_proj.weight"] = "W4A4_DYNAMIC";
  std::ofstream(out / "quant_model_description.json") << description.dump();
  EXPECT_EQ(test::errorOf([&] { CausalLM::open(out)->forward(ids()); }, ErrorCode::kInput),
            (out / "quant_model_description.json").string() +
                ": 'model.layers.0.self_attn.q_proj.weight' is W4A4_DYNAMIC; qpipe loads FLOAT, W8A8, "
                "W8A8_DYNAMIC, W4A8_DYNAMIC, W8A16 and WFP8AFP8_DYNAMIC");
}

// ---- W4A8_DYNAMIC (msmodelslim save/ascendv1.py on_w4a8_dynamic, save/utils/pack.py)

// q[n, k] = (n + k) mod 15 − 7 covers [-7, 7]; scale s[n] = (n + 1) / 8 keeps every product exact.
int64_t handQ(int64_t n, int64_t k) {
  return (n + k) % 15 - 7;
}

std::shared_ptr<QuantLinear> handW4A8(int64_t out, int64_t in) {
  const at::Tensor q = at::empty({out, in}, at::kChar);
  for (int64_t n = 0; n < out; ++n) {
    for (int64_t k = 0; k < in; ++k) q[n][k] = handQ(n, k);
  }
  const at::Tensor scale = (at::arange(1, out + 1, at::kFloat) / 8).reshape({out, 1});
  return std::make_shared<QuantLinear>(q, quant::QParams{scale, at::zeros({out, 1}, at::kInt)}, kInt4Channel,
                                       activation(kInt8Token), at::Tensor(), at::kFloat);
}

TEST(AscendV1Saver, W4A8DynamicHandCheckedLayer) {
  // q_proj [16, 16] (column-parallel: one scale_bias per row) and o_proj [16, 16] (row-parallel: one
  // per 16th of the inputs) as W4A8; the rest stays float.
  auto lm = CausalLM::open(test::tinyLlama("ascend-w4a8-hand-src"));
  test::replaceLinears(*lm, [](const std::string& name, Linear& linear) -> std::shared_ptr<Module> {
    if (name.find("q_proj") == std::string::npos && name.find("o_proj") == std::string::npos) return nullptr;
    return handW4A8(linear.outFeatures(), linear.inFeatures());
  });
  const at::Tensor expected = lm->forward(ids());
  const fs::path out = test::testDir() / "ascend-w4a8-hand-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out, {.format = "ascendv1_saver"});

  const Json description = readJson(out / "quant_model_description.json");
  const auto ckpt = safetensors::Checkpoint::open(out, "quant_model_weights");
  for (const std::string p : {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"}) {
    for (const char* key : {".weight", ".weight_scale", ".weight_offset", ".scale_bias"}) {
      EXPECT_EQ(description[p + key], "W4A8_DYNAMIC") << p << key;
    }
    EXPECT_FALSE(description.contains(p + ".bias"));
    EXPECT_EQ(ckpt.info(p + ".weight").dtype, "I8");
    EXPECT_EQ(ckpt.info(p + ".weight").shape, (std::vector<int64_t>{8, 16}));
    for (const char* key : {".weight_scale", ".weight_offset", ".scale_bias"}) {
      EXPECT_EQ(ckpt.info(p + key).dtype, "F32") << p << key;
    }
    EXPECT_EQ(ckpt.info(p + ".weight_scale").shape, (std::vector<int64_t>{16, 1}));
    EXPECT_EQ(ckpt.info(p + ".weight_offset").shape, (std::vector<int64_t>{16, 1}));
    EXPECT_TRUE(at::equal(ckpt.tensor(p + ".weight_scale"), (at::arange(1, 17, at::kFloat) / 8).reshape({16, 1})));
    EXPECT_TRUE(at::equal(ckpt.tensor(p + ".weight_offset"), at::zeros({16, 1})));

    // Two rows per byte along the outputs: row 2j in the low nibble, 2j+1 in the high one.
    const at::Tensor packed = ckpt.tensor(p + ".weight");
    EXPECT_EQ(packed[0][0].item<int8_t>(), static_cast<int8_t>(0xA9));  // q[0][0] = -7 → 9, q[1][0] = -6 → A
    EXPECT_EQ(packed[0][1].item<int8_t>(), static_cast<int8_t>(0xBA));  // -6 → A, -5 → B
    EXPECT_EQ(packed[3][7].item<int8_t>(), 0x76);                       // q[6][7] = 6, q[7][7] = 7
    EXPECT_EQ(packed[4][0].item<int8_t>(), 0x21);                       // q[8][0] = 1, q[9][0] = 2
    for (int64_t j = 0; j < 8; ++j) {
      for (int64_t k = 0; k < 16; ++k) {
        const int64_t byte = (handQ(2 * j + 1, k) & 0xF) << 4 | (handQ(2 * j, k) & 0xF);
        EXPECT_EQ(packed[j][k].item<int8_t>(), byte > 127 ? byte - 256 : byte) << p << " [" << j << ", " << k << "]";
      }
    }
  }
  // scale_bias = 8 · s[n] · Σ_k q[n][k]: row 0 sums -7..7 and -7 (k = 15), row 1 -6..7, -7, -6.
  const at::Tensor column = ckpt.tensor("model.layers.0.self_attn.q_proj.scale_bias");
  EXPECT_EQ(ckpt.info("model.layers.0.self_attn.q_proj.scale_bias").shape, (std::vector<int64_t>{16, 1}));
  EXPECT_EQ(column[0][0].item<float>(), 8 * 0.125f * -7);
  EXPECT_EQ(column[1][0].item<float>(), 8 * 0.25f * -6);
  for (int64_t n = 0; n < 16; ++n) {
    int64_t sum = 0;
    for (int64_t k = 0; k < 16; ++k) sum += handQ(n, k);
    EXPECT_FLOAT_EQ(column[n][0].item<float>(), 8.0f * (n + 1) / 8 * sum) << n;
  }
  // Row-parallel: 16 chunks of 16 / 16 = 1 input, so column t is 8 · s[n] · q[n][t].
  const at::Tensor row = ckpt.tensor("model.layers.1.self_attn.o_proj.scale_bias");
  EXPECT_EQ(ckpt.info("model.layers.1.self_attn.o_proj.scale_bias").shape, (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(row[0][0].item<float>(), 8 * 0.125f * -7);
  EXPECT_EQ(row[1][15].item<float>(), 8 * 0.25f * -6);  // q[1][15] = 16 mod 15 − 7
  for (int64_t n = 0; n < 16; ++n) {
    for (int64_t t = 0; t < 16; ++t) EXPECT_FLOAT_EQ(row[n][t].item<float>(), 8.0f * (n + 1) / 8 * handQ(n, t));
  }

  // W4A8_DYNAMIC never becomes model_quant_type (msmodelslim leaves it out of QUANT_TYPE_PRIORITY):
  // the float linears make it FLOAT.
  EXPECT_EQ(description["model_quant_type"], "FLOAT");
  EXPECT_EQ(description["group_size"], 0);  // vllm-ascend reads 0 as per-channel W4A8
  EXPECT_EQ(description["version"], "1.0.0");
  EXPECT_EQ(description["model.layers.0.mlp.down_proj.weight"], "FLOAT");

  // Reloaded: the same int4 values and scales, so the same logits bit for bit.
  auto loaded = CausalLM::open(out);
  auto& linear = dynamic_cast<QuantLinear&>(loaded->layer(1).getSubmodule("self_attn.o_proj"));
  EXPECT_EQ(linear.weightScheme().name(), "int4_per_channel_sym");
  EXPECT_EQ(linear.inputQuant()->scheme.name(), "int8_per_token_sym");
  EXPECT_EQ(linear.parameter("weight")[9][0].item<int8_t>(), handQ(9, 0));
  EXPECT_TRUE(at::equal(loaded->forward(ids()), expected));
}

TEST(AscendV1Saver, W4A8DynamicRoundTripBitForBit) {
  // Tiny Qwen3: every width is a multiple of 16, so every projection can be W4A8 (untied lm_head).
  auto lm = CausalLM::open(test::tinyQwen3("ascend-w4a8-src"));
  quantize(*lm, everywhere({kInt4Channel, kInt8Token}));
  const at::Tensor expected = lm->forward(ids());
  const fs::path out = test::testDir() / "ascend-w4a8-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out, {.format = "ascendv1_saver"});
  EXPECT_TRUE(at::equal(CausalLM::open(out)->forward(ids()), expected));
  const Json description = readJson(out / "quant_model_description.json");
  EXPECT_EQ(description["model.layers.1.mlp.down_proj.scale_bias"], "W4A8_DYNAMIC");
  EXPECT_EQ(description["lm_head.weight"], "FLOAT");
  EXPECT_EQ(description["model_quant_type"], "FLOAT");
  const auto ckpt = safetensors::Checkpoint::open(out, "quant_model_weights");
  EXPECT_EQ(ckpt.info("model.layers.1.mlp.down_proj.weight").shape,
            (std::vector<int64_t>{test::kTinyQwen3Hidden / 2, test::kTinyQwen3Inter}));
  EXPECT_EQ(ckpt.info("model.layers.1.mlp.down_proj.scale_bias").shape,
            (std::vector<int64_t>{test::kTinyQwen3Hidden, 16}));
  EXPECT_EQ(ckpt.info("model.layers.1.mlp.gate_proj.scale_bias").shape,
            (std::vector<int64_t>{test::kTinyQwen3Inter, 1}));
  // Each row-parallel chunk sum adds up to the row's total (8 · Σ_k dequantized W).
  auto& down = dynamic_cast<QuantLinear&>(lm->layer(1).getSubmodule("mlp.down_proj"));
  const at::Tensor total = 8 * (down.parameter("weight").to(at::kFloat) * down.parameter("weight_scale")).sum(1);
  EXPECT_TRUE(at::allclose(ckpt.tensor("model.layers.1.mlp.down_proj.scale_bias").sum(1), total, 1e-4, 1e-4));

  // Mixed with another type on the tiny Llama (down_proj's 24 inputs cannot be W4A8, below):
  // model_quant_type is the other type's.
  at::Tensor mixedExpected;
  const fs::path mixed = saveAscend(
      "ascend-w4a8-mixed",
      [](const std::string& name) -> std::optional<Spec> {
        if (name.find("down_proj") != std::string::npos) return Spec{kInt8Channel, kInt8Token};
        return Spec{kInt4Channel, kInt8Token};
      },
      &mixedExpected);
  EXPECT_TRUE(at::equal(CausalLM::open(mixed)->forward(ids()), mixedExpected));
  EXPECT_EQ(readJson(mixed / "quant_model_description.json")["model_quant_type"], "W8A8_DYNAMIC");
}

TEST(AscendV1Saver, W4A8DynamicShapeRefusals) {
  // down_proj has 24 inputs: not 16 tensor-parallel chunks.
  auto lm = CausalLM::open(test::tinyLlama("ascend-w4a8-refuse-src"));
  quantize(*lm, everywhere({kInt4Channel, kInt8Token}));
  const fs::path out = test::testDir() / "ascend-w4a8-refuse-out";
  fs::remove_all(out);
  auto saver = createBuiltinSaver({.format = "ascendv1_saver"}, *lm, out);
  EXPECT_EQ(test::errorOf([&] { saver->writeLayer(0, lm->layerName(0), lm->layer(0)); }, ErrorCode::kConfig),
            "ascendv1_saver: model.layers.0.mlp.down_proj has 24 input features; W4A8_DYNAMIC's scale_bias of a "
            "row-parallel projection sums them in 16 tensor-parallel chunks, so the count must be a multiple of 16; "
            "exclude the module or use compressed_tensors");

  // An odd number of outputs cannot be packed two rows per byte.
  auto odd = CausalLM::open(test::tinyLlama("ascend-w4a8-odd-src"));
  test::replaceLinears(*odd, [](const std::string& name, Linear&) -> std::shared_ptr<Module> {
    return name == "model.layers.0.self_attn.q_proj" ? handW4A8(15, 16) : nullptr;
  });
  const fs::path oddOut = test::testDir() / "ascend-w4a8-odd-out";
  fs::remove_all(oddOut);
  auto oddSaver = createBuiltinSaver({.format = "ascendv1_saver"}, *odd, oddOut);
  EXPECT_EQ(test::errorOf([&] { oddSaver->writeLayer(0, odd->layerName(0), odd->layer(0)); }, ErrorCode::kConfig),
            "ascendv1_saver: model.layers.0.self_attn.q_proj has 15 output features; W4A8_DYNAMIC packs two int4 "
            "rows into one int8 row, so the count must be even; exclude the module or use compressed_tensors");
}

TEST(AscendV1Saver, W4A8DynamicTwoLevelPerGroupIsRefusedAtLoad) {
  auto lm = CausalLM::open(test::tinyQwen3("ascend-w4a8-second-src"));
  quantize(*lm, everywhere({kInt4Channel, kInt8Token}));
  const fs::path out = test::testDir() / "ascend-w4a8-second-out";
  fs::remove_all(out);
  test::saveCheckpoint(*lm, out, {.format = "ascendv1_saver"});
  // The older two-level layout adds weight_scale_second [out, in / group] to a W4A8 module.
  std::map<std::string, at::Tensor> tensors;
  {
    const auto ckpt = safetensors::Checkpoint::open(out, "quant_model_weights");
    for (const auto& name : ckpt.names()) tensors[name] = ckpt.tensor(name).clone();
  }
  fs::remove(out / "quant_model_weights.safetensors");
  safetensors::Writer writer(out, {.filePrefix = "quant_model_weights"});
  for (const auto& [name, tensor] : tensors) writer.add(name, tensor);
  writer.add("model.layers.0.self_attn.q_proj.weight_scale_second", at::ones({256, 1}));
  writer.finish();
  EXPECT_EQ(test::errorOf([&] { CausalLM::open(out)->forward(ids()); }, ErrorCode::kInput),
            "checkpoint " + out.string() +
                ": 'model.layers.0.self_attn.q_proj.weight_scale_second' is a two-level per-group W4A8_DYNAMIC "
                "weight; qpipe loads per-channel W4A8_DYNAMIC");
}

}  // namespace
}  // namespace qpipe
