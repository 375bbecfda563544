#include "option_checks.h"

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>

namespace qpipe::cli {

namespace {

template <typename T>
bool unbounded(T max) {
  return max == std::numeric_limits<T>::max() || max == std::numeric_limits<T>::infinity();
}

// "a whole number from 1 to 4096" for messages, "[1, 4096]" for --help.
template <typename T>
std::string describe(const char* kind, T min, T max, bool brief) {
  std::ostringstream text;
  if (brief) {
    text << (unbounded(max) ? ">= " : "[") << min;
    if (!unbounded(max)) text << ", " << max << "]";
  } else {
    text << kind << (unbounded(max) ? " of at least " : " from ") << min;
    if (!unbounded(max)) text << " to " << max;
  }
  return text.str();
}

// The whole text as a T, or nothing (trailing characters, a fraction for an integer, NaN, Inf).
template <typename T>
bool parse(const std::string& text, T& value) {
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc() || stop != end) return false;
  if constexpr (std::is_floating_point_v<T>) return std::isfinite(value);
  return true;
}

template <typename T>
CLI::Validator inRange(const char* kind, T min, T max) {
  const std::string expected = describe(kind, min, max, false);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        T value{};
        if (parse(text, value) && value >= min && value <= max) return {};
        return "expected " + expected + ", got '" + text + "'";
      },
      describe(kind, min, max, true));
}

}  // namespace

CLI::Validator wholeNumber(int64_t min, int64_t max) {
  return inRange("a whole number", min, max);
}

CLI::Validator number(double min, double max) {
  return inRange("a number", min, max);
}

CLI::Validator path() {
  return CLI::Validator([](std::string& text) { return text.empty() ? "expected a path, got ''" : std::string(); }, "");
}

}  // namespace qpipe::cli
