#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "commands.h"
#include "cpu_load.h"
#include "launch.h"
#include "option_checks.h"
#include "plugin_options.h"
#include "qpipe/device.h"
#include "qpipe/dist/process_group.h"
#include "qpipe/error.h"
#include "qpipe/host/quantize.h"
#include "qpipe/log.h"

namespace qpipe::cli {

namespace {

namespace fs = std::filesystem;

struct QuantOptions {
  std::string modelPath;
  std::string savePath;
  std::string modelType;
  std::string quantType;
  std::string configPath;
  std::string device = "cpu";
  bool trustRemoteCode = false;
  bool allowNonFinite = false;
  std::string calibData;
  int64_t calibSamples = 128;
  int64_t seqLen = 512;
  int64_t probeTokens = 32;
  std::optional<double> distTimeoutSeconds;  // unset: QPIPE_DIST_TIMEOUT_S, else 60
  std::optional<int> threadsPerRank;         // unset: the cores shared among this host's ranks
  PluginOptions plugins;
};

// Where this process stands: alone, the parent of local ranks, or one rank of a group.
struct Role {
  std::optional<dist::GroupOptions> group;  // set for a rank
  int worldSize = 1;                        // ranks of the run (the launcher's children for a parent)
  bool launcher = false;
  int localWorldSize = 1;  // the ranks sharing this host's cores
};

// --dist_timeout, where given.
std::optional<std::chrono::milliseconds> explicitTimeout(const QuantOptions& options) {
  if (!options.distTimeoutSeconds) return std::nullopt;
  return std::chrono::milliseconds(static_cast<int64_t>(*options.distTimeoutSeconds * 1000));
}

Role roleOf(const QuantOptions& options, const DeviceList& devices) {
  Role role;
  role.group = dist::optionsFromEnvironment(explicitTimeout(options));
  if (role.group && role.group->worldSize <= 1) {
    // A group of one is the one-process path; it launches nothing, whatever --device lists.
    QPIPE_REQUIRE(devices.ranks() <= 1, ErrorCode::kUsage,
                  "WORLD_SIZE=1 makes this process a run of one, but --device '", devices.text, "' lists ",
                  devices.ranks(),
                  " devices; unset RANK and WORLD_SIZE to start a rank per device, or give one device");
    role.group.reset();
    return role;
  }
  if (!role.group) {
    role.launcher = devices.ranks() > 1;
    role.worldSize = devices.ranks();
    return role;
  }
  role.worldSize = role.group->worldSize;
  // LOCAL_WORLD_SIZE (torchrun, our launcher), else the --device list, else every rank.
  role.localWorldSize = role.group->localWorldSize.value_or(devices.ranks() > 1 ? devices.ranks() : role.worldSize);
  return role;
}

std::chrono::milliseconds distTimeout(const QuantOptions& options) {
  if (const auto timeout = explicitTimeout(options)) return *timeout;
  return dist::timeoutFromEnvironment().value_or(std::chrono::seconds(60));
}

// The device of this process: the --device entry at its local rank; for a bare `cuda` on a
// rank, GPU LOCAL_RANK.
c10::Device rankDevice(const DeviceList& devices, const Role& role) {
  if (devices.type == c10::DeviceType::CPU) return c10::Device(c10::kCPU);
  const int localRank = role.group ? role.group->localRank : 0;
  if (devices.indices.empty()) return parseDevice(role.group ? "cuda:" + std::to_string(localRank) : "cuda");
  QPIPE_REQUIRE(localRank < static_cast<int>(devices.indices.size()), ErrorCode::kUsage, "--device '", devices.text,
                "' lists ", devices.indices.size(), " devices for local rank ", localRank,
                "; list one per rank on this host (e.g. cuda:0,1) or give cuda (GPU LOCAL_RANK)");
  return parseDevice("cuda:" + std::to_string(devices.indices[localRank]));
}

// The cores this process may run on (its affinity mask), at least 1.
int usableCores() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// A folder shipped with qpipe (configs/, data/): $QPIPE_HOME/<name>, else the source tree this
// binary was built from.
fs::path resourceDir(const std::string& name) {
  if (const char* home = std::getenv("QPIPE_HOME"); home != nullptr && *home != '\0') {
    QPIPE_REQUIRE(fs::is_directory(home), ErrorCode::kUsage, "QPIPE_HOME '", home,
                  "' is not a folder; point it at qpipe's configs/ and data/, or unset it");
    return fs::path(home) / name;
  }
  return fs::path(QPIPE_SOURCE_DIR) / name;
}

void run(const QuantOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const auto logger = log::logger();
  // Past a few a core, threads only wait for each other: 4,096 on two cores took minutes for a run
  // of a second. Checked before any rank starts.
  constexpr int kThreadsPerCore = 4;
  const int threadLimit = kThreadsPerCore * usableCores();
  QPIPE_REQUIRE(options.threadsPerRank.value_or(1) <= threadLimit, ErrorCode::kUsage, "--threads_per_rank ",
                *options.threadsPerRank, " is more than ", kThreadsPerCore, " threads a core on the ", usableCores(),
                " cores this process may use; give at most ", threadLimit);
  const DeviceList devices = parseDeviceList(options.device);
  const Role role = roleOf(options, devices);
  const int rank = role.group ? role.group->rank : 0;
  if (role.group) {
    markRank(rank, role.worldSize);
    log::setRank(rank, role.worldSize);
  }
  if (options.trustRemoteCode && rank == 0) {
    logger->info("--trust_remote_code: qpipe runs no model code from the checkpoint");
  }
  QuantizeOptions quant{.modelPath = options.modelPath,
                        .savePath = options.savePath,
                        .configPath = options.configPath,
                        .quantType = options.quantType,
                        .modelType = options.modelType,
                        .practiceDir = resourceDir("configs"),
                        .calibData = options.calibData,
                        .defaultCalibData = resourceDir("data") / "calib.jsonl",
                        .calibSamples = options.calibSamples,
                        .seqLen = options.seqLen,
                        .probeTokens = options.probeTokens,
                        .checkFinite = !options.allowNonFinite,
                        .pluginPath = pluginSearchPath(options.plugins),
                        .rank = rank,
                        .worldSize = role.worldSize};
  if (role.launcher) {
    // Everything about the pipeline, and the environment the ranks inherit, is checked before
    // any rank starts.
    checkQuantize(quant);
    dist::sharedMemoryAllowed();
    const bool forked = launchRanks({.worldSize = role.worldSize,
                                     .timeout = distTimeout(options),
                                     .savePath = options.savePath,
                                     .fork = devices.type == c10::DeviceType::CPU});
    // A forked rank has its rank's environment now: the rank flow, as a fresh copy would run it.
    if (forked) run(options);
    return;
  }

  quant.device = rankDevice(devices, role);
  if (quant.device.is_cuda()) c10::impl::getDeviceGuardImpl(quant.device.type())->setDevice(quant.device);
  if (role.group || options.threadsPerRank) {
    const int threads = options.threadsPerRank.value_or(std::max(1, usableCores() / role.localWorldSize));
    at::set_num_threads(threads);  // intra-op pool and OpenMP
    logger->info("device ", quant.device.str(), ", ", threads, " threads");
    // OpenMP's threads spin while they wait for work: more of them than cores, and each rank's
    // parallel regions wait for threads the other ranks' spinning keeps off the cores (2 ranks of
    // 2 threads on 2 cores: 9-20x slower than of 1).
    const int cores = usableCores();
    if ((!role.group || role.group->localRank == 0) && threads > 1 && threads * role.localWorldSize > cores) {
      logger->warn(role.group ? concat(role.localWorldSize, " ranks x ", threads, " threads on ", cores,
                                       " cores: the ranks will wait for each other's threads")
                              : concat(threads, " threads on ", cores, " cores: the threads will wait for each other"),
                   ", many times slower; give --threads_per_rank ", std::max(1, cores / role.localWorldSize),
                   " or set OMP_WAIT_POLICY=passive");
    }
  } else if (const int busy = coresBusyElsewhere(); busy > 0) {
    // A thread whose core another process holds stalls every parallel region of the run: beside
    // one busy process a data-free W8A8 run took 2.4-2.6x its quiet time with two threads, 1.3x
    // with one (docs/benchmarks.md). One process alone: ranks starting together would count
    // each other.
    const int cores = usableCores();
    const int threads = std::max(1, cores - busy);
    at::set_num_threads(threads);
    // Debug: a bad input stays a one-line error on a busy machine too.
    logger->debug(std::min(busy, cores), " of ", cores, " cores busy with other work: ", threads,
                  threads == 1 ? " thread" : " threads", " (--threads_per_rank sets the count)");
  }
  if (role.group) {
    // A peer that fails closes its sockets; writing to one must be an error this rank reports
    // (a distributed error, which echoes the peer's), not a death by SIGPIPE, which the launcher
    // would take for the cause of the run's failure.
    ::signal(SIGPIPE, SIG_IGN);
    quant.joinGroup = [&role] {
      std::shared_ptr<ProcessGroup> group = dist::connect(*role.group);
      markGroup(group);
      return group;
    };
  }
  const QuantizeResult result = quantize(quant);
  if (!result.saved) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << result.report.summary() << "saved " << result.saver << " checkpoint to " << options.savePath << " in "
            << seconds << " s (report: quant_report.json)\n";
}

}  // namespace

Subcommand setupQuant(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("quant", "Quantize a model with a pipeline and save the checkpoint");
  auto options = std::make_shared<QuantOptions>();
  app->add_option("--model_path", options->modelPath, "Model folder (config.json, safetensors, tokenizer.json)")
      ->required()
      ->check(path());
  app->add_option("--save_path", options->savePath, "Output folder; must not exist or be empty")
      ->required()
      ->check(path());
  app->add_option("--model_type", options->modelType,
                  "Model family for practice lookup (configs/<model_type>/); default: config.json's model_type");
  auto* quantType = app->add_option(
      "--quant_type", options->quantType,
      "w<W>a<A>[c8|f4|f8][s][_fp8|_nvfp4|_mxfp4][_static], e.g. w8a8, w4a16, w8a8_fp8, w8a8_static (docs/pipeline.md)");
  auto* configPath =
      app->add_option("--config_path", options->configPath, "Pipeline YAML instead of --quant_type")->check(path());
  quantType->excludes(configPath);
  configPath->excludes(quantType);
  app->add_option("--device", options->device,
                  "cpu, cuda, cuda:N, or several for one rank each: cpu:0,1,2,3, cuda:0,1 (docs/multirank.md)")
      ->capture_default_str();
  app->add_option("--dist_timeout", options->distTimeoutSeconds,
                  "Seconds a multi-rank run waits for a rendezvous or a collective; default "
                  "QPIPE_DIST_TIMEOUT_S, else 60")
      ->check(number(0.001, 604800));
  app->add_option("--threads_per_rank", options->threadsPerRank,
                  "Intra-op (and OpenMP) threads of each rank; default: the cores divided among this host's ranks "
                  "(one process: the cores other processes do not keep busy)")
      ->check(wholeNumber(1, 4096));
  app->add_flag("--trust_remote_code", options->trustRemoteCode, "Accepted for msmodelslim compatibility");
  app->add_flag("--allow_non_finite", options->allowNonFinite,
                "Load weights holding NaN or Inf and save what they give (checked and refused by default)");
  app->add_option("--calib_data", options->calibData,
                  "Calibration texts (.jsonl/.json/.txt); default: the pipeline's dataset, else data/calib.jsonl")
      ->check(path());
  app->add_option("--calib_samples", options->calibSamples, "Calibration windows")
      ->capture_default_str()
      ->check(wholeNumber(1));
  app->add_option("--seq_len", options->seqLen, "Tokens per calibration window")
      ->capture_default_str()
      ->check(wholeNumber(1, int64_t{1} << 20));
  app->add_option("--probe_tokens", options->probeTokens,
                  "Tokens of the first calibration window on which the report measures each layer's and "
                  "module's error (about three forwards of them per layer); 0: no errors in the report")
      ->capture_default_str()
      ->check(wholeNumber(0, int64_t{1} << 20));
  addPluginOptions(*app, options->plugins);
  app->callback([app, quantType, configPath] {
    if (quantType->count() == 0 && configPath->count() == 0) {
      throw CLI::RequiredError("one of --quant_type or --config_path");
    }
  });
  return {app, [options] { run(*options); }};
}

}  // namespace qpipe::cli
