// The built-in savers (docs/formats.md), registered in every Registry:
// - compressed_tensors (default): HF layout with `quantization_config` in config.json, what
//   vLLM and transformers load.
// - ascendv1_saver: msmodelslim's quant_model_weights*.safetensors + quant_model_description.json.
// Quantized modules are QuantLinear (qpipe/quant_linear.h); every other floating-point tensor is
// written in the source checkpoint's dtype (ModelConfig::checkpointDtype).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "qpipe/saver.h"

namespace qpipe {

// The spec.save step when a pipeline names none.
inline constexpr const char* kDefaultSaver = "compressed_tensors";

struct SaverOptions {
  std::string format = kDefaultSaver;  // compressed_tensors | ascendv1_saver
  double partFileSizeGb = 4;           // >= 0 (the schema's minimum); 0: one file
  // Writes segments only (SaverInfo::segmentFactory): no folder of its own, writeSegment alone.
  bool segmentsOnly = false;
};

// compressed_tensors and ascendv1_saver, with their spec.save schema.
std::vector<SaverInfo> builtinSavers();

// A built-in saver for options that passed the schema (tests and the registered factories).
std::unique_ptr<CheckpointSaver> createBuiltinSaver(const SaverOptions& options, CausalLM& model,
                                                    const std::filesystem::path& saveDir);

}  // namespace qpipe
