#include "qpipe/log.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace qpipe
