// Checks of options that say what the option takes and what it got. CLI11's own (Range,
// PositiveNumber) call a word like "abc" a value out of range and print an unbounded limit as the
// 309 digits of the largest double.
#pragma once

#include <cstdint>
#include <limits>

namespace CLI {
class Validator;
}

namespace qpipe::cli {

// An integer in [min, max].
CLI::Validator wholeNumber(int64_t min, int64_t max = std::numeric_limits<int64_t>::max());
// A finite number in [min, max].
CLI::Validator number(double min, double max = std::numeric_limits<double>::infinity());
// A file or folder name: not empty (an unset shell variable, `--save_path "$OUT"`).
CLI::Validator path();

}  // namespace qpipe::cli
