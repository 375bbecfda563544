// `qpipe convert gguf` as a user runs it: gguf-py writes a tiny random Llama GGUF (with the weights
// it must become), qpipe converts it, and transformers and tokenizers load the result. The real
// SmolLM2-135M-Instruct GGUF is converted and greedy-decoded when tools/setup.sh has fetched it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "qpipe/host/gguf.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;
using qpipe::test::runOracle;

using qpipe::test::CommandResult;
using qpipe::test::testDir;

CommandResult qpipe(const std::string& args) {
  return qpipe::test::runQpipe(args);
}

// A tiny Llama GGUF from the oracle and the HF weights it must convert to.
struct Fixture {
  fs::path gguf;
  fs::path expected;
};

Fixture tinyLlama(const std::string& options = "") {
  const fs::path dir = testDir();
  Fixture f{dir / "tiny.gguf", dir / "expected.safetensors"};
  const std::string out =
      runOracle("gguf_oracle.py", "llama " + f.gguf.string() + " " + f.expected.string() + " " + options);
  EXPECT_NE(out.find("wrote "), std::string::npos) << out;
  return f;
}

// Nothing but the finished folder may be left next to it: no partial folder of a run.
void expectNoPartial(const fs::path& parent) {
  for (const auto& entry : fs::directory_iterator(parent)) {
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  }
}

TEST(ConvertGguf, TinyLlamaLoadsInTransformersWithTheOraclesWeightsAndTokenizer) {
  const Fixture f = tinyLlama();
  const fs::path out = testDir() / "hf";
  fs::remove_all(out);
  const CommandResult r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string());
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find(f.gguf.string() + ": converted to " + out.string() + " (21 tensors, 113472 parameters, float32"),
            std::string::npos)
      << r.err;
  for (const char* name :
       {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(out / name)) << name;
  }
  expectNoPartial(testDir());

  const std::string check = runOracle("gguf_oracle.py", "check " + out.string() + " " + f.expected.string());
  for (const char* line : {
           "weights: 21 tensors equal (torch.float32)\n",
           "config: layers=2 heads=4 kv=2 head_dim=16 eps=1e-05 theta=500000.0 tied=False bos=1 eos=2\n",
           "forward: logits (1, 4, 308) finite\n",
           "tokenizer: 4 texts encode as the reference and round-trip\n",
           "special: bos=<|im_start|> eos=<|im_end|> pad=<|im_end|> unk=<|endoftext|>\n",
       }) {
    EXPECT_NE(check.find(line), std::string::npos) << "missing: " << line << check;
  }
}

TEST(ConvertGguf, TiedEmbeddingsInBfloat16) {
  const Fixture f = tinyLlama("--tied");
  const fs::path out = testDir() / "hf";
  fs::remove_all(out);
  const CommandResult r =
      qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string() + " --dtype bfloat16");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::string check = runOracle("gguf_oracle.py", "check " + out.string() + " " + f.expected.string());
  EXPECT_NE(check.find("weights: 20 tensors equal (torch.bfloat16)\n"), std::string::npos) << check;
  EXPECT_NE(check.find(" tied=True "), std::string::npos) << check;
}

TEST(ConvertGguf, UnsupportedPreTokenizerIsOneLineAndWritesNothing) {
  const Fixture f = tinyLlama("--pre qwen2");
  const fs::path out = testDir() / "hf";
  fs::remove_all(out);
  const CommandResult r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string());
  EXPECT_EQ(r.exitCode, 5);
  EXPECT_EQ(r.err, "qpipe: input error: " + f.gguf.string() +
                       ": metadata 'tokenizer.ggml.pre' is 'qwen2' (supported pre-tokenizers: gpt-2, smollm, "
                       "starcoder)\n");
  EXPECT_FALSE(fs::exists(out));
  expectNoPartial(testDir());
}

// JSON has no NaN: config.json would have said `"rope_theta": null` and the model run on a default.
TEST(ConvertGguf, ANonFiniteOrNonPositiveHyperparameterIsOneLineAndWritesNothing) {
  for (const char* base : {"nan", "-1"}) {
    const Fixture f = tinyLlama(std::string("--rope_freq_base ") + base);
    const fs::path out = testDir() / "hf";
    fs::remove_all(out);
    const CommandResult r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string());
    EXPECT_EQ(r.exitCode, 5);
    EXPECT_EQ(r.err, "qpipe: input error: " + f.gguf.string() + ": metadata 'llama.rope.freq_base' is " + base +
                         "; expected a positive number\n");
    EXPECT_FALSE(fs::exists(out));
  }
}

// --input as every command's input file: missing is an I/O error, a folder an input error.
TEST(ConvertGguf, AMissingOrFolderInputIsNamedAsOtherCommandsNameTheirs) {
  const fs::path missing = testDir() / "missing.gguf", out = testDir() / "hf-never";
  CommandResult r = qpipe("convert gguf --input " + missing.string() + " --output " + out.string());
  EXPECT_EQ(r.exitCode, 6);
  EXPECT_EQ(r.err, "qpipe: I/O error: cannot open '" + missing.string() + "': no such file\n");
  r = qpipe("convert gguf --input " + testDir().string() + " --output " + out.string());
  EXPECT_EQ(r.exitCode, 5);
  EXPECT_EQ(r.err, "qpipe: input error: '" + testDir().string() + "' is not a regular file (a directory)\n");
  EXPECT_FALSE(fs::exists(out));
}

TEST(ConvertGguf, TruncatedFileAndExistingOrUnwritableOutputAreOneLineErrors) {
  const Fixture f = tinyLlama();
  const auto file = qpipe::gguf::File::open(f.gguf);
  const qpipe::gguf::TensorInfo& first = file->tensors().front();
  const uint64_t end = file->dataOffset() + first.offset + first.bytes;
  const fs::path cut = testDir() / "cut.gguf";
  fs::copy_file(f.gguf, cut, fs::copy_options::overwrite_existing);
  fs::resize_file(cut, end - 1);
  const fs::path out = testDir() / "hf";
  fs::remove_all(out);

  CommandResult r = qpipe("convert gguf --input " + cut.string() + " --output " + out.string());
  EXPECT_EQ(r.exitCode, 5);
  EXPECT_EQ(r.err, "qpipe: input error: " + cut.string() + ": tensor '" + first.name +
                       "': data runs past the end of the file (bytes " + std::to_string(end - first.bytes) + " to " +
                       std::to_string(end) + ", file size " + std::to_string(end - 1) + ")\n");
  EXPECT_FALSE(fs::exists(out));

  fs::create_directories(out);
  r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string());
  EXPECT_EQ(r.exitCode, 6);
  EXPECT_EQ(r.err, "qpipe: I/O error: " + out.string() + ": already exists (remove it, or pass --overwrite)\n");
  r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string() + " --overwrite");
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  // "hf/" names the folder hf (the partial folder beside it, not inside, where the overwrite
  // removed it before the rename).
  r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string() + "/ --overwrite");
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  // --overwrite never removes the input, nor a folder that holds it.
  const fs::path holder = testDir() / "holder";
  fs::create_directories(holder);
  const fs::path inside = holder / "model.gguf";
  fs::copy_file(f.gguf, inside, fs::copy_options::overwrite_existing);
  // The folder through a link too: compared as files, not as the paths written.
  const fs::path linked = testDir() / "holder-link";
  fs::remove(linked);
  fs::create_directory_symlink(holder, linked);
  for (const auto& [output, verb] : {std::pair{inside, "is"}, {holder, "holds"}, {linked, "holds"}}) {
    r = qpipe("convert gguf --input " + inside.string() + " --output " + output.string() + " --overwrite");
    EXPECT_EQ(r.exitCode, 2);
    EXPECT_EQ(r.err, "qpipe: usage error: --output '" + output.string() + "' " + verb + " the input '" +
                         inside.string() + "', which --overwrite would remove; choose another --output\n");
    EXPECT_TRUE(fs::is_regular_file(inside));
  }

  r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + out.string() + " --dtype int8");
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;

  // The folder is written beside --output and renamed; where it cannot be made, --output is named.
  const fs::path notFolder = testDir() / "a-file";
  std::ofstream(notFolder) << "not a folder\n";
  r = qpipe("convert gguf --input " + f.gguf.string() + " --output " + (notFolder / "hf").string());
  EXPECT_EQ(r.exitCode, 6);
  EXPECT_EQ(r.err.rfind("qpipe: I/O error: cannot write --output '" + (notFolder / "hf").string() +
                            "': creating the folder '" + (notFolder / ".hf.partial-").string(),
                        0),
            0u)
      << r.err;
  EXPECT_TRUE(r.err.ends_with("' beside it failed: Not a directory\n")) << r.err;
}

// The real model: tools/setup.sh puts its GGUF in .cache (about 20 s).
TEST(ConvertGguf, SmolLM2GreedyDecodes) {
  const fs::path gguf = fs::path(QPIPE_SOURCE_DIR) / ".cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf";
  ASSERT_TRUE(fs::exists(gguf)) << gguf << " is missing: run tools/setup.sh";
  const fs::path out = testDir() / "smollm2";
  fs::remove_all(out);
  const CommandResult r = qpipe("convert gguf --input " + gguf.string() + " --output " + out.string());
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("(272 tensors, 134515008 parameters, float32"), std::string::npos) << r.err;
  const std::string text = runOracle("gguf_oracle.py", "generate " + out.string() + " 'The capital of France is'");
  EXPECT_NE(text.find("\"ids\": [504, 3575, 282, 4649, 314]"), std::string::npos) << text;
  EXPECT_NE(text.find("The capital of France is Paris."), std::string::npos) << text;
  fs::remove_all(out);
}

}  // namespace
