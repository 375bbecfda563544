// A parsed YAML value that remembers where it came from, so every error can name the file,
// line and column. Processors read their validated configuration through this type.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace qpipe {

struct SourceLocation {
  std::string file;
  int line = 0;    // 1-based; 0 when the value did not come from a file (a default)
  int column = 0;  // 1-based

  // "file:line:col", or "file" / "<default>" when parts are unknown.
  std::string str() const;
};

class ConfigNode {
 public:
  enum class Kind { kNull, kBool, kInt, kFloat, kString, kList, kMap };
  using Entry = std::pair<std::string, ConfigNode>;

  ConfigNode() = default;  // null
  static ConfigNode null(SourceLocation where);
  static ConfigNode boolean(bool value, SourceLocation where = {});
  static ConfigNode integer(int64_t value, SourceLocation where = {});
  static ConfigNode number(double value, SourceLocation where = {});
  static ConfigNode string(std::string value, SourceLocation where = {});
  static ConfigNode list(std::vector<ConfigNode> items = {}, SourceLocation where = {});
  static ConfigNode map(std::vector<Entry> entries = {}, SourceLocation where = {});
  static ConfigNode stringList(const std::vector<std::string>& items);

  // Reads one YAML document. Anchors, aliases and merge keys (<<) are resolved; duplicate
  // keys and syntax errors are Error(kConfig) naming file:line:col.
  static ConfigNode loadYamlFile(const std::filesystem::path& file);
  static ConfigNode parseYaml(std::string_view text, const std::string& fileName);

  Kind kind() const;
  static std::string_view kindName(Kind kind);
  bool isNull() const { return kind() == Kind::kNull; }
  bool isMap() const { return kind() == Kind::kMap; }
  bool isList() const { return kind() == Kind::kList; }

  // Typed reads; a wrong kind is Error(kConfig) naming the location. asFloat accepts ints.
  bool asBool() const;
  int64_t asInt() const;
  double asFloat() const;
  const std::string& asString() const;
  std::vector<std::string> asStringList() const;
  const std::vector<ConfigNode>& items() const;
  const std::vector<Entry>& entries() const;

  // Map lookup: null pointer when absent; at() throws Error(kConfig) when absent.
  const ConfigNode* find(std::string_view key) const;
  const ConfigNode& at(std::string_view key) const;
  // Inserts or replaces a map entry, keeping first-insertion order.
  void set(std::string key, ConfigNode value);
  // Appends to a list.
  void push(ConfigNode item);

  // True when the YAML defined an anchor (&name) on this value.
  bool hasAnchor() const { return anchored_; }
  void markAnchored() { anchored_ = true; }

  // The scalar as written in the file (for a plain scalar read into a string field).
  const std::string& sourceText() const { return text_; }
  void setSourceText(std::string text) { text_ = std::move(text); }

  const SourceLocation& location() const { return location_; }

  // Block-style YAML of this value, for `qpipe check` and reports.
  std::string toYaml() const;

 private:
  using Value =
      std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<ConfigNode>, std::vector<Entry>>;
  ConfigNode(Value value, SourceLocation where);
  [[noreturn]] void wrongKind(Kind expected) const;

  Value value_;
  SourceLocation location_;
  std::string text_;
  bool anchored_ = false;
};

}  // namespace qpipe
