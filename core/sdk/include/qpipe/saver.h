// Checkpoint savers: a quantized model streamed to disk layer by layer (docs/formats.md).
// Savers are registered like processors (name → schema → factory, qpipe/plugin.h addSaver); the
// host registers compressed_tensors (default; what vLLM and transformers load) and
// ascendv1_saver (msmodelslim's layout), and a spec.save step names one by its `type`.
//
// Contract of every saver:
// - Everything is written under partialDir(saveDir); `saveDir` appears (one rename) only when
//   finish() has written the last byte, so an interrupted run never leaves a directory at
//   `saveDir` that looks complete. A stale partial directory from a killed run is removed.
// - A non-empty existing `saveDir` is Error(kInput) when the saver is created, before any work.
// - Shards hold at most `part_file_size` GB each (0: one file) and are indexed as HF does.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "qpipe/schema.h"

namespace qpipe {

class CausalLM;
class ConfigNode;
class Module;
struct PlannedOutputs;

// How the executor of a split layer learns where its bytes go: start() blocks until the layer
// before it was laid out and returns that layer's passOn text (empty for layer 0); passOn gives
// the position after this layer to the next one's executor. Both texts are the saver's own.
struct SegmentChain {
  std::function<std::string()> start;
  std::function<void(const std::string& end)> passOn;
};

class CheckpointSaver {
 public:
  virtual ~CheckpointSaver() = default;

  // The hidden sibling a save to `saveDir` is written under until finish() renames it,
  // `.<name>.qpipe-partial` (absolute); the launcher of a multi-rank run removes it when a rank
  // was killed before its saver could.
  // A `saveDir` that is a symbolic link to a folder stands for that folder.
  static std::filesystem::path partialDir(const std::filesystem::path& saveDir);
  // The lock a saver holds on its partial folder while it writes (flock of the folder), so that
  // another run given the same path neither takes it for an interrupted save's nor removes it:
  // a descriptor to close once done, -1 where there is nothing to lock (no folder, or a file
  // system without such locks, NFS: it then guards nothing), nullopt where another process
  // holds it.
  static std::optional<int> lockPartial(const std::filesystem::path& partial);

  // The runner's LayerSink: writes every parameter of decoder layer `index` (full name `name`).
  // With index kNonLayer (only to a saver whose writesNonLayerFirst() is true): the model's
  // modules outside model.layers (`layer` is the model's root, `name` empty), before layer 0.
  virtual void writeLayer(int64_t index, const std::string& name, Module& layer) = 0;
  // A file written beside the weights (e.g. the quantization report).
  virtual void addFile(const std::string& fileName, const std::string& content) = 0;
  // Writes the non-layer modules (unless they came first), the index and the metadata, copies the
  // tokenizer and generation files, and renames the directory into place.
  virtual void finish() = 0;

  // The layer index that stands for the modules outside model.layers (embeddings, final norm,
  // lm_head). Where no step acts on them (Processor::actsOn), the runner hands them to a saver
  // that takes them first before layer 0, and a run that splits its layers writes them as one
  // more segment, beside the first layers, instead of on rank 0 after the last.
  static constexpr int64_t kNonLayer = -1;
  // Whether writeLayer, writeSegment and adoptSegment take kNonLayer. A saver that says no gets
  // the non-layer modules at finish(), as always.
  virtual bool writesNonLayerFirst() const { return false; }

  // A run that splits its decoder layers over the ranks (docs/scheduler.md) has each rank write
  // the layers it executed, on a saver from SaverInfo::segmentFactory, straight into rank 0's
  // partial folder: writeSegment lays layer `index` out after the layers before it (chain.start(),
  // which waits for them), hands the position after it on (chain.passOn), writes it and returns
  // what rank 0 needs to adopt it. Rank 0's saver adopts the layers in layer order and writes the
  // checkpoint writeLayer would have written, byte for byte. Only for savers that have a
  // segmentFactory. kNonLayer, where the saver writes the non-layer modules first, is the segment
  // before layer 0 (chain.start() returns at once).
  virtual std::string writeSegment(int64_t index, const std::string& name, Module& layer, const SegmentChain& chain);
  // Takes layer `index`, written by writeSegment, which returned `segment`.
  virtual void adoptSegment(int64_t index, const std::string& segment);
};

// Builds a saver from its validated spec.save step (defaults filled in, `type` removed).
// `model` supplies the config, the source directory and, at finish(), the non-layer modules.
using SaverFactory = std::function<std::unique_ptr<CheckpointSaver>(const ConfigNode& config, CausalLM& model,
                                                                    const std::filesystem::path& saveDir)>;

struct SaverInfo {
  std::string type;  // the YAML `type` of a spec.save step
  std::string description;
  Schema schema;
  SaverFactory factory;
  // Optional: a saver of the same format and configuration that only writes segments (it makes no
  // folder of its own); without one, a run never splits its layers.
  SaverFactory segmentFactory;
  // Optional: Error(kConfig) for what a step plans (Processor::plannedOutputs) that this saver
  // cannot write whatever the other steps do, saying what and why ("<type>: its Linear modules
  // would have …"); the host puts the step's file:line and path in front. What only the steps
  // together decide stays with the saver's write.
  std::function<void(const PlannedOutputs& planned)> checkPlanned;
};

}  // namespace qpipe
