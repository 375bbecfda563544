// Runs the real qpipe executable as a user would and checks exit codes and output.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/plugin.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;

const std::string kPipelines = std::string(QPIPE_SOURCE_DIR) + "/tests/fixtures/pipelines/";
const std::string kFaults = std::string(QPIPE_TEST_PLUGIN_DIR) + "/faults";
const std::string kExample = std::string(QPIPE_TEST_PLUGIN_DIR) + "/example";

using qpipe::test::CommandResult;

CommandResult qpipe(const std::string& args) {
  return qpipe::test::runQpipe(args);
}

// A user-facing failure is exactly one line on stderr.
void expectOneLineError(const CommandResult& r) {
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(Cli, VersionPrintsVersionAbiAndFingerprint) {
  const CommandResult r = qpipe("version");
  EXPECT_EQ(r.exitCode, 0);
  EXPECT_NE(r.out.find("qpipe 0.1.0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(qpipe::concat("plugin ABI ", QPIPE_PLUGIN_ABI_MAJOR, ".", QPIPE_PLUGIN_ABI_MINOR)),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("|torch=2.11.0|"), std::string::npos) << r.out;
}

TEST(Cli, OpenMpKeepsItsDefaultSpinUnlessTheUserChoseAPolicy) {
  // libgomp prints its settings at start-up with OMP_DISPLAY_ENV=verbose. It shows an unset policy
  // as 'PASSIVE' too, so the spin count is what tells them apart: 0 for passive, 300000 (a few
  // milliseconds) by default. qpipe chooses no policy (docs/cli.md, "Threads") and passes the
  // user's on.
  const auto settings = [](const std::string& env) {
    const CommandResult r = qpipe::test::runQpipe("version", env + " OMP_DISPLAY_ENV=verbose");
    EXPECT_EQ(r.exitCode, 0) << r.err;
    return r.err;
  };
  const std::string byDefault = settings("-u OMP_WAIT_POLICY -u GOMP_SPINCOUNT");
  EXPECT_NE(byDefault.find("GOMP_SPINCOUNT = '300000'"), std::string::npos) << byDefault;
  const std::string passive = settings("-u GOMP_SPINCOUNT OMP_WAIT_POLICY=passive");
  EXPECT_NE(passive.find("GOMP_SPINCOUNT = '0'"), std::string::npos) << passive;
  const std::string active = settings("-u GOMP_SPINCOUNT OMP_WAIT_POLICY=active");
  EXPECT_NE(active.find("OMP_WAIT_POLICY = 'ACTIVE'"), std::string::npos) << active;
}

TEST(Cli, PluginsListsEveryBrokenFixtureWithItsReasonAndExitsZero) {
  const CommandResult r = qpipe("plugins --plugin_dir " + kFaults);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  const std::string abiMajor = qpipe::concat("libfault_abi_major.so\n    plugin ABI ", QPIPE_PLUGIN_ABI_MAJOR + 1, ".",
                                             QPIPE_PLUGIN_ABI_MINOR, " is not compatible");
  for (const std::string& expected : std::vector<std::string>{
           "Rejected libraries (5):",
           abiMajor,
           "libfault_duplicate_b.so\n    processor type 'duplicate_type' is registered by plugin 'fault_duplicate_b'",
           "libfault_fingerprint.so\n    build fingerprint 'gcc-4.8|cxx11abi=0|torch=1.13.1|qpipe=0.0.1' does not "
           "match",
           "libfault_no_descriptor.so\n    no qpipe plugin descriptor",
           "libfault_not_elf.so\n    not a shared library",
           // the three fault fixtures that load, and the built-in linear_quant, smooth, fa3, qat
           "Loaded plugins (7):",
           "type: factory_throws",
           "type: linear_quant",
       }) {
    EXPECT_NE(r.out.find(expected), std::string::npos) << "missing: " << expected << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("1. " + kFaults + "  (--plugin_dir)"), std::string::npos) << r.out;
}

TEST(Cli, CheckAcceptsAValidPipelineAndPrintsItResolved) {
  const CommandResult r = qpipe("check --config_path " + kPipelines + "log_layers.yaml --plugin_dir " + kExample);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.out.find("type: group"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefix: \"first \""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("part_file_size: 2"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("valid (3 processors, 1 savers)"), std::string::npos) << r.err;
}

TEST(Cli, CheckWarnsOfAFieldWithoutEffect) {
  const fs::path pipeline = qpipe::test::writeTempFile("qat.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: learnable_scale_qat
      qconfig:
        weight: {dtype: int8, scope: per_channel, symmetric: True}
      loss_type: kd
)");
  const CommandResult r = qpipe("check --config_path " + pipeline.string());
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("[warning] " + pipeline.string() +
                       ":7:18: spec.process[0].loss_type: has no effect in blockwise training (training_mode: end2end "
                       "uses it)"),
            std::string::npos)
      << r.err;
  // What msmodelslim's own practices carry and its run passes over.
  const fs::path practice = qpipe::test::writeTempFile("w4a8.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        act: {dtype: int8, scope: per_token}
        weight: {dtype: int4, scope: per_channel, method: ssz, ext: {group_size: 64}}
  calib_dataset: calib_prompt.jsonl
)");
  const CommandResult msmodelslim = qpipe("check --config_path " + practice.string());
  EXPECT_EQ(msmodelslim.exitCode, 0) << msmodelslim.err;
  // In the order of the file, though the pipeline's own check (calib_dataset) runs first.
  size_t previous = 0;
  for (const char* expected :
       {":7:82: spec.process[0].qconfig.weight.ext.group_size: applies to scope per_group only; ignored",
        ":8:18: spec.calib_dataset: msmodelslim does not read it, and neither does qpipe"}) {
    const size_t at = msmodelslim.err.find("[warning] " + practice.string() + expected);
    EXPECT_NE(at, std::string::npos) << msmodelslim.err;
    EXPECT_GE(at, previous) << msmodelslim.err;
    previous = at;
  }
}

// What a step plans to leave in the model and the pipeline's saver cannot write is refused by
// `check` at the step, before any model is opened; the savers name the same limits per module as
// they write (test_saver, test_fa3, test_smooth).
TEST(Cli, CheckRefusesAStepTheSaverCannotWrite) {
  struct Case {
    std::string process;
    std::string saver;
    std::string expected;  // after "<file>:4:7: spec.process[0] (<type>): "
  };
  const std::string ascendTypes =
      "; ascendv1 defines W8A8 (int8 weights, static per_tensor int8 activations), W8A8_DYNAMIC (per_token int8), "
      "W4A8_DYNAMIC (int4 per_channel symmetric weights, per_token int8), W8A16 and WFP8AFP8_DYNAMIC (per_token "
      "fp8); use compressed_tensors for others";
  const std::vector<Case> cases = {
      {"linear_quant\n      qconfig:\n        weight: {dtype: int4, scope: per_group, ext: {group_size: 64}}",
       "ascendv1_saver",
       "(linear_quant): ascendv1_saver: its Linear modules would have weights int4_per_group_sym and activations none" +
           ascendTypes},
      {"linear_quant\n      qconfig:\n        act: {dtype: fp8_e4m3, scope: per_tensor}\n        weight: {dtype: "
       "fp8_e4m3, scope: per_tensor}",
       "ascendv1_saver",
       "(linear_quant): ascendv1_saver: its Linear modules would have weights fp8_e4m3_per_tensor_sym and activations "
       "fp8_e4m3_per_tensor_sym" +
           ascendTypes},
      {"fa3_quant\n      qconfig: {dtype: int8, scope: per_token}", "compressed_tensors",
       "(fa3_quant): compressed_tensors: its q_hook is per_token (dynamic); compressed-tensors' attention scales are "
       "static: use per_tensor or per_head"},
      {"fa3_quant\n      qconfig: {dtype: int8, scope: per_token}", "ascendv1_saver",
       "(fa3_quant): ascendv1_saver: its q_hook is per_token (dynamic); ascendv1's FAQuant and C8 entries hold static "
       "scales: use per_head or per_tensor"},
      {"fa3_quant\n      qconfig: {dtype: int8, scope: per_head, symmetric: False}", "compressed_tensors",
       "(fa3_quant): compressed_tensors: its q_hook is asymmetric, which vLLM's KV cache does not support; use "
       "symmetric: True"},
      {"iter_smooth\n      symmetric: False", "compressed_tensors",
       "(iter_smooth): compressed_tensors: its norms would have a bias (from iter_smooth with symmetric: False), which "
       "the RMSNorm of transformers and vLLM lacks and would drop; save with ascendv1_saver, or smooth with symmetric: "
       "True"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const fs::path pipeline =
        qpipe::test::writeTempFile("planned" + std::to_string(i) + ".yaml",
                                   "apiversion: modelslim_v1\nspec:\n  process:\n    - type: " + c.process +
                                       "\n  save:\n    - {type: " + c.saver + "}\n");
    const CommandResult r = qpipe("check --config_path " + pipeline.string());
    EXPECT_EQ(r.exitCode, 3) << r.err;
    expectOneLineError(r);
    EXPECT_EQ(r.err, "qpipe: configuration error: " + pipeline.string() + ":4:7: spec.process[0] " + c.expected + "\n");
  }
  // A group's child is refused at its own line.
  const fs::path group = qpipe::test::writeTempFile("planned_group.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: group
      configs:
        - type: linear_quant
          qconfig:
            weight: {dtype: int8, scope: per_channel}
        - type: iter_smooth
          symmetric: False
)");
  const CommandResult inGroup = qpipe("check --config_path " + group.string());
  EXPECT_EQ(inGroup.exitCode, 3) << inGroup.err;
  EXPECT_EQ(
      inGroup.err.rfind("qpipe: configuration error: " + group.string() +
                            ":9:11: spec.process[0].configs[1] (iter_smooth): compressed_tensors: its norms would "
                            "have a bias",
                        0),
      0u)
      << inGroup.err;
  // What only the steps together decide (K and V quantized together, one scheme for all of them,
  // ascendv1's C8 or FAQuant) is left to the saver's write: here Q comes from a second step, and the
  // model is FAQuant.
  const fs::path split = qpipe::test::writeTempFile("planned_split.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: fa3_quant
      details:
        fa_k: {dtype: int8, scope: per_head}
        fa_v: {dtype: int8, scope: per_head}
    - type: fa3_quant
      details:
        fa_q: {dtype: int8, scope: per_head}
  save:
    - {type: ascendv1_saver}
)");
  const CommandResult together = qpipe("check --config_path " + split.string());
  EXPECT_EQ(together.exitCode, 0) << together.err;
  // The warnings come before a refusal: they may explain it.
  const fs::path explained = qpipe::test::writeTempFile("planned_warned.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {dtype: int4, scope: per_channel, ext: {group_size: 64}}
  save:
    - {type: ascendv1_saver}
)");
  const CommandResult warned = qpipe("check --config_path " + explained.string());
  EXPECT_EQ(warned.exitCode, 3) << warned.err;
  const size_t warning = warned.err.find("[warning] " + explained.string() +
                                         ":6:69: spec.process[0].qconfig.weight.ext.group_size: applies to scope "
                                         "per_group only; ignored\n");
  EXPECT_NE(warning, std::string::npos) << warned.err;
  EXPECT_GT(warned.err.find("qpipe: configuration error: " + explained.string() +
                            ":4:7: spec.process[0] (linear_quant): ascendv1_saver: its Linear modules would have "
                            "weights int4_per_channel_sym and activations none"),
            warning)
      << warned.err;
}

TEST(Cli, CheckRejectsUnknownTypeNamingFileLineTypeAndKnownTypes) {
  const CommandResult r = qpipe("check --config_path " + kPipelines + "unknown_type.yaml --plugin_dir " + kExample);
  EXPECT_EQ(r.exitCode, 3);
  expectOneLineError(r);
  EXPECT_EQ(
      r.err.rfind(
          "qpipe: configuration error: " + kPipelines +
              "unknown_type.yaml:6:13: spec.process[1].type: "
              "unknown processor type 'awq_magic'; known types: fa3_quant, flex_awq_ssz, flex_smooth_quant, group, "
              "iter_smooth, learnable_scale_qat, linear_quant, log_layers, module_stats, smooth_quant",
          0),
      0u)
      << r.err;
}

TEST(Cli, CheckReportsAThrowingFactoryAsAPluginError) {
  const CommandResult r =
      qpipe("check --config_path " + kPipelines + "factory_throws.yaml --plugin_dir " + kFaults + " --log_level error");
  EXPECT_EQ(r.exitCode, 4);
  expectOneLineError(r);
  EXPECT_NE(r.err.find("processor 'factory_throws' (plugin 'fault_factory_throws') could not be created: cannot "
                       "build: no device"),
            std::string::npos)
      << r.err;
}

TEST(Cli, UsageErrorsExitTwoWithOneLine) {
  for (const char* args : {"check", "check --config_path x.yaml --log_level loud", "frobnicate",
                           "plugins --plugin_dir /nonexistent/plugins", "check --config_path x.yaml --bogus"}) {
    const CommandResult r = qpipe(args);
    EXPECT_EQ(r.exitCode, 2) << args << ": " << r.err;
    expectOneLineError(r);
    EXPECT_EQ(r.err.rfind("qpipe: usage error: ", 0), 0u) << r.err;
  }
}

// Numeric and path options say what they take and what they got: CLI11's own checks called a word
// a value out of range and printed an unbounded limit as the 309 digits of the largest double.
TEST(Cli, OptionsSayWhatTheyTakeAndWhatTheyGot) {
  const std::string quant = "quant --model_path m --save_path s --quant_type w8a8 ";
  const std::vector<std::pair<std::string, std::string>> cases{
      {quant + "--calib_samples abc", "--calib_samples: expected a whole number of at least 1, got 'abc'"},
      {quant + "--calib_samples 2.5", "--calib_samples: expected a whole number of at least 1, got '2.5'"},
      {quant + "--calib_samples 0", "--calib_samples: expected a whole number of at least 1, got '0'"},
      {quant + "--seq_len 2000000", "--seq_len: expected a whole number from 1 to 1048576, got '2000000'"},
      {quant + "--threads_per_rank 8x", "--threads_per_rank: expected a whole number from 1 to 4096, got '8x'"},
      {quant + "--dist_timeout inf", "--dist_timeout: expected a number from 0.001 to 604800, got 'inf'"},
      {"eval --model_path m --data d.jsonl --max_samples -1",
       "--max_samples: expected a whole number of at least 0, got '-1'"},
      {"compare a b --tolerance nan", "--tolerance: expected a number of at least 0, got 'nan'"},
      // An unset shell variable: `--save_path "$OUT"`.
      {"quant --model_path m --save_path '' --quant_type w8a8", "--save_path: expected a path, got ''"},
      {"quant --model_path m --save_path s --config_path ''", "--config_path: expected a path, got ''"},
      {"eval --model_path m --data ''", "--data: expected a path, got ''"},
  };
  for (const auto& [args, message] : cases) {
    const CommandResult r = qpipe(args);
    EXPECT_EQ(r.exitCode, 2) << args;
    EXPECT_EQ(r.err,
              "qpipe: usage error: " + message + " (see 'qpipe " + args.substr(0, args.find(' ')) + " --help')\n")
        << args;
  }
}

// CLI11 lists unexpected arguments last first ("1 --bogus"); the message names the first unknown
// option, or the first stray argument, and points to the help of the subcommand given.
TEST(Cli, UnknownOptionAndStrayArgumentAreNamed) {
  EXPECT_EQ(qpipe("check --config_path x.yaml --bogus 1").err,
            "qpipe: usage error: unknown option '--bogus' (see 'qpipe check --help')\n");
  EXPECT_EQ(qpipe("compare a b c").err, "qpipe: usage error: unexpected argument 'c' (see 'qpipe compare --help')\n");
}

// CLI11 checks required options first: a misspelled one was reported as missing.
TEST(Cli, AMisspelledOptionIsNamedWithTheOneMeant) {
  EXPECT_EQ(qpipe("quant --model-path m --save_path s --quant_type w8a8").err,
            "qpipe: usage error: unknown option '--model-path' (did you mean '--model_path'?) (see 'qpipe quant "
            "--help')\n");
  EXPECT_EQ(qpipe("eval --modelpath m --data d.jsonl").err,
            "qpipe: usage error: unknown option '--modelpath' (did you mean '--model_path'?) (see 'qpipe eval "
            "--help')\n");
  EXPECT_EQ(qpipe("check --Config-Path x.yaml").err,
            "qpipe: usage error: unknown option '--Config-Path' (did you mean '--config_path'?) (see 'qpipe check "
            "--help')\n");
  EXPECT_EQ(qpipe("--version").err,
            "qpipe: usage error: unknown option '--version' (did you mean the subcommand 'version'?) (see 'qpipe "
            "--help')\n");
  const CommandResult r = qpipe("quant --log-level debug");
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_EQ(r.err,
            "qpipe: usage error: unknown option '--log-level' (did you mean '--log_level'?) (see 'qpipe quant "
            "--help')\n");
  EXPECT_EQ(qpipe("eval --model-path=m --data d.jsonl").err,
            "qpipe: usage error: unknown option '--model-path=m' (did you mean '--model_path'?) (see 'qpipe eval "
            "--help')\n");
  // Spelled right but before its subcommand.
  EXPECT_EQ(qpipe("--model_path m quant --save_path s --quant_type w8a8").err,
            "qpipe: usage error: unknown option '--model_path'; it is an option of 'qpipe quant', given before it "
            "(see 'qpipe quant --help')\n");
  // A negative number is a stray argument.
  EXPECT_EQ(qpipe("compare a b -5").err, "qpipe: usage error: unexpected argument '-5' (see 'qpipe compare --help')\n");
}

TEST(Cli, AnOptionGivenTwiceOrWithoutItsValueIsSaidPlainly) {
  EXPECT_EQ(qpipe("quant --model_path a --model_path b --save_path s --quant_type w8a8").err,
            "qpipe: usage error: --model_path is given more than once; give it once (see 'qpipe quant --help')\n");
  EXPECT_EQ(qpipe("quant --save_path s --quant_type w8a8 --model_path").err,
            "qpipe: usage error: --model_path needs a value (see 'qpipe quant --help')\n");
  EXPECT_EQ(qpipe("quant --model_path m --save_path s --quant_type w8a8 --allow_non_finite=maybe").err,
            "qpipe: usage error: --allow_non_finite: a flag takes true or false (or no value), got 'maybe' (see 'qpipe "
            "quant --help')\n");
}

TEST(Cli, UnknownSubcommandIsNamed) {
  const CommandResult r = qpipe("frobnicate");
  EXPECT_EQ(r.err,
            "qpipe: usage error: unknown subcommand 'frobnicate'; use one of: check, compare, convert, eval, plugins, "
            "quant, version (see 'qpipe --help')\n");
  EXPECT_EQ(qpipe("convert foo").err,
            "qpipe: usage error: unknown subcommand 'foo' of 'qpipe convert'; use one of: gguf (see 'qpipe convert "
            "--help')\n");
  EXPECT_EQ(qpipe("convert").err,
            "qpipe: usage error: 'qpipe convert' needs a subcommand: gguf (see 'qpipe convert --help')\n");
  // Its options are unknown too, but the misspelt command is what to fix.
  EXPECT_EQ(qpipe("quantize --model_path m --save_path s").err,
            "qpipe: usage error: unknown subcommand 'quantize'; use one of: check, compare, convert, eval, plugins, "
            "quant, version (see 'qpipe --help')\n");
  EXPECT_EQ(qpipe("convert safetensors --input x").err,
            "qpipe: usage error: unknown subcommand 'safetensors' of 'qpipe convert'; use one of: gguf (see 'qpipe "
            "convert --help')\n");
  // Without a subcommand, its options' values are not taken for one.
  EXPECT_EQ(qpipe("--model_path m").err, "qpipe: usage error: unknown option '--model_path' (see 'qpipe --help')\n");
  EXPECT_EQ(qpipe("convert --input x.gguf").err,
            "qpipe: usage error: unknown option '--input' (see 'qpipe convert --help')\n");
}

// `qpipe help [command]` is `qpipe [command] --help`.
TEST(Cli, HelpAsASubcommandShowsTheCommandsHelp) {
  for (const auto& [args, usage] : std::vector<std::pair<std::string, std::string>>{
           {"help", "Usage: qpipe [OPTIONS] SUBCOMMAND"},
           {"help quant", "Usage: qpipe quant [OPTIONS]"},
           {"help convert gguf", "Usage: qpipe convert gguf [OPTIONS]"},
           {"help quant --model_path", "Usage: qpipe quant [OPTIONS]"},
           {"--log_level debug help eval", "Usage: qpipe eval [OPTIONS]"},
           {"--log_level=warn help compare", "Usage: qpipe compare [OPTIONS]"}}) {
    const CommandResult r = qpipe(args);
    EXPECT_EQ(r.exitCode, 0) << args << ": " << r.err;
    EXPECT_NE(r.out.find(usage), std::string::npos) << args << ": " << r.out;
  }
}

TEST(Cli, MissingPipelineFileIsAnIoError) {
  const CommandResult r = qpipe("check --config_path /nonexistent/p.yaml");
  EXPECT_EQ(r.exitCode, 6);
  expectOneLineError(r);
  EXPECT_EQ(r.err, "qpipe: I/O error: cannot open '/nonexistent/p.yaml': no such file\n");
}

TEST(Cli, HelpExitsZeroAndListsSubcommands) {
  const CommandResult r = qpipe("--help");
  EXPECT_EQ(r.exitCode, 0);
  for (const char* sub : {"check", "plugins", "version", "--log_level"}) {
    EXPECT_NE(r.out.find(sub), std::string::npos) << r.out;
  }
}

}  // namespace
