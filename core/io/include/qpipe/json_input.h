// JSON from a user's file, parsed with a nesting limit: no model or tokenizer file nests more than
// a few levels, and a hostile one must end in an error, not in a stack overflow.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "qpipe/error.h"

namespace qpipe {

inline constexpr int kMaxJsonDepth = 100;

// The callback to pass to Json::parse (nlohmann::json or ordered_json): Error(kInput) "<where>: JSON
// nested deeper than 100 levels" as soon as the parser goes deeper.
template <typename Json>
typename Json::parser_callback_t jsonDepthLimit(std::string where) {
  return [where = std::move(where)](int depth, typename Json::parse_event_t, Json&) {
    QPIPE_REQUIRE(depth <= kMaxJsonDepth, ErrorCode::kInput, where, ": JSON nested deeper than ", kMaxJsonDepth,
                  " levels");
    return true;
  };
}

}  // namespace qpipe
