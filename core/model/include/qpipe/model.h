// Causal language models in LibTorch, loaded from HF checkpoints (config.json + safetensors):
// Llama (incl. SmolLM2 and Llama-3 rope scaling), Qwen2 (qkv bias), Qwen3 (q/k norm) and
// Qwen3-MoE. Module names equal HF's, so include/exclude patterns and saved keys line up.
//
// Decoder layers are materialised on demand from the mapped checkpoint and can be released, so
// a model never has to be whole in memory. Weights whose dtype is the compute dtype stay
// zero-copy views of the mapped files.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "qpipe/module.h"
#include "qpipe/safetensors.h"
#include "qpipe/subgraph.h"

namespace qpipe {

namespace detail {
class QuantizedCheckpoint;
}

struct RopeConfig {
  double theta = 10000.0;
  std::string type = "default";  // default | llama3
  double factor = 1.0;           // llama3 scaling
  double lowFreqFactor = 1.0;
  double highFreqFactor = 4.0;
  int64_t originalMaxPositions = 8192;
};

struct ModelConfig {
  std::string modelType;  // llama | qwen2 | qwen3 | qwen3_moe
  int64_t vocabSize = 0;
  int64_t hiddenSize = 0;
  int64_t intermediateSize = 0;
  int64_t numLayers = 0;
  int64_t numHeads = 0;
  int64_t numKvHeads = 0;
  int64_t headDim = 0;
  double rmsNormEps = 1e-6;
  RopeConfig rope;
  bool tieWordEmbeddings = false;
  bool attentionBias = false;  // q/k/v projections (always true for qwen2)
  bool mlpBias = false;
  bool qkNorm = false;  // qwen3, qwen3_moe
  // Mixture of experts (qwen3_moe)
  int64_t numExperts = 0;
  int64_t expertsPerToken = 0;
  int64_t moeIntermediateSize = 0;
  bool normTopkProb = false;
  int64_t decoderSparseStep = 1;
  std::vector<int64_t> mlpOnlyLayers;
  at::ScalarType checkpointDtype = at::kFloat;

  // Reads config.json (both the rope_theta/rope_scaling and the rope_parameters forms).
  // Unsupported model types and missing fields are Error(kInput) naming the file and field.
  static ModelConfig fromFile(const std::filesystem::path& configJson);
  bool isMoeLayer(int64_t layer) const;
};

// cos and sin of rotary position embedding, [batch, seq, headDim], in the compute dtype.
struct Rotary {
  at::Tensor cos;
  at::Tensor sin;
};

class DecoderLayer : public Module {
 public:
  // `family`: the config.json model_type the layer implements.
  explicit DecoderLayer(std::string family) : Module("DecoderLayer"), family_(std::move(family)) {}
  // hidden [batch, seq, hidden]; mask: additive [batch, 1, seq, seq], or undefined for causal.
  virtual at::Tensor forward(const at::Tensor& hidden, const Rotary& rotary, const at::Tensor& mask) = 0;
  // True when every input runs through the same modules in the same order (no routing), so the
  // calibration forward can run staged (qpipe/staged.h).
  virtual bool uniformForward() const { return false; }
  const std::string& family() const { return family_; }
  // The smoothing subgraphs the family declares for this layer (qpipe/subgraph.h), in forward
  // order; empty when it declares none.
  virtual std::vector<Subgraph> subgraphs() const { return {}; }
  using Module::forward;

 private:
  std::string family_;
};

// True when no element of a floating-point tensor is NaN or ±Inf (any float dtype, the fp8 ones
// included, which LibTorch's isfinite does not take).
bool allFinite(const at::Tensor& tensor);

struct ModelOptions {
  at::ScalarType dtype = at::kFloat;  // compute dtype
  at::Device device = at::kCPU;
  // Every floating-point tensor read from the checkpoint is checked for NaN and Inf as it is read
  // (Error(kInput) naming it), and the savers check what they write; false skips both.
  bool checkFinite = true;
  // The forward only infers (qpipe eval): every QuantLinear loaded from a quantized checkpoint is
  // QuantLinear::setInferenceOnly() (W4A4 NVFP4 then runs Fp4Linear where the CPU runs it). Off
  // where the forward calibrates (qpipe quant of a quantized checkpoint), so that what it writes
  // does not depend on the CPU.
  bool inferenceOnly = false;
};

class CausalLM {
 public:
  // Maps the checkpoint and builds the non-layer parts (embeddings, final norm, lm_head).
  // A quantized checkpoint (compressed-tensors quantization_config, or msmodelslim's
  // quant_model_description.json; docs/formats.md) loads its quantized linears as QuantLinear.
  static std::unique_ptr<CausalLM> open(const std::filesystem::path& modelDir, ModelOptions options = {});

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  // The checkpoint directory the model was opened from, and its tensors.
  const std::filesystem::path& directory() const { return dir_; }
  const safetensors::Checkpoint& checkpoint() const { return checkpoint_; }
  // The root module: children "model" (embed_tokens, layers, norm) and "lm_head".
  Module& root() { return *root_; }
  std::string layerName(int64_t index) const { return "model.layers." + std::to_string(index); }

  // Loads decoder layer `index` from the checkpoint if it is not loaded, and returns it.
  DecoderLayer& layer(int64_t index);
  bool isLoaded(int64_t index) const;
  // A new instance of decoder layer `index` from the checkpoint, not part of the model: the float
  // reference of a layer that processors are changing.
  std::shared_ptr<DecoderLayer> loadLayerCopy(int64_t index);
  // Frees the layer's tensors; layer(index) loads it again. Returns their size in the checkpoint.
  uint64_t releaseLayer(int64_t index);

  at::Tensor embed(const at::Tensor& ids);
  Rotary rotary(const at::Tensor& positions);  // positions [batch, seq] int64
  // Additive causal mask honouring `attentionMask` [batch, seq] (1 = token, 0 = padding);
  // undefined when there is no padding (attention then uses the causal fast path).
  at::Tensor causalMask(const at::Tensor& attentionMask, int64_t seq);
  at::Tensor head(const at::Tensor& hidden);  // final norm + lm_head
  // A float lm_head is kept as the checkpoint stores it (mapped, its dtype) until used; this
  // converts its weight to the compute dtype on the device (head() does it on first use, the
  // runner before processors see lm_head). A tied head's copy leaves the embedding as it is.
  void prepareHead();
  // Undoes prepareHead while lm_head still holds the converted weight with the same values (no
  // processor replaced or changed it), freeing the copy: the savers then write the checkpoint's
  // tensor.
  void restoreHead();

  // Full forward: logits [batch, seq, vocab] in the compute dtype. Layers are loaded as needed
  // and kept loaded.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& attentionMask = {});

 private:
  CausalLM() = default;
  at::Tensor stored(const std::string& name);  // as in the checkpoint: mapped, its own dtype, CPU
  at::Tensor mapped(const std::string& name) const;  // stored(name) without the finiteness check
  // The error for a non-finite tensor `name` of the checkpoint, unless the options allow one;
  // `finite` where the caller checked already.
  void requireFinite(const std::string& name, const at::Tensor& t, std::optional<bool> finite = std::nullopt) const;
  at::Tensor weight(const std::string& name);  // on the device, floating point in the compute dtype
  // Module `name`: a QuantLinear where the checkpoint quantized it, else a Linear.
  std::shared_ptr<Module> linear(const std::string& name, bool bias);
  std::shared_ptr<Module> norm(const std::string& name);
  // What `attention`'s q_hook, k_hook or v_hook ('q', 'k', 'v') holds: the checkpoint's
  // AttentionQuant, else a HookPoint.
  std::shared_ptr<Module> attentionInput(const std::string& attention, char input);
  // A `name.bias` that config.json does not declare but the checkpoint's format defines and holds.
  bool undeclaredBias(const std::string& name) const;

  ModelConfig config_;
  ModelOptions options_;
  std::filesystem::path dir_;
  safetensors::Checkpoint checkpoint_;
  std::shared_ptr<const detail::QuantizedCheckpoint> quantized_;  // null for a float checkpoint
  // The [out, in] config.json implies for each quantized Linear, checked as linear() unpacks it.
  std::unordered_map<std::string, std::vector<int64_t>> quantizedShapes_;
  std::shared_ptr<Module> root_;
  Module* layers_ = nullptr;
  at::Tensor invFreq_;
  // prepareHead's converted lm_head weight and the weight it replaced.
  at::Tensor preparedHead_, headBeforePrepare_;
};

}  // namespace qpipe
