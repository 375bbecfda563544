#include "qpipe/config_node.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/utf8.h"

namespace qpipe {

std::string SourceLocation::str() const {
  if (file.empty()) return "<default>";
  if (line == 0) return file;
  return concat(file, ":", line, ":", column);
}

ConfigNode::ConfigNode(Value value, SourceLocation where) : value_(std::move(value)), location_(std::move(where)) {}

ConfigNode ConfigNode::null(SourceLocation where) {
  return {std::monostate{}, std::move(where)};
}
ConfigNode ConfigNode::boolean(bool value, SourceLocation where) {
  return {value, std::move(where)};
}
ConfigNode ConfigNode::integer(int64_t value, SourceLocation where) {
  return {value, std::move(where)};
}
ConfigNode ConfigNode::number(double value, SourceLocation where) {
  return {value, std::move(where)};
}
ConfigNode ConfigNode::string(std::string value, SourceLocation where) {
  ConfigNode node{Value{std::in_place_type<std::string>, value}, std::move(where)};
  node.text_ = std::move(value);
  return node;
}
ConfigNode ConfigNode::list(std::vector<ConfigNode> items, SourceLocation where) {
  return {std::move(items), std::move(where)};
}
ConfigNode ConfigNode::map(std::vector<Entry> entries, SourceLocation where) {
  return {std::move(entries), std::move(where)};
}
ConfigNode ConfigNode::stringList(const std::vector<std::string>& items) {
  std::vector<ConfigNode> nodes;
  nodes.reserve(items.size());
  for (const auto& item : items) nodes.push_back(string(item));
  return list(std::move(nodes));
}

ConfigNode::Kind ConfigNode::kind() const {
  return static_cast<Kind>(value_.index());
}

std::string_view ConfigNode::kindName(Kind kind) {
  switch (kind) {
    case Kind::kNull:
      return "null";
    case Kind::kBool:
      return "a boolean";
    case Kind::kInt:
      return "an integer";
    case Kind::kFloat:
      return "a number";
    case Kind::kString:
      return "a string";
    case Kind::kList:
      return "a list";
    case Kind::kMap:
      return "a mapping";
  }
  return "?";
}

void ConfigNode::wrongKind(Kind expected) const {
  throw Error(ErrorCode::kConfig,
              concat(location_.str(), ": expected ", kindName(expected), ", got ", kindName(kind())));
}

bool ConfigNode::asBool() const {
  if (kind() != Kind::kBool) wrongKind(Kind::kBool);
  return std::get<bool>(value_);
}
int64_t ConfigNode::asInt() const {
  if (kind() != Kind::kInt) wrongKind(Kind::kInt);
  return std::get<int64_t>(value_);
}
double ConfigNode::asFloat() const {
  if (kind() == Kind::kInt) return static_cast<double>(std::get<int64_t>(value_));
  if (kind() != Kind::kFloat) wrongKind(Kind::kFloat);
  return std::get<double>(value_);
}
const std::string& ConfigNode::asString() const {
  if (kind() != Kind::kString) wrongKind(Kind::kString);
  return std::get<std::string>(value_);
}
std::vector<std::string> ConfigNode::asStringList() const {
  std::vector<std::string> out;
  for (const auto& item : items()) out.push_back(item.asString());
  return out;
}
const std::vector<ConfigNode>& ConfigNode::items() const {
  if (kind() != Kind::kList) wrongKind(Kind::kList);
  return std::get<std::vector<ConfigNode>>(value_);
}
const std::vector<ConfigNode::Entry>& ConfigNode::entries() const {
  if (kind() != Kind::kMap) wrongKind(Kind::kMap);
  return std::get<std::vector<Entry>>(value_);
}

const ConfigNode* ConfigNode::find(std::string_view key) const {
  for (const auto& [name, value] : entries()) {
    if (name == key) return &value;
  }
  return nullptr;
}

const ConfigNode& ConfigNode::at(std::string_view key) const {
  const ConfigNode* found = find(key);
  QPIPE_REQUIRE(found != nullptr, ErrorCode::kConfig, location_.str(), ": missing field '", key, "'");
  return *found;
}

void ConfigNode::push(ConfigNode item) {
  if (kind() != Kind::kList) wrongKind(Kind::kList);
  std::get<std::vector<ConfigNode>>(value_).push_back(std::move(item));
}

void ConfigNode::set(std::string key, ConfigNode value) {
  if (kind() != Kind::kMap) wrongKind(Kind::kMap);
  auto& list = std::get<std::vector<Entry>>(value_);
  for (auto& [name, existing] : list) {
    if (name == key) {
      existing = std::move(value);
      return;
    }
  }
  list.emplace_back(std::move(key), std::move(value));
}

namespace {

// Resolves a plain (unquoted) scalar the way YAML 1.2's core schema does, plus the
// capitalised True/False that msmodelslim's practice files use.
ConfigNode resolvePlainScalar(const std::string& text, SourceLocation where) {
  static const std::regex kInt(R"([-+]?[0-9]+)");
  static const std::regex kFloat(R"([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?)");
  ConfigNode node;
  if (text == "true" || text == "True" || text == "TRUE") {
    node = ConfigNode::boolean(true, std::move(where));
  } else if (text == "false" || text == "False" || text == "FALSE") {
    node = ConfigNode::boolean(false, std::move(where));
  } else if (std::regex_match(text, kInt)) {
    try {
      node = ConfigNode::integer(std::stoll(text), where);
    } catch (const std::out_of_range&) {
      throw Error(ErrorCode::kConfig, concat(where.str(), ": integer ", text, " is out of range"));
    }
  } else if (std::regex_match(text, kFloat)) {
    try {
      node = ConfigNode::number(std::stod(text), where);
    } catch (const std::out_of_range&) {
      throw Error(ErrorCode::kConfig, concat(where.str(), ": number ", text, " is out of range"));
    }
  } else if (text == ".inf" || text == "+.inf" || text == ".Inf") {
    node = ConfigNode::number(INFINITY, std::move(where));
  } else if (text == "-.inf" || text == "-.Inf") {
    node = ConfigNode::number(-INFINITY, std::move(where));
  } else if (text == ".nan" || text == ".NaN") {
    node = ConfigNode::number(NAN, std::move(where));
  } else {
    return ConfigNode::string(text, std::move(where));
  }
  node.setSourceText(text);
  return node;
}

// Builds ConfigNodes from yaml-cpp's event stream. Events (rather than YAML::Node) give us
// anchors, duplicate-key detection and exact marks for every value.
class Builder : public YAML::EventHandler {
 public:
  explicit Builder(std::string file) : file_(std::move(file)) {}

  // An empty document (or one of comments only) is null, located at the file.
  ConfigNode takeRoot() { return std::move(root_).value_or(ConfigNode::null({file_})); }

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}

  void OnNull(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    emit(ConfigNode::null(where(mark)), anchor, mark);
  }

  void OnAlias(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    auto it = anchors_.find(anchor);
    QPIPE_REQUIRE(it != anchors_.end(), ErrorCode::kConfig, where(mark).str(), ": unknown alias");
    // Each alias copies its anchor's values, so nested aliases grow a file exponentially (a
    // "billion laughs" file took 23 GB before it was killed).
    aliasedValues_ += anchorValues_.at(anchor);
    QPIPE_REQUIRE(aliasedValues_ <= kMaxAliasedValues, ErrorCode::kConfig, where(mark).str(),
                  ": aliases expand to more than ", kMaxAliasedValues, " values");
    emit(it->second, 0, mark);
  }

  void OnScalar(const YAML::Mark& mark, const std::string& tag, YAML::anchor_t anchor,
                const std::string& value) override {
    const bool quoted = tag == "!" || tag == "tag:yaml.org,2002:str";
    emit(quoted ? ConfigNode::string(value, where(mark)) : resolvePlainScalar(value, where(mark)), anchor, mark);
  }

  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    rejectComplexKey(mark);
    stack_.push_back({ConfigNode::list({}, where(mark)), anchor, std::nullopt, mark, {}});
  }
  void OnSequenceEnd() override { closeCollection(); }

  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    rejectComplexKey(mark);
    stack_.push_back({ConfigNode::map({}, where(mark)), anchor, std::nullopt, mark, {}});
  }
  void OnMapEnd() override { closeCollection(); }

 private:
  struct Frame {
    ConfigNode node;
    YAML::anchor_t anchor;
    std::optional<std::string> pendingKey;  // maps: the key whose value comes next
    YAML::Mark mark;
    std::set<std::string> mergedKeys;  // maps: keys taken from `<<`, which own keys may override
  };

  SourceLocation where(const YAML::Mark& mark) const { return {file_, mark.line + 1, mark.column + 1}; }

  // Before a collection opens: keys are plain values, and nesting is bounded (a pipeline nests a
  // few levels; a hostile file must end in an error, not in a stack overflow).
  void rejectComplexKey(const YAML::Mark& mark) const {
    if (!stack_.empty() && stack_.back().node.isMap() && !stack_.back().pendingKey) {
      throw Error(ErrorCode::kConfig, concat(where(mark).str(), ": a mapping key must be a plain value"));
    }
    if (stack_.size() >= kMaxDepth) {
      throw Error(ErrorCode::kConfig, concat(where(mark).str(), ": nested deeper than ", kMaxDepth, " levels"));
    }
  }

  static constexpr size_t kMaxDepth = 100;
  // A pipeline holds hundreds of values.
  static constexpr size_t kMaxAliasedValues = 1'000'000;

  static size_t countValues(const ConfigNode& node) {
    size_t count = 1;
    if (node.isList()) {
      for (const ConfigNode& item : node.items()) count += countValues(item);
    } else if (node.isMap()) {
      for (const auto& [name, value] : node.entries()) count += countValues(value);
    }
    return count;
  }

  void closeCollection() {
    Frame frame = std::move(stack_.back());
    stack_.pop_back();
    emit(std::move(frame.node), frame.anchor, frame.mark);
  }

  void emit(ConfigNode node, YAML::anchor_t anchor, const YAML::Mark& mark) {
    if (anchor != 0) {
      node.markAnchored();
      anchors_[anchor] = node;
      anchorValues_[anchor] = countValues(node);
    }
    if (stack_.empty()) {
      root_ = std::move(node);
      return;
    }
    Frame& parent = stack_.back();
    if (parent.node.isList()) {
      parent.node.push(std::move(node));
      return;
    }
    if (!parent.pendingKey) {
      parent.pendingKey = node.isNull() ? std::string() : node.sourceText();
      keyMarks_[stack_.size()] = mark;
      return;
    }
    std::string key = std::move(*parent.pendingKey);
    parent.pendingKey.reset();
    if (key == "<<") {
      merge(parent, node, mark);
      return;
    }
    // A key the map sets itself overrides one that came in through `<<`, once.
    const bool merged = parent.mergedKeys.erase(key) > 0;
    QPIPE_REQUIRE(merged || parent.node.find(key) == nullptr, ErrorCode::kConfig, where(keyMarks_[stack_.size()]).str(),
                  ": duplicate key '", key, "'");
    parent.node.set(std::move(key), std::move(node));
  }

  // YAML merge key: `<<: *base` or `<<: [*a, *b]` adds the entries the map does not set itself.
  void merge(Frame& target, const ConfigNode& source, const YAML::Mark& mark) {
    if (source.isList()) {
      for (const auto& item : source.items()) merge(target, item, mark);
      return;
    }
    QPIPE_REQUIRE(source.isMap(), ErrorCode::kConfig, where(mark).str(),
                  ": the merge key '<<' needs a mapping or a list of mappings");
    for (const auto& [name, value] : source.entries()) {
      if (target.node.find(name) == nullptr) {
        target.node.set(name, value);
        target.mergedKeys.insert(name);
      }
    }
  }

  std::string file_;
  std::vector<Frame> stack_;
  std::map<YAML::anchor_t, ConfigNode> anchors_;
  std::map<YAML::anchor_t, size_t> anchorValues_;
  size_t aliasedValues_ = 0;
  std::map<size_t, YAML::Mark> keyMarks_;
  std::optional<ConfigNode> root_;
};

// The error's line `last` (from 0) or, failing that, the nearest line with content before it,
// numbered from 1, where that line's indentation holds a tab (comments and blank lines are no
// indentation). YAML indents with spaces only; yaml-cpp's error for a tab is about what follows
// it ("illegal block entry", "end of sequence not found").
std::optional<size_t> tabIndentedLine(std::string_view text, size_t last) {
  std::optional<size_t> previous;
  size_t start = 0;
  for (size_t line = 0; line <= last && start < text.size(); ++line) {
    const size_t end = std::min(text.find('\n', start), text.size());
    const std::string_view row = text.substr(start, end - start);
    start = end + 1;
    const size_t content = row.find_first_not_of(" \t\r");
    if (content == std::string_view::npos || row[content] == '#') continue;
    const bool tab = row.substr(0, content).find('\t') != std::string_view::npos;
    if (line == last) return tab ? std::optional<size_t>(line + 1) : previous;
    previous = tab ? std::optional<size_t>(line + 1) : std::nullopt;
  }
  return previous;
}

void emitNode(YAML::Emitter& out, const ConfigNode& node) {
  switch (node.kind()) {
    case ConfigNode::Kind::kNull:
      out << YAML::Null;
      break;
    case ConfigNode::Kind::kBool:
      out << node.asBool();
      break;
    case ConfigNode::Kind::kInt:
      out << node.asInt();
      break;
    case ConfigNode::Kind::kFloat:
      out << node.asFloat();
      break;
    case ConfigNode::Kind::kString: {
      // Quote strings that would read back as another kind.
      const std::string& text = node.asString();
      if (resolvePlainScalar(text, {}).kind() != ConfigNode::Kind::kString || text.empty()) {
        out << YAML::DoubleQuoted << text;
      } else {
        out << text;
      }
      break;
    }
    case ConfigNode::Kind::kList: {
      const bool scalars = std::all_of(node.items().begin(), node.items().end(),
                                       [](const ConfigNode& item) { return !item.isList() && !item.isMap(); });
      if (scalars) out << YAML::Flow;
      out << YAML::BeginSeq;
      for (const auto& item : node.items()) emitNode(out, item);
      out << YAML::EndSeq;
      break;
    }
    case ConfigNode::Kind::kMap:
      if (node.entries().empty()) out << YAML::Flow;
      out << YAML::BeginMap;
      for (const auto& [key, value] : node.entries()) {
        out << YAML::Key << key << YAML::Value;
        emitNode(out, value);
      }
      out << YAML::EndMap;
      break;
  }
}

}  // namespace

ConfigNode ConfigNode::loadYamlFile(const std::filesystem::path& file) {
  requireRegularFile(file);
  std::ifstream in(file);
  QPIPE_REQUIRE(in.good(), ErrorCode::kIo, "cannot open '", file.string(), "': permission denied");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  // yaml-cpp reads a NUL as the end of a line, and then blames what follows it; it takes bytes
  // that are not UTF-8 into names and paths, where PyYAML (msmodelslim's reader) refuses the file.
  // UTF-16, which PyYAML reads, is named rather than read (its NULs would be blamed otherwise).
  QPIPE_REQUIRE(!text.starts_with("\xFF\xFE") && !text.starts_with("\xFE\xFF"), ErrorCode::kConfig, file.string(),
                ": UTF-16 text (its byte order mark); save the file as UTF-8");
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    throw Error(ErrorCode::kConfig,
                concat(file.string(), ":", textPosition(text, nul), ": a NUL byte; a pipeline is YAML text"));
  }
  requireUtf8(text, file.string(), ErrorCode::kConfig);
  return parseYaml(text, file.string());
}

ConfigNode ConfigNode::parseYaml(std::string_view text, const std::string& fileName) {
  Builder builder(fileName);
  std::istringstream in{std::string(text)};
  try {
    YAML::Parser parser(in);
    if (!parser.HandleNextDocument(builder)) return builder.takeRoot();
    Builder extra(fileName);
    QPIPE_REQUIRE(!parser.HandleNextDocument(extra), ErrorCode::kConfig, fileName,
                  ": holds more than one YAML document; put the pipeline in one");
  } catch (const YAML::Exception& e) {
    // yaml-cpp quotes the offending byte as it is: a control byte would break the one line.
    std::string why;
    for (const char c : e.msg) {
      const auto byte = static_cast<unsigned char>(c);
      if (byte >= 0x20 && byte != 0x7f) {
        why += c;
      } else {
        char escaped[8];
        std::snprintf(escaped, sizeof escaped, "\\x%02X", byte);
        why += escaped;
      }
    }
    const std::optional<size_t> tab = e.mark.line >= 0 ? tabIndentedLine(text, e.mark.line) : std::nullopt;
    throw Error(ErrorCode::kConfig,
                concat(fileName, ":", e.mark.line + 1, ":", e.mark.column + 1, ": YAML syntax error: ", why,
                       tab ? concat("; line ", *tab, " indents with a tab, and YAML indents with spaces only") : ""));
  }
  return builder.takeRoot();
}

std::string ConfigNode::toYaml() const {
  YAML::Emitter out;
  out.SetIndent(2);
  emitNode(out, *this);
  return std::string(out.c_str()) + "\n";
}

}  // namespace qpipe
