#include <gtest/gtest.h>

#include "qpipe/schema.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

Schema qconfigSchema() {
  Schema side;
  side.choice("dtype", {"int8", "int4", "fp8_e4m3", "float"}, "float", "quantized type")
      .choice("scope", {"per_tensor", "per_channel", "per_token"}, "per_tensor", "granularity")
      .optional("symmetric", ValueType::kBool, ConfigNode::boolean(true), "symmetric range")
      .optional("ext", ValueType::kAny, ConfigNode::map(), "extras");
  Schema qconfig;
  qconfig.nested("act", side, false, "activations").nested("weight", side, true, "weights");
  Schema schema;
  schema.nested("qconfig", qconfig, true, "quantization")
      .optional("group_size", ValueType::kInt, ConfigNode::integer(128), "group")
      .includeExclude();
  return schema;
}

ConfigNode parse(const std::string& text) {
  return ConfigNode::parseYaml(text, "s.yaml");
}

TEST(Schema, FillsDefaultsAtEveryLevel) {
  const ConfigNode out = qconfigSchema().validate(parse("qconfig:\n  weight: {dtype: int8}\n"), "p");
  EXPECT_EQ(out.at("qconfig").at("weight").at("dtype").asString(), "int8");
  EXPECT_EQ(out.at("qconfig").at("weight").at("scope").asString(), "per_tensor");
  EXPECT_EQ(out.at("qconfig").at("act").at("dtype").asString(), "float");  // absent block of defaults
  EXPECT_EQ(out.at("group_size").asInt(), 128);
  EXPECT_EQ(out.at("include").asStringList(), std::vector<std::string>{"*"});
  EXPECT_TRUE(out.at("exclude").asStringList().empty());
}

TEST(Schema, DisallowedValueNamesFieldPathAndChoices) {
  const std::string message = test::errorOf(
      [] { qconfigSchema().validate(parse("qconfig:\n  weight:\n    dtype: int5\n"), "spec.process[0]"); },
      ErrorCode::kConfig);
  EXPECT_EQ(message,
            "s.yaml:3:12: spec.process[0].qconfig.weight.dtype: 'int5' is not one of: int8, int4, "
            "fp8_e4m3, float");
}

TEST(Schema, UnknownFieldSuggestsTheNearestOne) {
  const std::string message = test::errorOf(
      [] { qconfigSchema().validate(parse("qconfig: {weight: {}}\ngroup_sise: 64\n"), "p"); }, ErrorCode::kConfig);
  EXPECT_EQ(message,
            "s.yaml:2:13: p.group_sise: unknown field; did you mean 'group_size'?; expected one of: "
            "qconfig, group_size, include, exclude");
}

TEST(Schema, MissingRequiredFieldIsNamed) {
  const std::string message =
      test::errorOf([] { qconfigSchema().validate(parse("qconfig:\n  act: {}\n"), "p"); }, ErrorCode::kConfig);
  EXPECT_EQ(message, "s.yaml:2:3: p.qconfig: missing required field 'weight' (a mapping: weights)");
}

TEST(Schema, WrongTypeSaysWhatWasExpected) {
  const std::string message = test::errorOf(
      [] { qconfigSchema().validate(parse("qconfig: {weight: {}}\ngroup_size: [1]\n"), "p"); }, ErrorCode::kConfig);
  EXPECT_EQ(message, "s.yaml:2:13: p.group_size: expected an integer, got a list");
  const std::string floatForInt = test::errorOf(
      [] { qconfigSchema().validate(parse("qconfig: {weight: {}}\ngroup_size: 1.5\n"), "p"); }, ErrorCode::kConfig);
  EXPECT_EQ(floatForInt, "s.yaml:2:13: p.group_size: expected an integer, got a number");
}

// YAML's .nan passes every range comparison; no option means anything at .inf.
TEST(Schema, NonFiniteNumbersAreRejected) {
  Schema schema;
  schema.add(
      {.name = "size", .type = ValueType::kFloat, .help = "GB", .defaultValue = ConfigNode::number(4), .minimum = 0});
  for (const char* value : {".nan", ".inf", "-.inf"}) {
    EXPECT_EQ(test::errorOf([&] { schema.validate(parse(std::string("size: ") + value + "\n"), "save"); },
                            ErrorCode::kConfig),
              std::string("s.yaml:1:7: save.size: expected a finite number, got ") + value);
  }
}

TEST(Schema, PlainScalarsAreReadAsTheirTextInStringFields) {
  Schema schema;
  schema.optional("name", ValueType::kString, ConfigNode::string(""), "");
  EXPECT_EQ(schema.validate(parse("name: 0012\n"), "p").at("name").asString(), "0012");
}

TEST(Schema, PatternListsRejectMalformedPatternsWithTheirLocation) {
  const std::string message = test::errorOf(
      [] { qconfigSchema().validate(parse("qconfig: {weight: {}}\ninclude: [ok, 'model.{a,b']\n"), "p"); },
      ErrorCode::kConfig);
  EXPECT_EQ(message, "s.yaml:2:15: p.include[1]: pattern 'model.{a,b': '{' without a matching '}'");
}

TEST(Schema, NonMappingIsRejected) {
  const std::string message =
      test::errorOf([] { qconfigSchema().validate(parse("[1, 2]\n"), "p"); }, ErrorCode::kConfig);
  EXPECT_EQ(message, "s.yaml:1:1: p: expected a mapping, got a list");
}

}  // namespace
}  // namespace qpipe
