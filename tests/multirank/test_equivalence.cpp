// tools/check_equivalence.sh over every shipped practice: 1, 2 and 3 ranks (5 samples, so the
// ranks hold 5, 3+2 and 2+2+1) must write byte-identical checkpoints of a tiny Qwen3.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "equivalence.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;

std::vector<std::string> practices() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(fs::path(QPIPE_SOURCE_DIR) / "configs" / "default")) {
    if (entry.path().extension() == ".yaml") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class Equivalence : public ::testing::TestWithParam<std::string> {};

TEST_P(Equivalence, OneTwoAndThreeRanksWriteTheSameCheckpoint) {
  const fs::path model = qpipe::test::tinyQwen3("equivalence-" + GetParam());
  const fs::path pipeline = fs::path(QPIPE_SOURCE_DIR) / "configs" / "default" / (GetParam() + ".yaml");
  for (const std::string& row : qpipe::test::equivalenceRows(model, pipeline)) {
    EXPECT_NE(row.find("byte-identical, 0 within --tolerance 0, 0 different"), std::string::npos) << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Practices, Equivalence, ::testing::ValuesIn(practices()),
                         [](const auto& info) { return info.param; });

}  // namespace
