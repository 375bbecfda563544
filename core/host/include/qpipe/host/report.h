// The quantization report (docs/quantization.md): per decoder layer, the time each processor took and,
// per module a processor replaced, the relative output error of the new module against the
// original on a probe (the first RunnerOptions::probeTokens tokens of this rank's first calibration
// sample, carried through the quantized layers as inference would see them). Without a probe
// (`--probe_tokens 0`) the errors are absent: -1 here, null in the JSON.
//
// Relative error is relative MSE: mean((y_new - y_ref)²) / mean(y_ref²) over the module's (or the
// layer's) output, with y_ref the original module's output for the same input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "qpipe/processor.h"

namespace qpipe {

struct ModuleReport {
  std::string name;    // HF name, e.g. "model.layers.3.mlp.down_proj"
  std::string scheme;  // e.g. "w int8_per_channel_sym, a int8_per_token_sym dynamic"
  double relativeMse = 0;  // kNotProbed without a probe
};
inline constexpr double kNotProbed = -1;

struct LayerReport {
  std::string name;
  double seconds = 0;                    // load to release, probe included
  std::vector<double> processorSeconds;  // preprocess + process + postprocess, per processor
  double relativeMse = kNotProbed;       // the whole layer's output
  std::vector<ModuleReport> modules;
  // This rank's collectives during the layer (multi-rank runs): calls, payload bytes, seconds.
  int64_t syncCollectives = 0;
  int64_t syncBytes = 0;
  double syncSeconds = 0;
  // What processors reported on the unit (LayerRequest::report), in order.
  std::vector<ReportValue> values;

  // Every field as text and back, exactly (a split layer's report travels from its executor).
  std::string serialize() const;
  static LayerReport deserialize(const std::string& text);
};

struct QuantReport {
  std::vector<LayerReport> layers;
  double totalSeconds = 0;

  // What a replaced module is, for ModuleReport::scheme (its type name unless it is quantized).
  static std::string describe(Module& module);
  std::string toJson() const;
  // A short table for stdout: the layers, the worst modules, totals.
  std::string summary(size_t worstModules = 5) const;
};

}  // namespace qpipe
