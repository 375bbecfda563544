#include "qpipe/pattern.h"

#include <algorithm>
#include <charconv>
#include <regex>

#include "qpipe/error.h"

namespace qpipe {

namespace {

[[noreturn]] void malformed(const std::string& pattern, std::string_view why) {
  throw Error(ErrorCode::kConfig, concat("pattern '", pattern, "': ", why));
}

// Index of the brace closing the one at `open`, or npos.
size_t closingBrace(const std::string& text, size_t open) {
  int depth = 0;
  for (size_t i = open; i < text.size(); ++i) {
    if (text[i] == '{') ++depth;
    if (text[i] == '}' && --depth == 0) return i;
  }
  return std::string::npos;
}

std::vector<std::string> splitTopLevel(const std::string& body) {
  std::vector<std::string> parts(1);
  int depth = 0;
  for (char c : body) {
    if (c == '{') ++depth;
    if (c == '}') --depth;
    if (c == ',' && depth == 0) {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  return parts;
}

// The most patterns one may expand to: a range of a few thousand layers or experts is far below
// it, and a typo such as {0..99999999999} fails here instead of filling the memory.
constexpr size_t kMaxAlternatives = 100000;

// A bound of a numeric range, which must fit a long long.
long long rangeBound(const std::string& text, const std::string& original) {
  long long value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    malformed(original, concat("the range bound ", text, " is out of range"));
  }
  return value;
}

// A range's values as bash writes them: padded with zeros to the wider bound where either bound
// has a leading zero ({08..10}: 08 09 10).
std::vector<std::string> rangeValues(const std::string& from, const std::string& to, const std::string& original) {
  const long long first = rangeBound(from, original), last = rangeBound(to, original);
  // The distance in unsigned arithmetic, which holds it whatever the bounds; the count is one more.
  const unsigned long long distance =
      first <= last ? static_cast<unsigned long long>(last) - static_cast<unsigned long long>(first)
                    : static_cast<unsigned long long>(first) - static_cast<unsigned long long>(last);
  if (distance >= kMaxAlternatives) {
    malformed(original, concat("the range {", from, "..", to, "} has more than ", kMaxAlternatives, " values"));
  }
  const auto padded = [](const std::string& bound) {
    const size_t digits = bound[0] == '-' ? 1 : 0;
    return bound.size() > digits + 1 && bound[digits] == '0';
  };
  const size_t width = padded(from) || padded(to) ? std::max(from.size(), to.size()) : 0;
  std::vector<std::string> values;
  for (long long v = first;; v += first <= last ? 1 : -1) {
    // The magnitude as unsigned: -v overflows for the smallest long long.
    std::string text =
        std::to_string(v < 0 ? 0ULL - static_cast<unsigned long long>(v) : static_cast<unsigned long long>(v));
    const size_t digits = width > (v < 0 ? 1 : 0) ? width - (v < 0 ? 1 : 0) : 0;
    if (text.size() < digits) text.insert(0, digits - text.size(), '0');
    values.push_back(v < 0 ? "-" + text : text);
    if (v == last) break;
  }
  return values;
}

// Bash-style brace expansion: {a,b}, nested braces and numeric ranges {0..3}, {7..7} included. A
// brace group with neither a comma nor a range stays literal, as in bash.
void expand(const std::string& pattern, const std::string& original, std::vector<std::string>& out) {
  if (out.size() >= kMaxAlternatives) {
    malformed(original, concat("expands to more than ", kMaxAlternatives, " patterns"));
  }
  const size_t open = pattern.find('{');
  if (open == std::string::npos) {
    if (pattern.find('}') != std::string::npos) malformed(original, "'}' without a matching '{'");
    out.push_back(pattern);
    return;
  }
  const size_t close = closingBrace(pattern, open);
  if (close == std::string::npos) malformed(original, "'{' without a matching '}'");
  const std::string prefix = pattern.substr(0, open);
  const std::string body = pattern.substr(open + 1, close - open - 1);
  const std::string suffix = pattern.substr(close + 1);

  static const std::regex kRange(R"((-?[0-9]+)\.\.(-?[0-9]+))");
  std::smatch range;
  const bool isRange = std::regex_match(body, range, kRange);
  const std::vector<std::string> alternatives =
      isRange ? rangeValues(range[1], range[2], original) : splitTopLevel(body);
  if (!isRange && alternatives.size() == 1) {
    // Literal braces: keep them, expand what follows.
    std::vector<std::string> tails;
    expand(suffix, original, tails);
    for (const auto& tail : tails) out.push_back(prefix + "{" + body + "}" + tail);
    return;
  }
  for (const auto& alternative : alternatives) expand(prefix + alternative + suffix, original, out);
}

// Matches a bracket expression starting at pattern[p] == '['; sets `next` past it.
bool matchBracket(std::string_view pattern, size_t p, char c, size_t& next) {
  size_t i = p + 1;
  const bool negate = i < pattern.size() && (pattern[i] == '!' || pattern[i] == '^');
  if (negate) ++i;
  bool matched = false;
  bool first = true;
  for (; i < pattern.size() && (first || pattern[i] != ']'); ++i, first = false) {
    if (i + 2 < pattern.size() && pattern[i + 1] == '-' && pattern[i + 2] != ']') {
      matched |= pattern[i] <= c && c <= pattern[i + 2];
      i += 2;
    } else {
      matched |= pattern[i] == c;
    }
  }
  next = i + 1;
  return matched != negate;
}

bool globMatch(std::string_view pattern, std::string_view name) {
  size_t p = 0, n = 0;
  size_t starP = std::string_view::npos, starN = 0;
  while (n < name.size()) {
    if (p < pattern.size()) {
      const char pc = pattern[p];
      if (pc == '*') {
        starP = p++;
        starN = n;
        continue;
      }
      if (pc == '?') {
        ++p, ++n;
        continue;
      }
      if (pc == '[') {
        size_t next = 0;
        if (matchBracket(pattern, p, name[n], next)) {
          p = next, ++n;
          continue;
        }
      } else if (pc == name[n]) {
        ++p, ++n;
        continue;
      }
    }
    if (starP == std::string_view::npos) return false;
    p = starP + 1;
    n = ++starN;
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

void checkBrackets(const std::string& pattern) {
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '[') continue;
    const size_t close = pattern.find(']', i + 2);
    if (close == std::string::npos) malformed(pattern, "'[' without a matching ']'");
    i = close;
  }
}

}  // namespace

GlobPattern::GlobPattern(std::string pattern) : text_(std::move(pattern)) {
  if (text_.empty()) malformed(text_, "empty pattern");
  checkBrackets(text_);
  expand(text_, text_, alternatives_);
}

bool GlobPattern::matches(std::string_view name) const {
  for (const auto& alternative : alternatives_) {
    if (globMatch(alternative, name)) return true;
  }
  return false;
}

ModuleFilter::ModuleFilter(const std::vector<std::string>& include, const std::vector<std::string>& exclude) {
  for (const auto& p : include) include_.emplace_back(p);
  for (const auto& p : exclude) exclude_.emplace_back(p);
  includeHit_.assign(include_.size(), false);
  excludeHit_.assign(exclude_.size(), false);
}

bool ModuleFilter::matches(std::string_view name) {
  bool included = false;
  for (size_t i = 0; i < include_.size(); ++i) {
    if (include_[i].matches(name)) included = includeHit_[i] = true;
  }
  bool excluded = false;
  for (size_t i = 0; i < exclude_.size(); ++i) {
    if (exclude_[i].matches(name)) excluded = excludeHit_[i] = true;
  }
  return included && !excluded;
}

std::vector<std::string> ModuleFilter::unmatchedPatterns() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < include_.size(); ++i) {
    if (!includeHit_[i]) out.push_back("include '" + include_[i].text() + "'");
  }
  for (size_t i = 0; i < exclude_.size(); ++i) {
    if (!excludeHit_[i]) out.push_back("exclude '" + exclude_[i].text() + "'");
  }
  return out;
}

}  // namespace qpipe
