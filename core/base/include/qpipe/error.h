// Errors: one exception type carrying an exit-code category and a one-line message.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace qpipe {

// What went wrong, as the CLI reports it: each value is the process exit code (docs/cli.md).
enum class ErrorCode : int {
  kInternal = 1,       // a bug in qpipe or a plugin: an invariant did not hold
  kUsage = 2,          // command line: unknown option, missing argument, bad value
  kConfig = 3,         // pipeline YAML: syntax, schema, unknown processor type
  kPlugin = 4,         // a plugin library could not be loaded, or a plugin call failed
  kInput = 5,          // model, checkpoint, tokenizer or calibration data
  kIo = 6,             // reading or writing files
  kDistributed = 7,    // ranks, process groups, rendezvous
  kInterrupted = 130,  // SIGINT or SIGTERM stopped a multi-rank run (128 + SIGINT, as shells do)
};

std::string_view errorCodeName(ErrorCode code);

// The text up to its first newline: one line of a multi-line message (a c10 backtrace follows it).
std::string firstLine(std::string_view text);

// The message of an exception in one line. A LibTorch error (c10::Error) gives its message
// without the C++ backtrace that follows it; the whole text goes to the log at debug level.
std::string oneLine(const std::exception& error);

// A message of at most about `limit` bytes: a longer one keeps its start and its end around a
// count of the bytes left out, cut between UTF-8 characters. Where an input is echoed (a 1 MB
// value of a YAML file) the line stays one a terminal shows.
std::string shortened(std::string_view message, size_t limit = 2000);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ~Error() override;  // out of line: one type_info, in libqpipe_core, for host and plugins
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// The message builder of errors and logs: every argument streamed, in order, into one string.
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

namespace detail {
[[noreturn]] void failInternalCheck(const char* condition, const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace qpipe

// An invariant of qpipe itself; a failure is a bug, reported with the source location.
// The message arguments are streamed, and only evaluated when the check fails.
#define QPIPE_CHECK(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond)) [[unlikely]] {                                                                    \
      ::qpipe::detail::failInternalCheck(#cond, __FILE__, __LINE__, ::qpipe::concat(__VA_ARGS__)); \
    }                                                                                              \
  } while (false)

// A condition on user input; a failure throws qpipe::Error(code) whose message is exactly
// the streamed arguments: one line that names the input and what to fix.
#define QPIPE_REQUIRE(cond, code, ...)                            \
  do {                                                            \
    if (!(cond)) [[unlikely]] {                                   \
      throw ::qpipe::Error((code), ::qpipe::concat(__VA_ARGS__)); \
    }                                                             \
  } while (false)
