// `qpipe quant` on several ranks as a user runs it (docs/multirank.md): --device cpu:0,1 gives the
// checkpoint of --device cpu:0 tensor for tensor, byte for byte, and so do ranks started the
// torchrun way; a pipeline with a processor that cannot run on several ranks is refused before the
// model loads; a rank that raises, a rank killed midway and Ctrl-C to the launcher each stop every
// rank within the timeout, with one line naming the cause and nothing at --save_path.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "free_port.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using qpipe::ErrorCode;
using qpipe::test::CommandResult;

const fs::path kFixturePlugins = fs::path(QPIPE_TEST_PLUGIN_DIR) / "multirank";
// Few, short windows; one thread per rank (the test machines have two cores); a short timeout.
const std::string kTiny = " --calib_samples 4 --seq_len 32 --threads_per_rank 1 --dist_timeout 10";
constexpr auto kTimeout = std::chrono::seconds(10);

std::string quote(const fs::path& path) {
  return "'" + path.string() + "'";
}

int code(ErrorCode c) {
  return static_cast<int>(c);
}

// The last line of `text` (without its newline).
std::string lastLine(const std::string& text) {
  std::string trimmed = text;
  while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
  const size_t newline = trimmed.rfind('\n');
  return newline == std::string::npos ? trimmed : trimmed.substr(newline + 1);
}

// A pipeline file holding `process` (YAML lines under `spec.process:`).
fs::path pipelineFile(const std::string& name, const std::string& process) {
  return qpipe::test::writeTempFile(name, "apiversion: modelslim_v1\nspec:\n  process:\n" + process);
}

const std::string kW8A8 = R"(    - type: linear_quant
      qconfig:
        act: {dtype: int8, scope: per_token, symmetric: True, method: minmax}
        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
      include: ["*"]
)";

// W8A8 dynamic, then a step that sleeps `seconds` in each layer: a run to kill midway.
fs::path slowPipeline(double seconds) {
  return pipelineFile("slow.yaml",
                      kW8A8 + "    - type: rank_fault\n      sleep_seconds: " + std::to_string(seconds) + "\n");
}

// Everything two checkpoint folders hold agrees: the same safetensors tensors (name, dtype, shape
// and bytes; sharding aside) and the same other files byte for byte, except quant_report.json,
// which holds timings.
void expectSameCheckpoint(const fs::path& expected, const fs::path& actual) {
  const auto files = [](const fs::path& dir) {
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (name != "quant_report.json" && entry.path().extension() != ".safetensors") names.insert(name);
    }
    return names;
  };
  ASSERT_TRUE(fs::is_directory(expected)) << expected;
  ASSERT_TRUE(fs::is_directory(actual)) << actual;
  EXPECT_TRUE(fs::exists(expected / "quant_report.json"));
  EXPECT_TRUE(fs::exists(actual / "quant_report.json"));
  EXPECT_EQ(files(expected), files(actual));
  for (const std::string& name : files(expected)) {
    if (name.ends_with(".safetensors.index.json")) continue;  // shard names may differ
    EXPECT_EQ(qpipe::test::slurp(expected / name), qpipe::test::slurp(actual / name)) << name;
  }
  const auto a = qpipe::safetensors::Checkpoint::open(expected);
  const auto b = qpipe::safetensors::Checkpoint::open(actual);
  ASSERT_EQ(a.names(), b.names());
  ASSERT_FALSE(a.names().empty());
  for (const std::string& name : a.names()) {
    const at::Tensor x = a.tensor(name).contiguous();
    const at::Tensor y = b.tensor(name).contiguous();
    ASSERT_EQ(x.scalar_type(), y.scalar_type()) << name;
    ASSERT_EQ(x.sizes(), y.sizes()) << name;
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << name << " differs";
  }
}

// qpipe started in the background, its stdout and stderr in the test's folder.
struct Process {
  pid_t pid = -1;
  fs::path out;
  fs::path err;
};

Process start(const std::string& name, const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  const fs::path dir = qpipe::test::testDir();
  Process process{.pid = -1, .out = dir / (name + ".out"), .err = dir / (name + ".err")};
  std::vector<std::string> argv = {QPIPE_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> pointers;
  for (auto& arg : argv) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  process.pid = ::fork();
  if (process.pid == 0) {
    ::freopen(process.out.c_str(), "w", stdout);
    ::freopen(process.err.c_str(), "w", stderr);
    ::freopen("/dev/null", "r", stdin);
    ::unsetenv("QPIPE_PLUGIN_PATH");
    for (const char* var : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
      ::unsetenv(var);
    }
    for (const std::string& assignment : env) {
      const size_t eq = assignment.find('=');
      ::setenv(assignment.substr(0, eq).c_str(), assignment.substr(eq + 1).c_str(), 1);
    }
    ::execv(pointers[0], pointers.data());
    ::_exit(127);
  }
  return process;
}

// The exit code (-signal when killed by one), or nullopt if it runs past `limit` (then it is
// killed).
std::optional<int> waitFor(const Process& process, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  int status = 0;
  while (::waitpid(process.pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(process.pid, SIGKILL);
      ::waitpid(process.pid, &status, 0);
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

// The live child processes of `parent`.
std::vector<pid_t> childrenOf(pid_t parent) {
  std::vector<pid_t> children;
  for (const auto& entry : fs::directory_iterator("/proc/" + std::to_string(parent) + "/task")) {
    std::ifstream in(entry.path() / "children");
    for (pid_t pid; in >> pid;) children.push_back(pid);
  }
  return children;
}

// The ranks' pids in rank order, from the launcher's line "launched 2 ranks (pids P0…P1), …";
// empty before it. (A forked rank's /proc/<pid>/environ is the launcher's: it sets RANK after
// the fork.)
std::vector<pid_t> launchedRanks(const Process& launcher) {
  const std::string err = qpipe::test::slurp(launcher.err);
  const size_t at = err.find("launched 2 ranks (pids ");
  int first = -1, last = -1;
  if (at == std::string::npos || std::sscanf(err.c_str() + at, "launched 2 ranks (pids %d…%d)", &first, &last) != 2) {
    return {};
  }
  return {first, last};
}

bool alive(pid_t pid) {
  return ::kill(pid, 0) == 0;
}

// The launcher's ranks, in rank order, once the saver's temporary folder is there (rank 0 is
// past its checks, and every rank is running). Empty when that does not happen within 20 s.
std::vector<pid_t> ranksOnceSaving(const Process& launcher, const fs::path& out) {
  const fs::path partial = out.parent_path() / ("." + out.filename().string() + ".qpipe-partial");
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    const std::vector<pid_t> children = childrenOf(launcher.pid);
    const std::vector<pid_t> ranks = launchedRanks(launcher);
    if (fs::exists(partial) && children.size() == 2 && ranks.size() == 2 &&
        std::is_permutation(ranks.begin(), ranks.end(), children.begin())) {
      return ranks;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return {};
}

// The report probe's relative errors, decoder layer by layer and module by module, as text.
std::string probeErrors(const fs::path& checkpoint) {
  const nlohmann::json report = nlohmann::json::parse(qpipe::test::slurp(checkpoint / "quant_report.json"));
  std::string out;
  for (const auto& layer : report["layers"]) {
    if (!layer["name"].get<std::string>().starts_with("model.layers.")) continue;
    out += layer["name"].get<std::string>() + " " + layer["relative_mse"].dump() + "\n";
    for (const auto& module : layer["modules"]) {
      out += "  " + module["name"].get<std::string>() + " " + module["relative_mse"].dump() + "\n";
    }
  }
  return out;
}

void expectNothingSaved(const fs::path& out) {
  EXPECT_FALSE(fs::exists(out)) << out;
  EXPECT_FALSE(fs::exists(out.parent_path() / ("." + out.filename().string() + ".qpipe-partial")))
      << "the temporary folder of " << out << " was left";
}

std::string quantArgs(const fs::path& model, const fs::path& out, const std::string& rest) {
  return "quant --model_path " + quote(model) + " --save_path " + quote(out) + " " + rest + kTiny;
}

// The same as an argument vector (`rest` split at spaces, nothing quoted).
std::vector<std::string> quantArgv(const fs::path& model, const fs::path& out, const std::string& rest) {
  std::vector<std::string> args = {"quant", "--model_path", model.string(), "--save_path", out.string()};
  std::istringstream in(rest + kTiny);
  for (std::string arg; in >> arg;) args.push_back(arg);
  return args;
}

// ---------------------------------------------------------------------------------------------
// Equivalence.

TEST(QuantMultirank, TwoRanksWriteTheCheckpointOfOne) {
  const fs::path dir = qpipe::test::testDir();
  struct Case {
    fs::path model;
    std::string quantType;
  };
  const std::vector<Case> cases = {{qpipe::test::tinyLlama("llama"), "w8a8"},
                                   {qpipe::test::tinyQwen3("qwen3"), "w4a16"}};
  for (const Case& c : cases) {
    // The second case starts its ranks as fresh copies of the binary, as CUDA ranks are.
    const bool exec = &c == &cases.back();
    const std::string tag = c.model.filename().string() + "-" + c.quantType;
    const fs::path one = dir / (tag + "-one"), two = dir / (tag + "-two");
    fs::remove_all(one);
    fs::remove_all(two);
    const CommandResult single =
        qpipe::test::runQpipe(quantArgs(c.model, one, "--quant_type " + c.quantType + " --device cpu:0"));
    ASSERT_EQ(single.exitCode, 0) << single.err;
    const CommandResult multi =
        qpipe::test::runQpipe(quantArgs(c.model, two, "--quant_type " + c.quantType + " --device cpu:0,1"),
                              exec ? "QPIPE_RANK_START=exec" : "");
    ASSERT_EQ(multi.exitCode, 0) << multi.err;
    EXPECT_NE(multi.err.find("] [info] launched 2 ranks (pids "), std::string::npos) << multi.err;
    EXPECT_EQ(multi.err.find(", forked\n") == std::string::npos, exec) << multi.err;
    // Data-free: only rank 0, which writes the report, reads the tokens of its probe.
    EXPECT_NE(multi.err.find("[rank 0/2] [info] calibration: none (a data-free pipeline); the report's probe reads "
                             "the first 32 tokens of "),
              std::string::npos)
        << multi.err;
    EXPECT_EQ(multi.err.find("[rank 1/2] [info] data: "), std::string::npos) << multi.err;
    // Rank 0 alone prints the summary and saves.
    EXPECT_EQ(lastLine(multi.out).rfind("saved compressed_tensors checkpoint to " + two.string() + " in ", 0), 0u)
        << multi.out;
    EXPECT_EQ(multi.out.find("saved compressed_tensors"), multi.out.rfind("saved compressed_tensors")) << multi.out;
    expectSameCheckpoint(one, two);
    // Data-free: the decoder layers and the non-layer modules' write were split over the ranks, and
    // the report probe went from each layer's executor to the next one's, so the report's errors
    // are the one rank's.
    EXPECT_NE(multi.err.find("[rank 0/2] [info] runner: 2 decoder layers and the non-layer modules split over 2 ranks "
                             "[DTS] tasks=3 waves=1 parallel_waves=1 world_size=2 rank=0 my_tasks="),
              std::string::npos)
        << multi.err;
    EXPECT_EQ(probeErrors(one), probeErrors(two));
    // Each rank counted the modules of its layers; postRun adds them up.
    const std::string count = "linear_quant: 14 Linear modules";
    EXPECT_NE(single.err.find("[info] " + count), std::string::npos) << single.err;
    EXPECT_NE(multi.err.find("[rank 0/2] [info] " + count), std::string::npos) << multi.err;
  }
}

// `pipeline` over the tiny Llama on one rank and on two, whose layers it must split; both runs
// succeed and write the same checkpoint. Returns the two runs.
std::pair<CommandResult, CommandResult> oneAndTwoSplitRanks(const std::string& tag, const fs::path& pipeline) {
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path one = qpipe::test::testDir() / (tag + "-one"), two = qpipe::test::testDir() / (tag + "-two");
  fs::remove_all(one);
  fs::remove_all(two);
  const std::string config = "--config_path " + quote(pipeline);
  CommandResult single = qpipe::test::runQpipe(quantArgs(model, one, config + " --device cpu:0"));
  CommandResult multi = qpipe::test::runQpipe(quantArgs(model, two, config + " --device cpu:0,1"));
  EXPECT_EQ(single.exitCode, 0) << single.err;
  EXPECT_EQ(multi.exitCode, 0) << multi.err;
  const size_t line = multi.err.find("[rank 0/2] [info] runner: 2 decoder layers");
  EXPECT_NE(line, std::string::npos) << multi.err;
  EXPECT_NE(multi.err.find(" split over 2 ranks [DTS]", line), std::string::npos) << multi.err;
  if (single.exitCode == 0 && multi.exitCode == 0) expectSameCheckpoint(one, two);
  return {std::move(single), std::move(multi)};
}

// A split run with lm_head quantized: every rank runs the non-layer unit, so its modules count
// once, not once per rank, in the summary line that adds up the ranks' layers.
TEST(QuantMultirank, ASplitRunCountsTheNonLayerModulesOnce) {
  const auto [single, multi] = oneAndTwoSplitRanks("head", pipelineFile("w8a8_head.yaml", kW8A8));
  // 2 layers × 7 Linears and lm_head.
  const std::string count = "linear_quant: 15 Linear modules";
  EXPECT_NE(single.err.find("[info] " + count), std::string::npos) << single.err;
  for (const char* rank : {"[rank 0/2] [info] ", "[rank 1/2] [info] "}) {
    EXPECT_NE(multi.err.find(rank + count), std::string::npos) << multi.err;
  }
  // A step acts on lm_head, so the non-layer modules are written after the layers, by rank 0.
  EXPECT_NE(multi.err.find("[rank 0/2] [info] runner: 2 decoder layers split over 2 ranks [DTS] tasks=2 "),
            std::string::npos)
      << multi.err;
}

// A `group` of data-free steps (a scheme per kind of module) splits its layers like one step.
TEST(QuantMultirank, AGroupOfDataFreeStepsSplitsItsLayers) {
  oneAndTwoSplitRanks("group", pipelineFile("group.yaml", R"(    - type: group
      configs:
        - type: linear_quant
          qconfig:
            act: {dtype: int8, scope: per_token, symmetric: True, method: minmax}
            weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
          include: ["*self_attn*"]
        - type: linear_quant
          qconfig:
            weight: {dtype: int4, scope: per_group, symmetric: True, method: minmax, ext: {group_size: 8}}
          include: ["*mlp*"]
)"));
}

// By default each rank runs cores / ranks threads, so on a two-core machine one rank runs two
// threads and each of two ranks one (given here, as a busy machine could change the default).
// MKL's fp32 GEMM splits long sums by thread unless asked not to (seen on an Intel Xeon host,
// where this iterative smoothing's checkpoints differed): the CLI asks it. MKL documents that
// strict mode for its Intel code paths only. flex_smooth_quant adds its searches' losses, whose
// sums are made the same way on any thread count.
TEST(QuantMultirank, RanksOfOtherThreadCountsWriteTheCheckpointOfOne) {
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel") == 0) GTEST_SKIP() << "MKL's strict mode covers Intel CPUs only";
  const fs::path model = fs::path(QPIPE_SOURCE_DIR) / ".cache/models/smollm2-135m";
  ASSERT_TRUE(fs::exists(model / "config.json")) << model << " is missing: run tools/setup.sh";
  const fs::path dir = qpipe::test::testDir();
  const fs::path one = dir / "default-threads-one", two = dir / "default-threads-two";
  for (const char* practice : {"w8a8_iter_smooth.yaml", "w8a8_static_flex_smooth.yaml"}) {
    SCOPED_TRACE(practice);
    fs::remove_all(one);
    fs::remove_all(two);
    const std::string args = "quant --model_path " + quote(model) + " --config_path " +
                             quote(fs::path(QPIPE_SOURCE_DIR) / "configs/default" / practice) +
                             " --calib_samples 8 --seq_len 128 --dist_timeout 30 --save_path ";
    const CommandResult single = qpipe::test::runQpipe(args + quote(one) + " --device cpu:0 --threads_per_rank 2");
    ASSERT_EQ(single.exitCode, 0) << single.err;
    const CommandResult multi = qpipe::test::runQpipe(args + quote(two) + " --device cpu:0,1 --threads_per_rank 1");
    ASSERT_EQ(multi.exitCode, 0) << multi.err;
    expectSameCheckpoint(one, two);
  }
  fs::remove_all(one);
  fs::remove_all(two);
}

// flex_awq_ssz's α candidates are the parallel tasks (docs/scheduler.md, "Splitting a search"):
// each rank takes some of them, and the report records each candidate as run once.
TEST(QuantMultirank, TheSmoothingSearchSplitsItsCandidatesOverTheRanks) {
  const fs::path model = qpipe::test::tinyQwen3("qwen3");
  const fs::path out = qpipe::test::testDir() / "flex-awq-two";
  fs::remove_all(out);
  const fs::path config = fs::path(QPIPE_SOURCE_DIR) / "configs/default/w4a8_flex_awq.yaml";
  const CommandResult multi =
      qpipe::test::runQpipe(quantArgs(model, out, "--config_path " + config.string() + " --device cpu:0,1"));
  ASSERT_EQ(multi.exitCode, 0) << multi.err;
  // "flex_awq_ssz: subgraphs [DTS] tasks=T … my_tasks=M": M counts the choices and fusions (local:
  // every rank runs them) and the candidates this rank took, so M < T on both ranks says that
  // each rank left some candidates to the other.
  for (const int rank : {0, 1}) {
    const std::string head = "[rank " + std::to_string(rank) + "/2] [info] flex_awq_ssz: subgraphs [DTS] tasks=";
    const size_t line = multi.err.find(head);
    ASSERT_NE(line, std::string::npos) << multi.err;
    const size_t mine = multi.err.find("my_tasks=", line);
    ASSERT_NE(mine, std::string::npos) << multi.err;
    EXPECT_LT(std::stol(multi.err.substr(mine + 9)), std::stol(multi.err.substr(line + head.size())))
        << multi.err.substr(line, 200);
  }
  std::ifstream file(out / "quant_report.json");
  const nlohmann::json report = nlohmann::json::parse(file);
  int candidates = 0;
  for (const auto& layer : report["layers"]) {
    if (!layer.contains("values")) continue;
    for (const auto& [module, values] : layer["values"].items()) {
      for (const auto& [key, value] : values.items()) {
        if (key.rfind("dts:flex_awq_ssz.candidate#", 0) != 0 || !key.ends_with(":parallel")) continue;
        ++candidates;
        EXPECT_EQ(value.get<double>(), 1.0) << module << " " << key;
      }
    }
  }
  // 21 values of α for each of a layer's subgraphs.
  EXPECT_GT(candidates, 0);
  EXPECT_EQ(candidates % 21, 0);
}

// learnable_scale_qat on 2 and 3 ranks (4 samples: 2 + 2, and 2 + 1 + 1), each step drawing 3 of
// them across the ranks: the checkpoint, the scales artifact and the training log are the one
// rank's byte for byte. Blockwise with an fa3_quant step and kv_scale, and end2end with CAKLD.
TEST(QuantMultirank, QatOnTwoAndThreeRanksTrainsTheOneRankScales) {
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path dir = qpipe::test::testDir();
  const std::string qat = R"(    - type: learnable_scale_qat
      qconfig:
        act: {dtype: int8, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
      learning_rate: 1.0e-2
      max_steps: 3
      per_device_train_batch_size: 3
)";
  const std::string fa3 = R"(    - type: fa3_quant
      details:
        fa_k: {dtype: int8, scope: per_head, symmetric: True, method: minmax}
        fa_v: {dtype: int8, scope: per_head, symmetric: True, method: minmax}
)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"blockwise", fa3 + qat + "      plugin_config: {quant_config: {learnable: {act_scale: True, kv_scale: True}}}\n"},
      {"end2end", qat + "      training_mode: end2end\n      loss_type: cakld\n"}};
  for (const auto& [mode, process] : cases) {
    SCOPED_TRACE(mode);
    const fs::path pipeline = pipelineFile("qat_" + mode + ".yaml", process);
    const auto runOn = [&](const std::string& devices) {
      const fs::path out = dir / ("qat-" + mode + "-" + std::to_string(devices.size()));
      fs::remove_all(out);
      const CommandResult r =
          qpipe::test::runQpipe(quantArgs(model, out, "--config_path " + quote(pipeline) + " --device " + devices));
      EXPECT_EQ(r.exitCode, 0) << r.err;
      return out;
    };
    const fs::path one = runOn("cpu:0");
    for (const std::string devices : {"cpu:0,1", "cpu:0,1,2"}) {
      SCOPED_TRACE(devices);
      const fs::path many = runOn(devices);
      expectSameCheckpoint(one, many);
      for (const char* suffix : {".qat_scales.safetensors", ".qat_log.jsonl"}) {
        EXPECT_EQ(qpipe::test::slurp(one.string() + suffix), qpipe::test::slurp(many.string() + suffix)) << suffix;
      }
    }
  }
}

// save_steps saves the training state; a run resuming from it, on another number of ranks, writes
// the checkpoint and scales of the run that did not stop. The state the one-rank run leaves is its
// last: blockwise, layer 0 finished and layer 1 at step 4 of 5; end2end, step 4 of 5.
TEST(QuantMultirank, QatResumedFromATrainingStateOnOtherRankCountsEndsWhereTheUnstoppedRunDoes) {
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path dir = qpipe::test::testDir();
  const std::string qat = R"(    - type: learnable_scale_qat
      qconfig:
        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
      learning_rate: 1.0e-2
      max_steps: 5
      per_device_train_batch_size: 3
      save_steps: 2
      plugin_config: {quant_config: {learnable: {act_scale: True}}}
)";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"blockwise", "", "cpu:0,1"},
      {"end2end", "      training_mode: end2end\n      loss_type: kl_top_20\n", "cpu:0,1,2"}};
  for (const auto& [mode, extra, devices] : cases) {
    SCOPED_TRACE(mode);
    const fs::path full = dir / ("qat-unstopped-" + mode), resumed = dir / ("qat-resumed-" + mode);
    const fs::path state = dir / ("qat-state-" + mode + ".safetensors");
    fs::remove_all(full);
    fs::remove_all(resumed);
    const CommandResult first = qpipe::test::runQpipe(quantArgs(
        model, full,
        "--config_path " + quote(pipelineFile("qat_save_" + mode + ".yaml", qat + extra)) + " --device cpu:0"));
    ASSERT_EQ(first.exitCode, 0) << first.err;
    fs::copy_file(full.string() + ".qat_state.safetensors", state, fs::copy_options::overwrite_existing);
    const auto saved = qpipe::safetensors::File::open(state);
    EXPECT_EQ(saved->metadata().at("qpipe.qat.state.step"), "4");
    EXPECT_EQ(saved->metadata().at("qpipe.qat.state.unit"), mode == "blockwise" ? "model.layers.1" : "");
    EXPECT_EQ(saved->metadata().at("qpipe.qat.state.finished"), mode == "blockwise" ? "model.layers.0" : "");
    const std::string resume = qat + extra + "      resume_from: " + state.string() + "\n";
    const CommandResult second = qpipe::test::runQpipe(quantArgs(
        model, resumed,
        "--config_path " + quote(pipelineFile("qat_resume_" + mode + ".yaml", resume)) + " --device " + devices));
    ASSERT_EQ(second.exitCode, 0) << second.err;
    expectSameCheckpoint(full, resumed);
    EXPECT_EQ(qpipe::test::slurp(full.string() + ".qat_scales.safetensors"),
              qpipe::test::slurp(resumed.string() + ".qat_scales.safetensors"));
    // Continuing exactly needs the settings the state was saved with.
    std::string changed = resume;
    changed.replace(changed.find("learning_rate: 1.0e-2"), 21, "learning_rate: 2.0e-2");
    const CommandResult refused = qpipe::test::runQpipe(
        quantArgs(model, dir / "qat-refused",
                  "--config_path " + quote(pipelineFile("qat_refused.yaml", changed)) + " --device cpu:0"));
    EXPECT_EQ(refused.exitCode, code(ErrorCode::kConfig)) << refused.err;
    EXPECT_NE(lastLine(refused.err)
                  .find("is a training state saved with 'learning_rate: 0.01', but this run has "
                        "'learning_rate: 0.02': continuing it needs the settings it was saved with"),
              std::string::npos)
        << refused.err;
  }
}

// Split layers: a layer that fails on whichever rank runs it fails the run on every rank, naming
// the layer's task, and leaves nothing at --save_path (the segments lie in the partial folder).
TEST(QuantMultirank, ASplitLayerThatFailsStopsTheRunAndLeavesNothing) {
  const fs::path out = qpipe::test::testDir() / "quantized";
  fs::remove_all(out);
  const fs::path pipeline = pipelineFile(
      "split_fault.yaml", kW8A8 + "    - {type: rank_fault, fail_in_layer: 1, layers_independent: True}\n");
  const CommandResult r = qpipe::test::runQpipe(
      quantArgs(qpipe::test::tinyLlama("llama"), out,
                "--config_path " + quote(pipeline) + " --plugin_dir " + quote(kFixturePlugins) + " --device cpu:0,1"));
  EXPECT_EQ(r.exitCode, code(ErrorCode::kPlugin)) << r.err;
  const std::string last = lastLine(r.err);
  // Both ranks fail with the task's message, and the last line says so rather than naming one.
  EXPECT_EQ(last.rfind("qpipe: plugin error: ranks 0 and 1 failed: scheduler 'runner': task runner.layer {layer: 1} "
                       "failed on rank ",
                       0),
            0u)
      << r.err;
  EXPECT_NE(last.find(": processor 'rank_fault' (plugin 'rank_fault') failed in preprocess(model.layers.1): injected "
                      "failure on rank "),
            std::string::npos)
      << r.err;
  expectNothingSaved(out);
}

TEST(QuantMultirank, TorchrunStyleRanksWriteTheLauncherCheckpoint) {
  const fs::path dir = qpipe::test::testDir();
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path launched = dir / "launched", external = dir / "external";
  fs::remove_all(launched);
  fs::remove_all(external);
  const CommandResult r = qpipe::test::runQpipe(quantArgs(model, launched, "--quant_type w8a8 --device cpu:0,1"));
  ASSERT_EQ(r.exitCode, 0) << r.err;

  // As `torchrun --no-python --nproc_per_node 2 qpipe quant …` starts them: no --device list.
  const std::string port = std::to_string(qpipe::test::freePort());
  std::vector<Process> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.push_back(start("rank" + std::to_string(rank), quantArgv(model, external, "--quant_type w8a8"),
                          {"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank), "WORLD_SIZE=2",
                           "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port}));
  }
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(waitFor(ranks[rank], std::chrono::seconds(60)), 0) << qpipe::test::slurp(ranks[rank].err);
  }
  EXPECT_NE(qpipe::test::slurp(ranks[1].err)
                .find("[rank 1/2] [info] runner: 2 decoder layers and the non-layer modules split over 2 ranks"),
            std::string::npos)
      << qpipe::test::slurp(ranks[1].err);
  EXPECT_EQ(qpipe::test::slurp(ranks[1].out), "") << "only rank 0 prints the summary";
  expectSameCheckpoint(launched, external);
}

// ---------------------------------------------------------------------------------------------
// Refusals, before any rank starts.

TEST(QuantMultirank, ProcessorWithoutMultirankSupportIsRefusedBeforeTheModelLoads) {
  // A model folder without weights: only a refusal before loading gives a usage error.
  const fs::path model = qpipe::test::testDir() / "config-only";
  fs::create_directories(model);
  std::ofstream(model / "config.json") << R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4})";
  const fs::path out = qpipe::test::testDir() / "quantized";
  const fs::path pipeline = pipelineFile("single.yaml", kW8A8 + "    - type: single_rank_only\n");
  const std::string args = "--config_path " + quote(pipeline) + " --plugin_dir " + quote(kFixturePlugins);
  const CommandResult r = qpipe::test::runQpipe(quantArgs(model, out, args + " --device cpu:0,1"));
  EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage)) << r.err;
  EXPECT_EQ(r.err,
            "qpipe: usage error: spec.process[1] (single_rank_only) does not support multi-rank runs; use one "
            "device\n");
  // Inside a group, the child is named, not the group.
  const fs::path grouped = pipelineFile("grouped.yaml",
                                        "    - type: group\n      configs:\n        - type: "
                                        "linear_quant\n          qconfig: {weight: {}}\n"
                                        "        - type: single_rank_only\n");
  const CommandResult g = qpipe::test::runQpipe(quantArgs(
      model, out, "--config_path " + quote(grouped) + " --plugin_dir " + quote(kFixturePlugins) + " --device cpu:0,1"));
  EXPECT_EQ(g.exitCode, code(ErrorCode::kUsage)) << g.err;
  EXPECT_EQ(g.err,
            "qpipe: usage error: spec.process[0].configs[1] (single_rank_only) does not support multi-rank runs; use "
            "one device\n");
  // One device runs it (and gets as far as the missing weights).
  const CommandResult one = qpipe::test::runQpipe(quantArgs(model, out, args + " --device cpu:0"));
  EXPECT_EQ(one.exitCode, code(ErrorCode::kInput)) << one.err;
  expectNothingSaved(out);
}

// spec.runner layer_wise is a one-process runner: several ranks are refused before any starts,
// naming the file and line; dp_layer_wise runs them. (model_wise runs on every rank: the
// equivalence test runs msmodelslim's default-w8a8, which names it, on 1, 2 and 3.)
TEST(QuantMultirank, TheLayerWiseRunnerIsRefusedOnSeveralRanks) {
  const fs::path model = qpipe::test::tinyLlama("llama");
  for (const std::string runner : {"layer_wise"}) {
    const fs::path out = qpipe::test::testDir() / ("runner-" + runner);
    const fs::path pipeline = qpipe::test::writeTempFile(
        runner + ".yaml", "apiversion: modelslim_v1\nspec:\n  runner: " + runner + "\n  process:\n" + kW8A8);
    const CommandResult r =
        qpipe::test::runQpipe(quantArgs(model, out, "--config_path " + quote(pipeline) + " --device cpu:0,1"));
    EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage)) << r.err;
    EXPECT_EQ(r.err, "qpipe: usage error: " + pipeline.string() + ":3:11: spec.runner: " + runner +
                         " runs on one device; use dp_layer_wise or auto for 2 ranks\n");
    expectNothingSaved(out);
  }
}

// A rank started by another launcher refuses it too, on its own, before it joins the group.
TEST(QuantMultirank, TorchrunStyleRankRefusesAProcessorWithoutMultirankSupport) {
  const fs::path out = qpipe::test::testDir() / "quantized";
  const fs::path pipeline = pipelineFile("single.yaml", kW8A8 + "    - type: single_rank_only\n");
  const Process rank = start(
      "rank1",
      quantArgv(qpipe::test::tinyLlama("llama"), out,
                "--config_path " + pipeline.string() + " --plugin_dir " + kFixturePlugins.string()),
      {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(qpipe::test::freePort())});
  EXPECT_EQ(waitFor(rank, std::chrono::seconds(30)), code(ErrorCode::kUsage));
  EXPECT_EQ(lastLine(qpipe::test::slurp(rank.err)),
            "qpipe: usage error: [rank 1/2] spec.process[1] (single_rank_only) does not support multi-rank runs; use "
            "one device");
  expectNothingSaved(out);
}

// --dist_timeout bounds the rendezvous: rank 0 alone gives up on rank 1 after it, naming it.
TEST(QuantMultirank, DistTimeoutBoundsTheRendezvous) {
  const fs::path out = qpipe::test::testDir() / "quantized";
  const std::string port = std::to_string(qpipe::test::freePort());
  std::vector<std::string> args = quantArgv(qpipe::test::tinyLlama("llama"), out, "--quant_type w8a8");
  args.back() = "2";  // kTiny's --dist_timeout
  const auto begin = Clock::now();
  const Process rank = start("rank0", args, {"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port});
  const std::optional<int> exitCode = waitFor(rank, std::chrono::seconds(30));
  const std::string err = qpipe::test::slurp(rank.err);
  EXPECT_EQ(exitCode, code(ErrorCode::kDistributed)) << err;
  EXPECT_GT(Clock::now() - begin, std::chrono::seconds(2));
  EXPECT_LT(Clock::now() - begin, std::chrono::seconds(8));
  EXPECT_EQ(lastLine(err).rfind(
                "qpipe: distributed error: [rank 0/2] rank 1 did not join at 127.0.0.1:" + port + " within 2", 0),
            0u)
      << err;
  expectNothingSaved(out);
}

TEST(QuantMultirank, DeviceListErrorsAreUsageErrors) {
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path out = qpipe::test::testDir() / "quantized";
  fs::remove_all(out);
  const auto quant = [&](const std::string& device) {
    return qpipe::test::runQpipe(quantArgs(model, out, "--quant_type w8a8 --device " + device));
  };
  CommandResult r = quant("cpu:0,0");
  EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage));
  EXPECT_EQ(r.err,
            "qpipe: usage error: --device 'cpu:0,0' lists cpu:0 twice; give each device once (one rank per "
            "device)\n");
  for (const char* device : {"cpu:0,x", "cpu:0,01", "cpu:00", "cpu:0,"}) {
    r = quant(device);
    EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage)) << device;
    EXPECT_EQ(r.err, "qpipe: usage error: --device '" + std::string(device) +
                         "' is not cpu, cuda, cpu:0,1,… or cuda:N[,M,…]\n");
  }
  // The ranks' environment is refused before they start, and before the launcher makes its
  // folder of their error files; a process of a run of one (WORLD_SIZE=1) starts no ranks.
  const fs::path temp = qpipe::test::testDir() / "tmp";
  fs::remove_all(temp);
  fs::create_directories(temp);
  const std::string twoRanks = quantArgs(model, out, "--quant_type w8a8 --device cpu:0,1");
  const std::string noTimeout = "quant --model_path " + quote(model) + " --save_path " + quote(out) +
                                " --quant_type w8a8 --device cpu:0,1 --threads_per_rank 1";
  const std::vector<std::tuple<std::string, std::string, std::string>> refused = {
      {"QPIPE_RANK_START=spawn", twoRanks, "QPIPE_RANK_START='spawn' is not fork or exec"},
      {"QPIPE_DIST_SHM=no", twoRanks,
       "QPIPE_DIST_SHM='no' is neither 0 (ranks on one host talk over Gloo) nor 1 (through shared memory, the "
       "default)"},
      {"QPIPE_DIST_TIMEOUT_S=soon", noTimeout,
       "QPIPE_DIST_TIMEOUT_S='soon' is not a number of seconds in (0, 604800]; fix it, unset it or pass "
       "--dist_timeout"},
      {"RANK=0 WORLD_SIZE=1", twoRanks,
       "WORLD_SIZE=1 makes this process a run of one, but --device 'cpu:0,1' lists 2 devices; unset RANK and "
       "WORLD_SIZE to start a rank per device, or give one device"}};
  for (const auto& [env, command, message] : refused) {
    r = qpipe::test::runQpipe(command, env + " TMPDIR=" + quote(temp));
    EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage)) << env;
    EXPECT_EQ(lastLine(r.err), "qpipe: usage error: " + message) << r.err;
    EXPECT_TRUE(fs::is_empty(temp)) << env;
    expectNothingSaved(out);
  }
  // --dist_timeout wins over a bad QPIPE_DIST_TIMEOUT_S.
  r = qpipe::test::runQpipe(twoRanks, "QPIPE_DIST_TIMEOUT_S=soon");
  EXPECT_EQ(r.exitCode, 0) << r.err;
  fs::remove_all(out);
}

// Ranks started the torchrun way are each given their arguments: ranks given another pipeline, or
// another calibration setting, would each do their share of another run. Every rank refuses,
// naming the first difference, before the model loads.
TEST(QuantMultirank, TorchrunStyleRanksGivenOtherArgumentsAreRefused) {
  const fs::path model = qpipe::test::tinyLlama("llama");
  const fs::path out = qpipe::test::testDir() / "mixed";
  for (const auto& [rank1, difference] : std::vector<std::pair<std::string, std::string>>{
           {"--quant_type w8a16", "the pipeline w8a16.yaml"},
           {"--quant_type w8a8 --probe_tokens 8", "--probe_tokens 8 and rank 0 32"}}) {
    SCOPED_TRACE(rank1);
    fs::remove_all(out);
    const std::string port = std::to_string(qpipe::test::freePort());
    std::vector<Process> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.push_back(start("rank" + std::to_string(rank),
                            quantArgv(model, out, rank == 0 ? "--quant_type w8a8" : rank1),
                            {"RANK=" + std::to_string(rank), "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                             "MASTER_PORT=" + port, "QPIPE_DIST_TIMEOUT_S=30"}));
    }
    for (int rank = 0; rank < 2; ++rank) {
      const std::optional<int> exitCode = waitFor(ranks[rank], std::chrono::seconds(60));
      const std::string err = qpipe::test::slurp(ranks[rank].err);
      EXPECT_EQ(exitCode, code(ErrorCode::kUsage)) << err;
      const std::string line = lastLine(err);
      EXPECT_TRUE(
          line.starts_with("qpipe: usage error: [rank " + std::to_string(rank) + "/2] rank 1 was given " + difference))
          << line;
      EXPECT_TRUE(line.ends_with("; start every rank with the same arguments")) << line;
    }
    expectNothingSaved(out);
  }
}

TEST(QuantMultirank, OccupiedSavePathFailsOnRankZeroAndStopsTheOthers) {
  const fs::path out = qpipe::test::testDir() / "occupied";
  fs::create_directories(out);
  std::ofstream(out / "keep.txt") << "mine\n";
  const auto begin = Clock::now();
  const CommandResult r =
      qpipe::test::runQpipe(quantArgs(qpipe::test::tinyLlama("llama"), out, "--quant_type w8a8 --device cpu:0,1"));
  EXPECT_LT(Clock::now() - begin, kTimeout);
  EXPECT_EQ(r.exitCode, code(ErrorCode::kInput)) << r.err;
  EXPECT_EQ(lastLine(r.err), "qpipe: input error: rank 0 failed: save folder '" + out.string() +
                                 "' exists and is not empty; choose another --save_path or remove it")
      << r.err;
  EXPECT_EQ(qpipe::test::slurp(out / "keep.txt"), "mine\n");
}

TEST(QuantMultirank, AStaticRunNeedsACalibrationSampleOnEveryRank) {
  // A rank without samples would never reach the settle points of the staged forward, where the
  // others wait for its observers. --calib_samples below the rank count is refused before any
  // rank starts; a calibration file shorter than it, by every rank before the first layer.
  const fs::path out = qpipe::test::testDir() / "one_sample";
  const fs::path pipeline = pipelineFile("static.yaml", R"(    - type: linear_quant
      qconfig:
        act: {dtype: int8, scope: per_tensor, symmetric: False, method: minmax}
        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
      include: ["*"]
)");
  const std::string message =
      "1 calibration sample for 2 ranks: every rank needs one; give --calib_samples 2 or more, or use fewer devices";
  const auto quant = [&](const std::string& more) {
    return qpipe::test::runQpipe("quant --model_path " + quote(qpipe::test::tinyLlama("llama")) + " --save_path " +
                                 quote(out) + " --config_path " + quote(pipeline) +
                                 " --device cpu:0,1 --seq_len 32 --threads_per_rank 1 --dist_timeout 10 " + more);
  };
  CommandResult r = quant("--calib_samples 1");
  EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage)) << r.err;
  EXPECT_EQ(r.err, "qpipe: usage error: " + message + "\n");
  const fs::path text = qpipe::test::writeTempFile("short.txt", "A short text: one window of thirty-two tokens.\n");
  const auto begin = Clock::now();
  r = quant("--calib_samples 4 --calib_data " + quote(text));
  EXPECT_LT(Clock::now() - begin, kTimeout);
  EXPECT_EQ(r.exitCode, code(ErrorCode::kUsage)) << r.err;
  // Both ranks stop at the same check; the launcher names the one it heard from first.
  const std::string line = lastLine(r.err);
  EXPECT_TRUE(line.starts_with("qpipe: usage error: rank ")) << r.err;
  EXPECT_TRUE(line.ends_with(" failed: " + message)) << r.err;
  expectNothingSaved(out);
}

// ---------------------------------------------------------------------------------------------
// Failures midway.

TEST(QuantMultirank, RankThatRaisesStopsTheRunNamingIt) {
  const fs::path out = qpipe::test::testDir() / "quantized";
  fs::remove_all(out);
  const fs::path pipeline = pipelineFile(
      "raise.yaml", kW8A8 + "    - type: rank_fault\n      fail_on_rank: 1\n      message: calibration exploded\n");
  const auto begin = Clock::now();
  const CommandResult r = qpipe::test::runQpipe(
      quantArgs(qpipe::test::tinyLlama("llama"), out,
                "--config_path " + quote(pipeline) + " --plugin_dir " + quote(kFixturePlugins) + " --device cpu:0,1"));
  EXPECT_LT(Clock::now() - begin, kTimeout);
  EXPECT_EQ(r.exitCode, code(ErrorCode::kPlugin)) << r.err;
  EXPECT_EQ(lastLine(r.err),
            "qpipe: plugin error: rank 1 failed: processor 'rank_fault' (plugin 'rank_fault') failed in "
            "preprocess(model.layers.0): calibration exploded on rank 1")
      << r.err;
  // The rank's own report, with its place in the group.
  EXPECT_NE(r.err.find("[rank 1/2] [error] plugin error: processor 'rank_fault'"), std::string::npos) << r.err;
  expectNothingSaved(out);
}

// A two-rank run slow enough to disturb midway, started and caught once both ranks are saving.
struct SlowRun {
  fs::path out;
  Process launcher;
  std::vector<pid_t> ranks;  // empty when the run never reached saving (the test has failed)
};

// Two ranks running `pipeline` (by default one that sleeps 2 s a layer), once saving.
SlowRun startSlowRun(const fs::path& pipeline = slowPipeline(2)) {
  const fs::path out = qpipe::test::testDir() / "quantized";
  fs::remove_all(out);
  const Process launcher = start("launcher", quantArgv(qpipe::test::tinyLlama("llama"), out,
                                                       "--config_path " + pipeline.string() + " --plugin_dir " +
                                                           kFixturePlugins.string() + " --device cpu:0,1"));
  std::vector<pid_t> ranks = ranksOnceSaving(launcher, out);
  if (ranks.empty()) {
    waitFor(launcher, std::chrono::milliseconds(0));
    ADD_FAILURE() << "the run never reached saving: " << qpipe::test::slurp(launcher.err);
  }
  return {out, launcher, std::move(ranks)};
}

// Kills rank 1 of `run`: the launcher stops every rank within the timeout, naming the signal,
// and leaves nothing at --save_path.
void expectKilledRankStopsTheRun(const SlowRun& run) {
  const auto& [out, launcher, ranks] = run;
  if (ranks.empty()) return;
  const auto killed = Clock::now();
  ASSERT_EQ(::kill(ranks[1], SIGKILL), 0);
  const std::optional<int> exitCode = waitFor(launcher, std::chrono::seconds(30));
  EXPECT_LT(Clock::now() - killed, kTimeout);
  const std::string err = qpipe::test::slurp(launcher.err);
  EXPECT_EQ(exitCode, code(ErrorCode::kDistributed)) << err;
  EXPECT_EQ(lastLine(err), "qpipe: distributed error: rank 1 was killed by signal 9 (SIGKILL)") << err;
  EXPECT_FALSE(alive(ranks[0])) << "rank 0 outlived the launcher";
  expectNothingSaved(out);
}

TEST(QuantMultirank, KilledRankStopsTheRunWithinTheTimeout) {
  expectKilledRankStopsTheRun(startSlowRun());
}

// 20000 steps a layer: seconds of training, in which a rank is killed once the saver's folder is
// there. The allReduce of the next step's gradients fails on the other rank, and the run stops
// as any other run does.
TEST(QuantMultirank, KilledRankStopsQatTrainingWithinTheTimeout) {
  const SlowRun run = startSlowRun(pipelineFile("long_qat.yaml", R"(    - type: learnable_scale_qat
      qconfig:
        weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}
      max_steps: 20000
)"));
  expectKilledRankStopsTheRun(run);
}

TEST(QuantMultirank, InterruptStopsEveryRank) {
  const auto [out, launcher, ranks] = startSlowRun();
  if (ranks.empty()) return;
  const auto interrupted = Clock::now();
  ASSERT_EQ(::kill(launcher.pid, SIGINT), 0);
  const std::optional<int> exitCode = waitFor(launcher, std::chrono::seconds(30));
  EXPECT_LT(Clock::now() - interrupted, std::chrono::seconds(5));
  const std::string err = qpipe::test::slurp(launcher.err);
  EXPECT_EQ(exitCode, 130) << err;
  EXPECT_EQ(lastLine(err), "qpipe: interrupted: SIGINT received; all ranks stopped") << err;
  for (pid_t rank : ranks) EXPECT_FALSE(alive(rank)) << "rank pid " << rank << " is still running";
  expectNothingSaved(out);
}

}  // namespace
