// msmodelslim's LinearQConfig (msmodelslim/core/quantizer/linear.py): how the input activation
// and the weight of a linear layer are quantized. The YAML block, as processors take it:
//
//   qconfig:
//     act:    {dtype: int8, scope: per_token, symmetric: True, method: minmax}
//     weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: 128}}
//
// act defaults to float (not quantized: W8A16, W4A16); weight is required. ext holds the method
// options: aggregation_type (act minmax: max | mean), search_method (act histogram: l2_norm |
// kl_divergence), step (weight ssz iterations, default 50), group_size (per_group, default 128;
// nvfp4: 16, the only value).
// NVFP4 (qpipe's dtype name; compressed-tensors' NVFP4 / NVFP4A16 presets):
//     weight: {dtype: nvfp4, scope: per_group, symmetric: True, method: minmax}
//     act:    {dtype: nvfp4, scope: per_group, symmetric: True, method: minmax}   # W4A4; or float
// The activations' global scale is calibrated (static), their block scales computed per input.
// MXFP4 (compressed-tensors' MXFP4 / MXFP4A16 presets): dtype mxfp4, the same otherwise; group 32,
// the activations' block scales all computed per input (data-free).
// W4AFP8 (compressed-tensors' W4AFP8 preset): int4 per_group weights, fp8_e4m3 per_token activations.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qpipe/observer.h"
#include "qpipe/quant.h"

namespace qpipe {
class ConfigNode;
class Schema;
}  // namespace qpipe

namespace qpipe::quant {

enum class QMethod { kNone, kMinMax, kHistogram, kSsz };

struct QConfig {
  QScheme scheme;
  QMethod method = QMethod::kMinMax;
  Aggregation aggregation = Aggregation::kMax;
  HistogramObserver::Search search = HistogramObserver::Search::kL2Norm;
  int64_t sszSteps = 50;

  bool enabled() const { return scheme.dtype != QDtype::kFloat; }
  // Activations: computed from each input at run time (per_token, MXFP4 blocks), so no
  // calibration is needed.
  bool isDynamic() const { return quant::isDynamic(scheme); }
};

struct LinearQConfig {
  QConfig act;
  QConfig weight;

  // No static activation to calibrate: weights alone decide everything.
  bool isDataFree() const { return !act.enabled() || act.isDynamic(); }
  // "w int8 per_channel sym (minmax), a int8 per_token sym (dynamic)"
  std::string describe() const;
  // Error(kConfig) naming the module when its input width does not fit the weight's groups.
  void checkFits(const std::string& moduleName, int64_t inFeatures) const;
};

// The schema of a `qconfig` block (field types and allowed spellings).
Schema linearQConfigSchema();

// fa3_quant's QConfig for Q, K or V (msmodelslim's default: int8 per_head symmetric minmax):
// int8 or fp8_e4m3; per_head (static: calibrated, a recall window per head), per_tensor (qpipe's:
// the heads' windows merged, vLLM's fp8 KV cache) or per_token (dynamic); method minmax; dtype
// float leaves that input unquantized. Other values are
// Error(kConfig) naming file:line:col and the field under `path`.
Schema attentionQConfigSchema();
QConfig parseAttentionQConfig(const ConfigNode& node, std::string_view path);

// Reads a `qconfig` block validated by linearQConfigSchema(). Combinations that cannot be run
// (e.g. int4 activations, ssz on per_group, fp8 weights with int8 activations) are
// Error(kConfig) naming file:line:col and the field under `path`. An `ext` key that has no effect
// on its side (group_size beside per_channel, step without ssz; msmodelslim's quantizers pass over
// such keys) is a line "<file:line:col>: <path>.<side>.ext.<key>: <why>; ignored" in `ignored`
// (a processor passes ProcessorContext::configWarnings), or an error where `ignored` is null.
LinearQConfig parseLinearQConfig(const ConfigNode& qconfig, std::string_view path,
                                 std::vector<std::string>* ignored = nullptr);

}  // namespace qpipe::quant
