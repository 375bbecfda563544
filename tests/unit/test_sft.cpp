// SFT samples (qpipe/sft.h) on the tiny tokenizer: the plain format's labels, and every record or
// template a user can get wrong. The ChatML rendering is checked against transformers on SmolLM2
// (tests/oracle/test_smollm2_oracle.cpp).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qpipe/sft.h"
#include "qpipe/tokenizer.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;

Tokenizer tinyTokenizer() {
  const fs::path dir = test::testDir() / "sft_tokenizer";
  fs::create_directories(dir);
  test::writeTinyTokenizer(dir);
  return Tokenizer::fromFile(dir / "tokenizer.json");
}

std::vector<DataSample> records(const std::string& jsonl) {
  return loadDataset(test::writeTempFile("sft.jsonl", jsonl));
}

fs::path modelWithTemplate(const std::string& name, const std::string& chatTemplate) {
  const fs::path dir = test::testDir() / name;
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json") << nlohmann::json{{"chat_template", chatTemplate}}.dump();
  return dir;
}

TEST(Sft, PlainChatsSuperviseTheLastAssistantTurnAndItsNewline) {
  const Tokenizer tokenizer = tinyTokenizer();
  const auto samples =
      sftSamples(records(R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, )"
                         R"({"role": "user", "content": "and"}, {"role": "assistant", "content": "so"}]})"
                         "\n"),
                 tokenizer, {}, 0, 64);
  ASSERT_EQ(samples.size(), 1u);
  const std::vector<int64_t> prompt = tokenizer.encode("user: hi\nassistant: yo\nuser: and\nassistant: ");
  const std::vector<int64_t> all = tokenizer.encode("user: hi\nassistant: yo\nuser: and\nassistant: so\n");
  const at::Tensor ids = samples[0].ids, labels = samples[0].labels;
  ASSERT_EQ(ids.size(1), static_cast<int64_t>(all.size()));
  for (int64_t i = 0; i < ids.size(1); ++i) {
    EXPECT_EQ(ids[0][i].item<int64_t>(), all[static_cast<size_t>(i)]);
    EXPECT_EQ(labels[0][i].item<int64_t>(),
              i < static_cast<int64_t>(prompt.size()) ? -100 : all[static_cast<size_t>(i)]);
  }
  EXPECT_EQ(samples[0].supervised, static_cast<int64_t>(all.size() - prompt.size()));
  // Cut to 2 tokens past the prompt: the first two tokens of the answer stay supervised.
  const auto cut =
      sftSamples(records(R"({"instruction": "hi", "output": "so far"})"
                         "\n"),
                 tokenizer, {}, 0, static_cast<int64_t>(tokenizer.encode("user: hi\nassistant: ").size()) + 2);
  EXPECT_EQ(cut[0].supervised, 2);
}

TEST(Sft, BadRecordsAndTemplatesAreOneLineErrors) {
  const Tokenizer tokenizer = tinyTokenizer();
  const auto message = [&](const std::string& jsonl, int64_t seq = 64) {
    const auto data = records(jsonl + "\n");
    return test::errorOf([&] { sftSamples(data, tokenizer, {}, 0, seq); }, ErrorCode::kInput);
  };
  EXPECT_NE(message(R"({"text": "plain words"})")
                .find(":1: plain text in SFT data; every record must be a chat (messages, conversations, or "
                      "instruction and output)"),
            std::string::npos);
  EXPECT_NE(message(R"({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]})")
                .find(":1: the last turn is the user's; SFT supervises the last assistant turn"),
            std::string::npos);
  EXPECT_NE(message(R"({"messages": [{"role": "user", "content": "a long question"}, )"
                    R"({"role": "assistant", "content": "b"}]})",
                    8)
                .find(concat(":1: the prompt takes ", tokenizer.encode("user: a long question\nassistant: ").size(),
                             " tokens, and --seq_len 8 leaves none of the assistant turn; raise --seq_len")),
            std::string::npos);
  const fs::path llama3 = modelWithTemplate("sft_llama3", "{{ '<|start_header_id|>' + message['role'] }}");
  EXPECT_EQ(test::errorOf([&] { ChatFormat::fromModel(llama3); }, ErrorCode::kInput),
            (llama3 / "tokenizer_config.json").string() +
                ": the chat template is not ChatML (no <|im_start|>); qpipe renders ChatML and, for models without "
                "a template, the plain one (docs/data.md)");
  EXPECT_EQ(ChatFormat::fromModel(test::testDir() / "sft_no_model").kind, ChatFormat::Kind::kPlain);
  const ChatFormat qwen = ChatFormat::fromModel(
      modelWithTemplate("sft_qwen",
                        "{%- if not system %}{{- '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}{%- endif %}"
                        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"));
  EXPECT_EQ(qwen.kind, ChatFormat::Kind::kChatMl);
  EXPECT_EQ(qwen.defaultSystem, "You are Qwen.");
}

}  // namespace
}  // namespace qpipe
