// Module-name patterns of include/exclude lists (msmodelslim's ConfigSet semantics): shell
// globs with braces, where `*` also matches across dots, and exclude wins over include.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace qpipe {

class GlobPattern {
 public:
  // Supports * ? [abc] [a-z] [!abc] and nested {a,b}. Malformed patterns (an unclosed brace or
  // bracket) are Error(kConfig).
  explicit GlobPattern(std::string pattern);
  bool matches(std::string_view name) const;
  const std::string& text() const { return text_; }

 private:
  std::string text_;
  std::vector<std::string> alternatives_;  // brace-expanded
};

class ModuleFilter {
 public:
  ModuleFilter(const std::vector<std::string>& include, const std::vector<std::string>& exclude);

  // Records which patterns matched, for unmatchedPatterns().
  bool matches(std::string_view name);

  // Patterns that matched no name so far, as "include 'p'" / "exclude 'p'"; processors
  // warn about them at the end of a run.
  std::vector<std::string> unmatchedPatterns() const;

 private:
  std::vector<GlobPattern> include_, exclude_;
  std::vector<bool> includeHit_, excludeHit_;
};

}  // namespace qpipe
