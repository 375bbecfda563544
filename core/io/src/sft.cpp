#include "qpipe/sft.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <regex>
#include <sstream>

#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"
#include "qpipe/tokenizer.h"

namespace qpipe {
namespace {

constexpr std::string_view kImStart = "<|im_start|>", kImEnd = "<|im_end|>";

std::string renderTurn(const ChatFormat& format, const std::string& role, const std::string& content) {
  if (format.kind == ChatFormat::Kind::kPlain) return role + ": " + content + "\n";
  return concat(kImStart, role, "\n", content, kImEnd, "\n");
}

}  // namespace

ChatFormat ChatFormat::fromModel(const std::filesystem::path& modelDir) {
  const std::filesystem::path file = modelDir / "tokenizer_config.json";
  ChatFormat format;
  if (!std::filesystem::exists(file)) return format;
  const nlohmann::json config =
      nlohmann::json::parse(readInputFile(file), jsonDepthLimit<nlohmann::json>(file.string()),
                            /*allow_exceptions=*/false);
  if (!config.is_object() || !config.contains("chat_template") || !config["chat_template"].is_string()) return format;
  const std::string chatTemplate = config["chat_template"].get<std::string>();
  QPIPE_REQUIRE(chatTemplate.find(kImStart) != std::string::npos, ErrorCode::kInput, file.string(),
                ": the chat template is not ChatML (no <|im_start|>); qpipe renders ChatML and, for models without a "
                "template, the plain one (docs/data.md)");
  format.kind = Kind::kChatMl;
  // A literal system turn in a quoted string: the default SmolLM2's and Qwen2.5's templates add.
  static const std::regex kDefaultSystem(R"('<\|im_start\|>system\n([^'<]+)<\|im_end\|>)");
  std::smatch match;
  if (std::regex_search(chatTemplate, match, kDefaultSystem)) format.defaultSystem = match[1].str();
  return format;
}

std::vector<SftSample> sftSamples(const std::vector<DataSample>& records, const Tokenizer& tokenizer,
                                  const ChatFormat& format, int64_t count, int64_t maxTokens) {
  std::vector<SftSample> samples;
  for (const DataSample& record : records) {
    if (count > 0 && static_cast<int64_t>(samples.size()) == count) break;
    QPIPE_REQUIRE(!record.turns.empty(), ErrorCode::kInput, record.origin,
                  ": plain text in SFT data; every record must be a chat (messages, conversations, or instruction "
                  "and output)");
    const ChatTurn& last = record.turns.back();
    QPIPE_REQUIRE(last.role == "assistant", ErrorCode::kInput, record.origin, ": the last turn is the ", last.role,
                  "'s; SFT supervises the last assistant turn");
    std::string prefix;
    if (format.kind == ChatFormat::Kind::kChatMl && !format.defaultSystem.empty() &&
        record.turns.front().role != "system") {
      prefix = renderTurn(format, "system", format.defaultSystem);
    }
    for (size_t t = 0; t + 1 < record.turns.size(); ++t) {
      prefix += renderTurn(format, record.turns[t].role, record.turns[t].content);
    }
    prefix += format.kind == ChatFormat::Kind::kChatMl ? concat(kImStart, "assistant\n") : "assistant: ";
    const std::string answer =
        format.kind == ChatFormat::Kind::kChatMl ? concat(last.content, kImEnd) : last.content + "\n";
    const std::vector<int64_t> head = tokenizer.encode(prefix);
    std::vector<int64_t> ids = tokenizer.encode(prefix + answer);
    QPIPE_CHECK(ids.size() > head.size() && std::equal(head.begin(), head.end(), ids.begin()), record.origin,
                ": the prompt's tokens are not a prefix of the chat's");
    const auto supervisedEnd = static_cast<int64_t>(ids.size());
    if (format.kind == ChatFormat::Kind::kChatMl) ids.push_back(tokenizer.encode("\n").front());  // unsupervised
    const auto promptTokens = static_cast<int64_t>(head.size());
    QPIPE_REQUIRE(promptTokens < maxTokens, ErrorCode::kInput, record.origin, ": the prompt takes ", promptTokens,
                  " tokens, and --seq_len ", maxTokens, " leaves none of the assistant turn; raise --seq_len");
    const int64_t length = std::min<int64_t>(static_cast<int64_t>(ids.size()), maxTokens);
    at::Tensor idTensor = at::tensor(std::vector<int64_t>(ids.begin(), ids.begin() + length), at::kLong).unsqueeze(0);
    at::Tensor labels = idTensor.clone();
    labels.slice(1, 0, promptTokens).fill_(-100);
    if (length > supervisedEnd) labels.slice(1, supervisedEnd).fill_(-100);
    samples.push_back({.ids = std::move(idTensor),
                       .labels = std::move(labels),
                       .supervised = std::min(length, supervisedEnd) - promptTokens,
                       .origin = record.origin});
  }
  return samples;
}

}  // namespace qpipe
