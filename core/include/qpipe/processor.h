// The processor API: msmodelslim's lifecycle, driven by the layer-wise runner.
//
//   preRun()                       once, before the first layer
//   for each decoder layer, then once for the non-layer modules:
//     preprocess(request)          e.g. swap Linear modules for observing ones
//     process(request)             the calibration forward over this rank's samples
//     postprocess(request)         e.g. compute scales, deploy quantized modules
//   postRun()                      once, after the last unit
//
// The last unit holds the modules outside the decoder layers (model.embed_tokens, model.norm,
// lm_head): its name is "" and its module stands for the model's root without the decoder layers,
// so module names below it are the HF names themselves, matched by include/exclude like any
// module's. Its inputs are the final norm's (the last layer's outputs, {hidden} per sample); its
// forward runs model.norm, and lm_head once a processor has replaced it (the logits feed nothing,
// so only an observing replacement has a use for them), and fills no outputs. What a processor
// puts in its slots replaces the model's own modules after the last postprocess.
//
// Static calibration runs in two phases (docs/quantization.md): modules that observe in the
// forward register in preprocess, in `request.betweenForwards`, what fixes their parameters
// (the cross-rank sync of their observers, then freezing). calibrate(request) — what the default
// process() runs, and a `group` of processors with it — forwards once to observe, runs those
// steps, and forwards again, so the outputs the next layer gets carry the final quantization.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace qpipe {

class ConfigNode;
class Logger;
class Module;  // a node of the model's module tree (HF names), defined by the model runtime

// The positional inputs of one forward call of a layer: one calibration sample.
using TensorList = std::vector<at::Tensor>;

// One scheduled unit (a decoder layer, or the non-layer modules) with this rank's calibration data.
struct LayerRequest {
  std::string name;                 // HF module name, e.g. "model.layers.3"; "" for the non-layer unit
  Module* module = nullptr;         // owned by the runner for the duration of the unit
  std::vector<TensorList> inputs;   // one entry per calibration sample held by this rank
  std::vector<TensorList> outputs;  // filled by a decoder layer's calibration forward, same order
  // Runs the unit over `inputs` and, for a decoder layer, fills `outputs`; set by the runner.
  std::function<void(LayerRequest&)> forward;
  // Run by calibrate() between the observing forward and the propagating one, in order; every
  // rank registers the same steps in the same order (they may call collectives).
  std::vector<std::function<void()>> betweenForwards;
};

// True for the unit of the modules outside the decoder layers.
inline bool isNonLayerUnit(const LayerRequest& request) {
  return request.name.empty();
}

// The full HF name of the module at `path` below request.module ("" is the unit itself).
inline std::string moduleName(const LayerRequest& request, const std::string& path) {
  if (request.name.empty() || path.empty()) return request.name + path;
  return request.name + "." + path;
}

// The calibration forward: `forward`; then, when steps were registered in `betweenForwards`,
// those steps (the list is emptied) and a second `forward` whose outputs replace the first's.
inline void calibrate(LayerRequest& request) {
  if (!request.forward) return;
  request.forward(request);
  if (request.betweenForwards.empty()) return;
  const std::vector<std::function<void()>> steps = std::move(request.betweenForwards);
  request.betweenForwards.clear();
  for (const auto& step : steps) step();
  request.forward(request);
}

// What a processor is built with.
struct ProcessorContext {
  std::shared_ptr<Logger> logger;
  int rank = 0;
  int worldSize = 1;
  // Where the step sits in the pipeline ("spec.process[2]"), for the field paths of the
  // configuration errors a factory throws (Error(kConfig) passes through unwrapped).
  std::string configPath;
};

class Processor {
 public:
  virtual ~Processor() = default;

  virtual void preRun() {}
  virtual void preprocess(LayerRequest& request) { (void)request; }
  // Default: the calibration forward (calibrate()), unless the processor needs no data.
  virtual void process(LayerRequest& request) {
    if (!isDataFree()) calibrate(request);
  }
  virtual void postprocess(LayerRequest& request) { (void)request; }
  virtual void postRun() {}

  // True only when running on W ranks gives the same result as on one rank with all samples.
  virtual bool supportDistributed() const { return false; }
  // True when the processor needs no calibration forward (process() is skipped).
  virtual bool isDataFree() const { return false; }
};

// Builds a processor from its validated configuration (defaults filled in, `type` removed).
using ProcessorFactory = std::function<std::unique_ptr<Processor>(const ConfigNode& config, const ProcessorContext&)>;

}  // namespace qpipe
