#include "qpipe/subgraph.h"

#include <array>
#include <utility>

namespace qpipe {

namespace {

constexpr std::array<std::pair<SubgraphType, std::string_view>, 4> kNames{{
    {SubgraphType::kNormLinear, "norm-linear"},
    {SubgraphType::kLinearLinear, "linear-linear"},
    {SubgraphType::kOv, "ov"},
    {SubgraphType::kUpDown, "up-down"},
}};

}  // namespace

std::string_view subgraphTypeName(SubgraphType type) {
  for (const auto& [t, name] : kNames) {
    if (t == type) return name;
  }
  return "unknown";
}

std::optional<SubgraphType> parseSubgraphType(std::string_view name) {
  for (const auto& [t, n] : kNames) {
    if (n == name) return t;
  }
  return std::nullopt;
}

const std::vector<SubgraphType>& allSubgraphTypes() {
  static const std::vector<SubgraphType> types = [] {
    std::vector<SubgraphType> all;
    for (const auto& entry : kNames) all.push_back(entry.first);
    return all;
  }();
  return types;
}

}  // namespace qpipe
