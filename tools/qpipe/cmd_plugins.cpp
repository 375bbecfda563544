#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>

#include "commands.h"
#include "plugin_options.h"
#include "qpipe/host/registry.h"

namespace qpipe::cli {

namespace {

std::string describe(const std::string& description) {
  return description.empty() ? "" : "  -- " + description;
}

void listPlugins(const PluginOptions& options) {
  const auto searchPath = pluginSearchPath(options);
  Registry registry;
  PluginLoader loader(registry);
  loader.loadDirectories(searchPath);

  std::cout << "Plugin search path:\n";
  if (searchPath.empty()) std::cout << "  (none: no --plugin_dir, QPIPE_PLUGIN_PATH or built-in folder)\n";
  for (size_t i = 0; i < searchPath.size(); ++i) {
    std::cout << "  " << i + 1 << ". " << searchPath[i].dir.string() << "  (" << searchPath[i].source << ")\n";
  }

  std::cout << "\nLoaded plugins (" << loader.loaded().size() << "):\n";
  if (loader.loaded().empty()) std::cout << "  (none)\n";
  for (const auto& plugin : loader.loaded()) {
    std::cout << "  " << plugin.name << " " << plugin.version << "  " << plugin.origin << "\n";
    if (!plugin.description.empty()) std::cout << "    " << plugin.description << "\n";
    for (const auto& type : plugin.types) {
      std::cout << "    type: " << type << describe(registry.findProcessor(type)->info.description) << "\n";
    }
    for (const auto& type : plugin.savers) {
      std::cout << "    saver: " << type << describe(registry.findSaver(type)->info.description) << "\n";
    }
  }

  std::cout << "\nRejected libraries (" << loader.rejected().size() << "):\n";
  if (loader.rejected().empty()) std::cout << "  (none)\n";
  for (const auto& rejected : loader.rejected()) {
    std::cout << "  " << rejected.path << "\n    " << rejected.reason << "\n";
  }
  std::cout << "\nCore types: ";
  for (const auto& type : Registry::coreTypes()) std::cout << type << " ";
  std::cout << "\nBuilt-in savers: ";
  for (const auto& entry : registry.savers()) {
    if (entry.origin == "built-in") std::cout << entry.info.type << " ";
  }
  std::cout << "\n";
}

}  // namespace

Subcommand setupPlugins(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "plugins", "List the processor plugins found on the search path, and the libraries rejected with why");
  auto options = std::make_shared<PluginOptions>();
  addPluginOptions(*app, *options);
  return {app, [options] { listPlugins(*options); }};
}

}  // namespace qpipe::cli
