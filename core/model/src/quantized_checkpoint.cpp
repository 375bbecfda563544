#include "qpipe/quantized_checkpoint.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <mutex>
#include <optional>
#include <regex>
#include <unordered_map>
#include <vector>

#include "qpipe/attention_quant.h"
#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"

namespace qpipe::detail {

namespace fs = std::filesystem;
using quant::QDtype;
using quant::QScheme;
using quant::QScope;
using safetensors::shapeText;

std::optional<ActivationQuant> writtenInputQuant(const QuantLinear& linear) {
  const auto& input = linear.inputQuant();
  if (!input || input->scheme.dtype == QDtype::kFloat) return std::nullopt;
  return input;
}

std::string compressedTensorsFormat(const QScheme& weight, const std::optional<ActivationQuant>& input) {
  if (weight.dtype == QDtype::kNvfp4) return "nvfp4-pack-quantized";
  if (weight.dtype == QDtype::kMxfp4) return "mxfp4-pack-quantized";
  const bool isFloat = weight.dtype == QDtype::kFp8E4m3;
  // W4AFP8: compressed-tensors' own inference says int-quantized (int8 tensors holding int4
  // values), but vLLM's W4A8Fp8 scheme allocates pack-quantized tensors.
  if (input && weight.dtype == QDtype::kInt4 && input->scheme.dtype == QDtype::kFp8E4m3) return "pack-quantized";
  if (input) return isFloat ? "float-quantized" : "int-quantized";
  return isFloat ? "naive-quantized" : "pack-quantized";
}

namespace {

// `dynamic`: true, false, or "local" (NVFP4 activations: block scales per input, a static global).
SortedJson argsObject(QDtype dtype, const std::string& strategy, bool symmetric, int64_t groupSize,
                      const SortedJson& dynamic) {
  const bool fp4 = quant::isFp4(dtype);
  SortedJson args{{"actorder", nullptr},
                  {"block_structure", nullptr},
                  {"dynamic", dynamic},
                  {"group_size", groupSize > 0 ? SortedJson(groupSize) : SortedJson(nullptr)},
                  {"num_bits", dtype == QDtype::kInt4 || fp4 ? 4 : 8},
                  // Informational for loaders; dynamic arguments carry none (compressed-tensors forces null).
                  {"observer", dynamic == true ? SortedJson(nullptr) : SortedJson("minmax")},
                  {"observer_kwargs", SortedJson::object()},
                  {"strategy", dtype == QDtype::kNvfp4 ? "tensor_group" : strategy},
                  {"symmetric", symmetric},
                  {"type", dtype == QDtype::kFp8E4m3 || fp4 ? "float" : "int"}};
  // compressed-tensors (≥ 0.13, as its NVFP4 and MXFP4 presets write it) rounds the block scales
  // it computes to this dtype: without it, NVFP4 activations would run with fp32 block scales
  // rather than the E4M3 ones vLLM's kernels use, and MX scales would not be powers of two.
  if (dtype == QDtype::kNvfp4) args["scale_dtype"] = "torch.float8_e4m3fn";
  if (dtype == QDtype::kMxfp4) args["scale_dtype"] = "torch.uint8";
  return args;
}

}  // namespace

SortedJson compressedTensorsWeightArgs(const QScheme& weight) {
  std::string strategy;
  switch (weight.scope) {
    case QScope::kPerTensor:
      strategy = "tensor";
      break;
    case QScope::kPerChannel:
      strategy = "channel";
      break;
    case QScope::kPerGroup:
      strategy = "group";
      break;
    default:
      QPIPE_REQUIRE(false, ErrorCode::kConfig, "compressed_tensors: weight scope ", quant::qscopeName(weight.scope),
                    " cannot be saved; weights are per_tensor, per_channel or per_group");
  }
  return argsObject(weight.dtype, strategy, weight.symmetric, weight.groupSize, false);
}

SortedJson compressedTensorsKvCacheArgs(const QScheme& scheme) {
  QPIPE_CHECK(scheme.scope == QScope::kPerTensor || scheme.scope == QScope::kPerHead, "a KV-cache scheme ",
              scheme.name());
  return argsObject(scheme.dtype, scheme.scope == QScope::kPerHead ? "attn_head" : "tensor", scheme.symmetric, 0,
                    false);
}

SortedJson compressedTensorsInputArgs(const ActivationQuant& input) {
  if (input.scheme.dtype == QDtype::kNvfp4) {
    return argsObject(input.scheme.dtype, "tensor_group", true, input.scheme.groupSize, "local");
  }
  if (input.scheme.dtype == QDtype::kMxfp4)
    return argsObject(input.scheme.dtype, "group", true, input.scheme.groupSize, true);
  QPIPE_REQUIRE(input.scheme.scope == QScope::kPerTensor || input.scheme.scope == QScope::kPerToken, ErrorCode::kConfig,
                "compressed_tensors: activation scope ", quant::qscopeName(input.scheme.scope),
                " cannot be saved; activations are per_tensor (static) or per_token (dynamic)");
  QPIPE_REQUIRE(input.scheme.dtype != QDtype::kInt4, ErrorCode::kConfig,
                "compressed_tensors: int4 activations cannot be saved; use int8 or fp8_e4m3");
  return argsObject(input.scheme.dtype, input.isDynamic() ? "token" : "tensor", input.scheme.symmetric, 0,
                    input.isDynamic());
}

namespace {

// The pattern of a "re:" entry, matched in libstdc++'s polynomial mode: a breadth-first search of
// the automaton, where the default backtracks, and took exponential time on a pattern such as
// "(.*)*z" (Python's re backtracks too). Whether a name matches is the same in either mode; the
// one thing polynomial mode refuses is a back-reference, when the pattern is compiled. Each
// pattern is compiled once per process: a model's open and each layer's load match every Linear
// against every pattern (tens of thousands of matches in a many-expert MoE).
const std::regex& targetPattern(const std::string& entry) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::regex> compiled;
  const std::lock_guard lock(mutex);
  if (const auto found = compiled.find(entry); found != compiled.end()) return found->second;
  std::regex pattern(entry.substr(3), std::regex::ECMAScript | std::regex_constants::__polynomial);
  return compiled.emplace(entry, std::move(pattern)).first->second;
}

}  // namespace

bool compressedTensorsMatches(const std::string& target, const std::string& moduleName) {
  if (target == "Linear") return true;
  if (target.rfind("re:", 0) == 0) {
    return std::regex_search(moduleName, targetPattern(target), std::regex_constants::match_continuous);
  }
  return target == moduleName;
}

at::Tensor packInt8(const at::Tensor& q, int64_t dim) {
  QPIPE_CHECK(q.dim() == 2 && (dim == 0 || dim == 1), "packInt8 takes a 2-D tensor and dim 0 or 1");
  const at::Tensor rows = (dim == 0 ? q.t() : q).to(at::kShort) + 128;
  const int64_t words = (rows.size(1) + 3) / 4;
  // Little-endian bytes of a word are its elements 0..3, so a byte view is the bit layout.
  const at::Tensor bytes = at::constant_pad_nd(rows, {0, words * 4 - rows.size(1)}, 0).to(at::kByte).contiguous();
  // Through one dimension: a dimension of size 1 keeps whatever stride it had (a channel zero
  // point's [1, N] has stride 1), which view(kInt) refuses.
  const at::Tensor packed = bytes.reshape({-1}).view(at::kInt).view({rows.size(0), words});
  return dim == 0 ? packed.t().contiguous() : packed;
}

at::Tensor unpackInt8(const at::Tensor& packed, int64_t size, int64_t dim) {
  QPIPE_CHECK(packed.dim() == 2 && (dim == 0 || dim == 1), "unpackInt8 takes a 2-D tensor and dim 0 or 1");
  const at::Tensor words = (dim == 0 ? packed.t() : packed).contiguous();
  const at::Tensor q = (words.view(at::kByte).narrow(1, 0, size).to(at::kShort) - 128).to(at::kChar);
  return dim == 0 ? q.t().contiguous() : q;
}

at::Tensor packInt4Rows(const at::Tensor& q) {
  QPIPE_CHECK(q.dim() == 2 && q.size(0) % 2 == 0, "packInt4Rows takes [out, in] with out even");
  const at::Tensor pairs = q.to(at::kInt).reshape({q.size(0) / 2, 2, q.size(1)});
  const at::Tensor byte =
      pairs.select(1, 1).bitwise_and(0xF).bitwise_left_shift(4).bitwise_or(pairs.select(1, 0).bitwise_and(0xF));
  // 0..255 to the int8 of the same bits without relying on a narrowing conversion.
  return (byte.bitwise_xor(0x80) - 0x80).to(at::kChar).contiguous();
}

at::Tensor unpackInt4Rows(const at::Tensor& packed) {
  QPIPE_CHECK(packed.dim() == 2, "unpackInt4Rows takes a 2-D tensor");
  const at::Tensor bytes = packed.to(at::kInt).bitwise_and(0xFF);
  const auto signedNibble = [](const at::Tensor& n) { return n.bitwise_xor(8) - 8; };
  const at::Tensor low = signedNibble(bytes.bitwise_and(0xF));
  const at::Tensor high = signedNibble(bytes.bitwise_right_shift(4).bitwise_and(0xF));
  return at::stack({low, high}, 1).reshape({packed.size(0) * 2, packed.size(1)}).to(at::kChar).contiguous();
}

at::Tensor deqScaleToInt64(const at::Tensor& deqScale) {
  return deqScale.to(at::kFloat).contiguous().view(at::kInt).to(at::kLong);
}

at::Tensor deqScaleFromInt64(const at::Tensor& stored) {
  return stored.to(at::kInt).contiguous().view(at::kFloat);
}

// ---------------------------------------------------------------------------------------------
// Loading

namespace {

using Json = nlohmann::ordered_json;

// int4 codes held one to a byte (compressed-tensors' int-quantized, msmodelslim's unpacked
// W4A8_DYNAMIC): a code outside int4's range means the description was edited, and no int4
// kernel would compute the weight the file holds.
void requireInt4Codes(const at::Tensor& q, const std::string& tensor, const std::string& dir,
                      const std::string& describedAs) {
  if (q.numel() == 0) return;
  const auto [low, high] = at::aminmax(q);
  const int64_t lowest = low.item<int64_t>(), highest = high.item<int64_t>();
  QPIPE_REQUIRE(lowest >= quant::qmin(QDtype::kInt4) && highest <= quant::qmax(QDtype::kInt4), ErrorCode::kInput,
                "checkpoint ", dir, ": '", tensor, "' holds codes from ", lowest, " to ", highest,
                ", outside int4's [-8, 7], but ", describedAs);
}

Json readJson(const fs::path& path) {
  const std::string text = readInputFile(path);
  try {
    return Json::parse(text, jsonDepthLimit<Json>(path.string()));
  } catch (const Json::exception& e) {
    throw Error(ErrorCode::kInput, concat(path.string(), ": not valid JSON (", e.what(), ")"));
  }
}

// The expected [rows, cols] of a weight's scale for `scheme` and weight [out, in].
std::vector<int64_t> scaleShape(const QScheme& scheme, int64_t out, int64_t in) {
  switch (scheme.scope) {
    case QScope::kPerTensor:
      return {1};
    case QScope::kPerChannel:
      return {out, 1};
    default:
      return {out, in / scheme.groupSize};
  }
}

// `stored` (any float dtype, any shape with the right element count) as fp32 of `shape`.
at::Tensor asShape(const at::Tensor& stored, const std::vector<int64_t>& shape, const std::string& name,
                   const std::string& dir) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  QPIPE_REQUIRE(stored.numel() == numel, ErrorCode::kInput, "checkpoint ", dir, ": '", name, "' has shape ",
                shapeText(stored.sizes()), ", expected ", shapeText(shape));
  return stored.to(at::kFloat).reshape(shape);
}

// What a scale does: multiply codes (a weight's), or divide what is quantized (an activation's,
// a global scale).
enum class ScaleUse { kMultiplies, kDivides };

// A scale is never negative (its sign would flip what it scales), and one that divides is never
// zero either: compressed-tensors and msmodelslim clamp theirs to a small positive value, so
// either is a checkpoint edited by hand.
void requireScaleSign(const at::Tensor& scale, const std::string& name, const std::string& dir, ScaleUse use) {
  if (scale.numel() == 0) return;
  // One pass: NaN reaches both ends, Inf one of them. Checked whatever --allow_non_finite says,
  // which is about weights (docs/cli.md, Validation).
  const auto [low, high] = at::aminmax(scale);
  const double lowest = low.item<double>(), highest = high.item<double>();
  QPIPE_REQUIRE(std::isfinite(lowest) && std::isfinite(highest), ErrorCode::kInput, "checkpoint ", dir, ": '", name,
                "' holds NaN or Inf; a quantization scale is a finite number");
  QPIPE_REQUIRE(lowest > 0 || (lowest == 0 && use == ScaleUse::kMultiplies), ErrorCode::kInput, "checkpoint ", dir,
                ": '", name, "' holds ", lowest, " (its least value); a quantization scale is ",
                use == ScaleUse::kDivides ? "positive" : "never negative");
}

at::Tensor asScale(const at::Tensor& stored, const std::vector<int64_t>& shape, const std::string& name,
                   const std::string& dir, ScaleUse use) {
  // An integer tensor's values would be taken for scales (a dtype edited in the header).
  QPIPE_REQUIRE(at::isFloatingType(stored.scalar_type()), ErrorCode::kInput, "checkpoint ", dir, ": '", name, "' is ",
                c10::toString(stored.scalar_type()), "; a quantization scale is floating point");
  at::Tensor scale = asShape(stored, shape, name, dir);
  requireScaleSign(scale, name, dir, use);
  return scale;
}

// Zero points (compressed-tensors' zero_point, msmodelslim's offsets) as int32 of `shape`: numbers
// (Bool is not one), rounded as a float offset is, in the range of the `codes` they shift, to
// which every quantizer clamps them (fp8 codes have none: 0). An offset of 1e9, or a uint8 255
// that meant -1, was taken as it stood.
at::Tensor asZeroPoints(const at::Tensor& stored, const std::vector<int64_t>& shape, QDtype codes,
                        const std::string& name, const std::string& dir) {
  QPIPE_REQUIRE(stored.scalar_type() != at::kBool, ErrorCode::kInput, "checkpoint ", dir, ": '", name,
                "' is Bool; a zero point is an integer");
  const at::Tensor points = at::round(asShape(stored, shape, name, dir));
  if (points.numel() == 0) return points.to(at::kInt);
  const bool integer = quant::isInt(codes);
  const double low = integer ? quant::qmin(codes) : 0, high = integer ? quant::qmax(codes) : 0;
  const auto [least, most] = at::aminmax(points);
  const double lowest = least.item<double>(), highest = most.item<double>();
  const double outside = lowest < low || std::isnan(lowest) ? lowest : highest;
  QPIPE_REQUIRE(lowest >= low && highest <= high, ErrorCode::kInput, "checkpoint ", dir, ": '", name, "' holds ",
                std::isnan(outside) ? std::string("NaN") : concat(outside), "; a zero point of ",
                quant::qdtypeName(codes), " codes is ",
                integer ? concat("in [", low, ", ", high, "]") : std::string("0"));
  return points.to(at::kInt);
}

// ---- compressed-tensors

struct CtScheme {
  QScheme weight;
  std::optional<ActivationQuant> input;
  std::string format;
  std::vector<std::string> targets;
};

class CompressedTensorsCheckpoint final : public QuantizedCheckpoint {
 public:
  CompressedTensorsCheckpoint(const fs::path& configPath, const Json& config)
      : dir_(configPath.parent_path().string()) {
    const std::string file = configPath.string();
    const auto field = [&](const std::string& path) { return file + ": quantization_config." + path; };
    const auto unsupported = [&](const std::string& path, const Json& value, const std::string& expected) {
      throw Error(ErrorCode::kInput,
                  concat(field(path), " ", value.dump(), " is not supported; qpipe loads ", expected));
    };
    QPIPE_REQUIRE(config.is_object(), ErrorCode::kInput, file, ": quantization_config is not a JSON object");
    const std::string status = config.value("quantization_status", std::string("compressed"));
    if (status != "compressed") {
      unsupported("quantization_status", config["quantization_status"], "\"compressed\" checkpoints");
    }
    for (const char* key : {"sparsity_config", "transform_config"}) {
      if (config.contains(key) && !config[key].is_null() && !config[key].empty()) {
        unsupported(key, config[key], "checkpoints without sparsity or transforms");
      }
    }
    if (config.contains("kv_cache_scheme") && !config["kv_cache_scheme"].is_null()) {
      kvCache_ = parseArgs(config["kv_cache_scheme"], "kv_cache_scheme", field, unsupported, Role::kKvCache).scheme;
    }
    // Module names, class names and "re:" patterns (targets, ignore), each checked as it is read.
    const auto names = [&](const Json& list, const std::string& at) {
      std::vector<std::string> out;
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string entry = concat(at, "[", i, "]");
        QPIPE_REQUIRE(list[i].is_string(), ErrorCode::kInput, field(entry), " is ", list[i].dump(),
                      ", not a module name or \"re:\" pattern");
        const std::string name = list[i].get<std::string>();
        if (name.starts_with("re:")) {
          // std::regex matches by recursion, a level per element of the pattern: 100,000 of them
          // overflowed the stack. compressed-tensors' own patterns are tens of characters.
          constexpr size_t kLongestPattern = 4096;
          QPIPE_REQUIRE(name.size() - 3 <= kLongestPattern, ErrorCode::kInput, field(entry), " '", name.substr(0, 40),
                        "…' is a pattern of ", name.size() - 3, " characters; qpipe reads patterns of up to ",
                        kLongestPattern);
          try {
            targetPattern(name);
          } catch (const std::regex_error& error) {
            throw Error(ErrorCode::kInput,
                        concat(field(entry), " '", name, "' is not a pattern qpipe reads (", error.what(),
                               "): ECMAScript syntax, without Python's (?P<name>...) groups, (?i) flags and "
                               "back-references"));
          }
        }
        out.push_back(name);
      }
      return out;
    };
    const std::string globalFormat = config.value("format", std::string("dense"));
    if (config.contains("ignore") && !config["ignore"].is_null()) {
      QPIPE_REQUIRE(config["ignore"].is_array(), ErrorCode::kInput, field("ignore"), " is not a list");
      ignore_ = names(config["ignore"], "ignore");
    }
    QPIPE_REQUIRE(config.contains("config_groups") && config["config_groups"].is_object(), ErrorCode::kInput,
                  field("config_groups"), " is missing or not an object");
    for (const auto& [groupName, group] : config["config_groups"].items()) {
      const std::string at = "config_groups." + groupName;
      QPIPE_REQUIRE(group.is_object() && group.contains("targets") && group["targets"].is_array(), ErrorCode::kInput,
                    field(at), " is not a scheme object with a 'targets' list");
      CtScheme scheme;
      scheme.targets = names(group["targets"], at + ".targets");
      // No weights: a group on the attention modules, whose input_activations quantize Q, K and V.
      if ((!group.contains("weights") || group["weights"].is_null()) && group.contains("input_activations") &&
          !group["input_activations"].is_null()) {
        try {
          attention_ =
              parseArgs(group["input_activations"], at + ".input_activations", field, unsupported, Role::kKvCache)
                  .scheme;
        } catch (const Error& e) {
          // A Linear scheme that lost its weights reads as this: say which reading was taken.
          throw Error(e.code(), concat(e.what(), " (", at,
                                       " has no 'weights', so it is read as attention's Q, K and V "
                                       "scheme; a Linear scheme needs its 'weights')"));
        }
        attentionTargets_ = scheme.targets;
        continue;
      }
      scheme.format =
          group.contains("format") && group["format"].is_string() ? group["format"].get<std::string>() : globalFormat;
      const std::string formatField = group.contains("format") ? at + ".format" : "format";
      if (scheme.format != "int-quantized" && scheme.format != "float-quantized" &&
          scheme.format != "naive-quantized" && scheme.format != "pack-quantized" &&
          scheme.format != "nvfp4-pack-quantized" && scheme.format != "mxfp4-pack-quantized") {
        unsupported(formatField, scheme.format,
                    "int-quantized, float-quantized, naive-quantized, pack-quantized, nvfp4-pack-quantized and "
                    "mxfp4-pack-quantized");
      }
      if (group.contains("output_activations") && !group["output_activations"].is_null()) {
        unsupported(at + ".output_activations", group["output_activations"], "no output quantization");
      }
      QPIPE_REQUIRE(group.contains("weights") && group["weights"].is_object(), ErrorCode::kInput,
                    field(at + ".weights"), " is missing; qpipe loads schemes that quantize weights");
      scheme.weight = parseArgs(group["weights"], at + ".weights", field, unsupported, Role::kWeight).scheme;
      if (group.contains("input_activations") && !group["input_activations"].is_null()) {
        scheme.input =
            parseArgs(group["input_activations"], at + ".input_activations", field, unsupported, Role::kInput);
      }
      if (scheme.format == "pack-quantized" && scheme.weight.dtype == QDtype::kFp8E4m3) {
        unsupported(formatField, scheme.format, "pack-quantized for int weights only");
      }
      // Each fp4 format holds its own fp4 weights (codes and block scales packed its way), and no others.
      const QDtype dtype = scheme.weight.dtype;
      const bool nvfp4Format = scheme.format == "nvfp4-pack-quantized";
      const bool mxfp4Format = scheme.format == "mxfp4-pack-quantized";
      if (nvfp4Format != (dtype == QDtype::kNvfp4) || mxfp4Format != (dtype == QDtype::kMxfp4)) {
        throw Error(
            ErrorCode::kInput,
            concat(
                field(formatField), " \"", scheme.format, "\" holds ",
                nvfp4Format   ? "nvfp4"
                : mxfp4Format ? "mxfp4"
                              : "no fp4",
                " weights, but quantization_config.", at, ".weights describes ", quant::qdtypeName(dtype), " weights",
                quant::isFp4(dtype) ? concat(", whose format is ", quant::qdtypeName(dtype), "-pack-quantized") : ""));
      }
      schemes_.push_back(std::move(scheme));
    }
  }

  std::string weightsPrefix() const override { return "model"; }

  std::shared_ptr<AttentionQuant> attentionInput(const std::string& attention, char input, int64_t heads,
                                                 const TensorFn& tensor) const override {
    const bool grouped =
        attention_ && std::any_of(attentionTargets_.begin(), attentionTargets_.end(),
                                  [&](const std::string& t) { return compressedTensorsMatches(t, attention); });
    const std::optional<QScheme> scheme = input == 'q' ? (grouped ? attention_ : std::nullopt)
                                                       : (kvCache_  ? kvCache_
                                                          : grouped ? attention_
                                                                    : std::nullopt);
    if (!scheme) return nullptr;
    const std::string name = attention + "." + input + "_scale";
    const at::Tensor stored = tensor(name).to(at::kFloat);
    const bool perHead = scheme->scope == QScope::kPerHead;
    const std::vector<int64_t> expected = perHead ? std::vector<int64_t>{heads, 1, 1} : std::vector<int64_t>{1};
    QPIPE_REQUIRE(stored.sizes().vec() == expected, ErrorCode::kInput, "checkpoint ", dir_, ": '", name, "' has shape ",
                  shapeText(stored.sizes()), ", expected ", shapeText(expected),
                  perHead ? " (attn_head)" : " (tensor)");
    requireScaleSign(stored, name, dir_, ScaleUse::kDivides);
    const at::Tensor scale = perHead ? stored.reshape({1, -1, 1, 1}) : stored.reshape({1});
    return std::make_shared<AttentionQuant>(
        *scheme, quant::QParams{scale, at::zeros_like(scale, scale.options().dtype(at::kInt))});
  }

  std::optional<StoredWeight> storedWeight(const std::string& name, int64_t out, int64_t in) const override {
    const CtScheme* scheme = schemeOf(name);
    if (scheme == nullptr) return std::nullopt;
    if (quant::isFp4(scheme->weight.dtype))
      return StoredWeight{name + ".weight_packed", {out, in / 2}, "two codes a byte"};
    if (scheme->format == "pack-quantized") {
      const int64_t bits = scheme->weight.dtype == QDtype::kInt4 ? 4 : 8;
      return StoredWeight{name + ".weight_packed", {out, (in * bits + 31) / 32}, concat(32 / bits, " codes a word")};
    }
    return StoredWeight{name + ".weight", {out, in}, ""};
  }

  std::shared_ptr<QuantLinear> linear(const std::string& name, bool hasBias, const TensorFn& tensor, const HasFn& has,
                                      at::ScalarType computeDtype) const override {
    const CtScheme* scheme = schemeOf(name);
    if (scheme == nullptr) return nullptr;
    const QScheme& w = scheme->weight;
    at::Tensor q;
    at::Tensor zeroPoint;
    const auto weightShape = [&](int64_t out, int64_t in) {
      QPIPE_REQUIRE(w.scope != QScope::kPerGroup || in % w.groupSize == 0, ErrorCode::kInput, "checkpoint ", dir_,
                    ": '", name, "' has ", in, " input features, not a multiple of group_size ", w.groupSize);
      return scaleShape(w, out, in);
    };
    std::vector<int64_t> paramShape;
    at::Tensor globalScale;
    at::Tensor scale;
    if (quant::isFp4(w.dtype)) {
      const at::Tensor packed = tensor(name + ".weight_packed");
      QPIPE_REQUIRE(packed.scalar_type() == at::kByte && packed.dim() == 2, ErrorCode::kInput, "checkpoint ", dir_,
                    ": '", name, ".weight_packed' is ", c10::toString(packed.scalar_type()), " ",
                    shapeText(packed.sizes()), ", expected 2-D Byte (two E2M1 codes per byte)");
      q = quant::unpackFp4(packed);
      paramShape = weightShape(q.size(0), q.size(1));
      if (w.dtype == QDtype::kNvfp4) {
        globalScale = asScale(tensor(name + ".weight_global_scale"), {1}, name + ".weight_global_scale", dir_,
                              ScaleUse::kDivides);
      } else {
        const at::Tensor exponents = tensor(name + ".weight_scale");
        QPIPE_REQUIRE(exponents.scalar_type() == at::kByte, ErrorCode::kInput, "checkpoint ", dir_, ": '", name,
                      ".weight_scale' is ", c10::toString(exponents.scalar_type()), ", expected Byte (E8M0 exponents)");
        const at::Tensor bytes = asShape(exponents, paramShape, name + ".weight_scale", dir_).to(at::kByte);
        // 255 is E8M0's NaN; from 253 (2^126) up, 6 · scale, FP4's largest value, is past fp32's.
        constexpr int64_t kLargestFinite = 252;
        const int64_t largest = bytes.numel() == 0 ? 0 : bytes.max().item<int64_t>();
        QPIPE_REQUIRE(largest <= kLargestFinite, ErrorCode::kInput, "checkpoint ", dir_, ": '", name,
                      ".weight_scale' holds E8M0 byte ", largest,
                      largest == 255 ? ", NaN in the OCP MX format"
                                     : concat(" (2^", largest - 127, "), whose FP4 values overflow fp32 (at most byte ",
                                              kLargestFinite, ")"));
        scale = quant::fromE8m0(bytes);
      }
    } else if (scheme->format == "pack-quantized") {
      const at::Tensor shape = tensor(name + ".weight_shape").to(at::kCPU).to(at::kLong);
      QPIPE_REQUIRE(shape.numel() == 2, ErrorCode::kInput, "checkpoint ", dir_, ": '", name, ".weight_shape' has ",
                    shape.numel(), " elements, expected 2");
      const int64_t out = shape[0].item<int64_t>(), in = shape[1].item<int64_t>();
      const at::Tensor packed = tensor(name + ".weight_packed");
      const int64_t bits = w.dtype == QDtype::kInt4 ? 4 : 8;
      const std::vector<int64_t> expected{out, (in * bits + 31) / 32};
      QPIPE_REQUIRE(packed.scalar_type() == at::kInt && packed.sizes().vec() == expected, ErrorCode::kInput,
                    "checkpoint ", dir_, ": '", name, ".weight_packed' is ", c10::toString(packed.scalar_type()), " ",
                    shapeText(packed.sizes()), ", expected Int ", shapeText(expected));
      q = bits == 4 ? quant::unpackInt4(packed, in) : unpackInt8(packed, in);
      paramShape = weightShape(out, in);
      if (!w.symmetric || has(name + ".weight_zero_point")) {
        const at::Tensor stored = tensor(name + ".weight_zero_point");
        if (w.scope == QScope::kPerTensor) {
          zeroPoint = asZeroPoints(stored, paramShape, w.dtype, name + ".weight_zero_point", dir_);
        } else {
          zeroPoint = (bits == 4 ? quant::unpackInt4(stored, out, 0) : unpackInt8(stored, out, 0)).to(at::kInt);
        }
      }
    } else {
      q = tensor(name + ".weight");
      const at::ScalarType expected = w.dtype == QDtype::kFp8E4m3 ? at::kFloat8_e4m3fn : at::kChar;
      QPIPE_REQUIRE(q.dim() == 2 && q.scalar_type() == expected, ErrorCode::kInput, "checkpoint ", dir_, ": '", name,
                    ".weight' is ", c10::toString(q.scalar_type()), " ", shapeText(q.sizes()), ", expected 2-D ",
                    c10::toString(expected), " for ", scheme->format);
      if (w.dtype == QDtype::kInt4) {
        requireInt4Codes(q, name + ".weight", dir_, "its quantization_config gives it num_bits 4");
      }
      paramShape = weightShape(q.size(0), q.size(1));
      if (!w.symmetric || has(name + ".weight_zero_point")) {
        zeroPoint =
            asZeroPoints(tensor(name + ".weight_zero_point"), paramShape, w.dtype, name + ".weight_zero_point", dir_);
      }
    }
    // A symmetric scheme has no zero points: non-zero ones were written by an asymmetric one whose
    // description was edited, and would be dropped.
    QPIPE_REQUIRE(!w.symmetric || !zeroPoint.defined() || !zeroPoint.ne(0).any().item<bool>(), ErrorCode::kInput,
                  "checkpoint ", dir_, ": '", name,
                  ".weight_zero_point' holds non-zero zero points, but quantization_config gives the weights "
                  "symmetric: true");
    if (w.symmetric) zeroPoint = at::Tensor();
    if (!scale.defined())
      scale = asScale(tensor(name + ".weight_scale"), paramShape, name + ".weight_scale", dir_, ScaleUse::kMultiplies);
    zeroPoint =
        zeroPoint.defined() ? zeroPoint.reshape(paramShape) : at::zeros_like(scale, scale.options().dtype(at::kInt));
    std::optional<ActivationQuant> input = scheme->input;
    if (input && input->scheme.dtype == QDtype::kNvfp4) {
      input->params.globalScale =
          asScale(tensor(name + ".input_global_scale"), {1}, name + ".input_global_scale", dir_, ScaleUse::kDivides);
    } else if (input && !input->isDynamic()) {
      const at::Tensor inputScale =
          asScale(tensor(name + ".input_scale"), {1}, name + ".input_scale", dir_, ScaleUse::kDivides);
      input->params = {inputScale, input->scheme.symmetric
                                       ? at::zeros_like(inputScale, inputScale.options().dtype(at::kInt))
                                       : asZeroPoints(tensor(name + ".input_zero_point"), {1}, input->scheme.dtype,
                                                      name + ".input_zero_point", dir_)};
    }
    const at::Tensor bias = hasBias ? tensor(name + ".bias").to(computeDtype) : at::Tensor();
    return std::make_shared<QuantLinear>(q, quant::QParams{scale, zeroPoint, globalScale}, w, std::move(input), bias,
                                         computeDtype);
  }

 private:
  // The scheme of Linear `name`: the first whose targets match it, none where `ignore` does.
  const CtScheme* schemeOf(const std::string& name) const {
    for (const auto& entry : ignore_) {
      if (compressedTensorsMatches(entry, name)) return nullptr;
    }
    for (const auto& candidate : schemes_) {
      for (const auto& target : candidate.targets) {
        if (compressedTensorsMatches(target, name)) return &candidate;
      }
    }
    return nullptr;
  }

  // What a QuantizationArgs object describes: a weight, a Linear's input, or the KV cache.
  enum class Role { kWeight, kInput, kKvCache };

  template <typename FieldFn, typename UnsupportedFn>
  static ActivationQuant parseArgs(const Json& args, const std::string& at, const FieldFn& field,
                                   const UnsupportedFn& unsupported, Role role) {
    const bool activation = role != Role::kWeight;
    QPIPE_REQUIRE(args.is_object(), ErrorCode::kInput, field(at), " is not an object");
    const Json type = args.value("type", Json("int"));
    const Json bits = args.value("num_bits", Json(8));
    ActivationQuant out;
    QScheme& s = out.scheme;
    if (type == "int" && bits == 8) {
      s.dtype = QDtype::kInt8;
    } else if (type == "int" && bits == 4 && !activation) {
      s.dtype = QDtype::kInt4;
    } else if (type == "float" && bits == 8) {
      s.dtype = QDtype::kFp8E4m3;
    } else if (type == "float" && bits == 4 && role != Role::kKvCache) {
      s.dtype = QDtype::kNvfp4;  // or MXFP4: told by the strategy below
    } else {
      unsupported(at + ".num_bits", Json{{"num_bits", bits}, {"type", type}},
                  activation ? "int8, fp8, nvfp4 and mxfp4 activations" : "int8, int4, fp8, nvfp4 and mxfp4 weights");
    }
    s.symmetric = args.value("symmetric", true);
    const Json groupSize = args.contains("group_size") ? args["group_size"] : Json(nullptr);
    const Json dynamic = args.value("dynamic", Json(false));
    Json strategy = args.contains("strategy") ? args["strategy"] : Json(nullptr);
    if (strategy.is_null()) {
      // compressed-tensors' inference: no group_size → tensor, > 0 → group, -1 → channel.
      strategy = groupSize.is_null() ? "tensor" : groupSize == -1 ? "channel" : "group";
    }
    for (const char* key : {"block_structure", "actorder"}) {
      const Json value = args.contains(key) ? args[key] : Json(nullptr);
      const bool harmless = value.is_null() || value == false || value == "weight" || value == "static";
      if (!harmless) unsupported(at + "." + key, value, "schemes without blocks or activation-order indices");
    }
    if (role == Role::kKvCache) {
      if (dynamic != false || (strategy != "tensor" && strategy != "attn_head") || !s.symmetric) {
        unsupported(at, Json{{"dynamic", dynamic}, {"strategy", strategy}, {"symmetric", s.symmetric}},
                    "static symmetric tensor and attn_head KV-cache schemes");
      }
      s.scope = strategy == "tensor" ? QScope::kPerTensor : QScope::kPerHead;
      return out;
    }
    if (s.dtype == QDtype::kNvfp4) {
      // vLLM runs NVFP4 as tensor_group with group_size 16 only, its activations with local dynamic
      // scales; MXFP4 as group with group_size 32, its activations dynamic.
      const bool mx = strategy == "group";
      if (mx) s.dtype = QDtype::kMxfp4;
      const Json width = mx ? quant::kMxfp4GroupSize : quant::kNvfp4GroupSize;
      const Json expectedDynamic = !activation ? Json(false) : mx ? Json(true) : Json("local");
      if ((!mx && strategy != "tensor_group") || groupSize != width || !s.symmetric || dynamic != expectedDynamic) {
        unsupported(
            at,
            Json{{"dynamic", dynamic}, {"group_size", groupSize}, {"strategy", strategy}, {"symmetric", s.symmetric}},
            activation ? "nvfp4 activations as symmetric tensor_group, group_size 16, dynamic \"local\", "
                         "and mxfp4 ones as symmetric group, group_size 32, dynamic"
                       : "nvfp4 weights as symmetric tensor_group, group_size 16, static, and mxfp4 ones "
                         "as symmetric group, group_size 32, static");
      }
      s.scope = QScope::kPerGroup;
      s.groupSize = width.get<int64_t>();
      return out;
    }
    // An fp8 zero point would shift values that are not codes in a range; compressed-tensors'
    // fp8 schemes, and vLLM's kernels, are symmetric.
    QPIPE_REQUIRE(s.dtype != QDtype::kFp8E4m3 || s.symmetric, ErrorCode::kInput, field(at + ".symmetric"),
                  " is false; fp8 ", activation ? "activations" : "weights", " are symmetric");
    if (activation) {
      if (strategy == "tensor" && dynamic == false) {
        s.scope = QScope::kPerTensor;
      } else if (strategy == "token" && dynamic == true) {
        s.scope = QScope::kPerToken;
      } else {
        unsupported(at, Json{{"dynamic", dynamic}, {"strategy", strategy}},
                    "static per-tensor and dynamic per-token activations");
      }
      return out;
    }
    if (dynamic != false) unsupported(at + ".dynamic", dynamic, "static weights");
    if (strategy == "tensor") {
      s.scope = QScope::kPerTensor;
    } else if (strategy == "channel") {
      s.scope = QScope::kPerChannel;
    } else if (strategy == "group" && groupSize.is_number_integer() && groupSize.get<int64_t>() > 0) {
      s.scope = QScope::kPerGroup;
      s.groupSize = groupSize.get<int64_t>();
    } else {
      unsupported(at + ".strategy", Json{{"group_size", groupSize}, {"strategy", strategy}},
                  "tensor, channel and group (group_size > 0) weights");
    }
    return out;
  }

  std::string dir_;
  std::vector<std::string> ignore_;
  std::vector<CtScheme> schemes_;
  std::optional<QScheme> kvCache_;
  std::optional<QScheme> attention_;  // a weightless group's, for the attention modules it targets
  std::vector<std::string> attentionTargets_;
};

// ---- ascendv1

class AscendV1Checkpoint final : public QuantizedCheckpoint {
 public:
  AscendV1Checkpoint(const fs::path& path, Json description)
      : file_(path.string()), dir_(path.parent_path().string()), description_(std::move(description)) {
    QPIPE_REQUIRE(description_.is_object(), ErrorCode::kInput, file_, ": not a JSON object");
    const Json groupSize = description_.value("group_size", Json(0));
    QPIPE_REQUIRE(groupSize.is_number_integer() && groupSize.get<int64_t>() >= 0, ErrorCode::kInput, file_,
                  ": group_size ", groupSize.dump(), " is not a size");
    groupSize_ = groupSize.get<int64_t>();
    // vllm-ascend's rule: version "1.0.0" packs W4A8_DYNAMIC weights two per int8, older
    // descriptions keep one int4 value per int8.
    packedInt4_ = description_.value("version", Json("0")) == "1.0.0";
  }

  std::string weightsPrefix() const override { return kAscendWeightsPrefix; }
  bool loadsUndeclaredBiases() const override { return true; }

  // FAQuant: `<attention>.fa_<input>.scale` [heads, 1] with `.offset` (int8 zero points: int8;
  // floating: fp8, zeros). C8 (K and V): `<attention>.<k|v>_proj.kv_cache_scale` and
  // `kv_cache_offset` [heads · head_dim], int8, whose values must be equal within each head.
  std::shared_ptr<AttentionQuant> attentionInput(const std::string& attention, char input, int64_t heads,
                                                 const TensorFn& tensor) const override {
    const std::string fa = attention + ".fa_" + input;
    const std::string c8 = attention + "." + input + "_proj.kv_cache";
    at::Tensor scale, offset;
    QScheme scheme{.dtype = QDtype::kInt8, .scope = QScope::kPerHead};
    if (described(fa + ".scale", "FAQuant")) {
      scale = asScale(tensor(fa + ".scale"), {heads, 1}, fa + ".scale", dir_, ScaleUse::kDivides);
      const at::Tensor stored = tensor(fa + ".offset");
      QPIPE_REQUIRE(stored.scalar_type() == at::kChar || at::isFloatingType(stored.scalar_type()), ErrorCode::kInput,
                    "checkpoint ", dir_, ": '", fa, ".offset' is ", c10::toString(stored.scalar_type()),
                    ", expected Char (int8) or a float type (fp8)");
      if (stored.scalar_type() != at::kChar) scheme.dtype = QDtype::kFp8E4m3;
      offset = asZeroPoints(stored, {heads, 1}, scheme.dtype, fa + ".offset", dir_);
    } else if (input != 'q' && described(c8 + "_scale", "C8")) {
      // Read as `read` checks a tensor of [heads, values a head], before the values are compared.
      const auto perHead = [&](const std::string& name, const auto& read) {
        const at::Tensor stored = tensor(name);
        QPIPE_REQUIRE(stored.numel() % heads == 0, ErrorCode::kInput, "checkpoint ", dir_, ": '", name, "' has shape ",
                      shapeText(stored.sizes()), ", not a multiple of the ", heads, " KV heads");
        const at::Tensor channels = read(stored, std::vector<int64_t>{heads, stored.numel() / heads});
        QPIPE_REQUIRE(channels.eq(channels.narrow(1, 0, 1)).all().item<bool>(), ErrorCode::kInput, "checkpoint ", dir_,
                      ": '", name,
                      "' differs within a KV head (per-channel C8); qpipe runs C8 with one value per head, as it "
                      "writes them");
        return channels.narrow(1, 0, 1).contiguous();
      };
      scale = perHead(c8 + "_scale", [&](const at::Tensor& stored, const std::vector<int64_t>& shape) {
        return asScale(stored, shape, c8 + "_scale", dir_, ScaleUse::kDivides);
      });
      offset = perHead(c8 + "_offset", [&](const at::Tensor& stored, const std::vector<int64_t>& shape) {
        return asZeroPoints(stored, shape, scheme.dtype, c8 + "_offset", dir_);
      });
    } else {
      return nullptr;
    }
    scheme.symmetric = offset.eq(0).all().item<bool>();
    return std::make_shared<AttentionQuant>(
        scheme, quant::QParams{scale.reshape({1, heads, 1, 1}), offset.reshape({1, heads, 1, 1})});
  }

  std::optional<StoredWeight> storedWeight(const std::string& name, int64_t out, int64_t in) const override {
    const std::string type = typeOf(name);
    if (type == "FLOAT") return std::nullopt;
    if (type == "W4A8_DYNAMIC" && packedInt4_) return StoredWeight{name + ".weight", {out / 2, in}, "two rows a row"};
    return StoredWeight{name + ".weight", {out, in}, ""};
  }

  std::shared_ptr<QuantLinear> linear(const std::string& name, bool hasBias, const TensorFn& tensor, const HasFn& has,
                                      at::ScalarType computeDtype) const override {
    const std::string key = name + ".weight";
    const std::string type = typeOf(name);
    if (type == "FLOAT") return nullptr;
    const at::Tensor stored = tensor(key);
    QPIPE_REQUIRE(stored.dim() == 2, ErrorCode::kInput, "checkpoint ", dir_, ": '", key, "' is not 2-D");
    // W4A8_DYNAMIC holds two int4 rows per int8 row; the other types one value per element.
    const bool packed = type == "W4A8_DYNAMIC" && packedInt4_;
    const int64_t out = packed ? 2 * stored.size(0) : stored.size(0), in = stored.size(1);
    QScheme w;
    std::optional<ActivationQuant> input;
    at::Tensor scale, offset;
    if (type == "W8A8") {
      // Static: the weight scale is only present folded into deq_scale = input_scale · weight_scale.
      const at::Tensor inputScale =
          asScale(tensor(name + ".input_scale"), {1}, name + ".input_scale", dir_, ScaleUse::kDivides);
      const at::Tensor inputOffset =
          asZeroPoints(tensor(name + ".input_offset"), {1}, QDtype::kInt8, name + ".input_offset", dir_);
      at::Tensor deq = tensor(name + ".deq_scale");
      deq = deq.scalar_type() == at::kLong ? deqScaleFromInt64(deq) : deq.to(at::kFloat);
      scale = asScale(deq, {out, 1}, name + ".deq_scale", dir_, ScaleUse::kMultiplies) / inputScale;
      w = {.dtype = QDtype::kInt8, .scope = QScope::kPerChannel};
      const bool symmetric = inputOffset.eq(0).all().item<bool>();
      input = ActivationQuant{{.dtype = QDtype::kInt8, .scope = QScope::kPerTensor, .symmetric = symmetric},
                              {inputScale, inputOffset}};
    } else if (type == "W8A8_DYNAMIC" || type == "W8A16" || type == "WFP8AFP8_DYNAMIC" || type == "W4A8_DYNAMIC") {
      scale = tensor(name + ".weight_scale").to(at::kFloat);
      offset = tensor(name + ".weight_offset");
      const bool int4 = type == "W4A8_DYNAMIC";
      w.dtype = type == "WFP8AFP8_DYNAMIC" ? QDtype::kFp8E4m3 : int4 ? QDtype::kInt4 : QDtype::kInt8;
      // W4A8_DYNAMIC is per-channel in msmodelslim's V1 layout; its scale_bias is a term of the
      // NPU kernel that qpipe's forward does not need. The two-level per-group variant (older
      // savers) multiplies a second scale in, which this loader does not.
      QPIPE_REQUIRE(!int4 || !has(name + ".weight_scale_second"), ErrorCode::kInput, "checkpoint ", dir_, ": '", name,
                    ".weight_scale_second' is a two-level per-group W4A8_DYNAMIC weight; qpipe loads "
                    "per-channel W4A8_DYNAMIC");
      if (scale.numel() == out || int4) {
        w.scope = QScope::kPerChannel;
      } else {
        QPIPE_REQUIRE(groupSize_ > 0 && in % groupSize_ == 0, ErrorCode::kInput, "checkpoint ", dir_, ": '", name,
                      ".weight_scale' has shape ", shapeText(scale.sizes()), " but ", file_, " gives group_size ",
                      groupSize_);
        w.scope = QScope::kPerGroup;
        w.groupSize = groupSize_;
      }
      scale = asScale(scale, scaleShape(w, out, in), name + ".weight_scale", dir_, ScaleUse::kMultiplies);
      offset = asZeroPoints(offset, scaleShape(w, out, in), w.dtype, name + ".weight_offset", dir_);
      w.symmetric = offset.eq(0).all().item<bool>();
      if (type != "W8A16") {
        const QDtype act = type == "WFP8AFP8_DYNAMIC" ? QDtype::kFp8E4m3 : QDtype::kInt8;
        input = ActivationQuant{{.dtype = act, .scope = QScope::kPerToken}, {}};
      }
    } else {
      throw Error(ErrorCode::kInput,
                  concat(file_, ": '", key, "' is ", type,
                         "; qpipe loads FLOAT, W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC, W8A16 and WFP8AFP8_DYNAMIC"));
    }
    const at::ScalarType expected = w.dtype == QDtype::kFp8E4m3 ? at::kFloat8_e4m3fn : at::kChar;
    QPIPE_REQUIRE(stored.scalar_type() == expected, ErrorCode::kInput, "checkpoint ", dir_, ": '", key, "' is ",
                  c10::toString(stored.scalar_type()), ", expected ", c10::toString(expected), " for ", type);
    if (w.dtype == QDtype::kInt4 && !packed) requireInt4Codes(stored, key, dir_, concat(file_, " gives it ", type));
    const at::Tensor q = packed ? unpackInt4Rows(stored) : stored;
    const at::Tensor zeroPoint = offset.defined() ? offset : at::zeros_like(scale, scale.options().dtype(at::kInt));
    const at::Tensor bias = hasBias ? tensor(name + ".bias").to(computeDtype) : at::Tensor();
    return std::make_shared<QuantLinear>(q, quant::QParams{scale, zeroPoint}, w, std::move(input), bias, computeDtype);
  }

 private:
  // The quantization type the description gives Linear `name`'s weight ("FLOAT" where it is not
  // quantized).
  std::string typeOf(const std::string& name) const {
    const std::string key = name + ".weight";
    QPIPE_REQUIRE(description_.contains(key) && description_[key].is_string(), ErrorCode::kInput, file_,
                  ": no quantization type for '", key, "'");
    return description_[key].get<std::string>();
  }

  // Whether the description gives `key`, as `type` (Error(kInput) when it gives another).
  bool described(const std::string& key, const std::string& type) const {
    if (!description_.contains(key)) return false;
    QPIPE_REQUIRE(description_[key] == type, ErrorCode::kInput, file_, ": '", key, "' is ", description_[key].dump(),
                  ", expected \"", type, "\"");
    return true;
  }

  std::string file_;
  std::string dir_;
  Json description_;
  int64_t groupSize_ = 0;
  bool packedInt4_ = true;
};

}  // namespace

std::unique_ptr<QuantizedCheckpoint> QuantizedCheckpoint::detect(const fs::path& dir) {
  if (fs::exists(dir / kAscendDescription)) {
    return std::make_unique<AscendV1Checkpoint>(dir / kAscendDescription, readJson(dir / kAscendDescription));
  }
  const fs::path configPath = dir / "config.json";
  if (!fs::exists(configPath)) return nullptr;
  const Json config = readJson(configPath);
  if (!config.is_object() || !config.contains("quantization_config")) return nullptr;
  const Json& quantization = config["quantization_config"];
  const Json method = quantization.is_object() ? quantization.value("quant_method", Json(nullptr)) : Json(nullptr);
  QPIPE_REQUIRE(method == "compressed-tensors", ErrorCode::kInput, configPath.string(),
                ": quantization_config.quant_method ", method.dump(),
                " is not supported; qpipe loads compressed-tensors and ascendv1 checkpoints");
  return std::make_unique<CompressedTensorsCheckpoint>(configPath, quantization);
}

}  // namespace qpipe::detail
