#include <gtest/gtest.h>

#include "qpipe/log.h"
#include "qpipe/utf8.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

TEST(Logger, FiltersByLevelAndStreamsArgumentsIntoOneLine) {
  std::vector<std::string> lines;
  Logger logger([&](LogLevel, std::string_view m) { lines.emplace_back(m); }, LogLevel::kInfo);
  logger.debug("hidden ", 1);
  logger.info("layer ", 3, " took ", 1.5, " s");
  logger.warn("careful");
  logger.setLevel(LogLevel::kOff);
  logger.error("silenced");
  EXPECT_EQ(lines, (std::vector<std::string>{"layer 3 took 1.5 s", "careful"}));
  EXPECT_FALSE(logger.enabled(LogLevel::kError));
}

TEST(Logger, LevelNamesAreCheckedWithAUsageError) {
  EXPECT_EQ(log::parseLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(log::parseLevel("off"), LogLevel::kOff);
  EXPECT_EQ(test::errorOf([] { log::parseLevel("verbose"); }, ErrorCode::kUsage),
            "unknown log level 'verbose'; use one of trace, debug, info, warn, error, off");
}

TEST(ErrorText, ALongMessageKeepsItsStartAndEndAndCountsWhatItLeavesOut) {
  EXPECT_EQ(shortened("short", 10), "short");
  EXPECT_EQ(shortened("0123456789abcdefghij", 8), "012345 [... 12 bytes left out ...] ij");
  // A cut never splits a character: each cut point falls inside a two-byte "é".
  const std::string accents = "aaaaa\xC3\xA9" + std::string(47, 'b') +
                              "\xC3\xA9"
                              "c";
  const std::string cut = shortened(accents, 8);
  EXPECT_EQ(cut, "aaaaa [... 51 bytes left out ...] c");
  EXPECT_FALSE(findInvalidUtf8(cut).has_value());
  const std::string huge = "dtype: '" + std::string(1000000, 'x') + "'; use int8 or int4";
  const std::string line = shortened(huge);
  EXPECT_LE(line.size(), 2100u);
  EXPECT_TRUE(line.starts_with("dtype: 'xxx"));
  EXPECT_TRUE(line.ends_with("'; use int8 or int4"));
}

}  // namespace
}  // namespace qpipe
