// The table of what pipelines can name: processor types (spec.process) and saver types
// (spec.save), each with its schema and factory. Plugins add to it through the loader; the host
// adds the core's own (`group`, and the built-in savers). The pipeline validator and the runs
// read this one table.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qpipe/plugin.h"

namespace qpipe {

class Registry {
 public:
  // Where an entry came from. `owner` keeps the plugin's library loaded while the factory (code
  // in that library) is reachable; declared first so that it is destroyed last.
  struct Origin {
    std::shared_ptr<const void> owner;
    std::string plugin;  // plugin name ("qpipe" for the core's own entries)
    std::string origin;  // library path, "static:<name>" or "built-in"
  };
  struct ProcessorEntry : Origin {
    ProcessorInfo info;
  };
  struct SaverEntry : Origin {
    SaverInfo info;
  };

  // With the built-in savers (compressed_tensors, ascendv1_saver) registered.
  Registry();

  // Types the core defines itself (`group`); they are in processorTypes() but have no entry.
  static const std::vector<std::string>& coreTypes();

  // Adds every entry or none. A type registered twice, reserved, empty or without a factory is
  // Error(kPlugin) naming the plugins involved.
  void add(std::vector<ProcessorEntry> processors, std::vector<SaverEntry> savers);

  const ProcessorEntry* findProcessor(std::string_view type) const;
  const SaverEntry* findSaver(std::string_view type) const;
  std::vector<std::string> processorTypes() const;  // sorted, core types included
  std::vector<std::string> saverTypes() const;      // sorted
  const std::vector<ProcessorEntry>& processors() const { return processors_; }
  const std::vector<SaverEntry>& savers() const { return savers_; }

  // Calls the factory of processor `type` with `config` (a step validated against the type's
  // schema, `path` naming it in errors). The result guards every call into plugin code, keeps
  // the library loaded and, after postRun(), warns about the patterns of the filters the
  // processor made through its context that matched no module.
  std::unique_ptr<Processor> createProcessor(std::string_view type, const ConfigNode& config, std::string_view path,
                                             const ProcessorContext& context) const;
  // Calls the factory of saver `type` with its validated step, or its segmentFactory
  // (`segmentsOnly`; null when it has none). The result guards every call into plugin code
  // (errors name the saver and plugin) and keeps the library loaded.
  std::unique_ptr<CheckpointSaver> createSaver(std::string_view type, const ConfigNode& config, CausalLM& model,
                                               const std::filesystem::path& saveDir, bool segmentsOnly = false) const;
  // Asks saver `type` whether it can write what a step plans (SaverInfo::checkPlanned; nothing
  // when it has no check): its Error(kConfig) as it is, anything else it throws as kPlugin naming
  // the saver and plugin.
  void checkPlanned(std::string_view type, const PlannedOutputs& planned) const;

 private:
  std::vector<ProcessorEntry> processors_;
  std::vector<SaverEntry> savers_;
};

}  // namespace qpipe
