// tools/check_equivalence.sh over every shipped practice: 1, 2 and 3 ranks (5 samples, so the
// ranks hold 5, 3+2 and 2+2+1) must write byte-identical checkpoints of a tiny Qwen3.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "test_helpers.h"
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
  const fs::path dir = qpipe::test::testDir();
  std::string command = "QPIPE_BINARY=";
  command += QPIPE_BINARY;
  command += " " + (fs::path(QPIPE_SOURCE_DIR) / "tools" / "check_equivalence.sh").string();
  command += " --model_path '" + model.string() + "' --config_path '" +
             (fs::path(QPIPE_SOURCE_DIR) / "configs" / "default" / (GetParam() + ".yaml")).string() + "'";
  command += " --calib_samples 5 --seq_len 32 --threads_per_rank 1 --dist_timeout 20";
  command += " >" + (dir / "out").string() + " 2>" + (dir / "err").string() + " </dev/null";
  const int status = std::system(command.c_str());
  const std::string out = qpipe::test::slurp(dir / "out");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out << qpipe::test::slurp(dir / "err");
  // One row per run; each multi-rank row says every tensor is byte-identical.
  EXPECT_NE(out.find("(reference)"), std::string::npos) << out;
  for (const char* ranks : {"\n2 ", "\n3 "}) {
    const size_t row = out.find(ranks);
    ASSERT_NE(row, std::string::npos) << out;
    const std::string line = out.substr(row + 1, out.find('\n', row + 1) - row - 1);
    EXPECT_NE(line.find("byte-identical, 0 within --tolerance 0, 0 different"), std::string::npos) << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Practices, Equivalence, ::testing::ValuesIn(practices()),
                         [](const auto& info) { return info.param; });

}  // namespace
