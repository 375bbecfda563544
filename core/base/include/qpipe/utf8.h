// UTF-8 checks for text a user gives (data sets, pipelines, tokenizers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "qpipe/error.h"

namespace qpipe {

// Byte offset of the first invalid sequence, or nullopt when `text` is valid UTF-8 (Unicode's
// table of well-formed sequences: overlong forms, surrogates and values past U+10FFFF are not).
std::optional<size_t> findInvalidUtf8(std::string_view text);
// Bytes as UTF-8, each maximal invalid subsequence replaced by U+FFFD (as Rust's from_utf8_lossy
// and Python's errors="replace" do).
std::string utf8Lossy(std::string_view bytes);
// "line:column" of byte `offset` of `text` (both from 1, the column in bytes), where `text`
// starts at line `firstLine` of its file.
std::string textPosition(std::string_view text, size_t offset, int64_t firstLine = 1);
// Error(code) "<path>:<line>:<column>: byte 0xFF is not valid UTF-8; save the file as UTF-8" at
// the first invalid byte of `text`, which starts at line `firstLine` of `path`.
void requireUtf8(std::string_view text, const std::string& path, ErrorCode code, int64_t firstLine = 1);

}  // namespace qpipe
