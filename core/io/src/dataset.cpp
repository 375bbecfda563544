#include "qpipe/dataset.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <string_view>

#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"
#include "qpipe/log.h"
#include "qpipe/perplexity.h"
#include "qpipe/tokenizer.h"
#include "qpipe/utf8.h"

namespace qpipe {
namespace {

using Json = nlohmann::json;

std::string describeType(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::boolean:
      return "a boolean";
    default:
      return "a number";
  }
}

bool isBlank(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

// nlohmann reports "[json.exception.parse_error.101] parse error at line L, column C: <what>";
// we report "<file>:<line>:<col>: invalid JSON: <what>", the line counted in the whole file.
[[noreturn]] void throwParseError(const std::string& path, int64_t firstLine, const Json::parse_error& e) {
  const std::string message = e.what();
  const auto at = message.find(" at line ");
  const auto column = message.find(", column ", at);
  const auto rest = message.find(": ", column);
  if (at != std::string::npos && column != std::string::npos && rest != std::string::npos) {
    const int64_t line = firstLine - 1 + std::stoll(message.substr(at + 9, column - at - 9));
    throw Error(ErrorCode::kInput, concat(path, ":", line, ":", message.substr(column + 9, rest - column - 9),
                                          ": invalid JSON: ", message.substr(rest + 2)));
  }
  throw Error(ErrorCode::kInput, concat(path, ":", firstLine, ": invalid JSON: ", message));
}

Json parseJson(const std::string& text, const std::string& path, int64_t firstLine) {
  try {
    return Json::parse(text, jsonDepthLimit<Json>(concat(path, ":", firstLine)));
  } catch (const Json::parse_error& e) {
    throwParseError(path, firstLine, e);
  } catch (const Json::exception& e) {  // a number out of range
    throw Error(ErrorCode::kInput, concat(path, ":", firstLine, ": invalid JSON: ", e.what()));
  }
}

const std::string& requireString(const Json& value, const std::string& where, const std::string& field) {
  QPIPE_REQUIRE(value.is_string(), ErrorCode::kInput, where, ": ", field, " is ", describeType(value),
                "; expected a string");
  return value.get_ref<const std::string&>();
}

// An optional string member: absent gives "".
std::string optionalString(const Json& record, const char* key, const std::string& where) {
  const auto it = record.find(key);
  return it == record.end() ? std::string() : requireString(*it, where, key);
}

// messages / conversations: a non-empty array of objects, each with a role and a content field.
std::vector<ChatTurn> parseTurns(const Json& turns, const std::string& where, const char* field, const char* roleKey,
                                 const char* contentKey, bool shareGpt) {
  QPIPE_REQUIRE(turns.is_array(), ErrorCode::kInput, where, ": ", field, " is ", describeType(turns),
                "; expected an array of {\"", roleKey, "\", \"", contentKey, "\"} objects");
  QPIPE_REQUIRE(!turns.empty(), ErrorCode::kInput, where, ": ", field, " is empty");
  std::vector<ChatTurn> result;
  result.reserve(turns.size());
  for (size_t i = 0; i < turns.size(); ++i) {
    const std::string name = std::string(field) + "[" + std::to_string(i) + "]";
    const Json& turn = turns[i];
    QPIPE_REQUIRE(turn.is_object(), ErrorCode::kInput, where, ": ", name, " is ", describeType(turn),
                  "; expected an object with \"", roleKey, "\" and \"", contentKey, "\"");
    for (const char* key : {roleKey, contentKey}) {
      QPIPE_REQUIRE(turn.contains(key), ErrorCode::kInput, where, ": ", name, " has no \"", key, "\"");
    }
    std::string role = requireString(turn[roleKey], where, name + "." + roleKey);
    QPIPE_REQUIRE(!role.empty(), ErrorCode::kInput, where, ": ", name, ".", roleKey, " is empty");
    if (shareGpt && role == "human") role = "user";
    if (shareGpt && role == "gpt") role = "assistant";
    result.push_back({std::move(role), requireString(turn[contentKey], where, name + "." + contentKey)});
  }
  return result;
}

DataSample parseRecord(const Json& record, std::string where) {
  QPIPE_REQUIRE(record.is_object(), ErrorCode::kInput, where, ": record is ", describeType(record),
                "; expected a JSON object");
  // Exactly one shape per record: a record that mixes them has no single meaning.
  constexpr std::array<std::string_view, 4> kShapes = {"text", "messages", "conversations", "instruction/input"};
  std::vector<std::string_view> shapes;
  for (const auto shape : kShapes) {
    const bool present = shape == kShapes[3] ? record.contains("instruction") || record.contains("input")
                                             : record.contains(std::string(shape));
    if (present) shapes.push_back(shape);
  }
  QPIPE_REQUIRE(!shapes.empty(), ErrorCode::kInput, where,
                ": record has none of the fields text, messages, conversations, instruction, input");
  QPIPE_REQUIRE(shapes.size() == 1, ErrorCode::kInput, where, ": record mixes the fields ", shapes[0], " and ",
                shapes[1], "; keep one per record");

  DataSample sample;
  if (shapes[0] == "text") {
    sample.text = requireString(record["text"], where, "text");
    QPIPE_REQUIRE(!sample.text.empty(), ErrorCode::kInput, where, ": text is empty");
  } else if (shapes[0] == "messages") {
    sample.turns = parseTurns(record["messages"], where, "messages", "role", "content", false);
  } else if (shapes[0] == "conversations") {
    sample.turns = parseTurns(record["conversations"], where, "conversations", "from", "value", true);
  } else {
    const std::string instruction = optionalString(record, "instruction", where);
    const std::string input = optionalString(record, "input", where);
    const std::string output = optionalString(record, "output", where);
    QPIPE_REQUIRE(!instruction.empty() || !input.empty(), ErrorCode::kInput, where,
                  ": instruction and input are both empty; the pair has no prompt");
    const std::string prompt =
        instruction.empty() || input.empty() ? instruction + input : instruction + "\n\n" + input;
    sample.turns.push_back({"user", prompt});
    if (!output.empty()) sample.turns.push_back({"assistant", output});
  }
  if (!sample.turns.empty()) sample.text = renderPlainChat(sample.turns);
  sample.origin = std::move(where);
  return sample;
}

bool full(const std::vector<DataSample>& samples, const DatasetOptions& options) {
  return options.maxSamples > 0 && static_cast<int64_t>(samples.size()) >= options.maxSamples;
}

std::vector<DataSample> readJsonl(const std::string& content, const std::string& path, const DatasetOptions& options) {
  std::vector<DataSample> samples;
  size_t start = 0;
  for (int64_t lineNo = 1; start < content.size() && !full(samples, options); ++lineNo) {
    const size_t end = std::min(content.find('\n', start), content.size());
    const std::string line = content.substr(start, end - start);
    start = end + 1;
    if (isBlank(line)) continue;
    requireUtf8(line, path, ErrorCode::kInput, lineNo);
    const std::string where = path + ":" + std::to_string(lineNo);
    samples.push_back(parseRecord(parseJson(line, path, lineNo), where));
  }
  return samples;
}

std::vector<DataSample> readJson(const std::string& content, const std::string& path, const DatasetOptions& options) {
  const Json document = parseJson(content, path, 1);
  const Json* records = &document;
  if (document.is_object() && document.size() == 1 && document.begin().value().is_array()) {
    records = &document.begin().value();
  }
  QPIPE_REQUIRE(records->is_array(), ErrorCode::kInput, path, ": the document is ", describeType(document),
                "; expected an array of records, or an object whose one member is that array");
  QPIPE_REQUIRE(!records->empty(), ErrorCode::kInput, path, ": the array of records is empty");
  std::vector<DataSample> samples;
  for (size_t i = 0; i < records->size() && !full(samples, options); ++i) {
    samples.push_back(parseRecord((*records)[i], path + ": record " + std::to_string(i + 1)));
  }
  return samples;
}

// Paragraphs are runs of non-blank lines; a paragraph keeps its line breaks.
std::vector<DataSample> readText(const std::string& content, const std::string& path, const DatasetOptions& options) {
  std::vector<DataSample> samples;
  DataSample paragraph;
  auto flush = [&] {
    if (!paragraph.text.empty() && !full(samples, options)) samples.push_back(std::move(paragraph));
    paragraph = {};
  };
  size_t start = 0;
  for (int64_t lineNo = 1; start < content.size() && !full(samples, options); ++lineNo) {
    const size_t end = std::min(content.find('\n', start), content.size());
    std::string line = content.substr(start, end - start);
    start = end + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (isBlank(line)) {
      flush();
      continue;
    }
    requireUtf8(line, path, ErrorCode::kInput, lineNo);
    if (paragraph.text.empty()) {
      paragraph.origin = path + ":" + std::to_string(lineNo);
    } else {
      paragraph.text += '\n';
    }
    paragraph.text += line;
  }
  flush();
  return samples;
}

}  // namespace

std::string renderPlainChat(const std::vector<ChatTurn>& turns) {
  std::string text;
  for (const auto& turn : turns) text += turn.role + ": " + turn.content + "\n";
  return text;
}

std::vector<DataSample> loadDataset(const std::filesystem::path& path, const DatasetOptions& options) {
  const std::string name = path.string();
  QPIPE_REQUIRE(options.maxSamples >= 0, ErrorCode::kUsage,
                "the maximum number of samples must be >= 0 (0 = all), got ", options.maxSamples);
  // A missing path is reported as missing, whatever its extension.
  QPIPE_REQUIRE(std::filesystem::exists(path), ErrorCode::kIo, name, ": no such data file");
  QPIPE_REQUIRE(!std::filesystem::is_directory(path), ErrorCode::kInput, name,
                ": is a directory; expected a .jsonl, .json or .txt file");
  std::string extension = path.extension().string();
  std::transform(extension.begin(), extension.end(), extension.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  QPIPE_REQUIRE(extension == ".jsonl" || extension == ".json" || extension == ".txt", ErrorCode::kInput, name,
                ": unknown data file type \"", extension, "\"; expected .jsonl, .json or .txt");

  const std::string content = readInputFile(path);
  QPIPE_REQUIRE(!isBlank(content), ErrorCode::kInput, name, ": the file is empty");
  std::vector<DataSample> samples = extension == ".jsonl"  ? readJsonl(content, name, options)
                                    : extension == ".json" ? readJson(content, name, options)
                                                           : readText(content, name, options);
  const auto chats = std::count_if(samples.begin(), samples.end(), [](const auto& s) { return !s.turns.empty(); });
  log::logger()->info("data: ", samples.size(), " samples from ", name, " (", chats, " chats)");
  return samples;
}

namespace {

std::vector<std::string> datasetTexts(const std::filesystem::path& path, const DatasetOptions& options = {}) {
  std::vector<std::string> texts;
  for (auto& sample : loadDataset(path, options)) texts.push_back(std::move(sample.text));
  return texts;
}

}  // namespace

TokenStream encodeDataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                          const DatasetOptions& options) {
  const std::vector<std::string> texts = datasetTexts(path, options);
  return {tokenizer.encode(joinEvalTexts(texts), /*addSpecialTokens=*/false), texts.size()};
}

std::vector<int64_t> encodeDatasetPrefix(const std::filesystem::path& path, const Tokenizer& tokenizer, int64_t count) {
  const std::vector<std::string> texts = datasetTexts(path);
  const auto encodeFirst = [&](size_t n) {
    return tokenizer.encode(joinEvalTexts({texts.begin(), texts.begin() + static_cast<std::ptrdiff_t>(n)}),
                            /*addSpecialTokens=*/false);
  };
  // Doubling the texts tried keeps the work within twice what the final prefix costs.
  size_t held = 1;
  while (held < texts.size() && static_cast<int64_t>(encodeFirst(held).size()) < count) {
    held = std::min(2 * held, texts.size());
  }
  std::vector<int64_t> ids = encodeFirst(std::min(held + 1, texts.size()));
  QPIPE_REQUIRE(static_cast<int64_t>(ids.size()) >= count, ErrorCode::kInput, path.string(), ": ", ids.size(),
                " tokens, fewer than the ", count, " the report's probe reads (--probe_tokens)");
  ids.resize(static_cast<size_t>(count));
  return ids;
}

std::vector<at::Tensor> calibrationWindows(const TokenStream& stream, const std::string& origin, int64_t count,
                                           int64_t seqLen) {
  const int64_t available = static_cast<int64_t>(stream.ids.size()) / seqLen;
  QPIPE_REQUIRE(available > 0, ErrorCode::kInput, origin, ": ", stream.ids.size(),
                " tokens, fewer than one window of --seq_len ", seqLen);
  if (available < count) {
    log::logger()->warn(origin, ": ", stream.ids.size(), " tokens make ", available, " windows of ", seqLen,
                        ", fewer than --calib_samples ", count, "; calibrating on ", available);
  }
  const at::Tensor all = at::tensor(stream.ids, at::kLong);
  std::vector<at::Tensor> windows;
  for (int64_t i = 0; i < std::min(count, available); ++i) {
    windows.push_back(all.slice(0, i * seqLen, (i + 1) * seqLen).unsqueeze(0).clone());
  }
  return windows;
}

}  // namespace qpipe
