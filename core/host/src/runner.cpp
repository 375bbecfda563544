#include "qpipe/host/runner.h"

#include <ATen/ATen.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string_view>

#include "qpipe/error.h"
#include "qpipe/host/report.h"
#include "qpipe/log.h"
#include "qpipe/progress.h"
#include "qpipe/saver.h"
#include "qpipe/scheduler/task_scheduler.h"
#include "qpipe/staged.h"

namespace qpipe {

namespace {

using Clock = std::chrono::steady_clock;

// The report's entries of the units whose requests' name is "".
constexpr std::string_view kNonLayerReportName = "(non-layer modules)";
constexpr std::string_view kWholeModelReportName = "(whole model)";

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
// Linear's input and output in the float unit; afterwards each module a processor replaced is
// run on the recorded input and compared with the recorded output.
class Probe {
 public:
  using Forward = std::function<at::Tensor(const TensorList&)>;

  explicit Probe(TensorList input) : input_(std::move(input)) {}

  void recordFloat(Module& unit, const std::string& prefix, const Forward& forward) {
    const FewRowsGemm fewRows;
    std::vector<std::pair<Module*, Module::HookHandle>> hooks;
    for (auto& [name, module] : unit.namedModules(prefix)) {
      if (module->typeName() != "Linear") continue;
      hooks.emplace_back(module,
                         module->addForwardHook([this, name](Module&, const at::Tensor& x, const at::Tensor& y) {
                           io_[name] = {x, y};
                           return at::Tensor();
                         }));
    }
    floatOutput_ = forward(input_);
    for (auto& [module, handle] : hooks) module->removeHook(handle);
  }

  const TensorList& input() const { return input_; }

  // Fills the module errors and the unit's. A decoder layer's quantized output becomes the probe's
  // next input; the non-layer unit is compared only when a processor replaced one of its modules.
  // `output`: the unit's output on the probe when it was already computed.
  void compare(Module& unit, const std::string& prefix, const Forward& forward, bool propagate, LayerReport& report,
               at::Tensor output = {}) {
    const FewRowsGemm fewRows;
    for (auto& [name, module] : unit.namedModules(prefix)) {
      const auto it = io_.find(name);
      if (it == io_.end() || module->typeName() == "Linear") continue;
      const auto& [x, y] = it->second;
      report.modules.push_back({name, QuantReport::describe(*module), relativeMse((*module)(x), y)});
    }
    if (propagate || !report.modules.empty()) {
      if (!output.defined()) output = forward(input_);
      report.relativeMse = relativeMse(output, floatOutput_);
      if (propagate) input_[0] = output;
    }
    io_.clear();
    floatOutput_ = at::Tensor();
  }

 private:
  TensorList input_;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> io_;
  at::Tensor floatOutput_;
};

// The non-layer unit's module: shaped like the model's root without model.layers ("model" holding
// embed_tokens and norm, then lm_head), its slots holding the root's own modules. namedModules()
// gives their HF names; a processor's replacement stays in the unit until writeBack().
class NonLayerUnit {
 public:
  explicit NonLayerUnit(Module& root) : module_(std::make_shared<Module>(root.typeName())) {
    mirror(root, *module_, "");
  }

  Module& module() { return *module_; }
  // The root's modules the unit holds ("model.embed_tokens", "model.norm", "lm_head").
  const std::vector<std::string>& paths() const { return paths_; }

  // Puts each module a processor replaced in the unit in its place in `root`; returns their paths.
  std::vector<std::string> writeBack(Module& root) {
    for (const auto& [path, container] : containers_) {
      QPIPE_CHECK(&module_->getSubmodule(path) == container, "a processor replaced '", path,
                  "' in the non-layer unit; replace the modules below it instead");
    }
    std::vector<std::string> replaced;
    for (const std::string& path : paths_) {
      const size_t dot = path.rfind('.');
      Module& parent = dot == std::string::npos ? *module_ : module_->getSubmodule(path.substr(0, dot));
      const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
      for (const auto& [childName, child] : parent.children()) {
        if (childName == name && child.get() != &root.getSubmodule(path)) {
          root.replace(path, child);
          replaced.push_back(path);
        }
      }
    }
    return replaced;
  }

 private:
  static constexpr std::string_view kLayers = "model.layers";

  void mirror(Module& source, Module& target, const std::string& prefix) {
    for (const auto& [name, child] : source.children()) {
      const std::string path = prefix.empty() ? name : prefix + "." + name;
      if (path == kLayers) continue;
      if (kLayers.starts_with(path + ".")) {
        auto container = std::make_shared<Module>(child->typeName());
        target.addChild(name, container);
        containers_.emplace_back(path, container.get());
        mirror(*child, *container, path);
      } else {
        target.addChild(name, child);
        paths_.push_back(path);
      }
    }
  }

  std::shared_ptr<Module> module_;
  std::vector<std::pair<std::string, Module*>> containers_;  // the unit's own modules above the slots
  std::vector<std::string> paths_;                           // the root's modules it holds
};

// The probe chain over split layers: the hidden state that enters layer `index`, in the group's
// store as the raw bytes of [1, tokens, hidden] in the compute dtype, or one of these markers.
std::string probeKey(int64_t index) {
  return "runner/probe/" + std::to_string(index);
}
constexpr std::string_view kProbeOff = "off";  // the run has no report
// On either chain: the layer before failed (its error is the run's).
constexpr std::string_view kLayerFailed = "failed";

// The segment chain (SegmentChain) over split layers: where layer `index`'s bytes start, as
// "+<the saver's text>", or kLayerFailed.
std::string segmentKey(int64_t index) {
  return "runner/segment/" + std::to_string(index);
}

std::string hiddenBytes(const at::Tensor& hidden) {
  const at::Tensor flat = hidden.contiguous().cpu();
  return {static_cast<const char*>(flat.data_ptr()), flat.nbytes()};
}

// The probe's input from hiddenBytes: the hidden state with its rotary tables.
TensorList probeInput(CausalLM& model, const std::string& bytes) {
  const ModelConfig& config = model.config();
  const at::ScalarType dtype = model.options().dtype;
  const int64_t tokens = static_cast<int64_t>(bytes.size() / c10::elementSize(dtype)) / config.hiddenSize;
  at::Tensor hidden = at::empty({1, tokens, config.hiddenSize}, at::TensorOptions().dtype(dtype));
  std::memcpy(hidden.data_ptr(), bytes.data(), bytes.size());
  const at::Tensor positions = at::arange(tokens, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  const Rotary rotary = model.rotary(positions.to(model.options().device));
  return {hidden.to(model.options().device), rotary.cos, rotary.sin};
}

// What one unit (a decoder layer, or the non-layer modules) runs: the probe's float record, every
// processor's preprocess → process → postprocess, the probe's comparison, and the report.
struct UnitRun {
  LayerRequest& request;
  Probe::Forward probeForward;
  bool propagateProbe;  // a decoder layer's quantized probe output is the next layer's probe input
  // What request.forwardUntil is for a step that a later forward follows; unset where samples
  // cannot stop early.
  std::function<void(LayerRequest&, const std::vector<Module*>&)> forwardUntil;
};

// Thrown by forwardUntil's last hook of a sample, caught around that sample's forward.
struct SampleDone {};

// LayerRequest::forwardUntil for `layer`: a pre-hook on every watched module marks it seen for
// the running sample (registered after the step's own hooks, so it runs after them), and the
// last one ends the sample. A module called twice in a sample is seen once.
void forwardLayerUntil(DecoderLayer& layer, LayerRequest& r, const std::vector<Module*>& watched) {
  r.outputs.assign(r.inputs.size(), {});
  std::vector<bool> seen(watched.size());
  size_t remaining = 0;
  std::vector<std::pair<Module*, Module::HookHandle>> hooks;
  const auto removeHooks = [&] {
    for (auto& [module, handle] : hooks) module->removeHook(handle);
  };
  for (size_t i = 0; i < watched.size(); ++i) {
    hooks.emplace_back(watched[i], watched[i]->addForwardPreHook([&seen, &remaining, i](Module&, const at::Tensor&) {
      if (!seen[i]) {
        seen[i] = true;
        if (--remaining == 0) throw SampleDone{};
      }
      return at::Tensor();
    }));
  }
  const auto sample = [&](int64_t s) {
    std::fill(seen.begin(), seen.end(), false);
    remaining = watched.size();
    try {
      forwardLayer(layer, r.inputs[static_cast<size_t>(s)]);
    } catch (const SampleDone&) {
    }
  };
  try {
    runStaged(static_cast<int64_t>(r.inputs.size()), sample);
  } catch (...) {
    removeHooks();
    throw;
  }
  removeHooks();
}

}  // namespace

LayerWiseRunner::LayerWiseRunner(CausalLM& model, std::vector<std::unique_ptr<Processor>>& processors,
                                 RunnerOptions options)
    : model_(model), processors_(processors), options_(std::move(options)) {
  QPIPE_CHECK(options_.group != nullptr, "the runner needs a process group");
}

bool layersSplittable(const std::vector<std::unique_ptr<Processor>>& processors, RunnerMode mode) {
  return mode == RunnerMode::kLayerWise && std::all_of(processors.begin(), processors.end(), [](const auto& processor) {
           return processor->isDataFree() && processor->layersIndependent();
         });
}

bool splitsLayers(const std::vector<std::unique_ptr<Processor>>& processors, int worldSize, RunnerMode mode) {
  return worldSize > 1 && layersSplittable(processors, mode);
}

void LayerWiseRunner::run(const std::vector<at::Tensor>& samples, const LayerSink& sink) {
  const GradientScope gradients(anyTrains(processors_));
  const auto runStart = Clock::now();
  ProcessGroup& group = *options_.group;
  // The processors of the layer and non-layer units: all but the whole-model ones, which see only
  // the whole-model unit at the end.
  const auto onUnits = [](const std::unique_ptr<Processor>& processor) { return !processor->wholeModel(); };
  const bool wholeModel = anyWholeModel(processors_);
  const bool needsData = std::any_of(processors_.begin(), processors_.end(), [&](const auto& processor) {
    return onUnits(processor) && needsCalibration(*processor);
  });
  const bool split = options_.segments.has_value();
  QPIPE_CHECK(!split || splitsLayers(processors_, group.worldSize(), options_.mode),
              "segments for a run that cannot split its layers");
  for (auto& processor : processors_) processor->preRun();
  // What no step acts on is final now: where the saver takes it, it goes before layer 0.
  const auto nonLayerActed = [&](const LayerRequest& request) {
    return std::any_of(processors_.begin(), processors_.end(),
                       [&](const auto& processor) { return onUnits(processor) && processor->actsOn(request); });
  };
  // Made once: its slots hold the root's own modules from here on, so their path() stays theirs.
  std::optional<NonLayerUnit> nonLayerUnit;
  const bool nonLayerFirst = options_.nonLayerFirst && !wholeModel && [&] {
    nonLayerUnit.emplace(model_.root());
    LayerRequest request{.name = "", .module = &nonLayerUnit->module()};
    request.splitLayers = split;
    return !nonLayerActed(request);
  }();

  // Layer 0's inputs: the embeddings of every sample, with its rotary tables.
  std::vector<TensorList> inputs;
  if (needsData) {
    for (const at::Tensor& ids : samples) inputs.push_back(embedSample(model_, ids));
  }
  // `samples` is this rank's share (rankShare): sample k is the run's sample rank + k·worldSize.
  std::vector<int64_t> sampleIds;
  for (size_t k = 0; k < inputs.size(); ++k) {
    sampleIds.push_back(group.rank() + static_cast<int64_t>(k) * group.worldSize());
  }
  // The report's error probe; without it the report still lists each unit's replaced modules.
  const bool probes = options_.report != nullptr && !samples.empty() && options_.probeTokens > 0;
  std::optional<Probe> probe;
  if (probes) {
    probe.emplace(embedSample(model_, samples.front().slice(1, 0, options_.probeTokens)));
  }

  // This rank's collectives since `before`, into the unit's report.
  const auto countTraffic = [&group](const ProcessGroup::Traffic& before, LayerReport& report) {
    const ProcessGroup::Traffic after = group.traffic();
    report.syncCollectives = after.collectives - before.collectives;
    report.syncBytes = after.bytes - before.bytes;
    report.syncSeconds = after.seconds - before.seconds;
  };
  // A unit's Linears by name, taken before its steps, so that the report can name those a step
  // replaced where no probe measures them.
  const auto linearsOf = [](Module& unit, const std::string& prefix) {
    std::map<std::string, Module*> linears;
    for (auto& [name, module] : unit.namedModules(prefix)) {
      if (module->typeName() == "Linear") linears.emplace(name, module);
    }
    return linears;
  };
  const auto listReplaced = [](Module& unit, const std::string& prefix, const std::map<std::string, Module*>& linears,
                               LayerReport& report) {
    for (auto& [name, module] : unit.namedModules(prefix)) {
      const auto it = linears.find(name);
      if (it != linears.end() && it->second != module) {
        report.modules.push_back({name, QuantReport::describe(*module), kNotProbed});
      }
    }
  };
  // Rank 0's units are reported; where nothing probes them, their replaced Linears are listed.
  const bool listsReplaced = options_.report != nullptr && !probes;
  // Runs the unit; returns whether a calibration forward ran.
  const auto runUnit = [&](const UnitRun& unit, LayerReport& report, Probe* unitProbe, bool listing) {
    LayerRequest& request = unit.request;
    if (unitProbe) unitProbe->recordFloat(*request.module, request.name, unit.probeForward);
    const std::map<std::string, Module*> linears =
        listing ? linearsOf(*request.module, request.name) : std::map<std::string, Module*>();
    bool forwarded = false;
    const bool onWholeModel = request.wholeModel;
    for (size_t i = 0; i < processors_.size(); ++i) {
      Processor* processor = processors_[i].get();
      if (processor->wholeModel() != onWholeModel) continue;
      const auto start = Clock::now();
      processor->preprocess(request);
      if (needsCalibration(*processor)) {
        const bool followed =
            std::any_of(processors_.begin() + static_cast<std::ptrdiff_t>(i) + 1, processors_.end(),
                        [&](const auto& later) { return onUnits(later) && needsCalibration(*later); });
        request.forwardUntil = followed ? unit.forwardUntil : nullptr;
        processor->process(request);
        request.forwardUntil = nullptr;
        forwarded = true;
      }
      processor->postprocess(request);
      report.processorSeconds.push_back(secondsSince(start));
    }
    if (unitProbe) unitProbe->compare(*request.module, request.name, unit.probeForward, unit.propagateProbe, report);
    if (listing) listReplaced(*request.module, request.name, linears, report);
    report.values = std::move(request.reportValues);
    return forwarded;
  };
  const auto loadFloatLayer = [this](const std::string& layerName) -> std::shared_ptr<Module> {
    for (int64_t index = 0; index < model_.config().numLayers; ++index) {
      if (model_.layerName(index) == layerName) return model_.loadLayerCopy(index);
    }
    throw Error(ErrorCode::kInternal, concat("no decoder layer '", layerName, "'"));
  };
  const auto layerRequest = [&](DecoderLayer& layer, int64_t index, std::vector<TensorList> layerInputs) {
    LayerRequest request{.name = model_.layerName(index), .module = &layer, .inputs = std::move(layerInputs)};
    request.loadFloatLayer = loadFloatLayer;
    request.staged = layer.uniformForward();
    request.family = layer.family();
    request.sampleIds = sampleIds;
    request.subgraphs = layer.subgraphs();
    request.splitLayers = split;
    request.forward = [&layer](LayerRequest& r) {
      r.outputs.assign(r.inputs.size(), {});
      const auto sample = [&](int64_t s) {
        r.outputs[static_cast<size_t>(s)] = {forwardLayer(layer, r.inputs[static_cast<size_t>(s)])};
      };
      // Staged or not, the samples run as tasks, so hooks can tell which one they see
      // (currentSample); without settle points each task runs to its end before the next.
      runStaged(static_cast<int64_t>(r.inputs.size()), sample);
    };
    return request;
  };
  const auto layerUnit = [](LayerRequest& request, DecoderLayer& layer) {
    UnitRun unit{request, [&layer](const TensorList& input) { return forwardLayer(layer, input); }, true};
    if (request.staged) {
      unit.forwardUntil = [&layer](LayerRequest& r, const std::vector<Module*>& watched) {
        forwardLayerUntil(layer, r, watched);
      };
    }
    return unit;
  };

  const auto release = [this](int64_t index) {
    const uint64_t layerBytes = model_.releaseLayer(index);
    // glibc keeps freed heap, and fragmentation would grow it layer by layer (by about 15 MB a
    // layer in a static calibration of SmolLM2); trimming returns it. But every trim makes the
    // next layer fault its working set back in, at about 3 µs a page here (a sixth of that
    // calibration's time; in a data-free run more than the weights' quantization itself). So
    // the heap is trimmed only once its free memory exceeds a layer's size (at least 64 MiB):
    // RSS stays within that of the working set.
    constexpr uint64_t kMinFreeBytes = uint64_t{64} << 20;
    if (::mallinfo2().fordblks > std::max(kMinFreeBytes, layerBytes)) ::malloc_trim(0);
  };

  // A split layer, on its executor: processed, written as a segment, probed (the quantized
  // output goes on to the next layer's executor first; the float reference is a second copy of
  // the layer from the checkpoint) and released. What rank 0 adopts and its report are the task's
  // result.
  const auto runSplitLayer = [&](int64_t index) {
    const auto layerStart = Clock::now();
    const std::string name = model_.layerName(index);
    LayerReport report{.name = name};
    std::string segment;
    bool passedOn = false, segmentPassedOn = false;
    // What the layer before put under `key`, once it is there.
    const auto fromLayerBefore = [&](const std::string& key) {
      std::string value = group.storeGet(key);
      QPIPE_REQUIRE(value != kLayerFailed, ErrorCode::kDistributed, name, ": ",
                    index == 0 ? "the non-layer modules written before it failed" : "the layer before it failed");
      return value;
    };
    try {
      DecoderLayer& layer = model_.layer(index);
      LayerRequest request = layerRequest(layer, index, {});
      // Any rank may execute the layer, and rank 0 reports it: where the probe is off, this rank
      // names the replaced Linears itself.
      const std::map<std::string, Module*> linears = linearsOf(layer, name);
      runUnit(layerUnit(request, layer), report, nullptr, false);
      // The segment first: the layer before passes its position on before its probe, and while
      // this layer is written, that probe may still be on its way.
      const SegmentChain chain{.start = [&] { return fromLayerBefore(segmentKey(index)).substr(1); },
                               .passOn =
                                   [&](const std::string& end) {
                                     group.storeSet(segmentKey(index + 1), "+" + end);
                                     segmentPassedOn = true;
                                   }};
      segment = options_.segments->write(index, name, layer, chain);
      const std::string entering = fromLayerBefore(probeKey(index));
      if (entering == kProbeOff) {
        group.storeSet(probeKey(index + 1), std::string(kProbeOff));
        passedOn = true;
        listReplaced(layer, name, linears, report);
      } else {
        Probe layerProbe(probeInput(model_, entering));
        const at::Tensor output = [&] {
          const FewRowsGemm fewRows;  // as Probe::compare computes it on one rank
          return forwardLayer(layer, layerProbe.input());
        }();
        group.storeSet(probeKey(index + 1), hiddenBytes(output));
        passedOn = true;
        const std::shared_ptr<DecoderLayer> reference = model_.loadLayerCopy(index);
        layerProbe.recordFloat(*reference, name,
                               [&reference](const TensorList& input) { return forwardLayer(*reference, input); });
        layerProbe.compare(layer, name, {}, true, report, output);
      }
      release(index);
    } catch (...) {
      if (!passedOn) group.storeSet(probeKey(index + 1), std::string(kLayerFailed));
      if (!segmentPassedOn) group.storeSet(segmentKey(index + 1), std::string(kLayerFailed));
      throw;
    }
    report.seconds = secondsSince(layerStart);
    return ConfigNode::map(
        {{"segment", ConfigNode::string(segment)}, {"report", ConfigNode::string(report.serialize())}});
  };
  // The non-layer modules as the segment before layer 0, on whichever rank claims them first.
  const auto runNonLayerSegment = [&] {
    bool passedOn = false;
    try {
      const SegmentChain chain{.start = [] { return std::string(); },
                               .passOn =
                                   [&](const std::string& end) {
                                     group.storeSet(segmentKey(0), "+" + end);
                                     passedOn = true;
                                   }};
      const std::string segment = options_.segments->write(CheckpointSaver::kNonLayer, "", model_.root(), chain);
      return ConfigNode::map({{"segment", ConfigNode::string(segment)}});
    } catch (...) {
      if (!passedOn) group.storeSet(segmentKey(0), std::string(kLayerFailed));
      throw;
    }
  };

  const int64_t layers = model_.config().numLayers;
  std::optional<scheduler::RunSummary> splitSummary;  // the layer wave's, for the report
  if (split) {
    if (group.rank() == 0) {
      group.storeSet(probeKey(0), probe ? hiddenBytes(probe->input()[0]) : std::string(kProbeOff));
      if (!nonLayerFirst) group.storeSet(segmentKey(0), "+");
    }
    scheduler::DistributedTaskScheduler tasks(model_.root(), group, {.name = "runner", .claimLimit = 1});
    if (nonLayerFirst) {
      tasks.submit({.name = "runner.non_layer",
                    .fn = [&runNonLayerSegment](const ConfigNode&) { return runNonLayerSegment(); },
                    .args = ConfigNode::map({}),
                    .dependencies = nonLayerUnit->paths(),
                    .sync =
                        [this, &group](const TaskRecord& record, SyncContext&) {
                          if (group.rank() == 0) {
                            options_.segments->adopt(CheckpointSaver::kNonLayer,
                                                     record.result.at("segment").asString());
                          }
                        },
                    .syncName = "runner.adopt_segment"});
    }
    for (int64_t index = 0; index < layers; ++index) {
      tasks.submit({.name = "runner.layer",
                    .fn = [&runSplitLayer, index](const ConfigNode&) { return runSplitLayer(index); },
                    .args = ConfigNode::map({{"layer", ConfigNode::integer(index)}}),
                    .dependencies = {model_.layerName(index)},
                    .sync =
                        [this, &group, index](const TaskRecord& record, SyncContext&) {
                          if (group.rank() != 0) return;
                          options_.segments->adopt(index, record.result.at("segment").asString());
                          if (options_.report == nullptr) return;
                          LayerReport report = LayerReport::deserialize(record.result.at("report").asString());
                          report.values.push_back(
                              {report.name, "dts:runner:executor_rank", static_cast<double>(record.executorRank)});
                          options_.report->layers.push_back(std::move(report));
                        },
                    .syncName = "runner.adopt_segment"});
    }
    tasks.run();
    splitSummary = tasks.summary();
    log::logger()->info("runner: ", layers, " decoder layers", nonLayerFirst ? " and the non-layer modules" : "",
                        " split over ", group.worldSize(), " ranks [DTS] ", tasks.summary().line());
    if (probe) probe.emplace(probeInput(model_, group.storeGet(probeKey(layers))));
  } else {
    // The whole-model unit needs every layer, and the layers are written after it.
    const bool resident = options_.mode == RunnerMode::kModelWise || wholeModel;
    if (resident) {
      for (int64_t index = 0; index < layers; ++index) model_.layer(index);
    }
    if (nonLayerFirst && sink) sink(CheckpointSaver::kNonLayer, "", model_.root());
    ProgressBar bar("layers", layers, "layers");
    for (int64_t index = 0; index < layers; ++index) {
      const auto layerStart = Clock::now();
      const ProcessGroup::Traffic trafficBefore = group.traffic();
      DecoderLayer& layer = model_.layer(index);
      LayerRequest request = layerRequest(layer, index, std::move(inputs));
      LayerReport report{.name = request.name};
      const bool forwarded = runUnit(layerUnit(request, layer), report, probe ? &*probe : nullptr, listsReplaced);
      if (sink && !wholeModel) sink(index, request.name, layer);
      // Lock-step: no rank runs ahead of rank 0's writing by more than one layer.
      group.barrier();

      inputs = std::move(request.inputs);
      if (forwarded) {
        QPIPE_CHECK(request.outputs.size() == inputs.size(), "layer ", request.name, ": ", request.outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
        for (size_t s = 0; s < inputs.size(); ++s) {
          QPIPE_CHECK(!request.outputs[s].empty(), "layer ", request.name, ": no output for sample ", s);
          inputs[s][0] = request.outputs[s][0];
        }
      }
      if (!resident) release(index);
      report.seconds = secondsSince(layerStart);
      countTraffic(trafficBefore, report);  // the lock-step barrier included
      if (options_.report != nullptr) options_.report->layers.push_back(std::move(report));
      bar.update(index + 1);
    }
  }

  // The non-layer unit: the final norm's inputs are the last layer's outputs.
  {
    const auto unitStart = Clock::now();
    const ProcessGroup::Traffic trafficBefore = group.traffic();
    if (!nonLayerUnit) nonLayerUnit.emplace(model_.root());
    NonLayerUnit& unit = *nonLayerUnit;
    Module& module = unit.module();
    LayerRequest request{.name = "", .module = &module};
    request.sampleIds = sampleIds;
    request.splitLayers = split;
    for (TensorList& input : inputs) request.inputs.push_back({std::move(input[0])});
    inputs.clear();
    // Where no processor acts on the unit (lm_head excluded, as every practice does), its float
    // lm_head is never computed: neither converted (a vocabulary × hidden copy) nor probed.
    const bool acted = nonLayerActed(request);
    QPIPE_REQUIRE(!(acted && nonLayerFirst), ErrorCode::kPlugin,
                  "a step's actsOn said no of the non-layer modules before the first layer and yes now; its answer "
                  "must not change (the saver wrote them first)");
    if (acted) model_.prepareHead();
    Module* const floatHead = &module.getSubmodule("lm_head");
    request.forward = [&module, floatHead](LayerRequest& r) {
      r.outputs.clear();
      Module& norm = module.getSubmodule("model.norm");
      Module& head = module.getSubmodule("lm_head");
      for (const TensorList& input : r.inputs) {
        const at::Tensor normed = norm(input[0]);
        if (&head != floatHead) head(normed);  // its logits are dropped at once
      }
    };
    const Probe::Forward probeForward = [&module](const TensorList& input) {
      return module.getSubmodule("lm_head")(module.getSubmodule("model.norm")(input[0]));
    };
    LayerReport report{.name = std::string(kNonLayerReportName)};
    runUnit({request, probeForward, false}, report, acted && probe ? &*probe : nullptr, listsReplaced);
    if (splitSummary) {
      for (const auto& [key, value] : splitSummary->reportValues()) report.values.push_back({"", key, value});
    }
    const std::vector<std::string> replaced = unit.writeBack(model_.root());
    QPIPE_REQUIRE(!nonLayerFirst || replaced.empty(), ErrorCode::kPlugin, "a step replaced '",
                  replaced.empty() ? "" : replaced.front(),
                  "' in the non-layer unit although every step's actsOn said no of it (the saver wrote the unit's "
                  "modules before the first layer)");
    if (acted) model_.restoreHead();
    report.seconds = secondsSince(unitStart);
    countTraffic(trafficBefore, report);
    // Listed only when a processor replaced or reported on one of its modules (default practices
    // leave them).
    if (options_.report != nullptr && (!report.modules.empty() || !report.values.empty())) {
      options_.report->layers.push_back(std::move(report));
    }
  }

  if (wholeModel) {
    const auto unitStart = Clock::now();
    LayerRequest request{.name = "", .module = &model_.root()};
    request.wholeModel = true;
    request.loadFloatLayer = loadFloatLayer;
    QPIPE_CHECK(options_.labels.empty() || options_.labels.size() == samples.size(), options_.labels.size(),
                " labels for ", samples.size(), " samples");
    for (size_t k = 0; k < samples.size(); ++k) {
      const at::Tensor ids = samples[k].to(model_.options().device);
      request.inputs.push_back({ids, options_.labels.empty() ? ids : options_.labels[k].to(model_.options().device)});
      request.sampleIds.push_back(group.rank() + static_cast<int64_t>(k) * group.worldSize());
    }
    request.forward = [this](LayerRequest& r) {
      r.outputs.clear();
      for (const TensorList& input : r.inputs) r.outputs.push_back({model_.forward(input[0])});
    };
    LayerReport report{.name = std::string(kWholeModelReportName)};
    runUnit({request, {}, false}, report, nullptr, listsReplaced);
    report.seconds = secondsSince(unitStart);
    if (probes) {
      // The layers' module errors as the unit left them: each layer against a float copy from the
      // checkpoint, on a probe of the quantized stream, replacing what the layer units recorded.
      Probe after(embedSample(model_, samples.front().slice(1, 0, options_.probeTokens)));
      for (LayerReport& entry : options_.report->layers) {
        for (int64_t index = 0; index < layers; ++index) {
          if (entry.name != model_.layerName(index)) continue;
          const std::shared_ptr<DecoderLayer> reference = model_.loadLayerCopy(index);
          after.recordFloat(*reference, entry.name,
                            [&reference](const TensorList& input) { return forwardLayer(*reference, input); });
          DecoderLayer& layer = model_.layer(index);
          LayerReport probed;
          after.compare(layer, entry.name, [&layer](const TensorList& input) { return forwardLayer(layer, input); },
                        true, probed);
          entry.modules = std::move(probed.modules);
          entry.relativeMse = probed.relativeMse;
        }
      }
    }
    if (options_.report != nullptr) options_.report->layers.push_back(std::move(report));
    for (int64_t index = 0; index < layers; ++index) {
      if (sink) sink(index, model_.layerName(index), model_.layer(index));
      group.barrier();
    }
  }

  for (auto& processor : processors_) processor->postRun();
  if (options_.report != nullptr) options_.report->totalSeconds = secondsSince(runStart);
  log::logger()->debug("runner: ", layers, " layers and the non-layer modules, ", samples.size(), " samples on rank ",
                       group.rank(), "/", group.worldSize());
}

}  // namespace qpipe
