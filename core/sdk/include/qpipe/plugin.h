// The SDK: what a plugin includes (docs/plugins.md). One header gives the processor lifecycle
// (qpipe/processor.h: Processor, LayerRequest, ProcessorContext, forEach, calibrate), schemas and
// configuration nodes, the logger, errors and their message builder (qpipe::concat), the module
// tree with include/exclude matching, the smoothing subgraphs, the process group, and the saver
// interface. Register processor (and saver) types in a function and name it in QPIPE_PLUGIN;
// build the plugin with qpipe_add_plugin() (cmake/QpipeHelpers.cmake):
//
//   void registerAll(qpipe::PluginRegistrar& r) { r.addProcessor({...}); }
//   QPIPE_PLUGIN("my_plugin", "1.0.0", "What it does", registerAll)
//
// The host reads the C-layout descriptor first and checks the ABI version and the build
// fingerprint; only then does any C++ type cross the library boundary. The host's own headers
// (qpipe/host/: registries, loader, pipeline, runner, savers, report) are not on a plugin's
// include path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/error.h"
#include "qpipe/log.h"
#include "qpipe/module.h"
#include "qpipe/pattern.h"
#include "qpipe/plugin_entry.h"
#include "qpipe/process_group.h"
#include "qpipe/processor.h"
#include "qpipe/saver.h"
#include "qpipe/schema.h"
#include "qpipe/subgraph.h"
#include "qpipe/version.h"

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#endif

namespace qpipe {

struct ProcessorInfo {
  std::string type;  // the YAML `type` of a spec.process step
  std::string description;
  Schema schema;
  ProcessorFactory factory;
};

// Collects what one plugin registers; the loader commits it all or nothing.
class PluginRegistrar {
 public:
  explicit PluginRegistrar(std::shared_ptr<Logger> logger) : logger_(std::move(logger)) {}
  void addProcessor(ProcessorInfo info) { processors_.push_back(std::move(info)); }
  void addSaver(SaverInfo info) { savers_.push_back(std::move(info)); }
  const std::shared_ptr<Logger>& logger() const { return logger_; }

 private:
  friend class PluginLoader;
  std::shared_ptr<Logger> logger_;
  std::vector<ProcessorInfo> processors_;
  std::vector<SaverInfo> savers_;
};

}  // namespace qpipe

// Bumped on any change to the descriptor or to a type that crosses the boundary: the major
// for incompatible changes, the minor for additions a newer host still understands.
// 3.0: the SDK (this header alone); ProcessorContext carries the process group, module filters
// and configError; LayerRequest carries report values; plugins may register savers (addSaver);
// the registrar exposes only add*.
// 4.0: LayerRequest carries `staged` (staged calibration forwards, qpipe/staged.h);
// LinearQuantizer and QuantLinear hold their int8 GEMM state.
// 5.0: LayerRequest carries the layer's family and smoothing subgraphs (qpipe/subgraph.h);
// DecoderLayer declares them.
// 6.0: LayerRequest carries forwardUntil (calibrateInputsOf, forwards that stop at the last
// watched module); RMSNorm may hold a bias.
// 7.0: the task scheduler (qpipe/scheduler/task_scheduler.h): ProcessGroup gains counterAdd,
// LinearQuantizer defers its weight solve and implements DistributedSync.
// 8.0: split layers: Processor::layersIndependent, LayerRequest::splitLayers, ProcessGroup's
// storeSet/storeGet, savers that write layer segments.
// 9.0: Processor::trains (runs with autograd available), ProcessorContext::savePath.
// 10.0: Processor::wholeModel (the whole-model unit).
// 11.0: QuantLinear and LinearQuantizer hold FP8 GEMM state.
// 12.0: Processor::actsOn (the runner skips converting and probing a non-layer unit no processor
// acts on).
// 13.0: QuantLinear and LinearQuantizer implement InputSharing (q/k/v and gate/up share one input
// quantization, FP8 one GEMM) and hold its state.
// 13.1: ProcessorContext::warnIfSet and configWarnings (appended).
// 14.0: CheckpointSaver::writesNonLayerFirst (the non-layer modules as layer kNonLayer).
// 15.0: Processor::plannedOutputs and SaverInfo::checkPlanned (a saver refuses a step before any
// work).
#define QPIPE_PLUGIN_ABI_MAJOR 15
#define QPIPE_PLUGIN_ABI_MINOR 0

#define QPIPE_STRINGIFY_IMPL(x) #x
#define QPIPE_STRINGIFY(x) QPIPE_STRINGIFY_IMPL(x)

#if defined(__clang__)
#define QPIPE_COMPILER_ID "clang-" QPIPE_STRINGIFY(__clang_major__) "." QPIPE_STRINGIFY(__clang_minor__)
#elif defined(__GNUC__)
#define QPIPE_COMPILER_ID "gcc-" QPIPE_STRINGIFY(__GNUC__) "." QPIPE_STRINGIFY(__GNUC_MINOR__)
#else
#define QPIPE_COMPILER_ID "unknown-compiler"
#endif

#if defined(TORCH_VERSION_MAJOR)
#define QPIPE_TORCH_ID \
  QPIPE_STRINGIFY(TORCH_VERSION_MAJOR) "." QPIPE_STRINGIFY(TORCH_VERSION_MINOR) "." QPIPE_STRINGIFY(TORCH_VERSION_PATCH)
#else
#define QPIPE_TORCH_ID "unknown"
#endif

// What must be equal between host and plugin for C++ objects to cross: compiler, C++ ABI,
// LibTorch and qpipe versions. Expanded in the including translation unit, so a plugin carries
// the values it was compiled with.
#define QPIPE_BUILD_FINGERPRINT                                                                   \
  QPIPE_COMPILER_ID "|cxx11abi=" QPIPE_STRINGIFY(_GLIBCXX_USE_CXX11_ABI) "|torch=" QPIPE_TORCH_ID \
                                                                         "|qpipe=" QPIPE_VERSION

extern "C" {
// Never changes shape within an ABI major version; fields are only appended.
struct QpipePluginDescriptor {
  uint32_t abiMajor;
  uint32_t abiMinor;
  const char* fingerprint;
  const char* name;
  const char* version;
  const char* description;
  // The C++ part: called only after the checks pass.
  void (*registerProcessors)(qpipe::PluginRegistrar& registrar);
};
}
static_assert(std::is_standard_layout_v<QpipePluginDescriptor>);

// The entry point's name and forms: qpipe/plugin_entry.h.
#define QPIPE_PLUGIN(NAME, VERSION, DESCRIPTION, REGISTER_FN)                                  \
  extern "C" QPIPE_PLUGIN_ENTRY_VISIBILITY const QpipePluginDescriptor* QPIPE_PLUGIN_ENTRY() { \
    static const QpipePluginDescriptor descriptor{QPIPE_PLUGIN_ABI_MAJOR,                      \
                                                  QPIPE_PLUGIN_ABI_MINOR,                      \
                                                  QPIPE_BUILD_FINGERPRINT,                     \
                                                  NAME,                                        \
                                                  VERSION,                                     \
                                                  DESCRIPTION,                                 \
                                                  &REGISTER_FN};                               \
    return &descriptor;                                                                        \
  }
