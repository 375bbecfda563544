// qpipe::Tokenizer against HF `tokenizers`: tokenizer_oracle.py trains one small byte-level BPE per
// family's configuration (GPT-2, Llama-3, Qwen2, SmolLM2, and one for the remaining options) and
// writes the ids and decoded text it expects for thousands of real and hand-written lines.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "qpipe/tokenizer.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

using Json = nlohmann::json;

// Shows where two id lists part, with the text that produced them.
std::string describe(const std::string& text, const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
  std::string out = "text " + Json(text).dump() + "\n  got  ";
  for (const auto id : got) out += std::to_string(id) + " ";
  out += "\n  want ";
  for (const auto id : want) out += std::to_string(id) + " ";
  return out;
}

TEST(TokenizerOracle, MatchesHfTokenizersOnEveryFamily) {
  const auto dir = test::writeTempFile("marker", "").parent_path() / "oracle";
  std::filesystem::create_directories(dir);
  const auto printed = test::runOracle("tokenizer_oracle.py", dir.string());
  std::ifstream in(dir / "expected.json");
  ASSERT_TRUE(in.good()) << printed;
  const auto expected = Json::parse(in);
  const auto cases = expected.at("cases").get<std::vector<std::string>>();
  ASSERT_GE(cases.size(), 1000u);

  for (const auto& family : expected.at("families")) {
    const auto name = family.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const auto tokenizer = Tokenizer::fromFile(family.at("file").get<std::string>());
    EXPECT_EQ(tokenizer.vocabSize(), family.at("vocab_size").get<int64_t>());

    int mismatches = 0;
    const auto report = [&](const std::string& what, const std::string& detail) {
      if (++mismatches <= 5) ADD_FAILURE() << name << " " << what << ": " << detail;
    };
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto plain = tokenizer.encode(cases[i], false);
      const auto wantPlain = family.at("encode")[i].get<std::vector<int64_t>>();
      if (plain != wantPlain) report("encode", describe(cases[i], plain, wantPlain));
      const auto special = tokenizer.encode(cases[i], true);
      const auto wantSpecial = family.at("encode_special")[i].get<std::vector<int64_t>>();
      if (special != wantSpecial) report("encode with special tokens", describe(cases[i], special, wantSpecial));
      const auto decoded = tokenizer.decode(wantSpecial, false);
      if (decoded != family.at("decode")[i].get<std::string>()) {
        report("decode", Json(decoded).dump() + " != " + family.at("decode")[i].dump());
      }
      const auto skipped = tokenizer.decode(wantSpecial, true);
      if (skipped != family.at("decode_skip")[i].get<std::string>()) {
        report("decode skipping special tokens", Json(skipped).dump() + " != " + family.at("decode_skip")[i].dump());
      }
    }
    const auto& randomIds = family.at("random_ids");
    for (size_t i = 0; i < randomIds.size(); ++i) {
      const auto decoded = tokenizer.decode(randomIds[i].get<std::vector<int64_t>>(), false);
      if (decoded != family.at("random_decode")[i].get<std::string>()) {
        report("decode of random ids",
               randomIds[i].dump() + ": " + Json(decoded).dump() + " != " + family.at("random_decode")[i].dump());
      }
    }
    EXPECT_EQ(mismatches, 0) << name << ": " << cases.size() << " lines and " << randomIds.size()
                             << " random id lists compared";
  }
}

}  // namespace
}  // namespace qpipe
