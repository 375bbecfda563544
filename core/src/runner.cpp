#include "qpipe/runner.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "qpipe/dist/process_group.h"
#include "qpipe/error.h"
#include "qpipe/log.h"
#include "qpipe/progress.h"
#include "qpipe/report.h"

namespace qpipe {

namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TensorList embedSample(CausalLM& model, const at::Tensor& ids) {
  QPIPE_CHECK(ids.dim() == 2 && ids.size(0) == 1, "calibration samples are [1, seq] token ids, got ", ids.sizes());
  const at::Tensor positions = at::arange(ids.size(1), at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  const Rotary rotary = model.rotary(positions.to(model.options().device));
  return {model.embed(ids.to(model.options().device)), rotary.cos, rotary.sin};
}

at::Tensor forwardLayer(DecoderLayer& layer, const TensorList& input) {
  return layer.forward(input[0], Rotary{input[1], input[2]}, at::Tensor());
}

double relativeMse(const at::Tensor& value, const at::Tensor& reference) {
  const at::Tensor ref = reference.to(at::kDouble);
  const double power = ref.pow(2).mean().item<double>();
  const double error = (value.to(at::kDouble) - ref).pow(2).mean().item<double>();
  return power > 0 ? error / power : error;
}

// One sample carried beside the calibration data: before the processors run, it records every
// Linear's input and output in the float layer; afterwards each module a processor replaced is
// run on the recorded input and compared with the recorded output.
class Probe {
 public:
  explicit Probe(TensorList input) : input_(std::move(input)) {}

  void recordFloat(DecoderLayer& layer, const std::string& prefix) {
    std::vector<std::pair<Module*, Module::HookHandle>> hooks;
    for (auto& [name, module] : layer.namedModules(prefix)) {
      if (module->typeName() != "Linear") continue;
      hooks.emplace_back(module,
                         module->addForwardHook([this, name](Module&, const at::Tensor& x, const at::Tensor& y) {
                           io_[name] = {x, y};
                           return at::Tensor();
                         }));
    }
    floatOutput_ = forwardLayer(layer, input_);
    for (auto& [module, handle] : hooks) module->removeHook(handle);
  }

  // Fills the module and layer errors, and moves the probe on to the quantized layer's output.
  void compare(DecoderLayer& layer, const std::string& prefix, LayerReport& report) {
    for (auto& [name, module] : layer.namedModules(prefix)) {
      const auto it = io_.find(name);
      if (it == io_.end() || module->typeName() == "Linear") continue;
      const auto& [x, y] = it->second;
      report.modules.push_back({name, QuantReport::describe(*module), relativeMse((*module)(x), y)});
    }
    const at::Tensor output = forwardLayer(layer, input_);
    report.relativeMse = relativeMse(output, floatOutput_);
    input_[0] = output;
    io_.clear();
    floatOutput_ = at::Tensor();
  }

 private:
  TensorList input_;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> io_;
  at::Tensor floatOutput_;
};

}  // namespace

LayerWiseRunner::LayerWiseRunner(CausalLM& model, std::vector<std::unique_ptr<Processor>>& processors,
                                 RunnerOptions options)
    : model_(model), processors_(processors), options_(options) {
  QPIPE_CHECK(options.worldSize >= 1 && options.rank >= 0 && options.rank < options.worldSize, "rank ", options.rank,
              " of ", options.worldSize);
}

void LayerWiseRunner::run(const std::vector<at::Tensor>& samples, const LayerSink& sink) {
  c10::InferenceMode inference;
  const auto runStart = Clock::now();
  const bool needsData = std::any_of(processors_.begin(), processors_.end(),
                                     [](const auto& processor) { return !processor->isDataFree(); });
  for (auto& processor : processors_) processor->preRun();

  // Layer 0's inputs: the embeddings of every sample, with its rotary tables.
  std::vector<TensorList> inputs;
  if (needsData) {
    for (const at::Tensor& ids : samples) inputs.push_back(embedSample(model_, ids));
  }
  std::optional<Probe> probe;
  if (options_.report != nullptr && !samples.empty()) {
    probe.emplace(embedSample(model_, samples.front().slice(1, 0, options_.probeTokens)));
  }

  const int64_t layers = model_.config().numLayers;
  ProgressBar bar("layers", layers, "layers");
  for (int64_t index = 0; index < layers; ++index) {
    const auto layerStart = Clock::now();
    const dist::ProcessGroup::Traffic trafficBefore = dist::world().traffic();
    DecoderLayer& layer = model_.layer(index);
    LayerRequest request{.name = model_.layerName(index), .module = &layer, .inputs = std::move(inputs)};
    request.forward = [&layer](LayerRequest& r) {
      r.outputs.clear();
      for (const TensorList& input : r.inputs) r.outputs.push_back({forwardLayer(layer, input)});
    };
    LayerReport report{.name = request.name};
    if (probe) probe->recordFloat(layer, request.name);
    bool forwarded = false;
    for (auto& processor : processors_) {
      const auto start = Clock::now();
      processor->preprocess(request);
      if (!processor->isDataFree()) {
        processor->process(request);
        forwarded = true;
      }
      processor->postprocess(request);
      report.processorSeconds.push_back(secondsSince(start));
    }
    if (probe) probe->compare(layer, request.name, report);
    if (sink) sink(index, request.name, layer);

    inputs = std::move(request.inputs);
    if (forwarded) {
      QPIPE_CHECK(request.outputs.size() == inputs.size(), "layer ", request.name, ": ", request.outputs.size(),
                  " outputs for ", inputs.size(), " inputs");
      for (size_t s = 0; s < inputs.size(); ++s) inputs[s][0] = request.outputs[s][0];
    }
    model_.releaseLayer(index);
    // glibc keeps freed heap otherwise, and the layer's buffers would pile up over the run.
    ::malloc_trim(0);
    report.seconds = secondsSince(layerStart);
    const dist::ProcessGroup::Traffic traffic = dist::world().traffic();
    report.syncCollectives = traffic.collectives - trafficBefore.collectives;
    report.syncBytes = traffic.bytes - trafficBefore.bytes;
    report.syncSeconds = traffic.seconds - trafficBefore.seconds;
    if (options_.report != nullptr) options_.report->layers.push_back(std::move(report));
    bar.update(index + 1);
  }
  for (auto& processor : processors_) processor->postRun();
  if (options_.report != nullptr) options_.report->totalSeconds = secondsSince(runStart);
  log::logger()->debug("runner: ", layers, " layers, ", samples.size(), " samples on rank ", options_.rank, "/",
                       options_.worldSize);
}

}  // namespace qpipe
