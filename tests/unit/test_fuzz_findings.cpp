// What tools/fuzz.sh found, each kept as a regression test: an input that made a parser throw
// something other than qpipe::Error (a crash of the CLI's one-line contract).
#include <gtest/gtest.h>

#include "qpipe/config_node.h"
#include "qpipe/dataset.h"
#include "qpipe/tokenizer.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

// A JSON number beyond double's range: nlohmann throws out_of_range, not parse_error.
TEST(FuzzFindings, ANumberBeyondDoubleInTokenizerJsonIsAnInputError) {
  EXPECT_EQ(test::errorOf([] { Tokenizer::fromJson(R"({"model": {"type": "BPE", "vocab": {"a": 1e309}}})", "t.json"); },
                          ErrorCode::kInput),
            "t.json: not valid JSON ([json.exception.out_of_range.406] number overflow parsing '1e309')");
}

TEST(FuzzFindings, ANumberBeyondDoubleInADataRecordIsAnInputError) {
  const auto file = test::writeTempFile("data.jsonl", "{\"text\": \"a\"}\n{\"text\": 1e309}\n");
  EXPECT_EQ(test::errorOf([&] { loadDataset(file); }, ErrorCode::kInput),
            file.string() + ":2: invalid JSON: [json.exception.out_of_range.406] number overflow parsing '1e309'");
}

// std::stod throws out_of_range for a float beyond double's range.
TEST(FuzzFindings, ANumberBeyondDoubleInYamlIsAConfigurationError) {
  EXPECT_EQ(test::errorOf([] { ConfigNode::parseYaml("score: 1e30950\n", "p.yaml"); }, ErrorCode::kConfig),
            "p.yaml:1:8: number 1e30950 is out of range");
}

}  // namespace
}  // namespace qpipe
