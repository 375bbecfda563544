#include <gtest/gtest.h>

#include <string>

#include "qpipe/config_node.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

using Kind = ConfigNode::Kind;

TEST(ConfigNode, PlainScalarsResolveAsYamlCoreSchemaAndQuotedOnesStayStrings) {
  const ConfigNode doc =
      ConfigNode::parseYaml("i: 42\nf: 1.5\ne: -3e2\nt: True\nn: false\nq: '8'\ns: hello\nz: ~\nempty:\n", "t.yaml");
  EXPECT_EQ(doc.at("i").asInt(), 42);
  EXPECT_DOUBLE_EQ(doc.at("f").asFloat(), 1.5);
  EXPECT_DOUBLE_EQ(doc.at("e").asFloat(), -300.0);
  EXPECT_TRUE(doc.at("t").asBool());
  EXPECT_FALSE(doc.at("n").asBool());
  EXPECT_EQ(doc.at("q").kind(), Kind::kString);
  EXPECT_EQ(doc.at("q").asString(), "8");
  EXPECT_EQ(doc.at("s").asString(), "hello");
  EXPECT_TRUE(doc.at("z").isNull());
  EXPECT_TRUE(doc.at("empty").isNull());
  EXPECT_DOUBLE_EQ(doc.at("i").asFloat(), 42.0);  // ints read as numbers
}

TEST(ConfigNode, LocationsAreOneBasedLineAndColumn) {
  const ConfigNode doc = ConfigNode::parseYaml("outer:\n  inner: [a, b]\n", "loc.yaml");
  const ConfigNode& inner = doc.at("outer").at("inner");
  EXPECT_EQ(inner.location().str(), "loc.yaml:2:10");
  EXPECT_EQ(inner.items()[1].location().str(), "loc.yaml:2:14");
}

TEST(ConfigNode, AnchorsAliasesAndMergeKeysResolve) {
  const ConfigNode doc = ConfigNode::parseYaml(
      "base: &b {dtype: int8, scope: per_tensor}\n"
      "copy: *b\n"
      "merged:\n  <<: *b\n  scope: per_channel\n",
      "a.yaml");
  EXPECT_TRUE(doc.at("base").hasAnchor());
  EXPECT_EQ(doc.at("copy").at("dtype").asString(), "int8");
  EXPECT_EQ(doc.at("merged").at("dtype").asString(), "int8");
  EXPECT_EQ(doc.at("merged").at("scope").asString(), "per_channel");  // the map's own key wins
}

// Nested aliases copy their anchors' values: ten levels of ten make 10^10 values ("billion laughs").
TEST(ConfigNode, AliasesExpandingBeyondAMillionValuesAreRejected) {
  std::string text = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int level = 1; level <= 9; ++level) {
    const std::string previous = "*l" + std::to_string(level - 1);
    text += "l" + std::to_string(level) + ": &l" + std::to_string(level) + " [";
    for (int i = 0; i < 10; ++i) text += (i ? ", " : "") + previous;
    text += "]\n";
  }
  const std::string message = test::errorOf([&] { ConfigNode::parseYaml(text, "laughs.yaml"); }, ErrorCode::kConfig);
  EXPECT_EQ(message.rfind("laughs.yaml:", 0), 0u) << message;
  EXPECT_NE(message.find(": aliases expand to more than 1000000 values"), std::string::npos) << message;
  // Five levels (111,110 values) are fine.
  const size_t fifth = text.find("l5:");
  EXPECT_EQ(ConfigNode::parseYaml(text.substr(0, fifth), "laughs.yaml").at("l4").items().size(), 10u);
}

TEST(ConfigNode, AnEmptyDocumentIsNullAtTheFile) {
  for (const char* text : {"", "# comments only\n"}) {
    const ConfigNode doc = ConfigNode::parseYaml(text, "empty.yaml");
    EXPECT_TRUE(doc.isNull());
    EXPECT_EQ(doc.location().str(), "empty.yaml");
  }
}

TEST(ConfigNode, DuplicateKeysAreErrorsWithTheirLocation) {
  const std::string message =
      test::errorOf([] { ConfigNode::parseYaml("a: 1\nb: 2\na: 3\n", "dup.yaml"); }, ErrorCode::kConfig);
  EXPECT_EQ(message, "dup.yaml:3:1: duplicate key 'a'");
}

TEST(ConfigNode, SyntaxErrorsNameFileLineAndColumn) {
  const std::string message =
      test::errorOf([] { ConfigNode::parseYaml("a: [1, 2\nb: 3\n", "bad.yaml"); }, ErrorCode::kConfig);
  EXPECT_EQ(message.rfind("bad.yaml:", 0), 0u) << message;
  EXPECT_NE(message.find("YAML syntax error"), std::string::npos) << message;
  // A NUL byte in a file is named where it is, not as the escape yaml-cpp then misreads.
  const auto nul = test::writeTempFile("nul.yaml", std::string("apiversion: modelslim_v1\nspec: {a") + '\0' + ": 1}\n");
  EXPECT_EQ(test::errorOf([&] { ConfigNode::loadYamlFile(nul); }, ErrorCode::kConfig),
            nul.string() + ":2:9: a NUL byte; a pipeline is YAML text");
  // Latin-1 (a comment saved by an old editor) is refused, as PyYAML refuses it, at the byte.
  const auto latin1 = test::writeTempFile("latin1.yaml", "apiversion: modelslim_v1\n# caf\xE9\nspec: {}\n");
  EXPECT_EQ(test::errorOf([&] { ConfigNode::loadYamlFile(latin1); }, ErrorCode::kConfig),
            latin1.string() + ":2:6: byte 0xE9 is not valid UTF-8; save the file as UTF-8");
  const auto utf16 = test::writeTempFile("utf16.yaml", std::string("\xFF\xFE"
                                                                   "a\0:\0 \0"
                                                                   "1\0\n\0",
                                                                   12));
  EXPECT_EQ(test::errorOf([&] { ConfigNode::loadYamlFile(utf16); }, ErrorCode::kConfig),
            utf16.string() + ": UTF-16 text (its byte order mark); save the file as UTF-8");
  // A control byte yaml-cpp quotes stays on the one line.
  const std::string control =
      test::errorOf([] { ConfigNode::parseYaml("a: \"\\\x01\"\n", "esc.yaml"); }, ErrorCode::kConfig);
  EXPECT_EQ(control, "esc.yaml:1:7: YAML syntax error: unknown escape character: \\x01");
  // A tab in the indentation is named beside yaml-cpp's words about what follows it; a tab after
  // the indentation's spaces too, and one in a value is no indentation.
  EXPECT_EQ(test::errorOf([] { ConfigNode::parseYaml("a: 1\nb:\n\t- 2\n", "tab.yaml"); }, ErrorCode::kConfig),
            "tab.yaml:3:2: YAML syntax error: illegal block entry; line 3 indents with a tab, and YAML indents with "
            "spaces only");
  EXPECT_EQ(
      test::errorOf([] { ConfigNode::parseYaml("a:\n  - b: 1\n    c:\n\t  d: 2\n", "tab.yaml"); }, ErrorCode::kConfig),
      "tab.yaml:4:4: YAML syntax error: end of sequence not found; line 4 indents with a tab, and YAML indents "
      "with spaces only");
  // Nor a tab before a comment, or one in a block scalar lines before the error.
  for (const char* text : {"a: \"x\ty\"\nb: [1\n", "a: 1\n\t# note\nb: [1\n", "a: |\n  x\n  \ty\nc: 2\nd: [1\n"}) {
    EXPECT_EQ(
        test::errorOf([&] { ConfigNode::parseYaml(text, "tab.yaml"); }, ErrorCode::kConfig).find("indents with a tab"),
        std::string::npos)
        << text;
  }
}

TEST(ConfigNode, MoreThanOneDocumentIsRejected) {
  const std::string message =
      test::errorOf([] { ConfigNode::parseYaml("a: 1\n---\nb: 2\n", "two.yaml"); }, ErrorCode::kConfig);
  EXPECT_EQ(message, "two.yaml: holds more than one YAML document; put the pipeline in one");
}

TEST(ConfigNode, WrongKindAccessNamesTheLocation) {
  const ConfigNode doc = ConfigNode::parseYaml("a: text\n", "k.yaml");
  const std::string message = test::errorOf([&] { doc.at("a").asInt(); }, ErrorCode::kConfig);
  EXPECT_EQ(message, "k.yaml:1:4: expected an integer, got a string");
  EXPECT_EQ(test::errorOf([&] { doc.at("b"); }, ErrorCode::kConfig), "k.yaml:1:1: missing field 'b'");
}

TEST(ConfigNode, ToYamlReadsBackToTheSameValues) {
  const ConfigNode doc =
      ConfigNode::parseYaml("name: x\nquoted: '8'\nflag: true\nlist: [a, '1']\nnested:\n  - {k: 1.5}\n", "r.yaml");
  const ConfigNode again = ConfigNode::parseYaml(doc.toYaml(), "again.yaml");
  EXPECT_EQ(again.at("name").asString(), "x");
  EXPECT_EQ(again.at("quoted").kind(), Kind::kString);
  EXPECT_EQ(again.at("quoted").asString(), "8");
  EXPECT_TRUE(again.at("flag").asBool());
  EXPECT_EQ(again.at("list").asStringList(), (std::vector<std::string>{"a", "1"}));
  EXPECT_DOUBLE_EQ(again.at("nested").items()[0].at("k").asFloat(), 1.5);
}

TEST(ConfigNode, MissingFileIsAnIoError) {
  const std::string message =
      test::errorOf([] { ConfigNode::loadYamlFile("/nonexistent/pipeline.yaml"); }, ErrorCode::kIo);
  EXPECT_EQ(message, "cannot open '/nonexistent/pipeline.yaml': no such file");
}

}  // namespace
}  // namespace qpipe
