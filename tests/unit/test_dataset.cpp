#include <gtest/gtest.h>

#include <string>

#include "qpipe/dataset.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

using test::errorOf;
using test::writeTempFile;

std::string loadError(const std::filesystem::path& path, ErrorCode code = ErrorCode::kInput) {
  return errorOf([&] { loadDataset(path); }, code);
}

// The message for a one-record .jsonl file: "<path>:1: <rule>".
std::string recordError(const std::string& record) {
  const auto path = writeTempFile("bad.jsonl", record + "\n");
  const std::string message = loadError(path);
  const std::string prefix = path.string() + ":1: ";
  EXPECT_EQ(message.substr(0, prefix.size()), prefix);
  return message.substr(std::min(prefix.size(), message.size()));
}

TEST(Dataset, JsonlTextRecordsSkipBlankLinesAndKeepOrigins) {
  const auto path =
      writeTempFile("calib.jsonl", "{\"text\": \"first\"}\n\n  \n{\"text\": \"second\\nline\", \"id\": 7}\n");
  const auto samples = loadDataset(path);
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].text, "first");
  EXPECT_TRUE(samples[0].turns.empty());
  EXPECT_EQ(samples[0].origin, path.string() + ":1");
  EXPECT_EQ(samples[1].text, "second\nline");
  EXPECT_EQ(samples[1].origin, path.string() + ":4");
}

TEST(Dataset, MessagesKeepTurnsAndRenderThePlainTemplate) {
  const auto path = writeTempFile(
      "chat.jsonl", R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, )"
                    R"({"role": "assistant", "content": "Hello.\nHow can I help?"}]})"
                    "\n");
  const auto samples = loadDataset(path);
  ASSERT_EQ(samples.size(), 1u);
  ASSERT_EQ(samples[0].turns.size(), 3u);
  EXPECT_EQ(samples[0].turns[2].role, "assistant");
  EXPECT_EQ(samples[0].turns[2].content, "Hello.\nHow can I help?");
  EXPECT_EQ(samples[0].text, "system: Be brief.\nuser: Hi\nassistant: Hello.\nHow can I help?\n");
}

TEST(Dataset, ShareGptConversationsMapHumanAndGpt) {
  const auto path = writeTempFile(
      "sharegpt.jsonl",
      R"({"id": "x", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, )"
      R"({"from": "gpt", "value": "A"}, {"from": "tool", "value": "T"}]})"
      "\n");
  const auto samples = loadDataset(path);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].text, "system: S\nuser: Q\nassistant: A\ntool: T\n");
}

TEST(Dataset, InstructionInputOutputPairs) {
  const auto path =
      writeTempFile("pairs.jsonl", R"({"instruction": "Translate.", "input": "Bonjour", "output": "Hello"})"
                                   "\n"
                                   R"({"instruction": "Say hi.", "input": "", "output": "Hi"})"
                                   "\n"
                                   R"({"input": "Only a prompt"})"
                                   "\n"
                                   R"({"input": "Q", "output": ""})"
                                   "\n");
  const auto samples = loadDataset(path);
  ASSERT_EQ(samples.size(), 4u);
  EXPECT_EQ(samples[0].text, "user: Translate.\n\nBonjour\nassistant: Hello\n");
  EXPECT_EQ(samples[1].text, "user: Say hi.\nassistant: Hi\n");
  EXPECT_EQ(samples[2].text, "user: Only a prompt\n");
  ASSERT_EQ(samples[2].turns.size(), 1u);
  EXPECT_EQ(samples[3].text, "user: Q\n");
}

TEST(Dataset, JsonArrayAndObjectHoldingTheArray) {
  const auto array =
      writeTempFile("calib.json", R"([{"text": "a"}, {"messages": [{"role": "user", "content": "b"}]}])");
  const auto samples = loadDataset(array);
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].text, "a");
  EXPECT_EQ(samples[1].text, "user: b\n");
  EXPECT_EQ(samples[1].origin, array.string() + ": record 2");

  const auto object = writeTempFile("wrapped.json", R"({"data": [{"text": "c"}, {"text": "d"}]})");
  const auto wrapped = loadDataset(object);
  ASSERT_EQ(wrapped.size(), 2u);
  EXPECT_EQ(wrapped[1].text, "d");
}

TEST(Dataset, TextParagraphsSplitOnBlankLines) {
  const auto path = writeTempFile("book.txt", "\nFirst line\r\nsecond line\n\n \t\n\nNext paragraph.\n\n\nLast");
  const auto samples = loadDataset(path);
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_EQ(samples[0].text, "First line\nsecond line");
  EXPECT_EQ(samples[0].origin, path.string() + ":2");
  EXPECT_EQ(samples[1].text, "Next paragraph.");
  EXPECT_EQ(samples[1].origin, path.string() + ":7");
  EXPECT_EQ(samples[2].text, "Last");
}

TEST(Dataset, MaxSamplesStopsReadingEarly) {
  // Line 3 is malformed: it is never read when two samples are asked for.
  const auto path = writeTempFile("calib.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{not json\n");
  const auto samples = loadDataset(path, {.maxSamples = 2});
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[1].text, "b");

  const auto json = writeTempFile("calib.json", R"([{"text": "a"}, {"text": "b"}, {"text": "c"}])");
  EXPECT_EQ(loadDataset(json, {.maxSamples = 1}).size(), 1u);
  const auto txt = writeTempFile("calib.txt", "a\n\nb\n\nc\n");
  EXPECT_EQ(loadDataset(txt, {.maxSamples = 2}).size(), 2u);
  // Nor is a byte that is not UTF-8 after the last paragraph kept.
  const auto latin1 = writeTempFile("latin1_late.txt", "a\n\nb\n\ncaf\xe9\n");
  EXPECT_EQ(loadDataset(latin1, {.maxSamples = 2}).size(), 2u);
  EXPECT_EQ(errorOf([&] { loadDataset(txt, {.maxSamples = -1}); }, ErrorCode::kUsage),
            "the maximum number of samples must be >= 0 (0 = all), got -1");
}

TEST(Dataset, FileErrors) {
  const auto missing = std::filesystem::temp_directory_path() / "qpipe-test-no-such-dir" / "calib.jsonl";
  EXPECT_EQ(loadError(missing, ErrorCode::kIo), missing.string() + ": no such data file");
  const auto noExtension = missing.parent_path() / "calib";
  EXPECT_EQ(loadError(noExtension, ErrorCode::kIo), noExtension.string() + ": no such data file");
  const auto dir = writeTempFile("placeholder", "").parent_path() / "folder.jsonl";
  std::filesystem::create_directories(dir);
  EXPECT_EQ(loadError(dir, ErrorCode::kInput),
            dir.string() + ": is a directory; expected a .jsonl, .json or .txt file");
  // Found by the data loader, which names the data file (the tokenizer could only name its own).
  const auto latin1 = writeTempFile("latin1.txt", "first line\ncaf\xe9 au lait\n");
  EXPECT_EQ(loadError(latin1), latin1.string() + ":2:4: byte 0xE9 is not valid UTF-8; save the file as UTF-8");
  const auto latin1Jsonl = writeTempFile("latin1.jsonl", "{\"text\": \"a\"}\n{\"text\": \"caf\xe9\"}\n");
  EXPECT_EQ(loadError(latin1Jsonl),
            latin1Jsonl.string() + ":2:14: byte 0xE9 is not valid UTF-8; save the file as UTF-8");
  const auto csv = writeTempFile("calib.csv", "text\na\n");
  EXPECT_EQ(loadError(csv), csv.string() + ": unknown data file type \".csv\"; expected .jsonl, .json or .txt");
  for (const char* name : {"empty.jsonl", "empty.json", "empty.txt"}) {
    const auto empty = writeTempFile(name, "\n  \n");
    EXPECT_EQ(loadError(empty), empty.string() + ": the file is empty");
  }
}

// The rule after "invalid JSON: " is nlohmann's; the position is ours, counted in the whole file.
TEST(Dataset, MalformedJsonNamesLineAndColumn) {
  const auto jsonl = writeTempFile("calib.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"\n");
  EXPECT_EQ(loadError(jsonl), jsonl.string() +
                                  ":2:13: invalid JSON: syntax error while parsing object - unexpected end of input; "
                                  "expected '}'");
  const auto trailing = writeTempFile("trailing.jsonl", "{\"text\": \"a\"} x\n");
  EXPECT_EQ(loadError(trailing), trailing.string() +
                                     ":1:15: invalid JSON: syntax error while parsing value - invalid literal; last "
                                     "read: '\"a\"} x'; expected end of input");
  const auto json = writeTempFile("calib.json", "[\n  {\"text\": \"a\"},\n  {\"text\": 'b'}\n]\n");
  EXPECT_EQ(loadError(json), json.string() +
                                 ":3:12: invalid JSON: syntax error while parsing value - invalid literal; last read: "
                                 "'\"text\": ''");
}

TEST(Dataset, JsonDocumentShapeErrors) {
  const auto object = writeTempFile("object.json", R"({"text": "a"})");
  EXPECT_EQ(loadError(object),
            object.string() +
                ": the document is an object; expected an array of records, or an object whose one member is that "
                "array");
  const auto number = writeTempFile("number.json", "3");
  EXPECT_EQ(loadError(number),
            number.string() +
                ": the document is a number; expected an array of records, or an object whose one member is that "
                "array");
  const auto empty = writeTempFile("empty.json", R"({"data": []})");
  EXPECT_EQ(loadError(empty), empty.string() + ": the array of records is empty");
  const auto badRecord = writeTempFile("bad.json", R"([{"text": "a"}, {"text": 1}])");
  EXPECT_EQ(loadError(badRecord), badRecord.string() + ": record 2: text is a number; expected a string");
}

TEST(Dataset, RecordErrors) {
  EXPECT_EQ(recordError(R"(["text"])"), "record is an array; expected a JSON object");
  EXPECT_EQ(recordError(R"({"prompt": "a"})"),
            "record has none of the fields text, messages, conversations, instruction, input");
  EXPECT_EQ(recordError(R"({"text": "a", "messages": []})"),
            "record mixes the fields text and messages; keep one per record");
  EXPECT_EQ(recordError(R"({"conversations": [], "input": "a"})"),
            "record mixes the fields conversations and instruction/input; keep one per record");
  EXPECT_EQ(recordError(R"({"text": null})"), "text is null; expected a string");
  EXPECT_EQ(recordError(R"({"text": ""})"), "text is empty");
}

TEST(Dataset, ChatErrors) {
  EXPECT_EQ(recordError(R"({"messages": "hi"})"),
            R"(messages is a string; expected an array of {"role", "content"} objects)");
  EXPECT_EQ(recordError(R"({"conversations": {}})"),
            R"(conversations is an object; expected an array of {"from", "value"} objects)");
  EXPECT_EQ(recordError(R"({"messages": []})"), "messages is empty");
  EXPECT_EQ(recordError(R"({"messages": ["hi"]})"),
            R"(messages[0] is a string; expected an object with "role" and "content")");
  EXPECT_EQ(recordError(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]})"),
            R"(messages[1] has no "content")");
  EXPECT_EQ(recordError(R"({"conversations": [{"value": "a"}]})"), R"(conversations[0] has no "from")");
  EXPECT_EQ(recordError(R"({"messages": [{"role": 1, "content": "a"}]})"),
            "messages[0].role is a number; expected a string");
  EXPECT_EQ(recordError(R"({"messages": [{"role": "", "content": "a"}]})"), "messages[0].role is empty");
  EXPECT_EQ(recordError(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})"),
            "messages[0].content is an array; expected a string");
  EXPECT_EQ(recordError(R"({"conversations": [{"from": "human", "value": false}]})"),
            "conversations[0].value is a boolean; expected a string");
}

TEST(Dataset, PairErrors) {
  EXPECT_EQ(recordError(R"({"instruction": "", "input": "", "output": "x"})"),
            "instruction and input are both empty; the pair has no prompt");
  EXPECT_EQ(recordError(R"({"instruction": ["a"]})"), "instruction is an array; expected a string");
  EXPECT_EQ(recordError(R"({"input": "a", "output": 3})"), "output is a number; expected a string");
}

TEST(Dataset, RenderPlainChat) {
  EXPECT_EQ(renderPlainChat({{"user", "a"}, {"assistant", ""}}), "user: a\nassistant: \n");
  EXPECT_EQ(renderPlainChat({}), "");
}

// The committed default sets (tools/make_datasets.sh data) load, and are the sizes docs/data.md gives.
TEST(Dataset, DefaultSetsLoad) {
  const std::filesystem::path data = std::filesystem::path(QPIPE_SOURCE_DIR) / "data";
  const auto calib = loadDataset(data / "calib.jsonl");
  EXPECT_EQ(calib.size(), 512u);
  const auto eval = loadDataset(data / "eval.jsonl");
  size_t chars = 0;
  for (const auto& sample : eval) chars += sample.text.size();
  EXPECT_GE(chars, 150000u);
  for (const auto& sample : eval) {
    for (const auto& other : calib) ASSERT_NE(sample.text, other.text);
  }
}

}  // namespace
}  // namespace qpipe
