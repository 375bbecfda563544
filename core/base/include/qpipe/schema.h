// Configuration schemas: what a processor (or any YAML block) accepts, checked before the
// processor is constructed. Validation fills in defaults, so a factory reads every declared
// field without checking for presence.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/error.h"

namespace qpipe {

// kPatternList: a list of module-name globs (qpipe/pattern.h), checked for syntax.
enum class ValueType { kBool, kInt, kFloat, kString, kStringList, kPatternList, kMap, kAny };

std::string_view valueTypeName(ValueType type);

class Schema;

struct FieldSpec {
  std::string name;
  ValueType type = ValueType::kString;
  std::string help;
  bool required = false;
  std::optional<ConfigNode> defaultValue;  // absent and not required: the field stays null
  std::vector<std::string> allowed;        // kString only; empty means any string
  std::optional<double> minimum;           // kInt and kFloat: the smallest value accepted
  std::optional<double> maximum;           // kInt and kFloat: the largest value accepted
  std::shared_ptr<const Schema> nested;    // kMap only; null means any keys
};

class Schema {
 public:
  Schema() = default;

  Schema& add(FieldSpec field);
  Schema& required(std::string name, ValueType type, std::string help);
  Schema& optional(std::string name, ValueType type, ConfigNode defaultValue, std::string help);
  Schema& choice(std::string name, std::vector<std::string> allowed, std::string defaultValue, std::string help);
  Schema& nested(std::string name, Schema schema, bool required, std::string help);
  // `include` (default ["*"]) and `exclude` (default []) module-name glob lists.
  Schema& includeExclude();

  // Returns `node` with defaults filled in. Errors are Error(kConfig):
  // "<file:line:col>: <path>.<field>: <what was expected>".
  ConfigNode validate(const ConfigNode& node, std::string_view path) const;

  const std::vector<FieldSpec>& fields() const { return fields_; }
  const FieldSpec* find(std::string_view name) const;
  // The field `name` most likely misspells (within two edits), or empty.
  std::string closest(std::string_view name) const;

 private:
  std::vector<FieldSpec> fields_;
};

// Error(kConfig) "<file:line:col of at>: <path>: <what>", the form of every configuration error;
// failAt throws it.
Error configError(const ConfigNode& at, std::string_view path, std::string_view what);
[[noreturn]] inline void failAt(const ConfigNode& at, std::string_view path, std::string_view what) {
  throw configError(at, path, what);
}

// "a, b, c": how messages list the names a field accepts.
std::string joinNames(const std::vector<std::string>& items);

}  // namespace qpipe
