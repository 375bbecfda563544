// The layer-wise runner (docs/architecture.md): msmodelslim's lock-step generated schedule over
// the decoder layers, with only one layer materialised at a time, then the non-layer modules.
//
//   preRun() on every processor
//   for each decoder layer i:
//     load layer i from the checkpoint
//     for each processor: preprocess → process (the calibration forward over this rank's samples,
//                         unless the processor is data-free) → postprocess
//     sink(i, layer)       (the saver writes the layer)
//     barrier of every rank (lock-step: no rank runs more than a layer ahead of rank 0's writing,
//                         so every wait stays well inside the collective timeout)
//     release layer i      (kept with RunnerMode::kModelWise)
//   the non-layer unit (model.embed_tokens, model.norm, lm_head; processor.h): the same three
//     calls, with the last layer's outputs as inputs; the modules processors put in its slots
//     then replace the model's own (the saver writes them at finish())
//   the whole-model unit, when a processor declares wholeModel() (processor.h): those processors
//     alone, on the model's root with every layer resident (they were kept loaded), the samples
//     as inputs; then sink(i, layer) for every layer
//   postRun() on every processor
//
// The next layer's inputs are the outputs of the last calibration forward of the layer, so the
// error of quantized activations propagates as in msmodelslim. When no processor needs data,
// no forward runs at all. Every rank runs every unit, the non-layer one included, in the same
// order, so the collectives processors register there pair up.
//
// Split layers (docs/scheduler.md): a data-free run on several ranks whose processors are all
// layersIndependent(), given RunnerOptions::segments, runs its decoder layers as the parallel
// tasks of one scheduler wave instead: each layer is loaded, processed, probed and written as a
// segment by one rank, and rank 0 adopts the segments in layer order. The report probe's
// hidden state goes from each layer's executor to the next one's through the group's store, so
// the report is the one rank's too; the non-layer unit and postRun() stay on every rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/model.h"
#include "qpipe/process_group.h"
#include "qpipe/processor.h"
#include "qpipe/saver.h"

namespace qpipe {

// The samples rank `rank` of `worldSize` calibrates on: sample i goes to rank i mod worldSize,
// so none is duplicated or dropped and uneven counts are allowed.
template <typename T>
std::vector<T> rankShare(const std::vector<T>& samples, int rank, int worldSize) {
  std::vector<T> share;
  for (size_t i = static_cast<size_t>(rank); i < samples.size(); i += static_cast<size_t>(worldSize)) {
    share.push_back(samples[i]);
  }
  return share;
}

struct QuantReport;

// What a run's forwards execute under: LibTorch's inference mode, or, for a pipeline that trains
// (Processor::trains), gradients off with autograd still available.
class GradientScope {
 public:
  explicit GradientScope(bool trains) {
    if (trains) {
      noGrad_.emplace();
    } else {
      inference_.emplace();
    }
  }

 private:
  std::optional<c10::InferenceMode> inference_;
  std::optional<at::NoGradGuard> noGrad_;
};

// spec.runner (docs/pipeline.md): both run the schedule above; model_wise keeps every decoder layer
// resident (loaded before the first unit, never released), layer_wise one at a time.
enum class RunnerMode { kLayerWise, kModelWise };

// Called once per decoder layer after the last postprocess, before the layer is released; and,
// where RunnerOptions::nonLayerFirst applies, once before layer 0 with index
// CheckpointSaver::kNonLayer for the modules outside model.layers (`layer` is the model's root).
using LayerSink = std::function<void(int64_t index, const std::string& name, Module& layer)>;

// What split layers are written with (CheckpointSaver::writeSegment / adoptSegment).
struct LayerSegments {
  // On the layer's executor, before the layer is released: writes it where `chain` says (the
  // runner passes the chain along the layers through the group's store), returns what adopt takes.
  std::function<std::string(int64_t index, const std::string& name, Module& layer, const SegmentChain& chain)> write;
  // On rank 0 after every layer ran, in layer order: takes the layer write returned `segment` for.
  std::function<void(int64_t index, const std::string& segment)> adopt;
};

struct RunnerOptions {
  // The ranks calibrating together; this rank's samples are its share (rankShare).
  std::shared_ptr<ProcessGroup> group = ProcessGroup::single();
  RunnerMode mode = RunnerMode::kLayerWise;
  // When set, filled per layer (qpipe/report.h). The probe is the first `probeTokens` tokens of
  // the first sample; it costs about three forwards of those tokens per layer, calibration or not
  // (32 × 576 values per module are plenty for a relative MSE; 128 tokens made the probe 70 % of
  // a data-free run, and 32 still take 70 % of a data-free W8A8 run's layer time on SmolLM2).
  // 0: no probe; the report lists each unit's replaced modules without their errors.
  QuantReport* report = nullptr;
  int64_t probeTokens = 32;
  // Set on every rank (or on none) where splitsLayers(): the run splits its layers, and the sink
  // sees none.
  std::optional<LayerSegments> segments;
  // The sink and the segments take the non-layer modules first (CheckpointSaver::kNonLayer) where
  // no step acts on them (Processor::actsOn) and none works on the whole model: a split run then
  // writes them as one more task beside its first layers, not on rank 0 after its last. Set for
  // pipelines whose layers can split (layersSplittable) and savers whose writesNonLayerFirst() is
  // true, on any rank count, so that one rank writes what several do; in a split run, on every
  // rank or on none.
  bool nonLayerFirst = false;
  // The whole-model unit's labels, one [1, seq] per sample (SFT data: -100 off the supervised
  // tokens); empty: each sample's ids.
  std::vector<at::Tensor> labels;
};

// Whether these processors' decoder layers can be split over ranks: layer-wise, every processor
// data-free and layersIndependent().
bool layersSplittable(const std::vector<std::unique_ptr<Processor>>& processors, RunnerMode mode);
// Whether a run of these processors on `worldSize` ranks splits its decoder layers when given
// segments: several ranks, and layersSplittable().
bool splitsLayers(const std::vector<std::unique_ptr<Processor>>& processors, int worldSize, RunnerMode mode);

class LayerWiseRunner {
 public:
  LayerWiseRunner(CausalLM& model, std::vector<std::unique_ptr<Processor>>& processors, RunnerOptions options = {});

  // `samples` are this rank's token ids, each [1, seq] int64 (lengths may differ). A layer's
  // request carries one input per sample: {hidden [1, seq, hidden], cos, sin}; the non-layer
  // unit's carries {hidden}. When every processor is data-free, requests carry none and no
  // calibration forward runs. A float lm_head is converted to the compute dtype on the device
  // (CausalLM::prepareHead) before processors see it.
  void run(const std::vector<at::Tensor>& samples, const LayerSink& sink);

 private:
  CausalLM& model_;
  std::vector<std::unique_ptr<Processor>>& processors_;
  RunnerOptions options_;
};

}  // namespace qpipe
