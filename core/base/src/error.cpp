#include "qpipe/error.h"

#include <c10/util/Exception.h>

#include "qpipe/log.h"

namespace qpipe {

Error::~Error() = default;

std::string firstLine(std::string_view text) {
  return std::string(text.substr(0, text.find('\n')));
}

std::string shortened(std::string_view message, size_t limit) {
  if (message.size() <= limit) return std::string(message);
  const auto continuation = [&](size_t at) { return (static_cast<unsigned char>(message[at]) & 0xC0) == 0x80; };
  // Three quarters before the cut, one after: a message names its input first and what to do last.
  size_t head = limit * 3 / 4, tail = message.size() - limit / 4;
  // A character has at most three continuation bytes; text that is not UTF-8 is cut where it falls.
  for (int step = 0; step < 3 && head > 0 && continuation(head); ++step) --head;
  for (int step = 0; step < 3 && tail < message.size() && continuation(tail); ++step) ++tail;
  return concat(message.substr(0, head), " [... ", tail - head, " bytes left out ...] ", message.substr(tail));
}

std::string oneLine(const std::exception& error) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&error)) {
    log::logger()->debug("LibTorch error: ", c10Error->what());
    return firstLine(c10Error->what_without_backtrace());
  }
  return firstLine(error.what());
}

std::string_view errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInternal:
      return "internal error";
    case ErrorCode::kUsage:
      return "usage error";
    case ErrorCode::kConfig:
      return "configuration error";
    case ErrorCode::kPlugin:
      return "plugin error";
    case ErrorCode::kInput:
      return "input error";
    case ErrorCode::kIo:
      return "I/O error";
    case ErrorCode::kDistributed:
      return "distributed error";
    case ErrorCode::kInterrupted:
      return "interrupted";
  }
  return "error";
}

namespace detail {
void failInternalCheck(const char* condition, const char* file, int line, const std::string& message) {
  throw Error(ErrorCode::kInternal, concat(message.empty() ? "internal check failed" : message, " [check '", condition,
                                           "' at ", file, ":", line, "]"));
}
}  // namespace detail

}  // namespace qpipe
