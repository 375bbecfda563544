#include "qpipe/host/plugin_loader.h"

#include <boost/dll/library_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <elf.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/log.h"
#include "qpipe/plugin.h"
#include "qpipe/schema.h"

namespace qpipe {

namespace fs = std::filesystem;

namespace {

// dlopen is serialised: plugin static initialisers then never run concurrently.
std::mutex& loadMutex() {
  static std::mutex mutex;
  return mutex;
}

[[noreturn]] void reject(const std::string& reason) {
  throw Error(ErrorCode::kPlugin, reason);
}

// dlopen maps a library's segments as its program headers describe them; in a file cut short
// (an interrupted copy or build) a segment ends past the end of the file, and touching those
// pages kills the process with SIGBUS. Where that is so, the reason; the ELF header itself was
// checked before (boost::dll::library_info).
std::optional<std::string> truncated(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  Elf64_Ehdr header{};
  in.read(reinterpret_cast<char*>(&header), sizeof header);
  const auto size = static_cast<uint64_t>(fs::file_size(path));
  const auto cut = [&](uint64_t end) {
    return concat("truncated (", size, " bytes; its ELF headers describe ", end, "): copy or build it again");
  };
  if (!in || header.e_phentsize != sizeof(Elf64_Phdr)) return cut(sizeof header);
  const uint64_t tableEnd = header.e_phoff + uint64_t{header.e_phnum} * sizeof(Elf64_Phdr);
  if (tableEnd > size) return cut(tableEnd);
  const uint64_t sectionsEnd = header.e_shoff + uint64_t{header.e_shnum} * header.e_shentsize;
  if (sectionsEnd > size) return cut(sectionsEnd);
  std::vector<Elf64_Phdr> segments(header.e_phnum);
  in.seekg(static_cast<std::streamoff>(header.e_phoff));
  in.read(reinterpret_cast<char*>(segments.data()), static_cast<std::streamsize>(segments.size() * sizeof(Elf64_Phdr)));
  for (const Elf64_Phdr& segment : segments) {
    if (segment.p_type == PT_LOAD && segment.p_offset + segment.p_filesz > size) {
      return cut(segment.p_offset + segment.p_filesz);
    }
  }
  return std::nullopt;
}

bool looksLikeLibrary(const fs::path& path) {
  const std::string name = path.filename().string();
  return name.size() > 3 && (name.ends_with(".so") || name.find(".so.") != std::string::npos);
}

}  // namespace

PluginLoader::PluginLoader(Registry& registry) : registry_(registry) {}

PluginLoader::~PluginLoader() {
  while (!libraries_.empty()) libraries_.pop_back();
}

fs::path PluginLoader::builtinDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  return (exe.parent_path() / ".." / "lib" / "qpipe" / "plugins").lexically_normal();
}

std::vector<PluginSearchDir> PluginLoader::searchPath(const std::optional<fs::path>& pluginDir,
                                                      const fs::path& builtinDir) {
  std::vector<PluginSearchDir> dirs;
  if (pluginDir) {
    QPIPE_REQUIRE(fs::is_directory(*pluginDir), ErrorCode::kUsage, "--plugin_dir '", pluginDir->string(),
                  "' is not a directory");
    dirs.push_back({*pluginDir, "--plugin_dir"});
  }
  if (const char* env = std::getenv("QPIPE_PLUGIN_PATH"); env != nullptr) {
    std::string_view rest(env);
    while (!rest.empty()) {
      const size_t colon = rest.find(':');
      const std::string entry(rest.substr(0, colon));
      rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
      if (entry.empty()) continue;
      if (fs::is_directory(entry)) {
        dirs.push_back({entry, "QPIPE_PLUGIN_PATH"});
      } else {
        log::logger()->warn("QPIPE_PLUGIN_PATH entry '", entry, "' is not a directory; skipped");
      }
    }
  }
  if (!builtinDir.empty() && fs::is_directory(builtinDir)) dirs.push_back({builtinDir, "built-in"});
  return dirs;
}

void PluginLoader::loadDirectories(const std::vector<PluginSearchDir>& dirs) {
  std::vector<fs::path> scanned;
  for (const auto& [dir, source] : dirs) {
    const fs::path canonical = fs::weakly_canonical(dir);
    if (std::find(scanned.begin(), scanned.end(), canonical) != scanned.end()) continue;
    scanned.push_back(canonical);

    std::vector<fs::path> files;
    for (const auto& item : fs::directory_iterator(dir)) {
      if (looksLikeLibrary(item.path())) files.push_back(item.path());
    }
    std::sort(files.begin(), files.end());
    log::logger()->debug("scanning ", source, " plugin folder ", dir.string(), " (", files.size(), " libraries)");
    for (const auto& file : files) {
      try {
        load(file);
      } catch (const Error& e) {
        rejected_.push_back({file.string(), e.what()});
        log::logger()->debug("rejected plugin library ", file.string(), ": ", e.what());
      }
    }
  }
}

PluginRecord PluginLoader::loadLibrary(const fs::path& path) {
  try {
    return load(path);
  } catch (const Error& e) {
    throw Error(ErrorCode::kPlugin, concat("plugin library '", path.string(), "': ", e.what()));
  }
}

const PluginRecord& PluginLoader::load(const fs::path& path) {
  const std::string origin = path.string();
  for (const auto& record : loaded_) {
    if (record.origin == origin) return record;
  }
  // A link loop or an unreadable entry is one rejected library, not a failure of every command.
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    reject(ec && ec != std::errc::no_such_file_or_directory ? ec.message() : "not a regular file");
  }
  try {
    boost::dll::library_info info(path, /*throw_if_not_native_format=*/true);
  } catch (const std::exception&) {
    reject("not a shared library (not an ELF file for this platform)");
  }
  if (const std::optional<std::string> reason = truncated(path)) reject(*reason);

  std::lock_guard<std::mutex> lock(loadMutex());
  auto library = std::make_shared<boost::dll::shared_library>();
  try {
    // RTLD_NOW: an unresolved symbol fails here, not at its first call mid-run.
    library->load(path, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    reject(concat("cannot be loaded: ", firstLine(e.what())));
  }
  if (!library->has(QPIPE_PLUGIN_ENTRY_NAME)) {
    reject(concat("no qpipe plugin descriptor (symbol '", QPIPE_PLUGIN_ENTRY_NAME,
                  "' is not exported); build the plugin with qpipe_add_plugin() and QPIPE_PLUGIN(...)"));
  }
  const QpipePluginDescriptor* descriptor = nullptr;
  try {
    descriptor = library->get<const QpipePluginDescriptor*()>(QPIPE_PLUGIN_ENTRY_NAME)();
  } catch (const std::exception& e) {
    reject(concat("its descriptor function threw: ", e.what()));
  }
  if (descriptor == nullptr) reject("its descriptor function returned null");
  return registerDescriptor(*descriptor, origin, std::static_pointer_cast<const void>(library));
}

PluginRecord PluginLoader::addStatic(const QpipePluginDescriptor* descriptor) {
  QPIPE_REQUIRE(descriptor != nullptr, ErrorCode::kPlugin, "static plugin descriptor is null");
  return registerDescriptor(*descriptor, concat("static:", descriptor->name ? descriptor->name : "?"), nullptr);
}

const PluginRecord& PluginLoader::registerDescriptor(const QpipePluginDescriptor& descriptor, const std::string& origin,
                                                     std::shared_ptr<const void> owner) {
  // Only the C-layout fields are read until the version and fingerprint checks pass.
  if (descriptor.abiMajor != QPIPE_PLUGIN_ABI_MAJOR || descriptor.abiMinor > QPIPE_PLUGIN_ABI_MINOR) {
    reject(concat("plugin ABI ", descriptor.abiMajor, ".", descriptor.abiMinor,
                  " is not compatible with this qpipe (plugin ABI ", QPIPE_PLUGIN_ABI_MAJOR, ".",
                  QPIPE_PLUGIN_ABI_MINOR, "); rebuild the plugin against qpipe ", QPIPE_VERSION));
  }
  const char* fingerprint = descriptor.fingerprint != nullptr ? descriptor.fingerprint : "";
  if (std::strcmp(fingerprint, QPIPE_BUILD_FINGERPRINT) != 0) {
    reject(concat("build fingerprint '", fingerprint, "' does not match this qpipe's '", QPIPE_BUILD_FINGERPRINT,
                  "'; rebuild the plugin with the same compiler, LibTorch and qpipe"));
  }
  if (descriptor.name == nullptr || descriptor.name[0] == '\0') reject("the descriptor has no plugin name");
  if (descriptor.registerProcessors == nullptr) reject("the descriptor has no registration function");
  const std::string name = descriptor.name;
  for (const auto& record : loaded_) {
    if (record.name == name) {
      reject(concat("plugin '", name, "' is already loaded from ", record.origin,
                    ", which comes first in the search order; this copy is ignored"));
    }
  }

  PluginRegistrar registrar(log::logger());
  try {
    descriptor.registerProcessors(registrar);
  } catch (const std::exception& e) {
    reject(concat("plugin '", name, "' failed to register its types: ", e.what()));
  } catch (...) {
    reject(concat("plugin '", name, "' failed to register its types: unknown exception"));
  }

  PluginRecord record{name,
                      descriptor.version ? descriptor.version : "",
                      descriptor.description ? descriptor.description : "",
                      origin,
                      {}};
  std::vector<Registry::ProcessorEntry> processors;
  for (auto& info : registrar.processors_) {
    record.types.push_back(info.type);
    processors.push_back({{owner, name, origin}, std::move(info)});
  }
  std::vector<Registry::SaverEntry> savers;
  for (auto& info : registrar.savers_) {
    record.savers.push_back(info.type);
    savers.push_back({{owner, name, origin}, std::move(info)});
  }
  try {
    registry_.add(std::move(processors), std::move(savers));
  } catch (const Error& e) {
    // The whole plugin stays out: say what goes with it, which matters when an earlier plugin in
    // the search order took one type of a built-in one.
    std::vector<std::string> types = record.types;
    types.insert(types.end(), record.savers.begin(), record.savers.end());
    reject(concat(e.what(), "; so plugin '", name, "' is not loaded, nor any of its types (", joinNames(types), ")"));
  }
  if (owner) libraries_.push_back(std::move(owner));
  loaded_.push_back(std::move(record));
  log::logger()->debug("loaded plugin ", name, " ", loaded_.back().version, " from ", origin);
  return loaded_.back();
}

void loadPlugins(PluginLoader& loader, const std::vector<PluginSearchDir>& dirs) {
  loader.loadDirectories(dirs);
  for (const auto& rejected : loader.rejected()) {
    log::logger()->warn("plugin library ", rejected.path, " not loaded: ", rejected.reason);
  }
}

}  // namespace qpipe
