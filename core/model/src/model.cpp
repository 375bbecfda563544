// Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder layers, following transformers'
// models/{llama,qwen2,qwen3,qwen3_moe}/modeling_*.py.
#include "qpipe/model.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fused_rows.h"
#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/log.h"
#include "qpipe/quantized_checkpoint.h"

namespace qpipe {

namespace {

at::Tensor rotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// A float weight's safetensors dtype (F8 ones are quantized: without their scales they are wrong).
bool isFloatWeight(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64";
}

// Takes the tensors and modules of one layer from the checkpoint by HF name.
struct LayerSource {
  std::function<at::Tensor(const std::string& name)> weight;
  std::function<bool(const std::string& name)> has;
  // A projection: Linear, or QuantLinear where the checkpoint is quantized.
  std::function<std::shared_ptr<Module>(const std::string& module, bool bias)> linear;
  std::function<std::shared_ptr<Module>(const std::string& module)> norm;
  // What sits at an attention's q_hook, k_hook or v_hook: a HookPoint, or the checkpoint's
  // AttentionQuant.
  std::function<std::shared_ptr<Module>(const std::string& attention, char input)> attentionInput;
};

class Mlp : public Module {
 public:
  Mlp(const LayerSource& w, const std::string& prefix, bool bias) : Module("MLP") {
    gate_ = addChild("gate_proj", w.linear(prefix + "gate_proj", bias));
    up_ = addChild("up_proj", w.linear(prefix + "up_proj", bias));
    down_ = addChild("down_proj", w.linear(prefix + "down_proj", bias));
  }
  Mlp(at::Tensor gate, at::Tensor up, at::Tensor down) : Module("MLP") {
    gate_ = addChild("gate_proj", std::make_shared<Linear>(std::move(gate)));
    up_ = addChild("up_proj", std::make_shared<Linear>(std::move(up)));
    down_ = addChild("down_proj", std::make_shared<Linear>(std::move(down)));
  }
  at::Tensor forward(const at::Tensor& x) override {
    // In place, and gate/up's outputs dropped before down_proj: a staged calibration forward
    // holds every sample's activations at down_proj's settle point, one intermediate-wide tensor
    // each rather than four.
    std::vector<at::Tensor> gateUp = forwardSharingInput(x, {&child(gate_), &child(up_)});
    at::Tensor h = at::silu(gateUp[0]);
    h.mul_(gateUp[1]);
    gateUp.clear();
    return child(down_)(h);
  }

 private:
  size_t gate_, up_, down_;
};

// Qwen3-MoE sparse block: softmax router in fp32, top-k experts, optionally renormalised.
class SparseMoe : public Module {
 public:
  SparseMoe(const LayerSource& w, const std::string& prefix, const ModelConfig& c)
      : Module("SparseMoeBlock"), topK_(c.expertsPerToken), normTopk_(c.normTopkProb) {
    gate_ = addChild("gate", w.linear(prefix + "gate", false));
    auto experts = std::make_shared<Module>("Experts");
    const std::string fused = prefix + "experts.gate_up_proj";
    // Checkpoints saved with fused experts ([E, 2I, H] and [E, H, I]) are sliced per expert so
    // every expert is an ordinary MLP with HF's per-expert names.
    const at::Tensor gateUp = w.has(fused) ? w.weight(fused) : at::Tensor();
    const at::Tensor down = w.has(fused) ? w.weight(prefix + "experts.down_proj") : at::Tensor();
    for (int64_t e = 0; e < c.numExperts; ++e) {
      const std::string name = std::to_string(e);
      if (gateUp.defined()) {
        const int64_t inter = gateUp.size(1) / 2;
        experts->addChild(name,
                          std::make_shared<Mlp>(gateUp[e].slice(0, 0, inter), gateUp[e].slice(0, inter), down[e]));
      } else {
        experts->addChild(name, std::make_shared<Mlp>(w, prefix + "experts." + name + ".", false));
      }
    }
    experts_ = addChild("experts", experts);
  }

  at::Tensor forward(const at::Tensor& x) override {
    const auto shape = x.sizes().vec();
    const at::Tensor flat = x.reshape({-1, x.size(-1)});
    const at::Tensor probs = at::softmax(child(gate_)(flat), -1, at::kFloat);
    auto [weights, chosen] = at::topk(probs, topK_, -1);
    if (normTopk_) weights = weights / weights.sum(-1, true);
    weights = weights.to(x.scalar_type());
    at::Tensor out = at::zeros_like(flat);
    Module& experts = child(experts_);
    for (size_t e = 0; e < experts.children().size(); ++e) {
      const at::Tensor hit = chosen.eq(static_cast<int64_t>(e)).nonzero();  // [n, 2]: token, slot
      if (hit.size(0) == 0) continue;
      const at::Tensor tokens = hit.select(1, 0);
      const at::Tensor scale = weights.index({tokens, hit.select(1, 1)}).unsqueeze(-1);
      out.index_add_(0, tokens, experts.child(e)(flat.index_select(0, tokens)) * scale);
    }
    return out.view(shape);
  }

 private:
  int64_t topK_;
  bool normTopk_;
  size_t gate_, experts_;
};

class Attention : public Module {
 public:
  Attention(const LayerSource& w, const std::string& prefix, const ModelConfig& c)
      : Module("Attention"), heads_(c.numHeads), kvHeads_(c.numKvHeads), headDim_(c.headDim) {
    q_ = addChild("q_proj", w.linear(prefix + "q_proj", c.attentionBias));
    k_ = addChild("k_proj", w.linear(prefix + "k_proj", c.attentionBias));
    v_ = addChild("v_proj", w.linear(prefix + "v_proj", c.attentionBias));
    o_ = addChild("o_proj", w.linear(prefix + "o_proj", c.modelType == "llama" && c.attentionBias));
    if (c.qkNorm) {
      qNorm_ = addChild("q_norm", w.norm(prefix + "q_norm"));
      kNorm_ = addChild("k_norm", w.norm(prefix + "k_norm"));
    }
    const std::string attention = prefix.substr(0, prefix.size() - 1);
    qHook_ = addChild("q_hook", w.attentionInput(attention, 'q'));
    kHook_ = addChild("k_hook", w.attentionInput(attention, 'k'));
    vHook_ = addChild("v_hook", w.attentionInput(attention, 'v'));
  }

  at::Tensor forward(const at::Tensor& x, const Rotary& rotary, const at::Tensor& mask) {
    // Q, K and V are gone before o_proj runs: a staged calibration forward holds every sample's
    // state at o_proj's settle point.
    const at::Tensor attended = attend(x, rotary, mask);
    return child(o_)(attended);
  }

 private:
  // The heads' outputs side by side: o_proj's input.
  at::Tensor attend(const at::Tensor& x, const Rotary& rotary, const at::Tensor& mask) {
    const int64_t batch = x.size(0), seq = x.size(1);
    const std::vector<at::Tensor> qkv = forwardSharingInput(x, {&child(q_), &child(k_), &child(v_)});
    // [batch, seq, n, head_dim], through q_norm or k_norm where the family has them.
    const auto heads = [&](const at::Tensor& projected, int64_t n, std::optional<size_t> norm) {
      const at::Tensor t = projected.view({batch, seq, n, headDim_});
      return norm ? child(*norm)(t) : t;
    };
    // The rotary embedding, as [batch, n, seq, head_dim].
    const auto rotate = [&](const at::Tensor& t) {
      if (std::optional<at::Tensor> rotated = detail::rotary(t, rotary.cos, rotary.sin)) return *rotated;
      const at::Tensor h = t.transpose(1, 2), cos = rotary.cos.unsqueeze(1), sin = rotary.sin.unsqueeze(1);
      return h * cos + rotateHalf(h) * sin;
    };
    const at::Tensor q = child(qHook_)(rotate(heads(qkv[0], heads_, qNorm_)));
    const at::Tensor k = child(kHook_)(rotate(heads(qkv[1], kvHeads_, kNorm_)));
    const at::Tensor v = child(vHook_)(heads(qkv[2], kvHeads_, std::nullopt).transpose(1, 2));
    return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                            /*dropout_p=*/0.0, /*is_causal=*/!mask.defined(), /*scale=*/std::nullopt,
                                            /*enable_gqa=*/kvHeads_ != heads_)
        .transpose(1, 2)
        .reshape({batch, seq, heads_ * headDim_});
  }

  int64_t heads_, kvHeads_, headDim_;
  size_t q_, k_, v_, o_, qHook_, kHook_, vHook_;
  std::optional<size_t> qNorm_, kNorm_;
};

class LlamaLayer final : public DecoderLayer {
 public:
  LlamaLayer(const LayerSource& w, const std::string& prefix, int64_t index, const ModelConfig& c)
      : DecoderLayer(c.modelType),
        heads_(c.numHeads),
        kvHeads_(c.numKvHeads),
        headDim_(c.headDim),
        experts_(c.numExperts) {
    inputNorm_ = addChild("input_layernorm", w.norm(prefix + "input_layernorm"));
    attention_ = addChild("self_attn", std::make_shared<Attention>(w, prefix + "self_attn.", c));
    postNorm_ = addChild("post_attention_layernorm", w.norm(prefix + "post_attention_layernorm"));
    moe_ = c.isMoeLayer(index);
    if (moe_) {
      mlp_ = addChild("mlp", std::make_shared<SparseMoe>(w, prefix + "mlp.", c));
    } else {
      mlp_ = addChild("mlp", std::make_shared<Mlp>(w, prefix + "mlp.", c.mlpBias));
    }
  }

  at::Tensor forward(const at::Tensor& hidden, const Rotary& rotary, const at::Tensor& mask) override {
    auto& attention = static_cast<Attention&>(child(attention_));
    const at::Tensor h = hidden + attention.forward(child(inputNorm_)(hidden), rotary, mask);
    return h + child(mlp_)(child(postNorm_)(h));
  }

  // A sparse MLP routes each token to some experts only.
  bool uniformForward() const override { return !moe_; }

  // transformers' Llama/Qwen2/Qwen3 layer: both norms feed Linears only, v_proj reaches o_proj
  // through attention, up_proj reaches down_proj through the gated product. In a sparse MLP the
  // router reads the norm's output too (it goes first: it sees every token), and each expert has
  // its own up-down.
  std::vector<Subgraph> subgraphs() const override {
    using T = SubgraphType;
    std::vector<Subgraph> graphs{
        {T::kNormLinear, "input_layernorm", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}},
        {T::kOv, "self_attn.v_proj", {"self_attn.o_proj"}, heads_, kvHeads_, headDim_},
    };
    if (!moe_) {
      graphs.push_back({T::kNormLinear, "post_attention_layernorm", {"mlp.gate_proj", "mlp.up_proj"}});
      graphs.push_back({T::kUpDown, "mlp.up_proj", {"mlp.down_proj"}});
      return graphs;
    }
    Subgraph experts{T::kNormLinear, "post_attention_layernorm", {"mlp.gate"}};
    for (int64_t e = 0; e < experts_; ++e) {
      const std::string expert = "mlp.experts." + std::to_string(e) + ".";
      experts.targets.push_back(expert + "gate_proj");
      experts.targets.push_back(expert + "up_proj");
    }
    graphs.push_back(std::move(experts));
    for (int64_t e = 0; e < experts_; ++e) {
      const std::string expert = "mlp.experts." + std::to_string(e) + ".";
      graphs.push_back({T::kUpDown, expert + "up_proj", {expert + "down_proj"}});
    }
    return graphs;
  }

 private:
  size_t inputNorm_, attention_, postNorm_, mlp_;
  bool moe_ = false;
  int64_t heads_, kvHeads_, headDim_, experts_;
};

// Stands in for a decoder layer that is not materialised.
class UnloadedLayer final : public DecoderLayer {
 public:
  UnloadedLayer() : DecoderLayer("unloaded") {}
  at::Tensor forward(const at::Tensor&, const Rotary&, const at::Tensor&) override {
    QPIPE_CHECK(false, "forward through an unloaded decoder layer");
    return {};
  }
};

// What config.json implies the checkpoint holds, checked from the safetensors headers before any
// tensor is read (docs/cli.md, Validation): every tensor the family needs is there, a float one
// has a float dtype and the shape the configuration implies, and a quantized weight the shape its
// format gives that. The [out, in] shape config.json implies for a quantized module is returned,
// for CausalLM::linear to check once its format has unpacked it (a pack-quantized weight's
// weight_shape, for one, is data, not header).
std::unordered_map<std::string, std::vector<int64_t>> validateCheckpoint(const std::filesystem::path& dir,
                                                                         const ModelConfig& c,
                                                                         const safetensors::Checkpoint& ckpt,
                                                                         const detail::QuantizedCheckpoint* quantized) {
  std::unordered_map<std::string, std::vector<int64_t>> quantizedShapes;
  const std::string where = concat("checkpoint ", dir.string());
  int64_t layersPresent = 0;
  for (const std::string& name : ckpt.names()) {
    if (!name.starts_with("model.layers.")) continue;
    const std::string index = name.substr(13, name.find('.', 13) - 13);
    if (!index.empty() && index.size() < 10 && std::all_of(index.begin(), index.end(), ::isdigit)) {
      layersPresent = std::max<int64_t>(layersPresent, std::stoll(index) + 1);
    }
  }
  QPIPE_REQUIRE(c.numLayers <= layersPresent, ErrorCode::kInput, where, ": config.json has num_hidden_layers ",
                c.numLayers, ", but the checkpoint holds ", layersPresent, " layers");
  // Fewer is a known shortcut (the first layers of a model, for a quick try), but said: the others
  // are left out of an evaluation and of a quantized checkpoint.
  if (c.numLayers < layersPresent) {
    log::logger()->warn(where, " holds ", layersPresent, " layers, config.json's num_hidden_layers ", c.numLayers,
                        ": only model.layers.0 to ", c.numLayers - 1, " are used (and saved)");
  }
  const auto isFloat = [](const std::string& dtype) { return dtype.starts_with("F") || dtype == "BF16"; };
  // A float tensor of exactly this shape.
  const auto tensor = [&](const std::string& name, const std::vector<int64_t>& shape) {
    QPIPE_REQUIRE(ckpt.contains(name), ErrorCode::kInput, where, ": missing tensor '", name, "'");
    const safetensors::TensorInfo& info = ckpt.info(name);
    QPIPE_REQUIRE(isFloat(info.dtype), ErrorCode::kInput, where, ": tensor '", name, "' has dtype ", info.dtype,
                  "; expected a floating-point dtype");
    QPIPE_REQUIRE(info.shape == shape, ErrorCode::kInput, where, ": tensor '", name, "' has shape ",
                  safetensors::shapeText(info.shape), ", but config.json implies ", safetensors::shapeText(shape));
  };
  const auto linear = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
    const std::string weight = name + ".weight";
    if (ckpt.contains(weight) && (isFloat(ckpt.info(weight).dtype) || !quantized)) {
      tensor(weight, {out, in});
      QPIPE_REQUIRE(quantized || isFloatWeight(ckpt.info(weight).dtype), ErrorCode::kInput, where, ": tensor '", weight,
                    "' is ", ckpt.info(weight).dtype, ", but config.json has no quantization_config");
    } else {
      QPIPE_REQUIRE(ckpt.contains(weight) || (quantized && ckpt.contains(name + ".weight_packed")), ErrorCode::kInput,
                    where, ": missing tensor '", weight, "'");
      if (const std::optional<detail::StoredWeight> stored = quantized->storedWeight(name, out, in)) {
        QPIPE_REQUIRE(ckpt.contains(stored->tensor), ErrorCode::kInput, where, ": missing tensor '", stored->tensor,
                      "'");
        const std::vector<int64_t>& shape = ckpt.info(stored->tensor).shape;
        QPIPE_REQUIRE(shape == stored->shape, ErrorCode::kInput, where, ": tensor '", stored->tensor, "' has shape ",
                      safetensors::shapeText(shape), ", but config.json implies ",
                      safetensors::shapeText(stored->shape),
                      stored->layout.empty() ? "" : concat(" (", stored->layout, ")"));
      }
      quantizedShapes[name] = {out, in};
    }
    if (bias) tensor(name + ".bias", {out});
  };
  const int64_t hidden = c.hiddenSize, q = c.numHeads * c.headDim, kv = c.numKvHeads * c.headDim;
  tensor("model.embed_tokens.weight", {c.vocabSize, hidden});
  tensor("model.norm.weight", {hidden});
  if (ckpt.contains("lm_head.weight") || ckpt.contains("lm_head.weight_packed")) {
    linear("lm_head", c.vocabSize, hidden, false);
  }
  for (int64_t layer = 0; layer < c.numLayers; ++layer) {
    const std::string p = concat("model.layers.", layer, ".");
    linear(p + "self_attn.q_proj", q, hidden, c.attentionBias);
    linear(p + "self_attn.k_proj", kv, hidden, c.attentionBias);
    linear(p + "self_attn.v_proj", kv, hidden, c.attentionBias);
    linear(p + "self_attn.o_proj", hidden, q, c.modelType == "llama" && c.attentionBias);
    if (c.qkNorm) {
      tensor(p + "self_attn.q_norm.weight", {c.headDim});
      tensor(p + "self_attn.k_norm.weight", {c.headDim});
    }
    tensor(p + "input_layernorm.weight", {hidden});
    tensor(p + "post_attention_layernorm.weight", {hidden});
    if (!c.isMoeLayer(layer)) {
      linear(p + "mlp.gate_proj", c.intermediateSize, hidden, c.mlpBias);
      linear(p + "mlp.up_proj", c.intermediateSize, hidden, c.mlpBias);
      linear(p + "mlp.down_proj", hidden, c.intermediateSize, c.mlpBias);
      continue;
    }
    const int64_t experts = c.numExperts, inter = c.moeIntermediateSize;
    linear(p + "mlp.gate", experts, hidden, false);
    if (ckpt.contains(p + "mlp.experts.gate_up_proj")) {
      tensor(p + "mlp.experts.gate_up_proj", {experts, 2 * inter, hidden});
      tensor(p + "mlp.experts.down_proj", {experts, hidden, inter});
      continue;
    }
    for (int64_t e = 0; e < experts; ++e) {
      const std::string expert = concat(p, "mlp.experts.", e, ".");
      linear(expert + "gate_proj", inter, hidden, false);
      linear(expert + "up_proj", inter, hidden, false);
      linear(expert + "down_proj", hidden, inter, false);
    }
  }
  return quantizedShapes;
}

}  // namespace

std::unique_ptr<CausalLM> CausalLM::open(const std::filesystem::path& modelDir, ModelOptions options) {
  std::unique_ptr<CausalLM> lm(new CausalLM());
  lm->dir_ = modelDir;
  lm->options_ = options;
  QPIPE_REQUIRE(std::filesystem::is_directory(modelDir), ErrorCode::kInput, "model folder '", modelDir.string(),
                "' does not exist");
  lm->config_ = ModelConfig::fromFile(modelFile(modelDir, "config.json"));
  lm->quantized_ = detail::QuantizedCheckpoint::detect(modelDir);
  lm->checkpoint_ = safetensors::Checkpoint::open(modelDir, lm->quantized_ ? lm->quantized_->weightsPrefix() : "model");
  lm->quantizedShapes_ = validateCheckpoint(modelDir, lm->config_, lm->checkpoint_, lm->quantized_.get());
  const ModelConfig& c = lm->config_;

  auto model = std::make_shared<Module>("Model");
  // The embedding and a float lm_head keep the checkpoint's dtype, mapped, until used: embed()
  // converts only the rows it looks up and head() converts lm_head on first use, so a run that
  // never calls the head (qpipe quant) never holds a converted copy of either. Their pages, read
  // by the finite check, are dropped again: resident, they were 384 MiB of a 4.4 GB model's RSS
  // for the whole run.
  const auto mappedOnly = [&lm](const std::string& name) {
    at::Tensor t = lm->stored(name);
    lm->checkpoint_.dropPages(name);
    return t;
  };
  model->addChild("embed_tokens", std::make_shared<Embedding>(mappedOnly("model.embed_tokens.weight")));
  auto layers = std::make_shared<Module>("Layers");
  for (int64_t i = 0; i < c.numLayers; ++i) layers->addChild(std::to_string(i), std::make_shared<UnloadedLayer>());
  lm->layers_ = layers.get();
  model->addChild("layers", layers);
  model->addChild("norm", lm->norm("model.norm"));
  lm->root_ = std::make_shared<Module>("CausalLM");
  lm->root_->addChild("model", model);
  const bool tied = !lm->checkpoint_.contains("lm_head.weight") && !lm->checkpoint_.contains("lm_head.weight_packed");
  QPIPE_REQUIRE(!tied || c.tieWordEmbeddings, ErrorCode::kInput, "checkpoint ", modelDir.string(),
                ": no 'lm_head.weight' and tie_word_embeddings is false");
  const bool floatHead = !tied && lm->checkpoint_.contains("lm_head.weight") &&
                         isFloatWeight(lm->checkpoint_.info("lm_head.weight").dtype) &&
                         !(lm->quantized_ && lm->checkpoint_.contains("lm_head.weight_scale"));
  lm->root_->addChild("lm_head", tied
                                     ? std::make_shared<Linear>(model->getSubmodule("embed_tokens").parameter("weight"))
                                 : floatHead ? std::make_shared<Linear>(mappedOnly("lm_head.weight"))
                                             : lm->linear("lm_head", false));

  // Inverse RoPE frequencies, with Llama-3's wavelength-dependent scaling when configured.
  at::Tensor invFreq =
      1.0 / at::pow(c.rope.theta, at::arange(0, c.headDim, 2, at::kDouble) / static_cast<double>(c.headDim));
  if (c.rope.type == "llama3") {
    const double oldContext = static_cast<double>(c.rope.originalMaxPositions);
    const double lowWavelen = oldContext / c.rope.lowFreqFactor;
    const double highWavelen = oldContext / c.rope.highFreqFactor;
    const at::Tensor wavelen = 2 * M_PI / invFreq;
    at::Tensor scaled = at::where(wavelen > lowWavelen, invFreq / c.rope.factor, invFreq);
    const at::Tensor smooth =
        (oldContext / wavelen - c.rope.lowFreqFactor) / (c.rope.highFreqFactor - c.rope.lowFreqFactor);
    const at::Tensor smoothed = (1 - smooth) * scaled / c.rope.factor + smooth * scaled;
    const at::Tensor medium = wavelen.ge(highWavelen).logical_and(wavelen.le(lowWavelen));
    invFreq = at::where(medium, smoothed, scaled);
  }
  lm->invFreq_ = invFreq.to(at::kFloat).to(options.device);
  return lm;
}

namespace {

// A bf16 pattern is NaN or Inf when all these bits are set.
constexpr uint16_t kBf16Exponent = 0x7F80;

// Whether any of n IEEE patterns has all exponent bits set (±inf or NaN; E4M3FN, which has no
// inf, passes its exponent and mantissa bits: NaN alone sets all of them). The loop vectorizes at
// -O3 (core/CMakeLists.txt).
template <typename Bits>
[[gnu::always_inline]] inline bool anyNonFinite(const Bits* p, int64_t n, Bits exponent) {
  Bits found = 0;
  for (int64_t i = 0; i < n; ++i) found |= (p[i] & exponent) == exponent;
  return found != 0;
}

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] bool anyNonFinite8(const uint8_t* p, int64_t n,
                                                                               uint8_t exponent) {
  return anyNonFinite(p, n, exponent);
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] bool anyNonFinite16(const uint16_t* p, int64_t n,
                                                                                uint16_t exponent) {
  return anyNonFinite(p, n, exponent);
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] bool anyNonFinite32(const uint32_t* p, int64_t n,
                                                                                uint32_t exponent) {
  return anyNonFinite(p, n, exponent);
}

// bf16 widened to fp32 (its bits are the top half of the fp32 pattern, NaN payloads included, as
// LibTorch's cast), returning whether any element was NaN or Inf.
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] bool widenBf16(const uint16_t* p, uint32_t* out,
                                                                           int64_t n) {
  uint16_t found = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint32_t>(p[i]) << 16;
    found |= (p[i] & kBf16Exponent) == kBf16Exponent;
  }
  return found != 0;
}

// A contiguous CPU bf16 tensor in fp32, and whether it is all finite: one read of the mapped
// checkpoint where a check and a cast made two (the check was 9 % of a data-free W8A8 run's
// samples on a 2,048-wide model, the cast 12 %).
std::pair<at::Tensor, bool> widenedBf16(const at::Tensor& t) {
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  constexpr int64_t kBlock = 1 << 16;
  const int64_t n = t.numel();
  const auto* in = static_cast<const uint16_t*>(t.const_data_ptr());
  auto* wide = static_cast<uint32_t*>(out.mutable_data_ptr());
  std::atomic<bool> bad{false};
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t begin = block * kBlock;
      if (widenBf16(in + begin, wide + begin, std::min(kBlock, n - begin))) bad = true;
    }
  });
  return {out, !bad};
}

}  // namespace

bool allFinite(const at::Tensor& tensor) {
  const at::ScalarType dtype = tensor.scalar_type();
  // fp32, bf16, fp16 and fp8 on the CPU: one read of the bits, a block at a time (a NaN early in
  // a large tensor ends the scan).
  if (tensor.device().is_cpu() && tensor.is_contiguous() &&
      (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat8_e4m3fn ||
       dtype == at::kFloat8_e5m2)) {
    constexpr int64_t kBlock = 1 << 16;
    const int64_t n = tensor.numel();
    const void* data = tensor.const_data_ptr();
    // Blocks over the threads: a model's open reads every weight here first, page faults of the
    // mapped checkpoint included (5 % of a data-free W8A8 run's samples on one thread).
    std::atomic<bool> bad{false};
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t first, int64_t last) {
      for (int64_t block = first; block < last && !bad.load(std::memory_order_relaxed); ++block) {
        const int64_t begin = block * kBlock, count = std::min(kBlock, n - begin);
        bool found = false;
        if (dtype == at::kFloat) {
          found = anyNonFinite32(static_cast<const uint32_t*>(data) + begin, count, 0x7F800000u);
        } else if (dtype == at::kBFloat16 || dtype == at::kHalf) {
          found = anyNonFinite16(static_cast<const uint16_t*>(data) + begin, count,
                                 dtype == at::kBFloat16 ? kBf16Exponent : uint16_t{0x7C00});
        } else {
          found = anyNonFinite8(static_cast<const uint8_t*>(data) + begin, count,
                                dtype == at::kFloat8_e4m3fn ? uint8_t{0x7F} : uint8_t{0x7C});
        }
        if (found) bad = true;
      }
    });
    return !bad;
  }
  // Otherwise a block at a time too: at::isfinite's temporaries (|x| and a mask) of a whole
  // embedding were 730 MB of heap at the open of a 4.4 GB model.
  constexpr int64_t kBlock = 1 << 20;
  const at::Tensor flat = tensor.reshape({-1});
  for (int64_t begin = 0; begin < flat.numel(); begin += kBlock) {
    const at::Tensor block = flat.slice(0, begin, begin + kBlock).to(at::kDouble);
    if (!at::isfinite(block).all().item<bool>()) return false;
  }
  return true;
}

at::Tensor CausalLM::mapped(const std::string& name) const {
  QPIPE_REQUIRE(checkpoint_.contains(name), ErrorCode::kInput, "checkpoint ", dir_.string(), ": missing tensor '", name,
                "'");
  return checkpoint_.tensor(name);
}

void CausalLM::requireFinite(const std::string& name, const at::Tensor& t, std::optional<bool> finite) const {
  if (!options_.checkFinite || !at::isFloatingType(t.scalar_type())) return;
  QPIPE_REQUIRE(finite.has_value() ? *finite : allFinite(t), ErrorCode::kInput, "checkpoint ", dir_.string(),
                ": tensor '", name, "' holds NaN or Inf (", at::isnan(t.to(at::kFloat)).sum().item<int64_t>(), " NaN, ",
                at::isinf(t.to(at::kFloat)).sum().item<int64_t>(), " Inf); --allow_non_finite loads it anyway");
}

at::Tensor CausalLM::stored(const std::string& name) {
  const at::Tensor t = mapped(name);
  requireFinite(name, t);
  return t;
}

at::Tensor CausalLM::weight(const std::string& name) {
  const at::Tensor t = mapped(name);
  if (options_.dtype == at::kFloat && options_.device.is_cpu() && t.scalar_type() == at::kBFloat16 &&
      t.device().is_cpu() && t.is_contiguous()) {
    auto [wide, finite] = widenedBf16(t);
    requireFinite(name, t, finite);
    return wide;
  }
  requireFinite(name, t);
  if (t.scalar_type() != options_.dtype && at::isFloatingType(t.scalar_type()))
    return t.to(options_.device, options_.dtype);
  return t.to(options_.device);
}

std::shared_ptr<Module> CausalLM::linear(const std::string& name, bool bias) {
  const std::string weightName = name + ".weight";
  if (quantized_) {
    const auto stored = [this](const std::string& tensor) { return this->stored(tensor).to(options_.device); };
    const auto has = [this](const std::string& tensor) { return checkpoint_.contains(tensor); };
    bias = bias || undeclaredBias(name);
    if (auto quantized = quantized_->linear(name, bias, stored, has, options_.dtype)) {
      const auto expected = quantizedShapes_.find(name);
      const at::IntArrayRef shape = quantized->parameter("weight").sizes();
      QPIPE_REQUIRE(expected == quantizedShapes_.end() || shape == at::IntArrayRef(expected->second), ErrorCode::kInput,
                    "checkpoint ", dir_.string(), ": the quantized weight of '", name, "' holds ",
                    safetensors::shapeText(shape), ", but config.json implies ",
                    safetensors::shapeText(expected->second));
      if (options_.inferenceOnly) quantized->setInferenceOnly();
      return quantized;
    }
    // An int8 or FP8 weight that no scheme claims (a quantization_config edited by hand) would
    // reach the GEMM unscaled. validateCheckpoint refuses them where there is no quantization_config.
    const std::string held = checkpoint_.contains(weightName) ? weightName : name + ".weight_packed";
    QPIPE_REQUIRE(isFloatWeight(checkpoint_.info(held).dtype), ErrorCode::kInput, "checkpoint ", dir_.string(),
                  ": tensor '", held, "' is ", checkpoint_.info(held).dtype,
                  ", but the checkpoint's quantization description gives '", name, "' no scheme");
  }
  return std::make_shared<Linear>(weight(weightName), bias ? weight(name + ".bias") : at::Tensor());
}

std::shared_ptr<Module> CausalLM::attentionInput(const std::string& attention, char input) {
  if (quantized_) {
    const auto stored = [this](const std::string& tensor) { return this->stored(tensor).to(options_.device); };
    const int64_t heads = input == 'q' ? config_.numHeads : config_.numKvHeads;
    if (auto quant = quantized_->attentionInput(attention, input, heads, stored)) return quant;
  }
  return std::make_shared<HookPoint>();
}

std::shared_ptr<Module> CausalLM::norm(const std::string& name) {
  return std::make_shared<RMSNorm>(weight(name + ".weight"), config_.rmsNormEps,
                                   undeclaredBias(name) ? weight(name + ".bias") : at::Tensor());
}

bool CausalLM::undeclaredBias(const std::string& name) const {
  return quantized_ && quantized_->loadsUndeclaredBiases() && checkpoint_.contains(name + ".bias");
}

DecoderLayer& CausalLM::layer(int64_t index) {
  if (!isLoaded(index)) layers_->replace(std::to_string(index), loadLayerCopy(index));
  return static_cast<DecoderLayer&>(layers_->child(static_cast<size_t>(index)));
}

std::shared_ptr<DecoderLayer> CausalLM::loadLayerCopy(int64_t index) {
  QPIPE_CHECK(index >= 0 && index < config_.numLayers, "layer ", index, " out of range");
  const LayerSource source{
      [this](const std::string& name) { return weight(name); },
      [this](const std::string& name) { return checkpoint_.contains(name); },
      [this](const std::string& name, bool bias) { return linear(name, bias); },
      [this](const std::string& name) { return norm(name); },
      [this](const std::string& attention, char input) { return attentionInput(attention, input); }};
  return std::make_shared<LlamaLayer>(source, layerName(index) + ".", index, config_);
}

bool CausalLM::isLoaded(int64_t index) const {
  return dynamic_cast<UnloadedLayer*>(&layers_->child(static_cast<size_t>(index))) == nullptr;
}

uint64_t CausalLM::releaseLayer(int64_t index) {
  layers_->replace(std::to_string(index), std::make_shared<UnloadedLayer>());
  // The layer's mapped pages would otherwise stay resident, and RSS would grow to the whole
  // checkpoint over a run.
  const std::string prefix = layerName(index) + ".";
  uint64_t bytes = 0;
  for (const std::string& name : checkpoint_.names()) {
    if (!name.starts_with(prefix)) continue;
    checkpoint_.dropPages(name);
    const safetensors::TensorInfo& info = checkpoint_.info(name);
    bytes += info.end - info.begin;
  }
  return bytes;
}

at::Tensor CausalLM::embed(const at::Tensor& ids) {
  Module& embedding = root_->getSubmodule("model.embed_tokens");
  const at::Tensor& table = embedding.parameter("weight");
  // A tokenizer of another model gives ids past the table: named here, not as an index error.
  if (ids.numel() > 0) {
    const auto [lowest, highest] = at::aminmax(ids);
    const at::Tensor bounds = at::stack({lowest, highest}).to(at::kCPU, at::kLong);  // one device sync
    const int64_t low = bounds[0].item<int64_t>(), high = bounds[1].item<int64_t>();
    QPIPE_REQUIRE(low >= 0 && high < table.size(0), ErrorCode::kInput, "token id ", low < 0 ? low : high,
                  " is outside the model's ", table.size(0), " embedding rows (vocab_size in ", dir_.string(),
                  "/config.json); does tokenizer.json belong to this model?");
  }
  return embedding(ids.to(table.device())).to(options_.device, options_.dtype);
}

Rotary CausalLM::rotary(const at::Tensor& positions) {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * invFreq_;
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(options_.dtype), emb.sin().to(options_.dtype)};
}

at::Tensor CausalLM::causalMask(const at::Tensor& attentionMask, int64_t seq) {
  if (!attentionMask.defined() || attentionMask.all().item<bool>()) return {};
  const auto opts = at::TensorOptions().dtype(at::kBool).device(options_.device);
  const at::Tensor causal = at::ones({seq, seq}, opts).tril();
  const at::Tensor keep = causal.unsqueeze(0).logical_and(attentionMask.to(at::kBool).unsqueeze(1));
  // The dtype's minimum rather than -inf, as transformers does: fully padded rows stay finite.
  const double lowest = options_.dtype == at::kHalf ? -65504.0 : std::numeric_limits<float>::lowest();
  const auto maskOptions = at::TensorOptions().dtype(options_.dtype).device(options_.device);
  return at::where(keep, at::zeros({}, maskOptions), at::full({}, lowest, maskOptions)).unsqueeze(1);
}

void CausalLM::prepareHead() {
  if (auto* linear = dynamic_cast<Linear*>(&root_->getSubmodule("lm_head"));
      linear != nullptr &&
      (linear->weight().scalar_type() != options_.dtype || linear->weight().device() != options_.device)) {
    headBeforePrepare_ = linear->weight();
    linear->weight() = linear->weight().to(options_.device, options_.dtype);
    preparedHead_ = linear->weight();
  }
}

void CausalLM::restoreHead() {
  auto* linear = dynamic_cast<Linear*>(&root_->getSubmodule("lm_head"));
  if (linear != nullptr && preparedHead_.defined() && linear->weight().is_same(preparedHead_)) {
    // Compared a block of rows at a time: a whole converted copy is what this frees.
    constexpr int64_t kRows = 4096;
    bool same = true;
    for (int64_t row = 0; same && row < preparedHead_.size(0); row += kRows) {
      same = at::equal(
          preparedHead_.slice(0, row, row + kRows),
          headBeforePrepare_.slice(0, row, row + kRows).to(preparedHead_.device(), preparedHead_.scalar_type()));
    }
    if (same) linear->weight() = headBeforePrepare_;
  }
  preparedHead_ = at::Tensor();
  headBeforePrepare_ = at::Tensor();
}

at::Tensor CausalLM::head(const at::Tensor& hidden) {
  prepareHead();
  return root_->getSubmodule("lm_head")(root_->getSubmodule("model.norm")(hidden));
}

at::Tensor CausalLM::forward(const at::Tensor& ids, const at::Tensor& attentionMask) {
  const int64_t batch = ids.size(0), seq = ids.size(1);
  const at::Tensor positions =
      at::arange(seq, at::TensorOptions().dtype(at::kLong).device(options_.device)).unsqueeze(0).expand({batch, seq});
  const Rotary rot = rotary(positions);
  const at::Tensor mask = causalMask(attentionMask, seq);
  at::Tensor hidden = embed(ids);
  for (int64_t i = 0; i < config_.numLayers; ++i) hidden = layer(i).forward(hidden, rot, mask);
  return head(hidden);
}

}  // namespace qpipe
