// Small helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
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

}  // namespace qpipe::test
