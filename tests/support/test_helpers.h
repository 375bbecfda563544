// Small helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <string>

#include "qpipe/error.h"

namespace qpipe::test {

// Runs `body`, expects qpipe::Error with `code`, and returns its message.
inline std::string errorOf(const std::function<void()>& body, ErrorCode code) {
  try {
    body();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected qpipe::Error, nothing was thrown";
  return {};
}

// A file under the test's temporary directory, holding `text`.
inline std::filesystem::path writeTempFile(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("qpipe-test-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  std::filesystem::create_directories(dir);
  const auto path = dir / name;
  std::ofstream(path) << text;
  return path;
}

// Runs `tests/oracle/<script>` with the oracle Python (.venv-test) and returns its stdout.
// A missing oracle environment or a failing script fails the test: oracle tests never skip.
inline std::string runOracle(const std::string& script, const std::string& args) {
  const std::filesystem::path python = QPIPE_TEST_PYTHON;
  if (!std::filesystem::exists(python)) {
    ADD_FAILURE() << "oracle Python " << python << " is missing: run tools/setup.sh --test";
    return {};
  }
  const auto out = writeTempFile("oracle.out", "");
  const std::string command = "PYTHONWARNINGS=ignore " + python.string() + " " + std::string(QPIPE_SOURCE_DIR) +
                              "/tests/oracle/" + script + " " + args + " > " + out.string();
  const int status = std::system(command.c_str());
  EXPECT_EQ(status, 0) << "oracle failed: " << command;
  std::ifstream in(out);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace qpipe::test
