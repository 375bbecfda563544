// What the two savers share: the temporary directory and its rename, the streaming weights
// writer, the walk over a module's tensors, and the copy of the source's side files.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "qpipe/attention_quant.h"
#include "qpipe/host/savers.h"
#include "qpipe/model.h"
#include "qpipe/processor.h"
#include "qpipe/quant_linear.h"
#include "qpipe/safetensors.h"

namespace qpipe::detail {

// What fa3_quant quantized of one attention's inputs: its q_hook, k_hook and v_hook, each null
// where that input stays in float (at least one is set).
struct AttentionInputs {
  AttentionQuant* q = nullptr;
  AttentionQuant* k = nullptr;
  AttentionQuant* v = nullptr;
};
// What `inputs` lacks of K and V, for an error: "K quantized but not V", "Q quantized but not K and V".
std::string missingKvText(const AttentionInputs& inputs);

class SaverBase : public CheckpointSaver {
 public:
  SaverBase(const SaverOptions& options, CausalLM& model, const std::filesystem::path& saveDir,
            const std::string& weightsPrefix);
  // Without finish(), the temporary directory and everything in it is removed.
  ~SaverBase() override;

  void writeLayer(int64_t index, const std::string& name, Module& layer) final;
  void addFile(const std::string& fileName, const std::string& content) final;
  void finish() final;
  std::string writeSegment(int64_t index, const std::string& name, Module& layer, const SegmentChain& chain) final;
  void adoptSegment(int64_t index, const std::string& segment) final;
  bool writesNonLayerFirst() const final { return true; }

 protected:
  // A quantized module, all of its tensors.
  virtual void writeQuantLinear(const std::string& name, QuantLinear& linear) = 0;
  // A Linear left in float (its tensors go through writeFloat).
  virtual void noteFloatLinear(const std::string& /*name*/) {}
  // An RMSNorm with a bias (msmodelslim's asymmetric smoothing; its tensors go through writeFloat).
  virtual void noteNormBias(const std::string& /*name*/) {}
  // All of their tensors, or Error(kConfig) in one line naming what the format cannot hold: a
  // saver never drops them.
  virtual void writeAttentionQuant(const std::string& attention, const AttentionInputs& inputs) = 0;
  // Writes a non-quantized tensor in the checkpoint dtype.
  virtual void writeFloat(const std::string& name, const at::Tensor& tensor);
  // Whether a tied lm_head.weight is left out (it is the embedding).
  virtual bool skipsTiedHead() const = 0;
  // config.json and the format's description, into `dir` (the temporary directory).
  virtual void writeMetadata(const std::filesystem::path& dir) = 0;
  // What the hooks above noted for writeMetadata since the last call, which then forgets it (a
  // segment's notes); mergeNotes adds such notes as if their modules had been written here.
  virtual std::string takeNotes() = 0;
  virtual void mergeNotes(const std::string& notes) = 0;

  void add(const std::string& name, const at::Tensor& tensor);
  CausalLM& model() { return model_; }
  // The source's config.json, key order kept; "tie_word_embeddings" false when the head was
  // untied (headUntied()).
  nlohmann::ordered_json sourceConfig() const;
  // True when the source ties lm_head to the embedding but lm_head is no longer the embedding
  // (quantized, or changed by a processor): both are then written, and the config says untied.
  bool headUntied() const { return headUntied_; }
  static void writeJson(const std::filesystem::path& path, const nlohmann::ordered_json& json);

 private:
  // Every tensor of `module` (full name `prefix`) except those under `skipPrefix`.
  void writeModule(const std::string& prefix, Module& module, const std::string& skipPrefix);
  // Decoder layer `index`, or the modules outside model.layers (kNonLayer; `module` is the root).
  void writeUnit(int64_t index, const std::string& name, Module& module);
  // Unit `index` is in the checkpoint now; the non-layer modules only before every layer.
  void noteWritten(int64_t index);
  void copySideFiles() const;

  CausalLM& model_;
  std::filesystem::path final_;
  std::filesystem::path temporary_;
  // The partial folder's lock while this saver writes it (CheckpointSaver::lockPartial).
  int lock_ = -1;
  safetensors::WriterOptions writerOptions_;
  std::optional<safetensors::Writer> writer_;
  // While writeSegment collects a layer's tensors: add() keeps them here instead of writing.
  std::vector<std::pair<std::string, at::Tensor>>* collected_ = nullptr;
  std::set<int64_t> layersWritten_;
  uint64_t bytesWritten_ = 0;
  std::chrono::steady_clock::time_point start_;
  bool finished_ = false;
  bool headUntied_ = false;  // set by finish()
  // headUntied() as it was when the non-layer modules came first (CheckpointSaver::kNonLayer).
  std::optional<bool> nonLayerHeadUntied_;
  bool segmentsOnly_ = false;
};

// SaverInfo::checkPlanned of the built-in savers.
void checkCompressedTensorsPlanned(const PlannedOutputs& planned);
void checkAscendV1Planned(const PlannedOutputs& planned);

std::unique_ptr<CheckpointSaver> makeCompressedTensorsSaver(const SaverOptions& options, CausalLM& model,
                                                            const std::filesystem::path& saveDir);
std::unique_ptr<CheckpointSaver> makeAscendV1Saver(const SaverOptions& options, CausalLM& model,
                                                   const std::filesystem::path& saveDir);

}  // namespace qpipe::detail
