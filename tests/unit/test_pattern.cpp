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
}

TEST(GlobPattern, MalformedPatternsAreConfigErrors) {
  EXPECT_EQ(test::errorOf([] { GlobPattern("a.{b,c"); }, ErrorCode::kConfig),
            "pattern 'a.{b,c': '{' without a matching '}'");
  EXPECT_EQ(test::errorOf([] { GlobPattern("a.b}"); }, ErrorCode::kConfig),
            "pattern 'a.b}': '}' without a matching '{'");
  EXPECT_EQ(test::errorOf([] { GlobPattern("a.[bc"); }, ErrorCode::kConfig),
            "pattern 'a.[bc': '[' without a matching ']'");
  EXPECT_EQ(test::errorOf([] { GlobPattern(""); }, ErrorCode::kConfig), "pattern '': empty pattern");
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
