// docs/plugins.md shows the two example plugins whole: the page must hold each file's text, so it
// cannot drift from the code the suite builds and runs. Both include the SDK header only.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "test_helpers.h"

namespace qpipe {
namespace {

const std::filesystem::path kSource = QPIPE_SOURCE_DIR;

TEST(PluginDocs, ShowTheExamplesAsTheyAre) {
  const std::string page = test::slurp(kSource / "docs/plugins.md");
  for (const char* example : {"log_layers.cpp", "module_stats.cpp"}) {
    const std::string code = test::slurp(kSource / "tests/fixtures/plugins" / example);
    EXPECT_NE(page.find("```cpp\n" + code + "```"), std::string::npos)
        << "docs/plugins.md does not show tests/fixtures/plugins/" << example << " as it is";
  }
}

TEST(PluginDocs, ExamplesIncludeTheSdkHeaderOnly) {
  const std::regex include(R"re(#include\s+"([^"]+)")re");
  for (const char* example : {"log_layers.cpp", "module_stats.cpp"}) {
    const std::string code = test::slurp(kSource / "tests/fixtures/plugins" / example);
    for (auto it = std::sregex_iterator(code.begin(), code.end(), include); it != std::sregex_iterator(); ++it) {
      EXPECT_EQ((*it)[1].str(), "qpipe/plugin.h") << example;
    }
  }
}

}  // namespace
}  // namespace qpipe
