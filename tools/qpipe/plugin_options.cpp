#include "plugin_options.h"

#include <CLI/CLI.hpp>

#include "option_checks.h"
#include "qpipe/log.h"

namespace qpipe::cli {

void addPluginOptions(CLI::App& app, PluginOptions& options) {
  app.add_option("--plugin_dir", options.pluginDir,
                 "Folder of processor plugins, searched before QPIPE_PLUGIN_PATH and the built-in folder")
      ->check(path());
}

std::vector<PluginSearchDir> pluginSearchPath(const PluginOptions& options) {
  std::optional<std::filesystem::path> dir;
  if (options.pluginDir) dir = *options.pluginDir;
  return PluginLoader::searchPath(dir, PluginLoader::builtinDir());
}

void loadPlugins(const PluginOptions& options, PluginLoader& loader) {
  qpipe::loadPlugins(loader, pluginSearchPath(options));
}

}  // namespace qpipe::cli
