// Smoothing subgraphs: where a per-channel scale can move between a producer and the Linears
// that consume its output without changing the float model (docs/smoothing.md). A model family
// declares them for its decoder layers (DecoderLayer::subgraphs); the smoothing processors only
// read the declarations, so a family without one is an error rather than a guess.
//
// With per-input-channel scales s, the consumers' weights become W[:, j]·s_j and the producer's
// output channel j is divided by s_j:
//   norm-linear    a norm (weight, and bias if it has one) → the Linears that read its output
//   linear-linear  a Linear's output rows (weight and bias) → the Linears that read them
//   ov             v_proj → o_proj, through attention: o_proj's input channel h·headDim + d reads
//                  v_proj's output channel (h / (heads / kvHeads))·headDim + d, so o_proj's scales
//                  are equal across the heads of one KV group (the MQGA reduction)
//   up-down        up_proj → down_proj, through the gated product silu(gate)·up
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qpipe {

enum class SubgraphType { kNormLinear, kLinearLinear, kOv, kUpDown };

// msmodelslim's names: "norm-linear", "linear-linear", "ov", "up-down".
std::string_view subgraphTypeName(SubgraphType type);
std::optional<SubgraphType> parseSubgraphType(std::string_view name);
const std::vector<SubgraphType>& allSubgraphTypes();

struct Subgraph {
  SubgraphType type;
  std::string source;                // the producer's path below the layer
  std::vector<std::string> targets;  // the consumers' paths; targets[0] reads every token the others read
  // ov only: attention's head counts and head size.
  int64_t heads = 0;
  int64_t kvHeads = 0;
  int64_t headDim = 0;
};

}  // namespace qpipe
