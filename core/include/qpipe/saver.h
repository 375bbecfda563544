// Checkpoint savers: a quantized model streamed to disk layer by layer (DESIGN.md §3.6).
//
// Formats:
// - compressed_tensors (default): HF layout with `quantization_config` in config.json, what
//   vLLM and transformers load (reference/formats_and_peers.md §A1).
// - ascendv1_saver: msmodelslim's quant_model_weights*.safetensors +
//   quant_model_description.json (reference/msmodelslim.md §e).
//
// Contract:
// - Everything is written under a temporary sibling of `saveDir`; `saveDir` appears (one rename)
//   only when finish() has written the last byte, so an interrupted run never leaves a directory
//   at `saveDir` that looks complete. A stale temporary directory from a killed run is removed.
// - A non-empty existing `saveDir` is Error(kInput) at create(), before any work.
// - Quantized modules are QuantLinear (qpipe/quant_linear.h); every other floating-point tensor is
//   written in the source checkpoint's dtype (ModelConfig::checkpointDtype).
// - Shards hold at most `partFileSizeGb` GB each (0: one file) and are indexed as HF does.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace qpipe {

class CausalLM;
class Module;

struct SaverOptions {
  std::string format = "compressed_tensors";  // compressed_tensors | ascendv1_saver
  double partFileSizeGb = 4;                  // 0: one file
};

class CheckpointSaver {
 public:
  // `model` supplies the config, the source directory (tokenizer and generation files are
  // copied from it) and, at finish(), the non-layer modules.
  static std::unique_ptr<CheckpointSaver> create(const SaverOptions& options, CausalLM& model,
                                                 const std::filesystem::path& saveDir);
  virtual ~CheckpointSaver() = default;

  // The hidden sibling a save to `saveDir` is written under until finish() renames it,
  // `.<name>.qpipe-partial` (absolute); the launcher of a multi-rank run removes it when a rank
  // was killed before its saver could.
  static std::filesystem::path partialDir(const std::filesystem::path& saveDir);

  // The runner's LayerSink: writes every parameter of decoder layer `index` (full name `name`).
  virtual void writeLayer(int64_t index, const std::string& name, Module& layer) = 0;
  // A file written beside the weights (e.g. the quantization report).
  virtual void addFile(const std::string& fileName, const std::string& content) = 0;
  // Writes the non-layer modules, the index, config.json / the description, copies the
  // tokenizer and generation files, and renames the directory into place.
  virtual void finish() = 0;
};

}  // namespace qpipe
