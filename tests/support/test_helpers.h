// Small helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <string_view>

#include "qpipe/error.h"
#include "qpipe/quant_linear.h"

namespace qpipe::test {

// Whether QuantLinear runs W4A4 FP4 Linears (those it may) through Fp4Linear here: the CPU runs
// it and QPIPE_FP4_FAKE_QUANT=1 does not ask for fake quantization.
inline bool fp4LinearRuns() {
  const char* fake = std::getenv("QPIPE_FP4_FAKE_QUANT");
  return Fp4Linear::cpuRuns() && !(fake != nullptr && std::string_view(fake) == "1");
}

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

// The whole text of a file ("" when it does not exist).
inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The folder of the running test under the system's temporary folder (ctest runs tests in
// parallel: each has its own).
inline std::filesystem::path testDir() {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("qpipe-test-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  std::filesystem::create_directories(dir);
  return dir;
}

// A file under the test's temporary directory, holding `text`.
inline std::filesystem::path writeTempFile(const std::string& name, const std::string& text) {
  const auto path = testDir() / name;
  std::ofstream(path) << text;
  return path;
}

struct CommandResult {
  int exitCode;
  std::string out;
  std::string err;
};

// Runs the built `qpipe` with `args` as a user would (no stdin, QPIPE_PLUGIN_PATH unset);
// `env` holds more arguments of env(1), e.g. "-u OMP_WAIT_POLICY".
inline CommandResult runQpipe(const std::string& args, const std::string& env = "") {
  const std::filesystem::path dir = testDir();
  // Appended piecewise: GCC 12 warns falsely (-Warray-bounds) on one long concatenation.
  std::string command = "env -u QPIPE_PLUGIN_PATH ";
  command += env + " ";
  command += QPIPE_BINARY;
  command += " " + args + " >" + (dir / "out").string() + " 2>" + (dir / "err").string() + " </dev/null";
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(dir / "out"), slurp(dir / "err")};
}

// `qpipe quant` of `model` into `out` with the pipeline file `pipeline`, calibrated on four
// 16-token windows of a short English text (the tiny models' tokenizer covers it).
inline CommandResult runTinyQuant(const std::filesystem::path& model, const std::filesystem::path& out,
                                  const std::filesystem::path& pipeline) {
  const std::filesystem::path calib = writeTempFile(
      "calib.txt", "the quick brown fox jumps over the lazy dog, then the dog sleeps. he thinks the fox is there.\n");
  return runQpipe("quant --model_path " + model.string() + " --save_path " + out.string() + " --config_path " +
                  pipeline.string() + " --calib_data " + calib.string() + " --calib_samples 4 --seq_len 16");
}

// Runs `tests/oracle/<script>` with `python` and returns its stdout. A missing oracle environment
// or a failing script fails the test: oracle tests never skip.
inline std::string runOracleWith(const std::filesystem::path& python, const std::string& script,
                                 const std::string& args) {
  if (!std::filesystem::exists(python)) {
    ADD_FAILURE() << "oracle Python " << python << " is missing: run tools/setup.sh --test";
    return {};
  }
  const auto out = writeTempFile("oracle.out", "");
  const std::string command = "PYTHONWARNINGS=ignore " + python.string() + " " + std::string(QPIPE_SOURCE_DIR) +
                              "/tests/oracle/" + script + " " + args + " > " + out.string();
  const int status = std::system(command.c_str());
  EXPECT_EQ(status, 0) << "oracle failed: " << command;
  return slurp(out);
}

// The same with .venv-test's Python (transformers, tokenizers, safetensors, gguf, compressed-tensors).
inline std::string runOracle(const std::string& script, const std::string& args) {
  return runOracleWith(QPIPE_TEST_PYTHON, script, args);
}

}  // namespace qpipe::test
