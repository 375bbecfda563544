// Runs tools/check_equivalence.sh (1, 2 and 3 ranks) on a model and pipeline, as the multirank
// tests do, and returns the verdict rows of the 2- and 3-rank runs.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "test_helpers.h"

namespace qpipe::test {

// Five short samples, so the ranks hold 5, 3+2 and 2+2+1; one thread per rank. Empty when the
// script failed (the test has failed then).
inline std::vector<std::string> equivalenceRows(const std::filesystem::path& model,
                                                const std::filesystem::path& pipeline) {
  const std::filesystem::path dir = testDir();
  std::string command = "QPIPE_BINARY=";
  command += QPIPE_BINARY;
  command += " " + (std::filesystem::path(QPIPE_SOURCE_DIR) / "tools" / "check_equivalence.sh").string();
  command += " --model_path '" + model.string() + "' --config_path '" + pipeline.string() + "'";
  command += " --calib_data " + (std::filesystem::path(QPIPE_SOURCE_DIR) / "data" / "calib.jsonl").string();
  command += " --calib_samples 5 --seq_len 32 --threads_per_rank 1 --dist_timeout 20";
  command += " >" + (dir / "out").string() + " 2>" + (dir / "err").string() + " </dev/null";
  const int status = std::system(command.c_str());
  const std::string out = slurp(dir / "out");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || out.find("(reference)") == std::string::npos) {
    ADD_FAILURE() << "check_equivalence.sh failed:\n" << out << slurp(dir / "err");
    return {};
  }
  std::vector<std::string> rows;
  for (const char* ranks : {"\n2 ", "\n3 "}) {
    const size_t row = out.find(ranks);
    if (row == std::string::npos) {
      ADD_FAILURE() << "no " << ranks + 1 << "-rank row in:\n" << out;
      return {};
    }
    rows.push_back(out.substr(row + 1, out.find('\n', row + 1) - row - 1));
  }
  return rows;
}

}  // namespace qpipe::test
