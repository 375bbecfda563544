#include "qpipe/schema.h"

#include <algorithm>
#include <cmath>

#include "qpipe/error.h"
#include "qpipe/pattern.h"

namespace qpipe {

std::string_view valueTypeName(ValueType type) {
  switch (type) {
    case ValueType::kBool:
      return "a boolean";
    case ValueType::kInt:
      return "an integer";
    case ValueType::kFloat:
      return "a number";
    case ValueType::kString:
      return "a string";
    case ValueType::kStringList:
      return "a list of strings";
    case ValueType::kPatternList:
      return "a list of module-name patterns";
    case ValueType::kMap:
      return "a mapping";
    case ValueType::kAny:
      return "any value";
  }
  return "?";
}

Schema& Schema::add(FieldSpec field) {
  QPIPE_CHECK(find(field.name) == nullptr, "schema declares field '", field.name, "' twice");
  QPIPE_CHECK(field.allowed.empty() || field.type == ValueType::kString, "allowed values on non-string field '",
              field.name, "'");
  fields_.push_back(std::move(field));
  return *this;
}

Schema& Schema::required(std::string name, ValueType type, std::string help) {
  return add({.name = std::move(name), .type = type, .help = std::move(help), .required = true});
}

Schema& Schema::optional(std::string name, ValueType type, ConfigNode defaultValue, std::string help) {
  return add({.name = std::move(name), .type = type, .help = std::move(help), .defaultValue = std::move(defaultValue)});
}

Schema& Schema::choice(std::string name, std::vector<std::string> allowed, std::string defaultValue, std::string help) {
  QPIPE_CHECK(std::find(allowed.begin(), allowed.end(), defaultValue) != allowed.end(), "default of '", name,
              "' is not an allowed value");
  return add({.name = std::move(name),
              .type = ValueType::kString,
              .help = std::move(help),
              .defaultValue = ConfigNode::string(std::move(defaultValue)),
              .allowed = std::move(allowed)});
}

Schema& Schema::nested(std::string name, Schema schema, bool required, std::string help) {
  return add({.name = std::move(name),
              .type = ValueType::kMap,
              .help = std::move(help),
              .required = required,
              .nested = std::make_shared<const Schema>(std::move(schema))});
}

Schema& Schema::includeExclude() {
  optional("include", ValueType::kPatternList, ConfigNode::stringList({"*"}),
           "module-name globs to process ('*' crosses dots, {a,b} braces)");
  return optional("exclude", ValueType::kPatternList, ConfigNode::stringList({}),
                  "module-name globs to skip; exclude wins over include");
}

const FieldSpec* Schema::find(std::string_view name) const {
  for (const auto& field : fields_) {
    if (field.name == name) return &field;
  }
  return nullptr;
}

namespace {

size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string fieldPath(std::string_view path, std::string_view field) {
  return path.empty() ? std::string(field) : concat(path, ".", field);
}

bool isScalar(const ConfigNode& node) {
  return !node.isNull() && !node.isList() && !node.isMap();
}

// A plain scalar read where a string is expected keeps the text it was written as.
ConfigNode asStringNode(const ConfigNode& node, const std::string& path, std::string_view expected) {
  if (node.kind() == ConfigNode::Kind::kString) return node;
  if (!isScalar(node)) failAt(node, path, concat("expected ", expected, ", got ", ConfigNode::kindName(node.kind())));
  return ConfigNode::string(node.sourceText(), node.location());
}

void checkRange(const FieldSpec& field, const ConfigNode& value, const std::string& path) {
  const double number = value.asFloat();
  if (field.minimum && number < *field.minimum)
    failAt(value, path, concat("must be >= ", *field.minimum, ", got ", number));
  if (field.maximum && number > *field.maximum)
    failAt(value, path, concat("must be <= ", *field.maximum, ", got ", number));
}

ConfigNode checkValue(const FieldSpec& field, const ConfigNode& value, const std::string& path) {
  const auto got = [&] {
    return concat("expected ", valueTypeName(field.type), ", got ", ConfigNode::kindName(value.kind()));
  };
  switch (field.type) {
    case ValueType::kBool:
      if (value.kind() != ConfigNode::Kind::kBool) failAt(value, path, got());
      return value;
    case ValueType::kInt:
      if (value.kind() != ConfigNode::Kind::kInt) failAt(value, path, got());
      checkRange(field, value, path);
      return value;
    case ValueType::kFloat:
      if (value.kind() != ConfigNode::Kind::kInt && value.kind() != ConfigNode::Kind::kFloat)
        failAt(value, path, got());
      // YAML's .nan passes every comparison, and no option means anything at .inf.
      if (!std::isfinite(value.asFloat()))
        failAt(value, path, concat("expected a finite number, got ", value.sourceText()));
      checkRange(field, value, path);
      return value;
    case ValueType::kString: {
      ConfigNode text = asStringNode(value, path, valueTypeName(field.type));
      if (!field.allowed.empty() &&
          std::find(field.allowed.begin(), field.allowed.end(), text.asString()) == field.allowed.end()) {
        failAt(value, path, concat("'", text.asString(), "' is not one of: ", joinNames(field.allowed)));
      }
      return text;
    }
    case ValueType::kStringList:
    case ValueType::kPatternList: {
      if (!value.isList()) failAt(value, path, got());
      ConfigNode out = ConfigNode::list({}, value.location());
      for (size_t i = 0; i < value.items().size(); ++i) {
        const std::string itemPath = concat(path, "[", i, "]");
        ConfigNode item = asStringNode(value.items()[i], itemPath, "a string");
        if (field.type == ValueType::kPatternList) {
          try {
            GlobPattern{item.asString()};
          } catch (const Error& e) {
            failAt(item, itemPath, e.what());
          }
        }
        out.push(std::move(item));
      }
      return out;
    }
    case ValueType::kMap:
      if (value.isNull() && field.nested) return field.nested->validate(ConfigNode::map({}, value.location()), path);
      if (!value.isMap()) failAt(value, path, got());
      return field.nested ? field.nested->validate(value, path) : value;
    case ValueType::kAny:
      return value;
  }
  return value;
}

}  // namespace

std::string Schema::closest(std::string_view name) const {
  std::string out;
  size_t best = 3;  // suggest only near misses
  for (const auto& field : fields_) {
    const size_t distance = editDistance(name, field.name);
    if (distance < best) best = distance, out = field.name;
  }
  return out;
}

std::string joinNames(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

Error configError(const ConfigNode& at, std::string_view path, std::string_view what) {
  return Error(ErrorCode::kConfig, concat(at.location().str(), ": ", path, ": ", what));
}

ConfigNode Schema::validate(const ConfigNode& node, std::string_view path) const {
  const std::string where = path.empty() ? std::string("document") : std::string(path);
  if (node.isNull()) return validate(ConfigNode::map({}, node.location()), path);
  if (!node.isMap()) failAt(node, where, concat("expected a mapping, got ", ConfigNode::kindName(node.kind())));

  for (const auto& [key, value] : node.entries()) {
    if (find(key) != nullptr) continue;
    std::vector<std::string> names;
    for (const auto& field : fields_) names.push_back(field.name);
    const std::string meant = closest(key);
    failAt(value, fieldPath(path, key),
           concat("unknown field", meant.empty() ? "" : "; did you mean '" + meant + "'?",
                  names.empty() ? std::string("; no fields are accepted here")
                                : "; expected one of: " + joinNames(names)));
  }

  ConfigNode out = ConfigNode::map({}, node.location());
  for (const auto& field : fields_) {
    const std::string childPath = fieldPath(path, field.name);
    const ConfigNode* value = node.find(field.name);
    // An explicit null (`key:` or `key: ~`) on an optional field reads as the field left out, so
    // validating an already validated node changes nothing.
    if (value != nullptr && value->isNull() && !field.required) value = nullptr;
    if (value != nullptr) {
      out.set(field.name, checkValue(field, *value, childPath));
    } else if (field.required) {
      failAt(node, where,
             concat("missing required field '", field.name, "' (", valueTypeName(field.type),
                    field.help.empty() ? "" : ": " + field.help, ")"));
    } else if (field.defaultValue) {
      out.set(field.name, *field.defaultValue);
    } else if (field.type == ValueType::kMap && field.nested &&
               std::none_of(field.nested->fields().begin(), field.nested->fields().end(),
                            [](const FieldSpec& inner) { return inner.required; })) {
      // An absent block whose fields all have defaults reads as that block of defaults.
      out.set(field.name, field.nested->validate(ConfigNode::map(), childPath));
    } else {
      out.set(field.name, ConfigNode());
    }
  }
  return out;
}

}  // namespace qpipe
