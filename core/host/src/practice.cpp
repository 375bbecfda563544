#include "qpipe/host/practice.h"

#include <algorithm>
#include <regex>
#include <set>

#include "qpipe/error.h"

namespace qpipe {

namespace fs = std::filesystem;

QuantType parseQuantType(std::string_view text) {
  static const std::regex kForm(R"(w(\d+)a(\d+)(c8|f4|f8)?(s)?(_fp8|_nvfp4|_mxfp4)?(_static)?)");
  std::cmatch m;
  const std::string value(text);
  QPIPE_REQUIRE(std::regex_match(value.c_str(), m, kForm), ErrorCode::kUsage, "--quant_type '", text,
                "' is not of the form w<bits>a<bits>[c8|f4|f8][s][_fp8|_nvfp4|_mxfp4][_static], e.g. w8a8, w4a16, "
                "w8a8c8, w8a8_fp8, w4a4_nvfp4, w8a8_static");
  QuantType type;
  type.text = value;
  type.wBit = std::stoi(m[1]);
  type.aBit = std::stoi(m[2]);
  const std::string extra = m[3];
  type.kvCache = extra == "c8";
  type.faBit = extra == "f4" ? 4 : extra == "f8" ? 8 : 0;
  type.sparse = m[4].matched;
  type.fp8 = m[5] == "_fp8";
  type.nvfp4 = m[5] == "_nvfp4";
  type.mxfp4 = m[5] == "_mxfp4";
  type.isStatic = m[6].matched;
  QPIPE_REQUIRE(!type.fp8 || type.wBit == 8 || (type.wBit == 4 && type.aBit == 8), ErrorCode::kUsage, "--quant_type '",
                text, "': _fp8 needs 8-bit weights (w8a8_fp8 or w8a16_fp8) or is W4AFP8 (w4a8_fp8)");
  for (const auto& [set, suffix] : {std::pair{type.nvfp4, "_nvfp4"}, std::pair{type.mxfp4, "_mxfp4"}}) {
    QPIPE_REQUIRE(!set || (type.wBit == 4 && (type.aBit == 4 || type.aBit == 16)), ErrorCode::kUsage, "--quant_type '",
                  text, "': ", suffix, " is w4a4", suffix, " or w4a16", suffix);
  }
  QPIPE_REQUIRE(!type.isStatic || type.aBit < 16, ErrorCode::kUsage, "--quant_type '", text,
                "': _static needs quantized activations (a_bit below 16, e.g. w8a8_static)");
  return type;
}

bool labelMatches(const PipelineLabel& label, const QuantType& type) {
  return label.wBit == type.wBit && label.aBit == type.aBit && label.kvCache == type.kvCache &&
         label.faBit == type.faBit && label.isSparse == type.sparse && label.fp8 == type.fp8 &&
         label.nvfp4 == type.nvfp4 && label.mxfp4 == type.mxfp4 && label.isStatic == type.isStatic;
}

namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

bool verifiedFor(const PipelineMetadata& metadata, const std::string& modelType) {
  if (metadata.verifiedModelTypes.empty()) return true;
  return std::any_of(metadata.verifiedModelTypes.begin(), metadata.verifiedModelTypes.end(),
                     [&](const std::string& verified) { return lower(verified) == lower(modelType); });
}

std::string describe(const PipelineLabel& label) {
  std::string out = "w" + std::to_string(label.wBit) + "a" + std::to_string(label.aBit);
  if (label.kvCache) out += "c8";
  if (label.faBit) out += "f" + std::to_string(label.faBit);
  if (label.isSparse) out += "s";
  if (label.fp8) out += "_fp8";
  if (label.nvfp4) out += "_nvfp4";
  if (label.mxfp4) out += "_mxfp4";
  if (label.isStatic) out += "_static";
  return out;
}

}  // namespace

PracticeMatch findPractice(const fs::path& library, const std::string& modelType, const QuantType& type) {
  QPIPE_REQUIRE(fs::is_directory(library), ErrorCode::kUsage, "practice library '", library.string(),
                "' is not a folder");
  std::set<std::string> offered;
  for (const fs::path& folder : {library / lower(modelType), library / "default"}) {
    if (!fs::is_directory(folder)) continue;
    std::vector<PracticeMatch> candidates;
    for (const auto& entry : fs::directory_iterator(folder)) {
      if (entry.path().extension() != ".yaml") continue;
      const PipelineMetadata metadata = readPipelineMetadata(entry.path());
      if (!metadata.label || !verifiedFor(metadata, modelType)) continue;
      offered.insert(describe(*metadata.label));
      if (labelMatches(*metadata.label, type)) candidates.push_back({entry.path(), metadata});
    }
    if (candidates.empty()) continue;
    std::sort(candidates.begin(), candidates.end(), [](const PracticeMatch& a, const PracticeMatch& b) {
      if (a.metadata.score != b.metadata.score) return a.metadata.score > b.metadata.score;
      return a.metadata.configId < b.metadata.configId;
    });
    return candidates.front();
  }
  std::string available;
  for (const auto& name : offered) available += (available.empty() ? "" : ", ") + name;
  throw Error(
      ErrorCode::kUsage,
      concat("no practice in ", library.string(), " for --quant_type ", type.text, " and model type ", modelType,
             available.empty() ? "; the library has none for this model type" : "; available: " + available,
             " (or pass --config_path)"));
}

}  // namespace qpipe
