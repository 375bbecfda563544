#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>

#include "commands.h"
#include "plugin_options.h"
#include "qpipe/registry.h"

namespace qpipe::cli {

namespace {

void listPlugins(const PluginOptions& options) {
  const auto searchPath = pluginSearchPath(options);
  ProcessorRegistry registry;
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
      const auto* entry = registry.find(type);
      std::cout << "    type: " << type << (entry->info.description.empty() ? "" : "  -- " + entry->info.description)
                << "\n";
    }
  }

  std::cout << "\nRejected libraries (" << loader.rejected().size() << "):\n";
  if (loader.rejected().empty()) std::cout << "  (none)\n";
  for (const auto& rejected : loader.rejected()) {
    std::cout << "  " << rejected.path << "\n    " << rejected.reason << "\n";
  }
  std::cout << "\nCore types: ";
  for (const auto& type : ProcessorRegistry::coreTypes()) std::cout << type << " ";
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
