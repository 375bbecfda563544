// ascendv1_saver: msmodelslim's layout (save/ascendv1.py; docs/formats.md):
// quant_model_weights*.safetensors + quant_model_description.json mapping every tensor to its
// quantization type, config.json without quantization_config.
#include <ATen/ATen.h>

#include <array>
#include <map>
#include <utility>

#include "qpipe/error.h"
#include "qpipe/quantized_checkpoint.h"
#include "saver_internal.h"

namespace qpipe::detail {

namespace {

namespace fs = std::filesystem;
using quant::QDtype;
using quant::QScope;

// msmodelslim's AscendV1Saver.QUANT_TYPE_PRIORITY, restricted to the types qpipe writes: the
// model's type is the one latest in this list (lower bits win; W8A8 over the dynamic types).
// W4A8_DYNAMIC is deliberately absent, as in msmodelslim: it never becomes model_quant_type.
// msmodelslim's initial model_quant_type, kept when nothing is written.
constexpr const char* kUnknownType = "Unknown";
constexpr std::array<std::string_view, 5> kTypePriority{"FLOAT", "W8A16", "W8A8_DYNAMIC", "W8A8", "WFP8AFP8_DYNAMIC"};

// msmodelslim's process_scale (save/utils/pack.py) tells the W4A8 scale_bias layouts apart by
// module name: row-parallel projections keep one sum per tensor-parallel chunk of their inputs.
constexpr std::array<std::string_view, 5> kColumnParallel{"up_proj", "gate_proj", "q_proj", "k_proj", "v_proj"};
constexpr std::array<std::string_view, 2> kRowParallel{"down_proj", "o_proj"};
// process_scale's tp_num, fixed at 16 by msmodelslim; vllm-ascend sums the chunks of its rank.
constexpr int64_t kScaleBiasChunks = 16;

bool containsAny(const std::string& name, const auto& parts) {
  for (std::string_view part : parts) {
    if (name.find(part) != std::string::npos) return true;
  }
  return false;
}

int priority(std::string_view type) {
  for (size_t i = 0; i < kTypePriority.size(); ++i) {
    if (kTypePriority[i] == type) return static_cast<int>(i);
  }
  return -1;
}

// The ascendv1 type of a Linear of these schemes (`input` none: weight-only), or "" where ascendv1
// defines none.
std::string linearType(const quant::QScheme& w, const std::optional<quant::QScheme>& input) {
  const bool channelLike = w.scope == QScope::kPerTensor || w.scope == QScope::kPerChannel;
  if (w.dtype == QDtype::kInt8 && !input && (channelLike || w.scope == QScope::kPerGroup)) return "W8A16";
  if (w.dtype == QDtype::kInt8 && w.symmetric && input && input->dtype == QDtype::kInt8) {
    const bool dynamic = quant::isDynamic(*input);
    if (!dynamic && input->scope == QScope::kPerTensor && channelLike) return "W8A8";
    if (dynamic && input->symmetric && (channelLike || w.scope == QScope::kPerGroup)) return "W8A8_DYNAMIC";
  }
  if (w.dtype == QDtype::kInt4 && w.symmetric && channelLike && input && quant::isDynamic(*input) &&
      input->dtype == QDtype::kInt8 && input->symmetric) {
    return "W4A8_DYNAMIC";
  }
  if (w.dtype == QDtype::kFp8E4m3 && channelLike && input && quant::isDynamic(*input) &&
      input->dtype == QDtype::kFp8E4m3) {
    return "WFP8AFP8_DYNAMIC";
  }
  return "";
}

// What a Linear that linearType() has no type for holds, and the types ascendv1 defines.
std::string unsupportedLinear(const quant::QScheme& w, const std::optional<quant::QScheme>& input) {
  return concat("weights ", w.name(), " and activations ", input ? input->name() : "none",
                "; ascendv1 defines W8A8 (int8 weights, static per_tensor int8 activations), W8A8_DYNAMIC "
                "(per_token int8), W4A8_DYNAMIC (int4 per_channel symmetric weights, per_token int8), W8A16 and "
                "WFP8AFP8_DYNAMIC (per_token fp8); use compressed_tensors for others");
}

// Error(kConfig) for an attention input, `hook`, that ascendv1 cannot hold at all.
void checkAscendV1Hook(const quant::QScheme& scheme, const std::string& hook) {
  QPIPE_REQUIRE(!quant::isDynamic(scheme), ErrorCode::kConfig, "ascendv1_saver: ", hook,
                " is per_token (dynamic); ascendv1's FAQuant and C8 entries hold static scales: use per_head or "
                "per_tensor");
}

class AscendV1Saver final : public SaverBase {
 public:
  AscendV1Saver(const SaverOptions& options, CausalLM& model, const fs::path& saveDir)
      : SaverBase(options, model, saveDir, kAscendWeightsPrefix) {}

 protected:
  // msmodelslim writes lm_head.weight even when it is tied (a clone of the embedding).
  bool skipsTiedHead() const override { return false; }

  void noteFloatLinear(const std::string&) override { noteType("FLOAT"); }

  void writeFloat(const std::string& name, const at::Tensor& tensor) override {
    notes_.description[name] = "FLOAT";
    SaverBase::writeFloat(name, tensor);
  }

  void writeQuantLinear(const std::string& name, QuantLinear& linear) override {
    const quant::QScheme& w = linear.weightScheme();
    const std::optional<ActivationQuant> input = writtenInputQuant(linear);
    const std::optional<quant::QScheme> inputScheme = input ? std::optional(input->scheme) : std::nullopt;
    const std::string type = linearType(w, inputScheme);
    QPIPE_REQUIRE(!type.empty(), ErrorCode::kConfig, "ascendv1_saver: ", name, " has ",
                  unsupportedLinear(w, inputScheme));
    noteType(type);
    const at::Tensor q = linear.parameter("weight");
    const int64_t out = q.size(0);
    // Per-channel keeps [out, 1]; a per-tensor weight scale is spread over the channels, which
    // is the same dequantization in the per-channel layout the types define.
    const auto perChannel = [&](const at::Tensor& t) {
      return w.scope == QScope::kPerTensor ? t.to(at::kFloat).reshape({1, 1}).expand({out, 1}).contiguous()
                                           : t.to(at::kFloat);
    };
    const at::Tensor scale = perChannel(linear.parameter("weight_scale"));
    const auto tensor = [&](const std::string& suffix, const at::Tensor& value) {
      notes_.description[name + suffix] = type;
      add(name + suffix, value);
    };
    if (type == "W8A8") {
      const at::Tensor inputScale = linear.parameter("input_scale").to(at::kFloat).reshape({1});
      const at::Tensor inputOffset = input->scheme.symmetric
                                         ? at::zeros({1}, inputScale.options())
                                         : linear.parameter("input_zero_point").to(at::kFloat).reshape({1});
      const at::Tensor deqScale = (inputScale * scale).reshape({out});
      const at::Tensor bias =
          linear.hasParameter("bias") ? linear.parameter("bias").to(at::kFloat) : at::zeros({out}, scale.options());
      // The kernel computes (x_q·W_q + quant_bias)·deq_scale with x_q offset by input_offset.
      const at::Tensor correction = q.to(at::kFloat).sum(1) * inputOffset;
      const at::Tensor quantBias = at::round(bias / deqScale - correction).to(at::kInt);
      const bool bf16 = model().config().checkpointDtype == at::kBFloat16;
      tensor(".weight", q);
      tensor(".quant_bias", quantBias);
      tensor(".input_scale", inputScale);
      tensor(".input_offset", inputOffset);
      tensor(".deq_scale", bf16 ? deqScale : deqScaleToInt64(deqScale));
    } else if (type == "W4A8_DYNAMIC") {
      const int64_t in = q.size(1);
      QPIPE_REQUIRE(out % 2 == 0, ErrorCode::kConfig, "ascendv1_saver: ", name, " has ", out,
                    " output features; W4A8_DYNAMIC packs two int4 rows into one int8 row, so the count must be "
                    "even; exclude the module or use compressed_tensors");
      // The NPU kernel adds scale_bias = 8·Σ_k W_q[n,k]·s[n] (msmodelslim on_w4a8_dynamic).
      const at::Tensor deq = q.to(at::kFloat) * scale;
      at::Tensor scaleBias;
      if (!containsAny(name, kColumnParallel) && containsAny(name, kRowParallel)) {
        QPIPE_REQUIRE(in % kScaleBiasChunks == 0, ErrorCode::kConfig, "ascendv1_saver: ", name, " has ", in,
                      " input features; W4A8_DYNAMIC's scale_bias of a row-parallel projection sums them in ",
                      kScaleBiasChunks, " tensor-parallel chunks, so the count must be a multiple of ",
                      kScaleBiasChunks, "; exclude the module or use compressed_tensors");
        scaleBias = (deq.reshape({out * kScaleBiasChunks, in / kScaleBiasChunks}).sum(1, true) * 8)
                        .reshape({out, kScaleBiasChunks});
      } else {
        scaleBias = deq.sum(1, true) * 8;
      }
      tensor(".weight", packInt4Rows(q));
      tensor(".weight_scale", scale);
      tensor(".weight_offset", at::zeros_like(scale));
      tensor(".scale_bias", scaleBias);
    } else {
      tensor(".weight", q);
      tensor(".weight_scale", scale);
      const at::Tensor offset = w.symmetric ? at::zeros_like(scale) : perChannel(linear.parameter("weight_zero_point"));
      tensor(".weight_offset", offset);
    }
    if (w.scope == QScope::kPerGroup) notes_.groupSize = w.groupSize;
    if (linear.hasParameter("bias")) {
      notes_.description[name + ".bias"] = "FLOAT";
      add(name + ".bias", linear.parameter("bias").to(at::kFloat));
    }
  }

  // Q, K and V quantized: msmodelslim's FAQuant entries (on_activation_per_head),
  // `<attention>.fa_q|fa_k|fa_v.scale` fp32 [heads, 1] and `.offset` [heads, 1] (int8 zero points
  // for int8, fp32 zeros for fp8), with fa_quant_type "FAKQuant". K and V alone: the C8 KV cache
  // (on_dynamic_cache), `<attention>.k_proj|v_proj.kv_cache_scale` / `kv_cache_offset` fp32
  // [kv_heads · head_dim], one value per channel, with kv_cache_type / kv_quant_type "C8".
  void writeAttentionQuant(const std::string& attention, const AttentionInputs& inputs) override {
    for (const auto& [quant, input] : {std::pair{inputs.q, 'q'}, {inputs.k, 'k'}, {inputs.v, 'v'}}) {
      if (quant != nullptr) checkAscendV1Hook(quant->scheme(), concat(attention, ".", input, "_hook"));
    }
    QPIPE_REQUIRE(inputs.k && inputs.v, ErrorCode::kConfig, "ascendv1_saver: ", attention, " has ",
                  missingKvText(inputs), "; ascendv1 quantizes K and V together (C8), or Q, K and V (FAQuant)");
    const ModelConfig& config = model().config();
    if (inputs.q != nullptr) {
      writeFaQuant(attention + ".fa_q", *inputs.q, config.numHeads);
      writeFaQuant(attention + ".fa_k", *inputs.k, config.numKvHeads);
      writeFaQuant(attention + ".fa_v", *inputs.v, config.numKvHeads);
      notes_.extra["fa_quant_type"] = "FAKQuant";
      return;
    }
    for (const auto& [quant, hook] : {std::pair{inputs.k, "k_hook"}, {inputs.v, "v_hook"}}) {
      QPIPE_REQUIRE(quant->scheme().dtype == QDtype::kInt8, ErrorCode::kConfig, "ascendv1_saver: ", attention, ".",
                    hook, " is ", quant->scheme().name(),
                    "; ascendv1's C8 KV cache is int8 (fp8 K and V only with Q, as FAQuant): use int8, or "
                    "compressed_tensors for an fp8 KV cache");
    }
    writeC8(attention + ".k_proj", *inputs.k, config.numKvHeads, config.headDim);
    writeC8(attention + ".v_proj", *inputs.v, config.numKvHeads, config.headDim);
    notes_.extra["kv_cache_type"] = "C8";
    notes_.extra["kv_quant_type"] = "C8";
  }

  std::string takeNotes() override {
    const nlohmann::ordered_json notes = {{"description", notes_.description},
                                          {"extra", notes_.extra},
                                          {"type", notes_.modelType},
                                          {"group_size", notes_.groupSize}};
    notes_ = {};
    return notes.dump();
  }

  void mergeNotes(const std::string& text) override {
    const nlohmann::ordered_json notes = nlohmann::ordered_json::parse(text);
    for (const auto& [name, type] : notes["description"].items()) notes_.description[name] = type;
    for (const auto& [key, value] : notes["extra"].items()) notes_.extra[key] = value.get<std::string>();
    noteType(notes["type"].get<std::string>());
    if (const int64_t size = notes["group_size"].get<int64_t>(); size != 0) notes_.groupSize = size;
  }

  void writeMetadata(const fs::path& dir) override {
    nlohmann::ordered_json description = notes_.description;
    for (const auto& [key, value] : notes_.extra) description[key] = value;
    description["version"] = "1.0.0";
    description["model_quant_type"] = notes_.modelType;
    description["metadata"] = nlohmann::ordered_json::object();
    description["group_size"] = notes_.groupSize;
    description["optional"] = nlohmann::ordered_json::object();
    writeJson(dir / kAscendDescription, description);
    // A leftover quantization_config makes vllm-ascend misread the checkpoint (msmodelslim
    // remove_quantization_config).
    nlohmann::ordered_json config = sourceConfig();
    config.erase("quantization_config");
    if (config.contains("text_config") && config["text_config"].is_object()) {
      config["text_config"].erase("quantization_config");
    }
    writeJson(dir / "config.json", config);
  }

 private:
  // An input's scale and zero point, one per head: [heads] (a per_tensor value repeated).
  static std::pair<at::Tensor, at::Tensor> perHead(AttentionQuant& quant, int64_t heads) {
    const quant::QParams p = quant.params();
    return {p.scale.to(at::kFloat).reshape({-1}).expand({heads}).contiguous(),
            p.zeroPoint.reshape({-1}).expand({heads}).contiguous()};
  }

  void writeFaQuant(const std::string& prefix, AttentionQuant& quant, int64_t heads) {
    const auto [scale, zeroPoint] = perHead(quant, heads);
    const bool int8 = quant.scheme().dtype == QDtype::kInt8;
    notes_.description[prefix + ".scale"] = "FAQuant";
    notes_.description[prefix + ".offset"] = "FAQuant";
    add(prefix + ".scale", scale.reshape({heads, 1}));
    add(prefix + ".offset", (int8 ? zeroPoint.to(at::kChar) : zeroPoint.to(at::kFloat)).reshape({heads, 1}));
  }

  void writeC8(const std::string& projection, AttentionQuant& quant, int64_t heads, int64_t headDim) {
    const auto [scale, zeroPoint] = perHead(quant, heads);
    notes_.description[projection + ".kv_cache_scale"] = "C8";
    notes_.description[projection + ".kv_cache_offset"] = "C8";
    add(projection + ".kv_cache_scale", scale.repeat_interleave(headDim));
    add(projection + ".kv_cache_offset", zeroPoint.to(at::kFloat).repeat_interleave(headDim));
  }

  void noteType(std::string_view type) {
    if (priority(type) > priority(notes_.modelType)) notes_.modelType = type;
  }

  // What the hooks noted for the description (takeNotes hands it on and starts afresh).
  struct Notes {
    nlohmann::ordered_json description = nlohmann::ordered_json::object();
    std::map<std::string, std::string> extra;  // fa_quant_type, kv_cache_type, kv_quant_type
    std::string modelType = kUnknownType;
    int64_t groupSize = 0;
  };
  Notes notes_;
};

}  // namespace

void checkAscendV1Planned(const PlannedOutputs& planned) {
  for (const PlannedOutputs::Linear& linear : planned.linears) {
    QPIPE_REQUIRE(!linearType(linear.weight, linear.input).empty(), ErrorCode::kConfig,
                  "ascendv1_saver: its Linear modules would have ", unsupportedLinear(linear.weight, linear.input));
  }
  for (const PlannedOutputs::Attention& attention : planned.attention) {
    for (const auto& [scheme, input] : {std::pair{attention.q, 'q'}, {attention.k, 'k'}, {attention.v, 'v'}}) {
      if (scheme) checkAscendV1Hook(*scheme, concat("its ", input, "_hook"));
    }
  }
}

std::unique_ptr<CheckpointSaver> makeAscendV1Saver(const SaverOptions& options, CausalLM& model,
                                                   const fs::path& saveDir) {
  return std::make_unique<AscendV1Saver>(options, model, saveDir);
}

}  // namespace qpipe::detail
