// The processor API: msmodelslim's lifecycle, driven by the layer-wise runner.
//
//   preRun()                       once, before the first layer
//   for each decoder layer:
//     preprocess(request)          e.g. swap Linear modules for observing ones
//     process(request)             the calibration forward over this rank's samples
//     postprocess(request)         e.g. compute scales, deploy quantized modules
//   postRun()                      once, after the last layer
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

// One scheduled unit (normally a decoder layer) with this rank's calibration data.
struct LayerRequest {
  std::string name;                 // HF module name, e.g. "model.layers.3"
  Module* module = nullptr;         // owned by the runner for the duration of the layer
  std::vector<TensorList> inputs;   // one entry per calibration sample held by this rank
  std::vector<TensorList> outputs;  // filled by the calibration forward, same order
  // Runs the layer over `inputs` and fills `outputs`; set by the runner.
  std::function<void(LayerRequest&)> forward;
};

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
  // Default: the calibration forward, unless the processor needs no data.
  virtual void process(LayerRequest& request) {
    if (!isDataFree() && request.forward) request.forward(request);
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
