#include "qpipe/utf8.h"

#include <algorithm>
#include <cstdio>
#include <utility>

namespace qpipe {

namespace {

// Length of the valid prefix of the UTF-8 sequence at bytes[pos] (its full length when complete),
// and whether it is complete. Follows Unicode's table of well-formed byte sequences, so that
// overlong forms, surrogates and values past U+10FFFF are invalid.
std::pair<size_t, bool> scanSequence(std::string_view bytes, size_t pos) {
  const auto lead = static_cast<unsigned char>(bytes[pos]);
  if (lead < 0x80) return {1, true};
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return {0, false};
  }
  size_t valid = 1;
  for (; valid < length && pos + valid < bytes.size(); ++valid) {
    const auto byte = static_cast<unsigned char>(bytes[pos + valid]);
    if (byte < low || byte > high) break;
    low = 0x80;
    high = 0xBF;
  }
  return {valid, valid == length};
}

}  // namespace

std::optional<size_t> findInvalidUtf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    const auto [length, complete] = scanSequence(text, pos);
    if (!complete) return pos;
    pos += length;
  }
  return std::nullopt;
}

std::string utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t pos = 0; pos < bytes.size();) {
    const auto [length, complete] = scanSequence(bytes, pos);
    if (complete) {
      out.append(bytes.substr(pos, length));
      pos += length;
    } else {
      out += "\xEF\xBF\xBD";
      pos += std::max<size_t>(length, 1);
    }
  }
  return out;
}

std::string textPosition(std::string_view text, size_t offset, int64_t firstLine) {
  const size_t lineStart = offset == 0 ? std::string_view::npos : text.rfind('\n', offset - 1);
  const size_t column = offset - (lineStart == std::string_view::npos ? 0 : lineStart + 1) + 1;
  return concat(firstLine + std::count(text.begin(), text.begin() + offset, '\n'), ":", column);
}

void requireUtf8(std::string_view text, const std::string& path, ErrorCode code, int64_t firstLine) {
  if (const std::optional<size_t> bad = findInvalidUtf8(text)) {
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02X", static_cast<unsigned char>(text[*bad]));
    throw Error(code, concat(path, ":", textPosition(text, *bad, firstLine), ": byte ", byte,
                             " is not valid UTF-8; save the file as UTF-8"));
  }
}

}  // namespace qpipe
