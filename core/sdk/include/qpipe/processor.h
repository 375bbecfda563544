// The processor API: msmodelslim's lifecycle, driven by the layer-wise runner (docs/plugins.md).
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
// The whole-model unit comes last, only when a processor declares wholeModel() (end2end training),
// and only to those processors, which see no other unit: its module is the model's root, every
// decoder layer resident with what the layer-wise processors left in it, so module names are the
// HF names; its inputs are {ids [1, seq], labels [1, seq]} per sample (int64; of a calibration
// window the labels are its ids, of an SFT chat -100 off the last assistant turn: docs/data.md),
// and its forward fills outputs with
// {logits [1, seq, vocab]}. The savers write the layers after it.
//
// Static calibration fixes each observer's parameters from every sample before any sample goes on
// past it (docs/quantization.md), in one of two ways:
// - staged (`request.staged`, a decoder layer whose modules run the same way for every sample):
//   `forward` runs the samples as the tasks of a staged run (qpipe/staged.h), so a module can
//   observe a sample's input and wait at a settle point, where its parameters are fixed (the
//   cross-rank sync, then freezing) once every sample has been observed; one forward does it all.
// - two passes (otherwise): modules that observe register in preprocess, in
//   `request.betweenForwards`, what fixes their parameters. calibrate(request) — what the default
//   process() runs, and a `group` of processors with it — forwards once to observe, runs those
//   steps, and forwards again, so the outputs the next layer gets carry the final quantization.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/module.h"
#include "qpipe/pattern.h"
#include "qpipe/process_group.h"
#include "qpipe/quant.h"
#include "qpipe/staged.h"
#include "qpipe/subgraph.h"

namespace qpipe {

class ConfigNode;
class Logger;

// The positional inputs of one forward call of a layer: one calibration sample.
using TensorList = std::vector<at::Tensor>;

// A number a processor adds to the report (quant_report.json, "values" of the unit).
struct ReportValue {
  std::string module;  // full HF name
  std::string key;
  double value = 0;
};

// One scheduled unit (a decoder layer, or the non-layer modules) with this rank's calibration data.
struct LayerRequest {
  std::string name;                // HF module name, e.g. "model.layers.3"; "" for the non-layer unit
  Module* module = nullptr;        // owned by the runner for the duration of the unit
  std::vector<TensorList> inputs;  // one entry per calibration sample held by this rank
  // The run's index of each input's sample (0 … samples − 1 over every rank): what orders data
  // gathered from several ranks as one rank would have seen it.
  std::vector<int64_t> sampleIds;
  std::vector<TensorList> outputs;  // filled by a decoder layer's calibration forward, same order
  // Runs the unit over `inputs` and, for a decoder layer, fills `outputs`; set by the runner.
  std::function<void(LayerRequest&)> forward;
  // Like `forward`, but each sample stops as soon as every module of `watched` has received its
  // input, and `outputs` stay empty. The runner offers it (else it is unset) to a step whose
  // outputs a later step's forward of the same unit replaces, on a decoder layer whose modules
  // run the same way for every sample. Use it through calibrateInputsOf().
  std::function<void(LayerRequest&, const std::vector<Module*>& watched)> forwardUntil;
  // True when `forward` runs the samples as a staged run: modules may wait at settle points
  // (qpipe/staged.h), and every rank reaches the same points in the same order.
  bool staged = false;
  // Run by calibrate() between the observing forward and the propagating one, in order; every
  // rank registers the same steps in the same order (they may call collectives).
  std::vector<std::function<void()>> betweenForwards;
  // A decoder layer's model family (config.json model_type) and the smoothing subgraphs it
  // declares (qpipe/subgraph.h), in forward order; both empty for the non-layer unit.
  std::string family;
  std::vector<Subgraph> subgraphs;
  // What processors reported for this unit, in order (rank 0's land in quant_report.json; of a
  // split layer, its executor's).
  std::vector<ReportValue> reportValues;
  // True on every unit of a run whose decoder layers the runner split over the ranks (a data-free
  // run whose processors are all layersIndependent()): this rank sees only the layers it executes,
  // inside a parallel task of the runner's scheduler, and every rank sees the non-layer unit (a
  // figure summed over the ranks, such as a count of modules, counts that unit once).
  bool splitLayers = false;
  // True on the whole-model unit (its name is "", as the non-layer unit's).
  bool wholeModel = false;
  // A new instance of decoder layer `layerName` ("model.layers.3") from the model's checkpoint, as
  // no processor changed it: the float weights of modules an earlier step replaced. Set on the
  // decoder-layer units and the whole-model unit.
  std::function<std::shared_ptr<Module>(const std::string& layerName)> loadFloatLayer;

  void report(std::string moduleName, std::string key, double value) {
    reportValues.push_back({std::move(moduleName), std::move(key), value});
  }
};

// Inside `forward`, e.g. in a hook: the run's index of the sample being forwarded (an entry of
// request.sampleIds); -1 outside a forward.
inline int64_t currentSample(const LayerRequest& request) {
  const int64_t task = stagedTask();
  return task >= 0 && task < static_cast<int64_t>(request.sampleIds.size()) ? request.sampleIds[task] : -1;
}

// True for the unit of the modules outside the decoder layers.
inline bool isNonLayerUnit(const LayerRequest& request) {
  return request.name.empty() && !request.wholeModel;
}

// The full HF name of the module at `path` below request.module ("" is the unit itself).
inline std::string moduleName(const LayerRequest& request, const std::string& path) {
  if (request.name.empty() || path.empty()) return request.name + path;
  return request.name + "." + path;
}

// Calls fn(path, name, module) for every module of the unit that is a T (dynamic type) and whose
// full HF name `filter` selects, in module order; `path` is below request.module, `name` the full
// name. Only modules of type T are offered to the filter, so a pattern that matches no T stays
// unmatched (the host warns about it at the end of the run). fn may replace the module it is
// given (request.module->replace(path, ...)), whose descendants are then not visited, but nothing
// else of the tree.
template <typename T, typename Fn>
void forEach(LayerRequest& request, ModuleFilter& filter, Fn&& fn) {
  std::string replaced;  // "<path>." of the last module fn replaced: its old descendants are gone
  for (auto& [path, module] : request.module->namedModules()) {
    if (!replaced.empty() && path.starts_with(replaced)) continue;
    auto* typed = dynamic_cast<T*>(module);
    if (typed == nullptr) continue;
    const std::string name = moduleName(request, path);
    if (!filter.matches(name)) continue;
    fn(path, name, *typed);
    if (&request.module->getSubmodule(path) != module) replaced = path + ".";
  }
}

// The calibration forward: `forward`; then, when steps were registered in `betweenForwards`,
// those steps (the list is emptied) and a second `forward` whose outputs replace the first's.
void calibrate(LayerRequest& request);

// The calibration forward of a step that only reads the inputs of `watched` (hooks that collect
// statistics) and registers nothing in betweenForwards: request.forwardUntil where the runner
// offers it, so the samples stop at the last watched module (and nothing runs when nothing is
// watched); else calibrate(request).
void calibrateInputsOf(LayerRequest& request, const std::vector<Module*>& watched);

// What a processor is built with.
struct ProcessorContext {
  std::shared_ptr<Logger> logger;
  // The ranks of the run: its rank and world size are final when the factory runs; collectives
  // may be called from preRun() on (on a multi-rank run the group is joined after every
  // processor was built and accepted).
  std::shared_ptr<ProcessGroup> group = ProcessGroup::single();
  // Where the step sits in the pipeline ("spec.process[2]"), for the field paths of the
  // configuration errors a factory throws (configError; docs/plugins.md).
  std::string configPath;
  // The run's --save_path (empty where there is none, e.g. `qpipe check`): what a processor names
  // files beside the checkpoint after (a training log).
  std::string savePath;
  // The filters made by moduleFilter(); the host warns, after postRun(), about each of their
  // patterns that matched no module.
  std::shared_ptr<std::vector<std::shared_ptr<ModuleFilter>>> filters =
      std::make_shared<std::vector<std::shared_ptr<ModuleFilter>>>();

  int rank() const { return group->rank(); }
  int worldSize() const { return group->worldSize(); }
  // "<configPath>.<field>": the field path of configuration errors, and of nested parsers.
  std::string fieldPath(std::string_view field) const;
  // The step's `include`/`exclude` lists (Schema::includeExclude()) as a filter the host reports on.
  std::shared_ptr<ModuleFilter> moduleFilter(const ConfigNode& config) const;
  // Error(kConfig) "<file:line:col>: <configPath>.<field>: <what>" for a field of the step's
  // configuration that the schema accepted but the processor cannot use.
  Error configError(const ConfigNode& config, std::string_view field, std::string_view what) const;
  // For a field that this configuration makes of no effect (an option of another mode): when the
  // pipeline file sets it (`value` has a line; a default never warns), adds
  // "<file:line:col>: <configPath>.<field>: <why>" to configWarnings.
  void warnIfSet(const ConfigNode& value, std::string_view field, std::string_view why) const;
  // What warnIfSet found, for the host to print: `qpipe check`, and rank 0 of `qpipe quant`.
  std::shared_ptr<std::vector<std::string>> configWarnings = std::make_shared<std::vector<std::string>>();
};

// What a step turns modules into, known from its configuration alone (Processor::plannedOutputs).
// `qpipe check` and the start of a run ask the pipeline's saver whether it can write them
// (SaverInfo::checkPlanned), so that a step the saver cannot write is refused at its file:line
// before any work; the saver still checks each module as it writes it.
struct PlannedOutputs {
  // `scheme` unless it is float (not quantized).
  static std::optional<quant::QScheme> quantized(const quant::QScheme& scheme) {
    return scheme.dtype == quant::QDtype::kFloat ? std::nullopt : std::optional(scheme);
  }
  struct Linear {
    quant::QScheme weight;
    std::optional<quant::QScheme> input;  // none: weight-only
  };
  // The schemes of an attention's Q, K and V inputs; none where that input stays in float.
  struct Attention {
    std::optional<quant::QScheme> q, k, v;
  };
  std::vector<Linear> linears;
  std::vector<Attention> attention;
  bool normBias = false;  // a bias added to a norm (iter_smooth with symmetric: False)
};

class Processor {
 public:
  virtual ~Processor() = default;

  virtual void preRun() {}
  virtual void preprocess(LayerRequest& request) { (void)request; }
  // The runner calls it only when needsCalibration(*this); the default is calibrate(request).
  virtual void process(LayerRequest& request) { calibrate(request); }
  virtual void postprocess(LayerRequest& request) { (void)request; }
  virtual void postRun() {}

  // True only when running on W ranks gives the same result as on one rank with all samples.
  virtual bool supportDistributed() const { return false; }
  // True when the processor needs no calibration forward (process() is then never called).
  virtual bool isDataFree() const { return false; }
  // True when each decoder layer's result depends on that layer alone: no state carried from one
  // layer to the next, no collective in a decoder layer's preprocess or postprocess. When every
  // processor of a data-free multi-rank run says so, the runner spreads the layers over the ranks
  // (LayerRequest::splitLayers; docs/scheduler.md).
  virtual bool layersIndependent() const { return false; }
  // True when the processor trains (backward passes, optimizer steps): the run then keeps autograd
  // available, with gradients off unless the processor turns them on (at::AutoGradMode), instead of
  // running in LibTorch's inference mode, whose tensors cannot be saved for a backward pass.
  virtual bool trains() const { return false; }
  // True when the processor works on the whole model at once (end2end training): the runner then
  // gives it the whole-model unit alone, after every unit of the other processors, and keeps every
  // decoder layer resident for the run (the whole model's memory; docs/architecture.md).
  virtual bool wholeModel() const { return false; }
  // Whether the processor may replace or change a module of `unit` (asked of the non-layer unit,
  // before its preprocess). When no processor does, the runner leaves that unit's lm_head in its
  // checkpoint dtype instead of converting it to the compute dtype (a vocabulary × hidden copy:
  // 0.4 GB in fp32 at 49,152 × 2,048) and does not probe the unit. The default, true, is always
  // correct.
  virtual bool actsOn(const LayerRequest& unit) const {
    (void)unit;
    return true;
  }
  // The kinds of quantized module the step makes, for the saver to refuse early; the default,
  // none, leaves every check to the saver's write.
  virtual PlannedOutputs plannedOutputs() const { return {}; }
};

// True when any processor of the pipeline works on the whole model (Processor::wholeModel).
inline bool anyWholeModel(const std::vector<std::unique_ptr<Processor>>& processors) {
  for (const auto& processor : processors) {
    if (processor->wholeModel()) return true;
  }
  return false;
}

// True when any processor of the pipeline trains (Processor::trains).
inline bool anyTrains(const std::vector<std::unique_ptr<Processor>>& processors) {
  for (const auto& processor : processors) {
    if (processor->trains()) return true;
  }
  return false;
}

// Whether the runner runs the processor's process(): the one place this is decided.
inline bool needsCalibration(const Processor& processor) {
  return !processor.isDataFree();
}

// Builds a processor from its validated configuration (defaults filled in, `type` removed).
using ProcessorFactory = std::function<std::unique_ptr<Processor>(const ConfigNode& config, const ProcessorContext&)>;

}  // namespace qpipe
