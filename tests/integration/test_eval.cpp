// `qpipe eval` on broken checkpoints: one line naming the file and the rule, exit code 5.
#include <gtest/gtest.h>

#include <fstream>

#include "test_helpers.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;
using qpipe::test::CommandResult;

// A model folder whose model.safetensors holds `header` (length-prefixed) and `dataBytes` bytes.
fs::path brokenModel(const std::string& name, const std::string& header, size_t dataBytes, uint64_t declared = 0) {
  const fs::path dir = qpipe::test::testDir() / name;
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 4,
    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})";
  std::string bytes(8, '\0');
  const uint64_t length = declared ? declared : header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  bytes += header + std::string(dataBytes, '\0');
  std::ofstream(dir / "model.safetensors", std::ios::binary) << bytes;
  return dir;
}

CommandResult eval(const fs::path& model) {
  return qpipe::test::runQpipe("eval --model_path " + model.string() + " --data " + QPIPE_SOURCE_DIR +
                               "/data/eval.jsonl");
}

void expectInputError(const CommandResult& r, const fs::path& model, const std::string& rule) {
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(r.err, "qpipe: input error: " + (model / "model.safetensors").string() + ": " + rule + "\n");
}

TEST(EvalCheckpointErrors, TruncatedFile) {
  const fs::path model =
      brokenModel("truncated", R"({"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 6);
  expectInputError(eval(model), model,
                   "tensor 'model.norm.weight': data_offsets [0, 16] run past the end of the data (6 bytes; file "
                   "truncated?)");
}

TEST(EvalCheckpointErrors, CorruptedHeader) {
  const fs::path model = brokenModel("corrupted", "{\"model.norm.weight\": [", 0, 4000);
  expectInputError(eval(model), model, "header length 4000 runs past the end of the file (31 bytes)");
}

TEST(EvalCheckpointErrors, OverlappingOffsets) {
  const fs::path model = brokenModel(
      "overlap",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      12);
  expectInputError(eval(model), model, "tensor 'b': data_offsets [4, 12] overlap tensor 'a' (which ends at 8)");
}

// JSON keeps the last of two equal keys; a header naming a tensor twice would lose one silently.
TEST(EvalCheckpointErrors, ATensorNamedTwice) {
  const fs::path model = brokenModel(
      "twice",
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      8);
  expectInputError(eval(model), model, "header names 'a' twice");
}

// Too little text names the data file (the perplexity code it would reach knows no file).
TEST(EvalInputErrors, TooLittleTextNamesTheDataFile) {
  const fs::path model = qpipe::test::tinyLlama("eval_short_text");
  const fs::path data = qpipe::test::writeTempFile("short.jsonl", "{\"text\": \"hi\"}\n");
  const CommandResult r = qpipe::test::runQpipe("eval --model_path " + model.string() + " --data " + data.string() +
                                                " --seq_len 512 --log_level error");
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(r.err.rfind("qpipe: input error: " + data.string() + ": ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(" tokens, fewer than one window of --seq_len 512; give more text or a smaller --seq_len\n"),
            std::string::npos)
      << r.err;
}

// An --output_json that cannot be written fails before the evaluation, not after it.
TEST(EvalInputErrors, AnUnwritableOutputJsonFailsFirst) {
  const fs::path model = qpipe::test::tinyLlama("eval_output_json");
  const fs::path folder = qpipe::test::testDir() / "eval_output_folder";
  fs::create_directories(folder);
  const std::string common = "eval --model_path " + model.string() + " --data /nonexistent.jsonl --output_json ";
  CommandResult r = qpipe::test::runQpipe(common + folder.string());
  EXPECT_EQ(r.exitCode, 6) << r.err;
  EXPECT_EQ(r.err, "qpipe: I/O error: --output_json '" + folder.string() + "' is a folder; give a file name\n");
  r = qpipe::test::runQpipe(common + (folder / "no" / "r.json").string());
  EXPECT_EQ(r.exitCode, 6) << r.err;
  EXPECT_EQ(r.err, "qpipe: I/O error: --output_json '" + (folder / "no" / "r.json").string() + "': no folder '" +
                       (folder / "no").string() + "' to write it in\n");
}

// The results never overwrite what the evaluation reads: the data, or the model's own files (a
// link or another spelling of the path does not hide them).
TEST(EvalInputErrors, AnOutputJsonThatIsAnInputIsRefused) {
  const fs::path model = qpipe::test::tinyLlama("eval_output_json");
  const fs::path data = qpipe::test::testDir() / "eval_output_data.jsonl";
  std::ofstream(data) << "{\"text\": \"hello world\"}\n";
  const fs::path link = qpipe::test::testDir() / "eval_output_data_link.jsonl";
  fs::remove(link);
  fs::create_symlink(data, link);
  const std::string common = "eval --model_path " + model.string() + " --data " + data.string() + " --output_json ";
  CommandResult r = qpipe::test::runQpipe(common + link.string());
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_EQ(r.err, "qpipe: usage error: --output_json '" + link.string() +
                       "' is the --data file; writing the results would overwrite the data\n");
  const fs::path config = qpipe::test::testDir() / "eval_output_config_link.json";
  fs::remove(config);
  fs::create_symlink(model / "config.json", config);
  r = qpipe::test::runQpipe(common + config.string());
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_EQ(r.err, "qpipe: usage error: --output_json '" + config.string() +
                       "' is the model's config.json; writing the results would overwrite it\n");
  EXPECT_EQ(std::ifstream(data).peek(), '{');
}

// A write that fails (a full disk) is an error, not a run that exits 0 with an empty file.
TEST(EvalInputErrors, AnOutputJsonThatCannotBeWrittenFails) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const fs::path model = qpipe::test::tinyLlama("eval_output_json");
  const CommandResult r =
      qpipe::test::runQpipe("eval --model_path " + model.string() + " --data " + QPIPE_SOURCE_DIR +
                            "/data/eval.jsonl --seq_len 16 --max_samples 2 --output_json /dev/full");
  EXPECT_EQ(r.exitCode, 6) << r.err;
  EXPECT_TRUE(r.err.ends_with("qpipe: I/O error: writing --output_json '/dev/full' failed: No space left on device\n"))
      << r.err;
}

}  // namespace
