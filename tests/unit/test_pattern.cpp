#include <gtest/gtest.h>

#include "qpipe/pattern.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

TEST(GlobPattern, StarCrossesDots) {
  EXPECT_TRUE(GlobPattern("*self_attn*").matches("model.layers.3.self_attn.q_proj"));
  EXPECT_TRUE(GlobPattern("*").matches("lm_head"));
  EXPECT_TRUE(GlobPattern("model.layers.*.mlp.down_proj").matches("model.layers.12.mlp.down_proj"));
  EXPECT_FALSE(GlobPattern("*.mlp.gate").matches("model.layers.0.mlp.gate_proj"));
  EXPECT_TRUE(GlobPattern("*.mlp.gate").matches("model.layers.0.mlp.gate"));
}

TEST(GlobPattern, QuestionMarkAndBrackets) {
  EXPECT_TRUE(GlobPattern("model.layers.?.mlp").matches("model.layers.7.mlp"));
  EXPECT_FALSE(GlobPattern("model.layers.?.mlp").matches("model.layers.17.mlp"));
  EXPECT_TRUE(GlobPattern("*.[qk]_proj").matches("a.k_proj"));
  EXPECT_FALSE(GlobPattern("*.[qk]_proj").matches("a.v_proj"));
  EXPECT_TRUE(GlobPattern("*.[!qk]_proj").matches("a.v_proj"));
  EXPECT_TRUE(GlobPattern("layers.[0-2].x").matches("layers.1.x"));
  EXPECT_FALSE(GlobPattern("layers.[0-2].x").matches("layers.3.x"));
}

TEST(GlobPattern, BracesExpandIncludingNestedAndRanges) {
  const GlobPattern layers("model.layers.{0,1,2}.mlp.*");
  EXPECT_TRUE(layers.matches("model.layers.2.mlp.up_proj"));
  EXPECT_FALSE(layers.matches("model.layers.3.mlp.up_proj"));
  const GlobPattern nested("*.{q,k{,v}}_proj");
  EXPECT_TRUE(nested.matches("x.q_proj"));
  EXPECT_TRUE(nested.matches("x.k_proj"));
  EXPECT_TRUE(nested.matches("x.kv_proj"));
  EXPECT_FALSE(nested.matches("x.v_proj"));
  const GlobPattern range("model.layers.{14..16}.*");
  EXPECT_TRUE(range.matches("model.layers.15.self_attn"));
  EXPECT_FALSE(range.matches("model.layers.17.self_attn"));
  EXPECT_TRUE(GlobPattern("a{b}c").matches("a{b}c"));  // no comma: literal, as in bash
  // One value is a range too ({0..0} is 0 in bash), and bounds with leading zeros pad.
  EXPECT_TRUE(GlobPattern("model.layers.{0..0}.*").matches("model.layers.0.mlp"));
  EXPECT_FALSE(GlobPattern("model.layers.{0..0}.*").matches("model.layers.1.mlp"));
  const GlobPattern padded("e{08..10}");
  EXPECT_TRUE(padded.matches("e08"));
  EXPECT_TRUE(padded.matches("e10"));
  EXPECT_FALSE(padded.matches("e8"));
  const GlobPattern down("x{2..-1}");
  for (const char* name : {"x2", "x1", "x0", "x-1"}) EXPECT_TRUE(down.matches(name)) << name;
  EXPECT_FALSE(down.matches("x3"));
  EXPECT_TRUE(GlobPattern("x{-9223372036854775808..-9223372036854775807}").matches("x-9223372036854775808"));
}

TEST(GlobPattern, MalformedPatternsAreConfigErrors) {
  EXPECT_EQ(test::errorOf([] { GlobPattern("a.{b,c"); }, ErrorCode::kConfig),
            "pattern 'a.{b,c': '{' without a matching '}'");
  EXPECT_EQ(test::errorOf([] { GlobPattern("a.b}"); }, ErrorCode::kConfig),
            "pattern 'a.b}': '}' without a matching '{'");
  EXPECT_EQ(test::errorOf([] { GlobPattern("a.[bc"); }, ErrorCode::kConfig),
            "pattern 'a.[bc': '[' without a matching ']'");
  EXPECT_EQ(test::errorOf([] { GlobPattern(""); }, ErrorCode::kConfig), "pattern '': empty pattern");
  // A range or a product of groups too large to list fails at once, not after filling the memory.
  EXPECT_EQ(test::errorOf([] { GlobPattern("*layers.{0..99999999999}.*"); }, ErrorCode::kConfig),
            "pattern '*layers.{0..99999999999}.*': the range {0..99999999999} has more than 100000 values");
  EXPECT_EQ(test::errorOf([] { GlobPattern("{-9223372036854775808..9223372036854775807}"); }, ErrorCode::kConfig),
            "pattern '{-9223372036854775808..9223372036854775807}': the range "
            "{-9223372036854775808..9223372036854775807} has more than 100000 values");
  EXPECT_EQ(test::errorOf([] { GlobPattern("{0..99999999999999999999}"); }, ErrorCode::kConfig),
            "pattern '{0..99999999999999999999}': the range bound 99999999999999999999 is out of range");
  EXPECT_EQ(test::errorOf([] { GlobPattern("{0..999}.{0..999}"); }, ErrorCode::kConfig),
            "pattern '{0..999}.{0..999}': expands to more than 100000 patterns");
}

TEST(ModuleFilter, ExcludeWinsAndUnmatchedPatternsAreReported) {
  ModuleFilter filter({"*self_attn*", "*mlp*", "vision.*"}, {"*kv_b_proj", "*.gate"});
  EXPECT_TRUE(filter.matches("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(filter.matches("model.layers.0.self_attn.kv_b_proj"));
  EXPECT_TRUE(filter.matches("model.layers.0.mlp.up_proj"));
  EXPECT_FALSE(filter.matches("lm_head"));
  EXPECT_EQ(filter.unmatchedPatterns(), (std::vector<std::string>{"include 'vision.*'", "exclude '*.gate'"}));
}

}  // namespace
}  // namespace qpipe
