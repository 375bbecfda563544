// ascendv1_saver: msmodelslim's layout (save/ascendv1.py; docs/formats.md):
// quant_model_weights*.safetensors + quant_model_description.json mapping every tensor to its
// quantization type, config.json without quantization_config.
#include <ATen/ATen.h>

#include <array>

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

class AscendV1Saver final : public SaverBase {
 public:
  AscendV1Saver(const SaverOptions& options, CausalLM& model, const fs::path& saveDir)
      : SaverBase(options, model, saveDir, kAscendWeightsPrefix), description_(nlohmann::ordered_json::object()) {}

 protected:
  // msmodelslim writes lm_head.weight even when it is tied (a clone of the embedding).
  bool skipsTiedHead() const override { return false; }

  void noteFloatLinear(const std::string&) override { noteType("FLOAT"); }

  void writeFloat(const std::string& name, const at::Tensor& tensor) override {
    description_[name] = "FLOAT";
    SaverBase::writeFloat(name, tensor);
  }

  void writeQuantLinear(const std::string& name, QuantLinear& linear) override {
    const quant::QScheme& w = linear.weightScheme();
    const std::optional<ActivationQuant> input = writtenInputQuant(linear);
    const std::string type = typeOf(name, w, input);
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
      description_[name + suffix] = type;
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
    if (w.scope == QScope::kPerGroup) groupSize_ = w.groupSize;
    if (linear.hasParameter("bias")) {
      description_[name + ".bias"] = "FLOAT";
      add(name + ".bias", linear.parameter("bias").to(at::kFloat));
    }
  }

  void writeMetadata(const fs::path& dir) override {
    nlohmann::ordered_json description = description_;
    description["version"] = "1.0.0";
    description["model_quant_type"] = modelType_;
    description["metadata"] = nlohmann::ordered_json::object();
    description["group_size"] = groupSize_;
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
  static std::string typeOf(const std::string& name, const quant::QScheme& w,
                            const std::optional<ActivationQuant>& input) {
    const bool channelLike = w.scope == QScope::kPerTensor || w.scope == QScope::kPerChannel;
    if (w.dtype == QDtype::kInt8 && !input && (channelLike || w.scope == QScope::kPerGroup)) return "W8A16";
    if (w.dtype == QDtype::kInt8 && w.symmetric && input && input->scheme.dtype == QDtype::kInt8) {
      if (!input->isDynamic() && input->scheme.scope == QScope::kPerTensor && channelLike) return "W8A8";
      if (input->isDynamic() && input->scheme.symmetric && (channelLike || w.scope == QScope::kPerGroup)) {
        return "W8A8_DYNAMIC";
      }
    }
    if (w.dtype == QDtype::kInt4 && w.symmetric && channelLike && input && input->isDynamic() &&
        input->scheme.dtype == QDtype::kInt8 && input->scheme.symmetric) {
      return "W4A8_DYNAMIC";
    }
    if (w.dtype == QDtype::kFp8E4m3 && channelLike && input && input->isDynamic() &&
        input->scheme.dtype == QDtype::kFp8E4m3) {
      return "WFP8AFP8_DYNAMIC";
    }
    const std::string activation = input ? input->scheme.name() : "none";
    QPIPE_REQUIRE(false, ErrorCode::kConfig, "ascendv1_saver: ", name, " has weights ", w.name(), " and activations ",
                  activation,
                  "; ascendv1 defines W8A8 (int8 weights, static per_tensor int8 activations), W8A8_DYNAMIC "
                  "(per_token int8), W4A8_DYNAMIC (int4 per_channel symmetric weights, per_token int8), W8A16 and "
                  "WFP8AFP8_DYNAMIC (per_token fp8); use compressed_tensors for others");
    return {};
  }

  void noteType(std::string_view type) {
    if (priority(type) > priority(modelType_)) modelType_ = type;
  }

  nlohmann::ordered_json description_;
  std::string modelType_ = "Unknown";  // msmodelslim's initial value, kept when nothing is written
  int64_t groupSize_ = 0;
};

}  // namespace

std::unique_ptr<CheckpointSaver> makeAscendV1Saver(const SaverOptions& options, CausalLM& model,
                                                   const fs::path& saveDir) {
  return std::make_unique<AscendV1Saver>(options, model, saveDir);
}

}  // namespace qpipe::detail
