// --plugin_dir, shared by every subcommand that loads plugins.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "qpipe/host/plugin_loader.h"

namespace CLI {
class App;
}

namespace qpipe::cli {

struct PluginOptions {
  std::optional<std::string> pluginDir;
};

void addPluginOptions(CLI::App& app, PluginOptions& options);

// The search path for these options (--plugin_dir, QPIPE_PLUGIN_PATH, built-in folder).
std::vector<PluginSearchDir> pluginSearchPath(const PluginOptions& options);

// Loads every plugin on the search path into `loader`; rejected libraries are logged as
// warnings (`qpipe plugins` shows them with their reasons).
void loadPlugins(const PluginOptions& options, PluginLoader& loader);

}  // namespace qpipe::cli
