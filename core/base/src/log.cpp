// The only translation unit that includes spdlog (see qpipe/log.h); it is compiled without
// LibTorch's include path.
#include "qpipe/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <array>
#include <string>

namespace qpipe::log {

namespace {

std::string pattern(const std::string& rankTag) {
  return "[%H:%M:%S.%e]" + rankTag + " [%^%l%$] %v";
}

const std::shared_ptr<spdlog::logger>& backend() {
  static const std::shared_ptr<spdlog::logger> instance = [] {
    auto created = spdlog::stderr_color_mt("qpipe");
    created->set_pattern(pattern(""));
    created->set_level(spdlog::level::trace);  // filtering happens in qpipe::Logger
    created->flush_on(spdlog::level::warn);
    return created;
  }();
  return instance;
}

spdlog::level::level_enum toSpdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

}  // namespace

const std::shared_ptr<Logger>& logger() {
  static const std::shared_ptr<Logger> instance = std::make_shared<Logger>(
      [](LogLevel level, std::string_view message) { backend()->log(toSpdlog(level), "{}", message); });
  return instance;
}

LogLevel parseLevel(std::string_view level) {
  static constexpr std::array<std::pair<std::string_view, LogLevel>, 6> kLevels{{
      {"trace", LogLevel::kTrace},
      {"debug", LogLevel::kDebug},
      {"info", LogLevel::kInfo},
      {"warn", LogLevel::kWarn},
      {"error", LogLevel::kError},
      {"off", LogLevel::kOff},
  }};
  for (const auto& [name, value] : kLevels) {
    if (name == level) return value;
  }
  throw Error(ErrorCode::kUsage,
              concat("unknown log level '", level, "'; use one of trace, debug, info, warn, error, off"));
}

void setLevel(std::string_view level) {
  logger()->setLevel(parseLevel(level));
}

void setRank(int rank, int worldSize) {
  backend()->set_pattern(pattern(worldSize > 1 ? concat(" [rank ", rank, "/", worldSize, "]") : std::string()));
}

void shutdown() {
  backend()->flush();
  spdlog::shutdown();
}

}  // namespace qpipe::log
