// The practice library: `qpipe quant --quant_type w8a8` picks a pipeline YAML from configs/ by its
// metadata.label, following msmodelslim's rules (docs/pipeline.md).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "qpipe/host/pipeline.h"

namespace qpipe {

// w<W>a<A>[c8|f4|f8][s][_fp8|_nvfp4|_mxfp4][_static]: weight and activation bits, int8 KV cache
// (c8) or attention quantized to 4/8 bits (f4/f8), sparse (s), and qpipe's own suffixes: _fp8 for
// fp8_e4m3 weights and activations instead of int (w8a8_fp8; w8a16_fp8 is fp8 weight-only; w4a8_fp8
// is W4AFP8, int4 weights with fp8 activations), _nvfp4 / _mxfp4 for NVFP4 / MXFP4 (w4a4_nvfp4;
// w4a16_nvfp4 is weight-only),
// _static for activations with calibrated scales instead of per-token ones computed at run time
// (msmodelslim's grammar cannot tell the two apart; its model-specific folders decide).
struct QuantType {
  std::string text;
  int wBit = 0;
  int aBit = 0;
  bool kvCache = false;
  int faBit = 0;
  bool sparse = false;
  bool fp8 = false;
  bool nvfp4 = false;
  bool mxfp4 = false;
  bool isStatic = false;
};

// Error(kUsage) naming the text and the accepted form.
QuantType parseQuantType(std::string_view text);
bool labelMatches(const PipelineLabel& label, const QuantType& type);

struct PracticeMatch {
  std::filesystem::path file;
  PipelineMetadata metadata;
};

// Looks in <library>/<modelType>/ first, then <library>/default/. In a folder, the matching
// practices are ordered by score (highest first), then config_id; a practice whose
// verified_model_types is not empty must list the model type (case-insensitive). Unlike
// msmodelslim, there is no silent fallback to another quant type: no match is Error(kUsage)
// listing the quant types the library offers for that model type.
PracticeMatch findPractice(const std::filesystem::path& library, const std::string& modelType, const QuantType& type);

}  // namespace qpipe
