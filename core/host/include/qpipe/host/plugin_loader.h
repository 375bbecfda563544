// Finds and loads plugins: shared libraries exporting a QpipePluginDescriptor (qpipe/plugin.h).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/host/registry.h"

struct QpipePluginDescriptor;

namespace qpipe {

struct PluginRecord {
  std::string name;
  std::string version;
  std::string description;
  std::string origin;               // library path, or "static:<name>"
  std::vector<std::string> types;   // processor types it registered
  std::vector<std::string> savers;  // saver types it registered
};

struct RejectedPlugin {
  std::string path;
  std::string reason;  // one line
};

struct PluginSearchDir {
  std::filesystem::path dir;
  std::string source;  // "--plugin_dir", "QPIPE_PLUGIN_PATH" or "built-in"
};

class PluginLoader {
 public:
  explicit PluginLoader(Registry& registry);
  // Drops the loader's references in reverse load order; a library stays loaded while a
  // processor or registry entry made from it is alive.
  ~PluginLoader();
  PluginLoader(const PluginLoader&) = delete;
  PluginLoader& operator=(const PluginLoader&) = delete;

  // The search order: --plugin_dir, then each entry of QPIPE_PLUGIN_PATH (':'-separated),
  // then the built-in folder. A --plugin_dir that does not exist is Error(kUsage).
  static std::vector<PluginSearchDir> searchPath(const std::optional<std::filesystem::path>& pluginDir,
                                                 const std::filesystem::path& builtinDir);
  // The built-in plugin folder of the running executable: <exe>/../lib/qpipe/plugins.
  static std::filesystem::path builtinDir();

  // Loads every *.so in each directory, in name order. A library that fails is recorded in
  // rejected() and does not stop the others. A plugin name already loaded from an earlier
  // directory shadows later ones (they are rejected, saying so).
  void loadDirectories(const std::vector<PluginSearchDir>& dirs);

  // Loads one library; Error(kPlugin) naming it and the reason when it is not a usable plugin.
  PluginRecord loadLibrary(const std::filesystem::path& path);
  // Registers a plugin linked into the executable (tests, static builds).
  PluginRecord addStatic(const QpipePluginDescriptor* descriptor);

  const std::vector<PluginRecord>& loaded() const { return loaded_; }
  const std::vector<RejectedPlugin>& rejected() const { return rejected_; }

 private:
  // Throws Error(kPlugin) whose message is the reason alone.
  const PluginRecord& load(const std::filesystem::path& path);
  const PluginRecord& registerDescriptor(const QpipePluginDescriptor& descriptor, const std::string& origin,
                                         std::shared_ptr<const void> owner);

  Registry& registry_;
  std::vector<PluginRecord> loaded_;
  std::vector<RejectedPlugin> rejected_;
  std::vector<std::shared_ptr<const void>> libraries_;  // in load order
};

// loader.loadDirectories(dirs), then a warning for each library it rejected (`qpipe plugins`
// lists them with their reasons).
void loadPlugins(PluginLoader& loader, const std::vector<PluginSearchDir>& dirs);

}  // namespace qpipe
