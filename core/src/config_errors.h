// Helpers shared by the YAML validators (schema.cpp, pipeline.cpp); not a public header.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "qpipe/config_node.h"

namespace qpipe::detail {

// "a, b, c"
std::string join(const std::vector<std::string>& items);

// Throws Error(kConfig): "<file:line:col of at>: <path>: <what>".
[[noreturn]] void failAt(const ConfigNode& at, std::string_view path, std::string_view what);

}  // namespace qpipe::detail
