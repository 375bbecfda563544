// Logging. The host owns one process logger (spdlog underneath, to stderr, the rank in the
// pattern); plugins receive it through ProcessorContext or PluginRegistrar and only write to
// it. spdlog stays out of this header: LibTorch ships its own fmt, which Debian's spdlog cannot
// be compiled against, so no translation unit that sees torch headers includes spdlog.
#pragma once

#include <functional>
#include <memory>
#include <string_view>
#include <utility>

#include "qpipe/error.h"

namespace qpipe {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };

class Logger {
 public:
  using Sink = std::function<void(LogLevel level, std::string_view message)>;

  // Writes every message at `level` or above to `sink`.
  explicit Logger(Sink sink, LogLevel level = LogLevel::kInfo) : sink_(std::move(sink)), level_(level) {}

  bool enabled(LogLevel level) const { return level >= level_ && level_ != LogLevel::kOff; }
  void setLevel(LogLevel level) { level_ = level; }
  void write(LogLevel level, std::string_view message) const {
    if (enabled(level)) sink_(level, message);
  }

  // The arguments are streamed into one message, and only when the level is enabled.
  template <typename... Args>
  void trace(const Args&... args) const {
    emit(LogLevel::kTrace, args...);
  }
  template <typename... Args>
  void debug(const Args&... args) const {
    emit(LogLevel::kDebug, args...);
  }
  template <typename... Args>
  void info(const Args&... args) const {
    emit(LogLevel::kInfo, args...);
  }
  template <typename... Args>
  void warn(const Args&... args) const {
    emit(LogLevel::kWarn, args...);
  }
  template <typename... Args>
  void error(const Args&... args) const {
    emit(LogLevel::kError, args...);
  }

 private:
  template <typename... Args>
  void emit(LogLevel level, const Args&... args) const {
    if (enabled(level)) sink_(level, concat(args...));
  }

  Sink sink_;
  LogLevel level_;
};

namespace log {

// The process logger: stderr (stdout is kept for command output).
const std::shared_ptr<Logger>& logger();

// trace | debug | info | warn | error | off. Anything else is Error(kUsage).
LogLevel parseLevel(std::string_view level);
void setLevel(std::string_view level);

// Puts "rank r/w" into every line once a process knows its place in a multi-rank run.
void setRank(int rank, int worldSize);

// Flushes and releases the logging backend; call once at process exit.
void shutdown();

}  // namespace log
}  // namespace qpipe
