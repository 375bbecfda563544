// qpipe::Tokenizer on small hand-made tokenizer.json files: merge ranks, added tokens,
// post-processing, decoding, and every error a user can hit. The comparison with HF itself on
// real text is tests/oracle/test_tokenizer_oracle.cpp.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "qpipe/tokenizer.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

using Json = nlohmann::json;

// A byte-level BPE over a few letters; "Ġ" is the byte-level form of a space.
Json baseJson() {
  return Json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [
      {"id": 9, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
       "special": true},
      {"id": 10, "content": "<tool>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
       "special": false}
    ],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "bc": 5, "abc": 6, "Ġa": 7, "Ã": 8},
              "merges": [["a", "b"], ["ab", "c"], ["b", "c"], ["Ġ", "a"]]}
  })");
}

Tokenizer load(const Json& json) {
  return Tokenizer::fromJson(json.dump(), "tokenizer.json");
}

std::string errorFor(const Json& json) {
  return test::errorOf([&] { load(json); }, ErrorCode::kInput);
}

TEST(Tokenizer, LowestRankMergesFirst) {
  auto json = baseJson();
  EXPECT_EQ(load(json).encode("abc"), (std::vector<int64_t>{6}));
  // With "b c" ranked first, "a" + "bc" has no merge, so the word stays in two pieces.
  json["model"]["merges"] = Json::parse(R"([["b", "c"], ["a", "b"], ["ab", "c"]])");
  EXPECT_EQ(load(json).encode("abc"), (std::vector<int64_t>{0, 5}));
  // This merge list has no "Ġ a": the space stays alone.
  EXPECT_EQ(load(json).encode("ab abc"), (std::vector<int64_t>{4, 3, 0, 5}));
}

TEST(Tokenizer, MergesAsStringsEqualMergesAsPairs) {
  auto json = baseJson();
  json["model"]["merges"] = Json::parse(R"(["a b", "ab c", "b c", "Ġ a"])");
  EXPECT_EQ(load(json).encode("abc cab a"), load(baseJson()).encode("abc cab a"));
  EXPECT_EQ(load(json).encode("abc cab a"), (std::vector<int64_t>{6, 3, 2, 4, 7}));
}

TEST(Tokenizer, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  auto json = baseJson();
  json["model"]["vocab"]["ca"] = 11;
  EXPECT_EQ(load(json).encode("ca"), (std::vector<int64_t>{2, 0}));
  json["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(json).encode("ca"), (std::vector<int64_t>{11}));
}

TEST(Tokenizer, AddedTokensAreMatchedInTheRawText) {
  const auto tokenizer = load(baseJson());
  EXPECT_EQ(tokenizer.encode("ab<|end|>c<tool>a"), (std::vector<int64_t>{4, 9, 2, 10, 0}));
  EXPECT_EQ(tokenizer.decode({4, 9, 2, 10, 0}), "ab<|end|>c<tool>a");
  EXPECT_EQ(tokenizer.decode({4, 9, 2, 10, 0}, true), "abc<tool>a");
  EXPECT_EQ(tokenizer.vocabSize(), 11);
  EXPECT_EQ(tokenizer.tokenToId("<|end|>"), 9);
  EXPECT_EQ(tokenizer.tokenToId("Ġa"), 7);
  EXPECT_EQ(tokenizer.tokenToId("zz"), std::nullopt);
  EXPECT_EQ(tokenizer.idToToken(10), "<tool>");
  EXPECT_EQ(tokenizer.idToToken(3), "Ġ");
  EXPECT_EQ(tokenizer.idToToken(99), std::nullopt);
}

TEST(Tokenizer, AddedTokenStripsWhitespaceAndRespectsWordBoundaries) {
  auto json = baseJson();
  json["added_tokens"][0]["lstrip"] = true;
  json["added_tokens"][0]["rstrip"] = true;
  json["added_tokens"][1]["single_word"] = true;
  const auto tokenizer = load(json);
  EXPECT_EQ(tokenizer.encode("a \t<|end|>  b"), (std::vector<int64_t>{0, 9, 1}));
  EXPECT_EQ(tokenizer.encode("a <tool>"), (std::vector<int64_t>{0, 3, 10}));
  // Inside a word, "<tool>" is plain text, whose letters outside the vocabulary are dropped.
  EXPECT_EQ(tokenizer.encode("a<tool>"), (std::vector<int64_t>{0}));
}

TEST(Tokenizer, TemplateAddsSpecialTokensOnlyWhenAsked) {
  auto json = baseJson();
  json["post_processor"] = Json::parse(R"({"type": "Sequence", "processors": [
    {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
    {"type": "TemplateProcessing",
     "single": [{"SpecialToken": {"id": "<|end|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<tool>", "type_id": 0}}],
     "pair": [],
     "special_tokens": {"<|end|>": {"id": "<|end|>", "ids": [9], "tokens": ["<|end|>"]},
                        "<tool>": {"id": "<tool>", "ids": [10], "tokens": ["<tool>"]}}}]})");
  const auto tokenizer = load(json);
  EXPECT_EQ(tokenizer.encode("ab", true), (std::vector<int64_t>{9, 4, 10}));
  EXPECT_EQ(tokenizer.encode("ab", false), (std::vector<int64_t>{4}));
}

TEST(Tokenizer, DecodeReplacesInvalidUtf8) {
  const auto tokenizer = load(baseJson());
  // "Ã" is the byte 0xC3, the first byte of a two-byte sequence: alone it is invalid.
  EXPECT_EQ(tokenizer.decode({8, 0}),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(tokenizer.decode({3, 0, 99}), " a");
}

TEST(Tokenizer, NormalizerAndSplitPreTokenizer) {
  auto json = baseJson();
  json["normalizer"] = Json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFC"}]})");
  json["pre_tokenizer"] = Json::parse(R"({"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"String": "b"}, "behavior": "Removed", "invert": false},
    {"type": "Digits", "individual_digits": true},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})");
  EXPECT_EQ(load(json).encode("abcab"), (std::vector<int64_t>{0, 2, 0}));
}

TEST(Tokenizer, MissingFileIsAnIoError) {
  EXPECT_EQ(test::errorOf([] { Tokenizer::fromFile("/nonexistent/tokenizer.json"); }, ErrorCode::kIo),
            "cannot open '/nonexistent/tokenizer.json': no such file");
}

// The parse streams model.vocab and model.merges past the document (TokenizerParse); a file
// still means what its document means: the last of a repeated token or key wins, and any other
// shape fails with the document's own message.
TEST(Tokenizer, StreamedVocabularyAndMergesMeanWhatTheDocumentMeans) {
  const auto withModel = [](const std::string& model) {
    std::string text = baseJson().dump();
    const std::string was = baseJson()["model"].dump();
    return text.replace(text.find(was), was.size(), R"({"type": "BPE", )" + model + "}");
  };
  const auto encode = [&](const std::string& model, const std::string& text) {
    return Tokenizer::fromJson(withModel(model), "tokenizer.json").encode(text);
  };
  const auto error = [&](const std::string& model) {
    return test::errorOf([&] { Tokenizer::fromJson(withModel(model), "tokenizer.json"); }, ErrorCode::kInput);
  };
  EXPECT_EQ(encode(R"("vocab": {"a": 0, "b": 1, "a": 11}, "merges": [])", "a"), (std::vector<int64_t>{11}));
  EXPECT_EQ(encode(R"("vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]], "merges": [])", "ab"),
            (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(encode(R"("vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"])", "ab"), (std::vector<int64_t>{2}));
  EXPECT_EQ(error(R"("vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]], "vocab": {"a": 0, "b": 1})"),
            "tokenizer.json: model.merges[0] ('a', 'b') refers to a token missing from model.vocab");
  EXPECT_EQ(error(R"("vocab": {"a": -1}, "merges": [])"),
            "tokenizer.json: model.vocab.a must be a non-negative integer id, not -1");
  EXPECT_EQ(error(R"("vocab": {"a": "0"}, "merges": [])"),
            "tokenizer.json: model.vocab.a must be a non-negative integer id, not \"0\"");
  EXPECT_EQ(error(R"("vocab": {"a": 0}, "merges": [["a"]])"),
            "tokenizer.json: model.merges[0] must be \"left right\" or [left, right], not [\"a\"]");
  EXPECT_EQ(error(R"("vocab": {"a": 0}, "merges": ["a  b"])"),
            "tokenizer.json: model.merges[0] 'a  b' must be two tokens separated by one space");
  EXPECT_EQ(error(R"("vocab": {"a": 0}, "merges": [], "x": )" + std::string(200, '[') + std::string(200, ']')),
            "tokenizer.json: JSON nested deeper than 100 levels");
  // A value inside 100 open containers (the top object, model, 98 lists) loads; inside 101 not.
  const auto nested = [](int lists) {
    return R"("vocab": {"a": 0}, "merges": [], "x": )" + std::string(lists, '[') + "1" + std::string(lists, ']');
  };
  EXPECT_EQ(encode(nested(98), "a"), (std::vector<int64_t>{0}));
  EXPECT_EQ(error(nested(99)), "tokenizer.json: JSON nested deeper than 100 levels");
}

TEST(Tokenizer, MalformedJsonIsAnInputError) {
  EXPECT_EQ(test::errorOf([] { Tokenizer::fromJson("{\"model\": [1, 2", "tokenizer.json"); }, ErrorCode::kInput),
            "tokenizer.json: not valid JSON (syntax error at byte 16)");
}

TEST(Tokenizer, UnsupportedPartsAreErrors) {
  auto json = baseJson();
  json["model"]["type"] = "Unigram";
  EXPECT_EQ(errorFor(json), "tokenizer.json: model type 'Unigram' is not supported (only byte-level BPE)");

  json = baseJson();
  json["model"]["byte_fallback"] = true;
  EXPECT_EQ(errorFor(json), "tokenizer.json: model.byte_fallback true is not supported (only byte-level BPE)");

  json = baseJson();
  json["model"]["dropout"] = 0.1;
  EXPECT_EQ(errorFor(json), "tokenizer.json: model.dropout 0.1 is not supported (set it to null)");

  json = baseJson();
  json["normalizer"] = Json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]})");
  EXPECT_EQ(errorFor(json),
            "tokenizer.json: normalizer.normalizers[1] type 'Lowercase' is not supported (supported: NFC, NFD, NFKC, "
            "NFKD, Sequence)");

  json = baseJson();
  json["pre_tokenizer"] = Json::parse(R"({"type": "Metaspace", "replacement": "▁"})");
  EXPECT_EQ(errorFor(json),
            "tokenizer.json: pre_tokenizer type 'Metaspace' is not supported (supported: ByteLevel, Split, Digits, "
            "Sequence)");

  json = baseJson();
  json["pre_tokenizer"] = Json::parse(R"({"type": "Split", "pattern": {"Regex": "\\s"}, "behavior": "Sideways"})");
  EXPECT_EQ(errorFor(json),
            "tokenizer.json: pre_tokenizer.behavior 'Sideways' is not supported (supported: Removed, Isolated, "
            "MergedWithPrevious, MergedWithNext, Contiguous)");

  json = baseJson();
  json["pre_tokenizer"] = Json::parse(R"({"type": "Split", "pattern": {"Regex": "(a"}, "behavior": "Isolated"})");
  EXPECT_EQ(errorFor(json),
            "tokenizer.json: pre_tokenizer.pattern: regex '(a' does not compile at offset 2: missing closing "
            "parenthesis");

  json = baseJson();
  json["decoder"] = Json::parse(R"({"type": "WordPiece", "prefix": "##"})");
  EXPECT_EQ(errorFor(json), "tokenizer.json: decoder type 'WordPiece' is not supported (only ByteLevel)");

  json = baseJson();
  json["post_processor"] = Json::parse(R"({"type": "BertLike"})");
  EXPECT_EQ(errorFor(json),
            "tokenizer.json: post_processor type 'BertLike' is not supported (supported: TemplateProcessing, "
            "ByteLevel, RobertaProcessing, BertProcessing, Sequence)");

  json = baseJson();
  json["truncation"] = Json::parse(R"({"max_length": 8})");
  EXPECT_EQ(errorFor(json), "tokenizer.json: truncation is not supported (set it to null)");
}

TEST(Tokenizer, InconsistentFilesAreErrors) {
  auto json = baseJson();
  json["model"]["merges"].push_back(Json::array({"c", "a"}));
  EXPECT_EQ(errorFor(json), "tokenizer.json: model.merges[4] ('c', 'a') refers to a token missing from model.vocab");

  json = baseJson();
  json["model"]["merges"] = Json::array({"a b c"});
  EXPECT_EQ(errorFor(json), "tokenizer.json: model.merges[0] 'a b c' must be two tokens separated by one space");

  json = baseJson();
  json["model"].erase("vocab");
  EXPECT_EQ(errorFor(json), "tokenizer.json: model.vocab is missing");

  json = baseJson();
  json["added_tokens"][1]["id"] = "ten";
  EXPECT_EQ(errorFor(json), "tokenizer.json: added_tokens[1].id must be a non-negative integer id, not \"ten\"");
}

TEST(Tokenizer, EncodingInvalidUtf8IsAnError) {
  const auto tokenizer = load(baseJson());
  EXPECT_EQ(test::errorOf([&] { tokenizer.encode("ab\xC3"); }, ErrorCode::kInput),
            "tokenizer.json: cannot encode text that is not valid UTF-8 (byte 2)");
}

}  // namespace
}  // namespace qpipe
