// qpipe compare: tensor by tensor across shards, JSON by value, quant_report.json skipped, and
// a one-line error naming the first difference.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "qpipe/error.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;
using qpipe::test::runQpipe;

const std::string kQuant = " --calib_samples 2 --seq_len 32";

std::string quoted(const fs::path& path) {
  return "'" + path.string() + "'";
}

// Two quantizations of one tiny model: the same practice twice, and another one.
struct Outputs {
  fs::path first, again, other;
};

Outputs quantizeTwice() {
  const fs::path model = qpipe::test::tinyLlama("compare-model");
  const fs::path dir = qpipe::test::testDir();
  Outputs outputs{dir / "first", dir / "again", dir / "other"};
  for (const auto& path : {outputs.first, outputs.again, outputs.other}) fs::remove_all(path);
  const fs::path configs = fs::path(QPIPE_SOURCE_DIR) / "configs" / "default";
  for (const auto& [out, practice] : {std::pair{outputs.first, "w8a8_static"}, std::pair{outputs.again, "w8a8_static"},
                                      std::pair{outputs.other, "w8a8"}}) {
    const auto r =
        runQpipe("quant --model_path " + quoted(model) + " --config_path " +
                 quoted(configs / (std::string(practice) + ".yaml")) + " --save_path " + quoted(out) + kQuant);
    EXPECT_EQ(r.exitCode, 0) << r.err;
  }
  return outputs;
}

TEST(QpipeCompare, IdenticalRunsAgreeAndOtherPracticesDiffer) {
  const Outputs outputs = quantizeTwice();
  auto r = runQpipe("compare " + quoted(outputs.first) + " " + quoted(outputs.again));
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("0 different; "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(quant_report.json not compared)"), std::string::npos) << r.out;

  // Static checkpoints carry input scales the dynamic one lacks; both folders' tensors are counted.
  r = runQpipe("compare " + quoted(outputs.first) + " " + quoted(outputs.other));
  EXPECT_EQ(r.exitCode, static_cast<int>(qpipe::ErrorCode::kInput)) << r.out;
  EXPECT_NE(r.err.find("differ: tensor model.layers.0.mlp.down_proj.input_scale only in " + outputs.first.string()),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find(" only in " + outputs.first.string() + ", 0 only in " + outputs.other.string() + ")"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("difference"), std::string::npos) << "a table without rows: " << r.out;
  r = runQpipe("compare " + quoted(outputs.other) + " " + quoted(outputs.first));
  EXPECT_NE(r.out.find(", 0 only in " + outputs.other.string() + ", "), std::string::npos) << r.out;
}

TEST(QpipeCompare, ToleranceAcceptsSmallFloatDifferencesAndNamesLargerOnes) {
  const Outputs outputs = quantizeTwice();
  // Nudge one scale by about 1e-7 relative: flip the last mantissa bit of its first element.
  const fs::path file = outputs.again / "model.safetensors";
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t headerSize = 0;
  stream.read(reinterpret_cast<char*>(&headerSize), sizeof headerSize);
  std::string header(headerSize, '\0');
  stream.read(header.data(), static_cast<std::streamsize>(headerSize));
  const std::string key = "\"model.layers.0.mlp.down_proj.weight_scale\"";
  const size_t at = header.find(key);
  ASSERT_NE(at, std::string::npos);
  const size_t offsets = header.find("\"data_offsets\":[", at) + 16;
  const uint64_t begin = std::stoull(header.substr(offsets));
  stream.seekg(static_cast<std::streamoff>(8 + headerSize + begin));
  char byte = 0;
  stream.read(&byte, 1);
  byte ^= 1;
  stream.seekp(static_cast<std::streamoff>(8 + headerSize + begin));
  stream.write(&byte, 1);
  stream.close();

  auto r = runQpipe("compare " + quoted(outputs.first) + " " + quoted(outputs.again));
  EXPECT_EQ(r.exitCode, static_cast<int>(qpipe::ErrorCode::kInput)) << r.out;
  EXPECT_NE(r.err.find("differ: tensor model.layers.0.mlp.down_proj.weight_scale differs ("), std::string::npos)
      << r.err;
  EXPECT_TRUE(r.err.ends_with("e-08, over --tolerance 0)\n")) << r.err;
  // Listed once, in the table, with its verdict.
  const size_t row = r.out.find("model.layers.0.mlp.down_proj.weight_scale");
  ASSERT_NE(row, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("model.layers.0.mlp.down_proj.weight_scale", row + 1), std::string::npos) << r.out;
  const std::string line = r.out.substr(row, r.out.find('\n', row) - row);
  EXPECT_TRUE(line.ends_with(" over") && line.find("e-08 ") != std::string::npos) << line;
  EXPECT_NE(r.out.find(" 0 within --tolerance 0, 1 different (1 over the tolerance, 0 of another dtype or shape, 0 "
                       "only in "),
            std::string::npos)
      << r.out;

  r = runQpipe("compare " + quoted(outputs.first) + " " + quoted(outputs.again) + " --tolerance 1e-6");
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("1 within --tolerance 1e-06, 0 different"), std::string::npos) << r.out;
}

TEST(QpipeCompare, MissingFolderIsAnInputError) {
  const auto r = runQpipe("compare /nonexistent/a /nonexistent/b");
  EXPECT_EQ(r.exitCode, static_cast<int>(qpipe::ErrorCode::kInput));
  EXPECT_NE(r.err.find("'/nonexistent/a' is not a folder"), std::string::npos) << r.err;
}

// Two folders without weights are the wrong folders, not two equal checkpoints.
TEST(QpipeCompare, AFolderWithoutTensorsIsAnInputError) {
  const fs::path empty = qpipe::test::testDir() / "no_tensors";
  fs::create_directories(empty);
  std::ofstream(empty / "config.json") << "{}";
  const auto r = runQpipe("compare " + empty.string() + " " + empty.string());
  EXPECT_EQ(r.exitCode, static_cast<int>(qpipe::ErrorCode::kInput));
  EXPECT_EQ(r.err, "qpipe: input error: '" + empty.string() + "' holds no tensors (no .safetensors file)\n");
}

}  // namespace
