// compressed_tensors saver: HF layout + quantization_config (docs/formats.md;
// tensor names and dtypes as compressed-tensors 0.20's naive/int/float/pack/nvfp4/mxfp4
// compressors write them, except the int and fp8 scales, which stay fp32: see docs/formats.md).
#include <ATen/ATen.h>

#include <map>
#include <regex>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/quantized_checkpoint.h"
#include "saver_internal.h"

namespace qpipe::detail {

namespace {

namespace fs = std::filesystem;
using quant::QDtype;
using quant::QScope;

struct Group {
  SortedJson scheme;  // weights, input_activations, output_activations, format (targets added at the end)
  std::vector<std::string> members;
};

// The part of a decoder-layer module's name after "model.layers.<i>.", or "" for other modules.
std::string layerSuffix(const std::string& name) {
  static const std::regex layer(R"(^model\.layers\.\d+\.(.+)$)");
  std::smatch match;
  return std::regex_match(name, match, layer) ? match[1].str() : std::string();
}

std::string escapeRegex(const std::string& text) {
  static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
  return std::regex_replace(text, special, R"(\$&)");
}

constexpr const char* kNormBiasText =
    "a bias (from iter_smooth with symmetric: False), which the RMSNorm of transformers and vLLM lacks and would "
    "drop; save with ascendv1_saver, or smooth with symmetric: True";

// Error(kConfig) for an attention input, `hook`, that compressed-tensors cannot hold at all.
void checkCompressedTensorsHook(const quant::QScheme& scheme, const std::string& hook) {
  QPIPE_REQUIRE(!quant::isDynamic(scheme), ErrorCode::kConfig, "compressed_tensors: ", hook,
                " is per_token (dynamic); compressed-tensors' attention scales are static: use per_tensor or per_head");
  QPIPE_REQUIRE(scheme.symmetric, ErrorCode::kConfig, "compressed_tensors: ", hook,
                " is asymmetric, which vLLM's KV cache does not support; use symmetric: True");
}

class CompressedTensorsSaver final : public SaverBase {
 public:
  CompressedTensorsSaver(const SaverOptions& options, CausalLM& model, const fs::path& saveDir)
      : SaverBase(options, model, saveDir, "model") {}

 protected:
  bool skipsTiedHead() const override { return true; }

  void noteFloatLinear(const std::string& name) override { notes_.assignment[name] = -1; }

  // K and V as compressed-tensors' kv_cache_scheme, Q (when quantized) as a config group on the
  // attention modules, all with one scheme (compressed-tensors initializes an attention group's
  // Q, K and V scales from its input_activations). Scales on the attention module:
  // `<attention>.q_scale` / `k_scale` / `v_scale`, [1] for tensor, [heads, 1, 1] for attn_head.
  void writeAttentionQuant(const std::string& attention, const AttentionInputs& inputs) override {
    for (const auto& [quant, input] : {std::pair{inputs.q, 'q'}, {inputs.k, 'k'}, {inputs.v, 'v'}}) {
      if (quant == nullptr) continue;
      const std::string name = attention + "." + input + "_hook";
      checkCompressedTensorsHook(quant->scheme(), name);
      noteAttentionArgs(compressedTensorsKvCacheArgs(quant->scheme()), name, quant->scheme().name());
      const at::Tensor scale = quant->parameter("scale").to(at::kFloat);
      add(attention + "." + input + "_scale",
          quant->scheme().scope == QScope::kPerHead ? scale.reshape({-1, 1, 1}) : scale.reshape({1}));
    }
    QPIPE_REQUIRE(inputs.k && inputs.v, ErrorCode::kConfig, "compressed_tensors: ", attention, " has ",
                  missingKvText(inputs), "; compressed-tensors quantizes K and V together (and Q with their scheme)");
    (inputs.q ? notes_.withQ : notes_.withoutQ) = true;
  }

  void noteNormBias(const std::string& name) override {
    QPIPE_REQUIRE(false, ErrorCode::kConfig, "compressed_tensors: ", name, " has ", kNormBiasText);
  }

  void writeQuantLinear(const std::string& name, QuantLinear& linear) override {
    const quant::QScheme& w = linear.weightScheme();
    const std::optional<ActivationQuant> input = writtenInputQuant(linear);
    const std::string format = compressedTensorsFormat(w, input);
    SortedJson scheme = {{"format", format},
                         {"input_activations", input ? compressedTensorsInputArgs(*input) : SortedJson(nullptr)},
                         {"output_activations", nullptr},
                         {"weights", compressedTensorsWeightArgs(w)}};
    joinGroup(scheme, name);

    const at::Tensor q = linear.parameter("weight");
    const at::Tensor scale = linear.parameter("weight_scale").to(at::kFloat);
    if (format == "nvfp4-pack-quantized") {
      // As vLLM allocates them: uint8 code pairs, E4M3 block scales (exact: they are E4M3 values),
      // fp32 global scales.
      add(name + ".weight_packed", quant::packFp4(q.cpu()));
      add(name + ".weight_scale", quant::toFp8E4m3(scale.cpu()));
      add(name + ".weight_global_scale", linear.parameter("weight_global_scale").to(at::kFloat));
      if (input) add(name + ".input_global_scale", linear.parameter("input_global_scale").to(at::kFloat));
    } else if (format == "mxfp4-pack-quantized") {
      // uint8 code pairs and E8M0 exponents (exact: the scales are powers of two).
      add(name + ".weight_packed", quant::packFp4(q.cpu()));
      add(name + ".weight_scale", quant::toE8m0(scale.cpu()));
    } else if (format == "pack-quantized") {
      const bool int4 = w.dtype == QDtype::kInt4;
      add(name + ".weight_packed", int4 ? quant::packInt4(q.cpu()) : packInt8(q.cpu()));
      add(name + ".weight_scale", scale);
      add(name + ".weight_shape", at::tensor(q.sizes().vec(), at::kLong));
      if (!w.symmetric) {
        const at::Tensor zp = linear.parameter("weight_zero_point").cpu().to(at::kChar);
        // compressed-tensors packs group / channel zero points along dim 0 and keeps a tensor one.
        if (w.scope == QScope::kPerTensor) {
          add(name + ".weight_zero_point", zp);
        } else {
          add(name + ".weight_zero_point", int4 ? quant::packInt4(zp, 0) : packInt8(zp, 0));
        }
      }
    } else {
      add(name + ".weight", q);
      add(name + ".weight_scale", scale);
      // Zero points in the quantized type, as compressed-tensors stores them.
      if (!w.symmetric) add(name + ".weight_zero_point", linear.parameter("weight_zero_point").to(at::kChar));
    }
    if (linear.hasParameter("input_scale")) {
      add(name + ".input_scale", linear.parameter("input_scale").to(at::kFloat));
      if (!input->scheme.symmetric) add(name + ".input_zero_point", linear.parameter("input_zero_point").to(at::kChar));
    }
    if (linear.hasParameter("bias")) writeFloat(name + ".bias", linear.parameter("bias"));
  }

  std::string takeNotes() override {
    SortedJson groups = SortedJson::array();
    for (const Group& group : notes_.groups) groups.push_back({{"scheme", group.scheme}, {"members", group.members}});
    SortedJson floats = SortedJson::array();
    for (const auto& [name, group] : notes_.assignment) {
      if (group < 0) floats.push_back(name);
    }
    const SortedJson notes = {{"groups", groups},
                              {"float", floats},
                              {"attention", notes_.attentionArgs},
                              {"attention_of", notes_.attentionArgsOf},
                              {"attention_scheme", notes_.attentionScheme},
                              {"with_q", notes_.withQ},
                              {"without_q", notes_.withoutQ}};
    notes_ = {};
    return notes.dump();
  }

  void mergeNotes(const std::string& text) override {
    const SortedJson notes = SortedJson::parse(text);
    for (const SortedJson& group : notes["groups"]) {
      for (const SortedJson& member : group["members"]) joinGroup(group["scheme"], member.get<std::string>());
    }
    for (const SortedJson& name : notes["float"]) notes_.assignment[name.get<std::string>()] = -1;
    if (!notes["attention"].is_null()) {
      noteAttentionArgs(notes["attention"], notes["attention_of"].get<std::string>(),
                        notes["attention_scheme"].get<std::string>());
    }
    notes_.withQ = notes_.withQ || notes["with_q"].get<bool>();
    notes_.withoutQ = notes_.withoutQ || notes["without_q"].get<bool>();
  }

  void writeMetadata(const fs::path& dir) override {
    // Nothing quantized (a smoothing-only pipeline): a plain HF checkpoint, which transformers and
    // vLLM load as the float model it is.
    QPIPE_REQUIRE(!notes_.withQ || !notes_.withoutQ, ErrorCode::kConfig,
                  "compressed_tensors: Q is quantized in some attentions and not in others; compressed-tensors' "
                  "attention group takes all of them or none");
    if (notes_.groups.empty() && notes_.attentionArgs.is_null()) {
      writeJson(dir / "config.json", sourceConfig());
      return;
    }
    SortedJson groups = SortedJson::object();
    std::vector<std::vector<std::string>> targets = chooseTargets();
    std::set<std::string> formats;
    for (size_t i = 0; i < notes_.groups.size(); ++i) {
      SortedJson scheme = notes_.groups[i].scheme;
      scheme["targets"] = targets[i];
      formats.insert(scheme["format"].get<std::string>());
      groups["group_" + std::to_string(i)] = scheme;
    }
    if (notes_.withQ) {
      groups["group_" + std::to_string(notes_.groups.size())] = {{"format", "dense"},
                                                                 {"input_activations", notes_.attentionArgs},
                                                                 {"output_activations", nullptr},
                                                                 {"targets", {kAttentionTarget}},
                                                                 {"weights", nullptr}};
    }
    std::vector<std::string> floats;
    for (const auto& [name, group] : notes_.assignment) {
      if (group < 0) floats.push_back(name);
    }
    const SortedJson quantization = {
        {"config_groups", groups},
        {"format", formats.empty()       ? "dense"
                   : formats.size() == 1 ? *formats.begin()
                                         : "mixed-precision"},
        {"global_compression_ratio", nullptr},
        {"ignore", targets.back()},
        {"kv_cache_scheme", notes_.attentionArgs},
        {"quant_method", "compressed-tensors"},
        {"quantization_status", "compressed"},
        {"sparsity_config", SortedJson::object()},
        {"transform_config", SortedJson::object()},
        {"version", kCompressedTensorsVersion},
    };
    nlohmann::ordered_json config = sourceConfig();
    // Through text, so the ordered config keeps compressed-tensors' sorted key order.
    config["quantization_config"] = nlohmann::ordered_json::parse(quantization.dump());
    writeJson(dir / "config.json", config);
  }

 private:
  // Targets of each group, then the ignore list (last). One group: "Linear" + the float modules by
  // name. Several: per module kind (name within a layer), a regex when the kind is entirely in
  // one group (or entirely float), else the exact names. The result is checked by matching every
  // module as compressed-tensors and vLLM do (ignore first, then the first matching group).
  std::vector<std::vector<std::string>> chooseTargets() const {
    std::vector<std::vector<std::string>> out(notes_.groups.size() + 1);
    if (notes_.groups.size() == 1) {
      out[0] = {"Linear"};
      out[1] = compress(-1);
    } else {
      for (size_t i = 0; i < notes_.groups.size(); ++i) out[i] = compress(static_cast<int>(i));
      out.back() = compress(-1);
    }
    if (resolvesExactly(out)) return out;
    for (size_t i = 0; i < out.size(); ++i) out[i] = exactNames(i + 1 == out.size() ? -1 : static_cast<int>(i));
    if (notes_.groups.size() == 1) out[0] = {"Linear"};
    QPIPE_CHECK(resolvesExactly(out), "compressed-tensors targets do not reproduce the quantized modules");
    return out;
  }

  std::vector<std::string> exactNames(int group) const {
    std::vector<std::string> names;
    for (const auto& [name, assigned] : notes_.assignment) {
      if (assigned == group) names.push_back(name);
    }
    return names;
  }

  std::vector<std::string> compress(int group) const {
    std::map<std::string, std::pair<int, int>> suffixCount;  // suffix -> (in group, in total)
    for (const auto& [name, assigned] : notes_.assignment) {
      const std::string suffix = layerSuffix(name);
      if (suffix.empty()) continue;
      auto& [inGroup, total] = suffixCount[suffix];
      inGroup += assigned == group;
      ++total;
    }
    std::vector<std::string> targets;
    for (const auto& [suffix, count] : suffixCount) {
      if (count.first > 0 && count.first == count.second) targets.push_back("re:.*\\." + escapeRegex(suffix) + "$");
    }
    for (const auto& [name, assigned] : notes_.assignment) {
      if (assigned != group) continue;
      const std::string suffix = layerSuffix(name);
      if (suffix.empty() || suffixCount.at(suffix).first != suffixCount.at(suffix).second) targets.push_back(name);
    }
    return targets;
  }

  bool resolvesExactly(const std::vector<std::vector<std::string>>& targets) const {
    for (const auto& [name, assigned] : notes_.assignment) {
      int resolved = -1;
      bool ignored = false;
      for (const auto& entry : targets.back()) ignored = ignored || compressedTensorsMatches(entry, name);
      for (size_t i = 0; !ignored && resolved < 0 && i + 1 < targets.size(); ++i) {
        for (const auto& target : targets[i]) {
          if (compressedTensorsMatches(target, name)) resolved = static_cast<int>(i);
        }
      }
      if (resolved != assigned) return false;
    }
    return true;
  }

  // `name` joins the group of `scheme`, a new one (numbered in order of first use) if none has it.
  void joinGroup(const SortedJson& scheme, const std::string& name) {
    const std::string key = scheme.dump();
    auto found = notes_.groupByKey.find(key);
    if (found == notes_.groupByKey.end()) {
      found = notes_.groupByKey.emplace(key, static_cast<int>(notes_.groups.size())).first;
      notes_.groups.push_back({scheme, {}});
    }
    notes_.groups[found->second].members.push_back(name);
    notes_.assignment[name] = found->second;
  }

  void noteAttentionArgs(const SortedJson& args, const std::string& name, const std::string& schemeName) {
    if (notes_.attentionArgs.is_null()) {
      notes_.attentionArgs = args;
      notes_.attentionArgsOf = name;
      notes_.attentionScheme = schemeName;
    }
    QPIPE_REQUIRE(args == notes_.attentionArgs, ErrorCode::kConfig, "compressed_tensors: ", name, " is ", schemeName,
                  " but ", notes_.attentionArgsOf,
                  " is not; compressed-tensors quantizes every K and V (and Q) with one scheme");
  }

  // What the hooks noted for the metadata (takeNotes hands it on and starts afresh).
  struct Notes {
    std::vector<Group> groups;
    std::map<std::string, int> groupByKey;
    std::map<std::string, int> assignment;  // every Linear: its group, or -1 when float
    SortedJson attentionArgs;               // null until an attention input is written
    std::string attentionArgsOf;            // the first module written with it
    std::string attentionScheme;            // and its scheme's name
    bool withQ = false;                     // an attention with Q quantized was written
    bool withoutQ = false;                  // one with K and V only
  };
  Notes notes_;
};

}  // namespace

void checkCompressedTensorsPlanned(const PlannedOutputs& planned) {
  for (const PlannedOutputs::Attention& attention : planned.attention) {
    for (const auto& [scheme, input] : {std::pair{attention.q, 'q'}, {attention.k, 'k'}, {attention.v, 'v'}}) {
      if (scheme) checkCompressedTensorsHook(*scheme, concat("its ", input, "_hook"));
    }
  }
  QPIPE_REQUIRE(!planned.normBias, ErrorCode::kConfig, "compressed_tensors: its norms would have ", kNormBiasText);
}

std::unique_ptr<CheckpointSaver> makeCompressedTensorsSaver(const SaverOptions& options, CausalLM& model,
                                                            const fs::path& saveDir) {
  return std::make_unique<CompressedTensorsSaver>(options, model, saveDir);
}

}  // namespace qpipe::detail
