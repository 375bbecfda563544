#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <memory>

#include "qpipe/error.h"
#include "tokenizer_internal.h"

namespace qpipe::detail::tok {

char32_t nextCodePoint(std::string_view text, size_t& pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  if (lead < 0x80) {
    ++pos;
    return lead;
  }
  const int length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
  char32_t cp = lead & (0xFF >> (length + 1));
  for (int k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[pos + k]) & 0x3F);
  pos += length;
  return cp;
}

void appendUtf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool isWhitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool isNumeric(char32_t cp) {
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return category == UTF8PROC_CATEGORY_ND || category == UTF8PROC_CATEGORY_NL || category == UTF8PROC_CATEGORY_NO;
}

bool isAlphanumeric(char32_t cp) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

ByteLevelMap::ByteLevelMap() : codePointToByte_(256 + 256, -1) {
  // Printable Latin-1 bytes keep their code point; the others move to 256, 257, ... in byte order,
  // so that every mapped token is visible text.
  char32_t next = 256;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE);
    const char32_t cp = printable ? static_cast<char32_t>(byte) : next++;
    appendUtf8(byteToUtf8_[byte], cp);
    codePointToByte_[cp] = static_cast<int16_t>(byte);
  }
}

const ByteLevelMap& ByteLevelMap::get() {
  static const ByteLevelMap map;
  return map;
}

void ByteLevelMap::encode(std::string_view raw, std::string& out) const {
  for (const char c : raw) out += byteToUtf8_[static_cast<unsigned char>(c)];
}

bool ByteLevelMap::decode(std::string_view mapped, std::string& out) const {
  const size_t start = out.size();
  for (size_t pos = 0; pos < mapped.size();) {
    const char32_t cp = nextCodePoint(mapped, pos);
    if (cp >= codePointToByte_.size() || codePointToByte_[cp] < 0) {
      out.resize(start);
      return false;
    }
    out += static_cast<char>(codePointToByte_[cp]);
  }
  return true;
}

std::vector<std::string> ByteLevelMap::alphabet() {
  const auto& map = get();
  return {std::begin(map.byteToUtf8_), std::end(map.byteToUtf8_)};
}

namespace {

struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

// One match block per thread, shared by all patterns: only the whole match (pair 0) is read.
pcre2_match_data* threadMatchData() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(pcre2_match_data_create(1, nullptr));
  return data.get();
}

}  // namespace

Regex::Regex(const std::string& pattern, bool literal, const std::string& where) {
  int errorCode = 0;
  PCRE2_SIZE errorOffset = 0;
  // PCRE2 refuses UCP with LITERAL; a literal needs no character classes anyway.
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &errorCode, &errorOffset,
                        nullptr);
  if (code_ == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(errorCode, message, sizeof(message));
    QPIPE_REQUIRE(false, ErrorCode::kInput, where, ": regex '", pattern, "' does not compile at offset ", errorOffset,
                  ": ", reinterpret_cast<const char*>(message));
  }
  // Without JIT, matching falls back to the interpreter: slower, same result.
  pcre2_jit_compile(static_cast<pcre2_code*>(code_), PCRE2_JIT_COMPLETE);
}

Regex::~Regex() {
  pcre2_code_free(static_cast<pcre2_code*>(code_));
}

void Regex::findAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  auto* data = threadMatchData();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start < text.size()) {
    const int rc = pcre2_match(static_cast<const pcre2_code*>(code_), subject, text.size(), start, PCRE2_NO_UTF_CHECK,
                               data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    QPIPE_REQUIRE(rc >= 0, ErrorCode::kInput, "tokenizer regex matching failed (PCRE2 error ", rc, ")");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else if (begin < text.size()) {
      // An empty match splits nothing; step over one code point to keep scanning.
      size_t pos = begin;
      nextCodePoint(text, pos);
      start = pos;
    } else {
      return;
    }
  }
}

}  // namespace qpipe::detail::tok
