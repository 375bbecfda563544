// The out-of-line parts of the SDK (qpipe/processor.h, qpipe/saver.h).
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <utility>

#include "qpipe/config_node.h"
#include "qpipe/processor.h"
#include "qpipe/saver.h"
#include "qpipe/schema.h"

namespace qpipe {

void calibrate(LayerRequest& request) {
  if (!request.forward) return;
  request.forward(request);
  if (request.betweenForwards.empty()) return;
  const std::vector<std::function<void()>> steps = std::move(request.betweenForwards);
  request.betweenForwards.clear();
  for (const auto& step : steps) step();
  request.forward(request);
}

void calibrateInputsOf(LayerRequest& request, const std::vector<Module*>& watched) {
  QPIPE_CHECK(request.betweenForwards.empty(), "calibrateInputsOf with steps between forwards");
  if (!request.forwardUntil) {
    calibrate(request);
  } else if (!watched.empty()) {
    request.forwardUntil(request, watched);
  }
}

std::shared_ptr<ModuleFilter> ProcessorContext::moduleFilter(const ConfigNode& config) const {
  auto filter =
      std::make_shared<ModuleFilter>(config.at("include").asStringList(), config.at("exclude").asStringList());
  filters->push_back(filter);
  return filter;
}

Error ProcessorContext::configError(const ConfigNode& config, std::string_view field, std::string_view what) const {
  const ConfigNode* node = config.find(field);
  const ConfigNode& at = node != nullptr && !node->isNull() ? *node : config;
  return qpipe::configError(at, fieldPath(field), what);
}

void ProcessorContext::warnIfSet(const ConfigNode& value, std::string_view field, std::string_view why) const {
  if (value.location().line > 0)
    configWarnings->push_back(concat(value.location().str(), ": ", fieldPath(field), ": ", why));
}

std::string ProcessorContext::fieldPath(std::string_view field) const {
  return configPath.empty() ? std::string(field) : concat(configPath, ".", field);
}

namespace {

constexpr std::string_view kPartialSuffix = ".qpipe-partial";

// The longest file name the file system holding `path` (or its nearest existing ancestor) takes.
size_t nameMax(std::filesystem::path path) {
  std::error_code ec;
  while (!path.empty() && !std::filesystem::exists(path, ec) && path != path.parent_path()) path = path.parent_path();
  const long limit = path.empty() ? -1 : ::pathconf(path.c_str(), _PC_NAME_MAX);
  return limit > 0 ? static_cast<size_t>(limit) : 255;  // NAME_MAX of Linux file systems
}

}  // namespace

std::filesystem::path CheckpointSaver::partialDir(const std::filesystem::path& saveDir) {
  std::filesystem::path target = std::filesystem::absolute(saveDir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();  // "out/" names "out"
  std::error_code ec;
  if (std::filesystem::is_symlink(target, ec)) {
    const std::filesystem::path resolved = std::filesystem::canonical(target, ec);
    if (!ec) target = resolved;
  }
  // A name the file system takes, but not with the suffix, failed as the file system's error deep
  // in the saver, after the model had loaded.
  const size_t name = target.filename().native().size(), extra = 1 + kPartialSuffix.size();
  const size_t limit = nameMax(target.parent_path());
  QPIPE_REQUIRE(name + extra <= limit, ErrorCode::kInput, "--save_path's folder name is ", name,
                " bytes; the partial folder written beside it takes ", extra, " more, over the file system's limit of ",
                limit, " bytes a name; choose a name of at most ", limit > extra ? limit - extra : 0, " bytes");
  // Hidden, beside the destination (same file system, so the final rename is atomic).
  return target.parent_path() / ("." + target.filename().string() + std::string(kPartialSuffix));
}

std::optional<int> CheckpointSaver::lockPartial(const std::filesystem::path& partial) {
  const int fd = ::open(partial.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return fd;
  const int error = errno;
  ::close(fd);
  if (error == EWOULDBLOCK) return std::nullopt;
  return -1;
}

std::string CheckpointSaver::writeSegment(int64_t index, const std::string& name, Module&, const SegmentChain&) {
  QPIPE_CHECK(false, "writeSegment(", index, ", ", name, ") on a saver without a segmentFactory");
  return {};
}

void CheckpointSaver::adoptSegment(int64_t index, const std::string&) {
  QPIPE_CHECK(false, "adoptSegment(", index, ") on a saver without a segmentFactory");
}

}  // namespace qpipe
