// Processor types by YAML `type` string, each with its schema and factory.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qpipe/processor.h"
#include "qpipe/schema.h"

namespace qpipe {

struct ProcessorInfo {
  std::string type;  // the YAML `type` string
  std::string description;
  Schema schema;
  ProcessorFactory factory;
};

class ProcessorRegistry {
 public:
  struct Entry {
    // Keeps the plugin's library loaded while the factory (code in that library) is reachable.
    // Declared first so that it is destroyed last, after the factory.
    std::shared_ptr<const void> owner;
    ProcessorInfo info;
    std::string plugin;  // plugin name
    std::string origin;  // library path or "static:<name>"
  };

  // Types the core defines itself (`group`); they are in types() but have no Entry.
  static const std::vector<std::string>& coreTypes();

  // Adds all entries or none. A type registered twice is Error(kPlugin) naming both origins.
  void add(std::vector<Entry> entries);

  const Entry* find(std::string_view type) const;
  std::vector<std::string> types() const;  // sorted, core types included
  const std::vector<Entry>& entries() const { return entries_; }

  // Validates `config` (a process step without its `type`, `path` naming it in errors)
  // against the type's schema, then calls the factory. The result guards every call into
  // plugin code and keeps the library loaded.
  std::unique_ptr<Processor> create(std::string_view type, const ConfigNode& config, std::string_view path,
                                    const ProcessorContext& context) const;

 private:
  std::vector<Entry> entries_;
};

// Wraps a processor so that an exception from any lifecycle call becomes qpipe::Error(kPlugin)
// naming the processor, its plugin, the call and the layer; the message is copied at once so
// nothing thrown by plugin code outlives the call.
std::unique_ptr<Processor> guardProcessor(std::unique_ptr<Processor> inner, std::string type, std::string plugin,
                                          std::shared_ptr<const void> owner);

}  // namespace qpipe
