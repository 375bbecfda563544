#include "qpipe/qconfig.h"

#include <string>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/error.h"
#include "qpipe/schema.h"

namespace qpipe::quant {

namespace {

Schema sideSchema(std::string defaultDtype, std::string defaultScope, std::vector<std::string> scopes) {
  Schema ext;
  ext.add(
         {.name = "aggregation_type", .help = "act minmax: max (running extremes) or mean", .allowed = {"max", "mean"}})
      .add({.name = "search_method",
            .help = "act histogram: l2_norm or kl_divergence",
            .allowed = {"l2_norm", "kl_divergence"}})
      .add({.name = "step", .type = ValueType::kInt, .help = "weight ssz: search iterations (default 50)"})
      .add({.name = "group_size", .type = ValueType::kInt, .help = "per_group: columns per group (default 128)"});
  Schema side;
  side.choice("dtype", {"int8", "int4", "fp8_e4m3", "nvfp4", "mxfp4", "float"}, std::move(defaultDtype),
              "element type; float = off")
      .choice("scope", std::move(scopes), std::move(defaultScope), "granularity of scales")
      .optional("symmetric", ValueType::kBool, ConfigNode::boolean(true), "zero point fixed at 0")
      .choice("method", {"minmax", "histogram", "ssz", "none"}, "minmax", "how the range is chosen")
      .nested("ext", std::move(ext), false, "method options");
  return side;
}

// A value's own location, or its block's when the value is a default.
const ConfigNode& located(const ConfigNode& value, const ConfigNode& block) {
  return value.location().line > 0 ? value : block;
}

struct Side {
  const ConfigNode& node;
  std::string path;
  // Where `ext` keys without effect go (parseLinearQConfig's `ignored`); null: they are errors.
  std::vector<std::string>* ignored = nullptr;

  const ConfigNode& field(std::string_view key) const { return node.at(key); }
  const ConfigNode* ext(std::string_view key) const {
    const ConfigNode& block = node.at("ext");
    const ConfigNode* value = block.isMap() ? block.find(key) : nullptr;
    return value != nullptr && !value->isNull() ? value : nullptr;
  }
  [[noreturn]] void fail(std::string_view key, std::string_view what) const {
    failAt(located(field(key), node), path + "." + std::string(key), what);
  }
  [[noreturn]] void failExt(std::string_view key, std::string_view what) const {
    failAt(*ext(key), path + ".ext." + std::string(key), what);
  }
};

QMethod parseMethod(std::string_view name) {
  if (name == "minmax") return QMethod::kMinMax;
  if (name == "histogram") return QMethod::kHistogram;
  if (name == "ssz") return QMethod::kSsz;
  return QMethod::kNone;
}

// The fields common to both sides; `ext` keys are consumed by the side-specific readers.
QConfig readCommon(const Side& side) {
  QConfig config;
  config.scheme.dtype = parseQDtype(side.field("dtype").asString(), side.path + ".dtype");
  if (side.field("scope").asString() == "per_block") {
    // msmodelslim's scope of its MX formats (mxfp4_per_block_sym): qpipe's per_group of the
    // format's block width.
    if (!isFp4(config.scheme.dtype)) {
      side.fail("scope", "per_block is msmodelslim's scope of the 4-bit block formats (mxfp4, nvfp4), not of " +
                             std::string(qdtypeName(config.scheme.dtype)));
    }
    config.scheme.scope = QScope::kPerGroup;
  } else {
    config.scheme.scope = parseQScope(side.field("scope").asString(), side.path + ".scope");
  }
  config.scheme.symmetric = side.field("symmetric").asBool();
  config.method = parseMethod(side.field("method").asString());
  if ((config.scheme.dtype == QDtype::kFp8E4m3 || isFp4(config.scheme.dtype)) && !config.scheme.symmetric) {
    side.fail("symmetric", std::string(qdtypeName(config.scheme.dtype)) + " is symmetric only; set symmetric: True");
  }
  if (config.enabled() && config.method == QMethod::kNone) {
    side.fail("method", "'none' quantizes nothing; use minmax, or dtype: float to leave this side unquantized");
  }
  return config;
}

// An FP4 dtype's fixed block width, and what its blocks are (for the errors).
struct Fp4Blocks {
  int64_t width;
  std::string weights;
  std::string activations;
  std::string widthWhy;
};

Fp4Blocks fp4Blocks(QDtype dtype) {
  if (dtype == QDtype::kNvfp4) {
    return {kNvfp4GroupSize, "blocks of 16 with E4M3 scales and one global scale",
            "blocks of 16 scaled per input, one calibrated global scale", "(what vLLM's NVFP4 kernels take)"};
  }
  return {kMxfp4GroupSize, "blocks of 32 with E8M0 scales", "blocks of 32 scaled per input", "(the OCP MX block)"};
}

// msmodelslim's quantizers read the `ext` keys they know and pass over the others, so a practice
// may carry one that has no effect here (group_size beside a per_channel scope).
void ignoreExt(const Side& side, std::string_view key, std::string_view why) {
  const ConfigNode* value = side.ext(key);
  if (value == nullptr) return;
  if (side.ignored == nullptr) side.failExt(key, why);
  side.ignored->push_back(concat(value->location().str(), ": ", side.path, ".ext.", key, ": ", why, "; ignored"));
}

QConfig readAct(const Side& side) {
  QConfig act = readCommon(side);
  if (!act.enabled()) {
    for (const char* key : {"aggregation_type", "search_method", "step", "group_size"}) {
      ignoreExt(side, key, "has no effect when dtype is float");
    }
    act.scheme = {.dtype = QDtype::kFloat, .scope = QScope::kPerTensor, .symmetric = true};
    act.method = QMethod::kNone;
    return act;
  }
  if (act.scheme.dtype == QDtype::kInt4) {
    side.fail("dtype", "int4 activations (W4A4) are not supported; use int8, fp8_e4m3, nvfp4 or mxfp4");
  }
  if (isFp4(act.scheme.dtype)) {
    const Fp4Blocks blocks = fp4Blocks(act.scheme.dtype);
    if (act.scheme.scope != QScope::kPerGroup) {
      side.fail("scope",
                std::string(qdtypeName(act.scheme.dtype)) + " activations are per_group (" + blocks.activations + ")");
    }
    act.scheme.groupSize = blocks.width;
  } else if (act.scheme.scope != QScope::kPerTensor && act.scheme.scope != QScope::kPerToken) {
    side.fail("scope", "linear activations are per_tensor (static, calibrated) or per_token (dynamic)");
  }
  if (act.method == QMethod::kSsz)
    side.fail("method", "ssz searches weight scales; activations take minmax or histogram");
  if (act.method == QMethod::kHistogram &&
      (act.scheme.scope != QScope::kPerTensor || act.scheme.dtype != QDtype::kInt8)) {
    side.fail("method", "histogram calibrates int8 per_tensor activations only");
  }
  ignoreExt(side, "step", "applies to weight ssz only");
  ignoreExt(side, "group_size", "applies to per_group weights only");
  const bool staticMinMax = act.method == QMethod::kMinMax && !act.isDynamic();
  if (!staticMinMax) ignoreExt(side, "aggregation_type", "applies to static minmax activations only");
  if (const ConfigNode* aggregation = staticMinMax ? side.ext("aggregation_type") : nullptr) {
    act.aggregation = parseAggregation(aggregation->asString(), side.path + ".ext.aggregation_type");
  }
  if (act.method != QMethod::kHistogram) ignoreExt(side, "search_method", "applies to method histogram only");
  if (const ConfigNode* search = act.method == QMethod::kHistogram ? side.ext("search_method") : nullptr) {
    act.search = HistogramObserver::parseSearch(search->asString(), side.path + ".ext.search_method");
  }
  return act;
}

QConfig readWeight(const Side& side) {
  QConfig weight = readCommon(side);
  if (!weight.enabled()) side.fail("dtype", "float leaves the weight unquantized; use int8, int4 or fp8_e4m3");
  const QScope scope = weight.scheme.scope;
  if (scope == QScope::kPerToken || scope == QScope::kPerHead) {
    side.fail("scope", "weights are per_tensor, per_channel or per_group");
  }
  if (weight.method == QMethod::kHistogram)
    side.fail("method", "histogram calibrates activations; weights take minmax or ssz");
  if (weight.method == QMethod::kSsz &&
      (scope != QScope::kPerChannel || !weight.scheme.symmetric || weight.scheme.dtype == QDtype::kFp8E4m3)) {
    side.fail("method", "ssz searches int8/int4 per_channel symmetric weights only");
  }
  const bool fp4 = isFp4(weight.scheme.dtype);
  const std::string dtypeName(qdtypeName(weight.scheme.dtype));
  if (fp4 && scope != QScope::kPerGroup) {
    side.fail("scope", dtypeName + " weights are per_group (" + fp4Blocks(weight.scheme.dtype).weights + ")");
  }
  if (scope == QScope::kPerGroup && weight.scheme.dtype == QDtype::kFp8E4m3) {
    side.fail("scope", "per_group applies to int8/int4 weights; fp8_e4m3 takes per_tensor or per_channel");
  }
  ignoreExt(side, "aggregation_type", "applies to static minmax activations only");
  ignoreExt(side, "search_method", "applies to act histogram only");
  if (weight.method != QMethod::kSsz) ignoreExt(side, "step", "applies to method ssz only");
  if (const ConfigNode* step = weight.method == QMethod::kSsz ? side.ext("step") : nullptr) {
    if (step->asInt() < 1) side.failExt("step", "must be >= 1");
    weight.sszSteps = step->asInt();
  }
  if (scope != QScope::kPerGroup) ignoreExt(side, "group_size", "applies to scope per_group only");
  if (const ConfigNode* group = scope == QScope::kPerGroup ? side.ext("group_size") : nullptr) {
    if (group->asInt() < 1) side.failExt("group_size", "must be >= 1");
    if (fp4 && group->asInt() != fp4Blocks(weight.scheme.dtype).width) {
      const Fp4Blocks blocks = fp4Blocks(weight.scheme.dtype);
      side.failExt("group_size",
                   dtypeName + " blocks are " + std::to_string(blocks.width) + " wide " + blocks.widthWhy);
    }
    weight.scheme.groupSize = group->asInt();
  } else if (scope == QScope::kPerGroup) {
    weight.scheme.groupSize = fp4 ? fp4Blocks(weight.scheme.dtype).width : 128;
  }
  return weight;
}

std::string describeSide(const QConfig& config, bool activation) {
  if (!config.enabled()) return "float";
  std::string text = std::string(qdtypeName(config.scheme.dtype)) + " " + std::string(qscopeName(config.scheme.scope));
  if (config.scheme.scope == QScope::kPerGroup) text += std::to_string(config.scheme.groupSize);
  text += config.scheme.symmetric ? " sym" : " asym";
  if (activation && config.isDynamic()) return text + " dynamic";
  switch (config.method) {
    case QMethod::kHistogram:
      return text + " histogram";
    case QMethod::kSsz:
      return text + " ssz";
    default:
      return text + " minmax";
  }
}

}  // namespace

std::string LinearQConfig::describe() const {
  return "w " + describeSide(weight, false) + ", a " + describeSide(act, true);
}

Schema linearQConfigSchema() {
  Schema schema;
  const std::vector<std::string> scopes = {"per_tensor", "per_channel", "per_group",
                                           "per_token",  "per_head",    "per_block"};
  schema
      .nested("act", sideSchema("float", "per_tensor", scopes), false,
              "input activation (default float: not quantized)")
      .nested("weight", sideSchema("int8", "per_channel", scopes), true, "weight");
  return schema;
}

Schema attentionQConfigSchema() {
  // per_block is msmodelslim's spelling; accepted by the schema so that its message is ours.
  return sideSchema("int8", "per_head",
                    {"per_head", "per_token", "per_block", "per_tensor", "per_channel", "per_group"});
}

QConfig parseAttentionQConfig(const ConfigNode& node, std::string_view path) {
  const Side side{node, std::string(path)};
  if (side.field("scope").asString() == "per_block") {
    side.fail("scope",
              "per_block (msmodelslim's dynamic blocks of tokens) is not supported yet; use per_head or "
              "per_token");
  }
  QConfig config = readCommon(side);
  for (const char* key : {"aggregation_type", "search_method", "step", "group_size"}) {
    ignoreExt(side, key, "does not apply to attention quantization");
  }
  if (!config.enabled()) {
    config.scheme = {.dtype = QDtype::kFloat, .scope = QScope::kPerTensor, .symmetric = true};
    config.method = QMethod::kNone;
    return config;
  }
  if (config.scheme.dtype == QDtype::kInt4 || isFp4(config.scheme.dtype)) {
    side.fail("dtype", "attention is quantized to int8 or fp8_e4m3");
  }
  if (config.scheme.scope != QScope::kPerHead && config.scheme.scope != QScope::kPerTensor &&
      config.scheme.scope != QScope::kPerToken) {
    side.fail("scope", "attention is quantized per_head or per_tensor (static, calibrated) or per_token (dynamic)");
  }
  if (config.method != QMethod::kMinMax) side.fail("method", "attention takes minmax (a recall window per head)");
  return config;
}

LinearQConfig parseLinearQConfig(const ConfigNode& qconfig, std::string_view path, std::vector<std::string>* ignored) {
  const std::string base(path);
  const Side act{qconfig.at("act"), base + ".act", ignored};
  const Side weight{qconfig.at("weight"), base + ".weight", ignored};
  LinearQConfig config{.act = readAct(act), .weight = readWeight(weight)};
  const QDtype w = config.weight.scheme.dtype;
  const QDtype a = config.act.scheme.dtype;
  if (!config.act.enabled() || w == a) return config;
  if (isFp4(w) || isFp4(a)) {
    const std::string name(qdtypeName(isFp4(w) ? w : a));
    act.fail("dtype", name + " weights run with " + name + " (W4A4) or float (W4A16) activations, and " + name +
                          " activations with " + name + " weights");
  }
  const bool w4afp8 = w == QDtype::kInt4 && a == QDtype::kFp8E4m3;
  if (!w4afp8 && (w == QDtype::kFp8E4m3) != (a == QDtype::kFp8E4m3)) {
    act.fail("dtype",
             "fp8_e4m3 weights run with fp8_e4m3 or float activations, int weights with int8 or float, "
             "and int4 weights also with fp8_e4m3 (W4AFP8)");
  }
  return config;
}

void LinearQConfig::checkFits(const std::string& moduleName, int64_t inFeatures) const {
  const int64_t group = weight.scheme.groupSize;
  QPIPE_REQUIRE(group == 0 || inFeatures % group == 0, ErrorCode::kConfig, moduleName, ": in_features ", inFeatures,
                " is not a multiple of group_size ", group,
                "; give the weight's qconfig an ext: {group_size: N} that divides it (in a --config_path pipeline) or "
                "exclude the module");
}

}  // namespace qpipe::quant
