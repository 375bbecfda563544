#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "commands.h"
#include "launch.h"
#include "plugin_options.h"
#include "qpipe/dataset.h"
#include "qpipe/device.h"
#include "qpipe/dist/process_group.h"
#include "qpipe/error.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/perplexity.h"
#include "qpipe/pipeline.h"
#include "qpipe/practice.h"
#include "qpipe/registry.h"
#include "qpipe/report.h"
#include "qpipe/runner.h"
#include "qpipe/saver.h"
#include "qpipe/tokenizer.h"

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
  std::string calibData;
  int64_t calibSamples = 128;
  int64_t seqLen = 512;
  std::optional<double> distTimeoutSeconds;  // unset: QPIPE_DIST_TIMEOUT_S, else 60
  std::optional<int> threadsPerRank;         // unset: the cores shared among this host's ranks
  PluginOptions plugins;
};

// Where this process stands: alone, the parent of local ranks, or one rank of a group.
struct Role {
  std::optional<dist::GroupOptions> group;  // set for a rank
  int worldSize = 1;                        // ranks of the run (the launcher's children for a parent)
  bool launcher = false;
  int localRank = 0;
  int localWorldSize = 1;
};

std::optional<int> intFromEnvironment(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  try {
    size_t end = 0;
    const int parsed = std::stoi(value, &end);
    if (end == std::string(value).size() && parsed >= 0) return parsed;
  } catch (const std::exception&) {
  }
  throw Error(ErrorCode::kDistributed, detail::concat(name, "='", value, "' is not a non-negative integer"));
}

Role roleOf(const QuantOptions& options, const DeviceList& devices) {
  Role role;
  role.group = dist::optionsFromEnvironment();
  if (role.group && role.group->worldSize <= 1) role.group.reset();  // a group of one is the one-process path
  if (!role.group) {
    role.launcher = devices.ranks() > 1;
    role.worldSize = devices.ranks();
    return role;
  }
  if (options.distTimeoutSeconds) {
    role.group->timeout = std::chrono::milliseconds(static_cast<int64_t>(*options.distTimeoutSeconds * 1000));
  }
  role.worldSize = role.group->worldSize;
  role.localRank = intFromEnvironment("LOCAL_RANK").value_or(role.group->rank);
  // The ranks sharing this host's cores: LOCAL_WORLD_SIZE (torchrun, our launcher), else the
  // --device list, else every rank.
  role.localWorldSize =
      intFromEnvironment("LOCAL_WORLD_SIZE").value_or(devices.ranks() > 1 ? devices.ranks() : role.group->worldSize);
  role.localWorldSize = std::max(1, role.localWorldSize);
  return role;
}

std::chrono::milliseconds distTimeout(const QuantOptions& options) {
  if (options.distTimeoutSeconds) {
    return std::chrono::milliseconds(static_cast<int64_t>(*options.distTimeoutSeconds * 1000));
  }
  // optionsFromEnvironment reads QPIPE_DIST_TIMEOUT_S; it needs RANK and WORLD_SIZE to answer.
  if (const char* seconds = std::getenv("QPIPE_DIST_TIMEOUT_S"); seconds != nullptr && *seconds != '\0') {
    try {
      size_t end = 0;
      const double value = std::stod(seconds, &end);
      if (end == std::string(seconds).size() && value > 0 && value <= 604800) {
        return std::chrono::milliseconds(static_cast<int64_t>(value * 1000));
      }
    } catch (const std::exception&) {
    }
    throw Error(ErrorCode::kDistributed,
                detail::concat("QPIPE_DIST_TIMEOUT_S='", seconds, "' is not a number of seconds in (0, 604800]"));
  }
  return std::chrono::seconds(60);
}

// The device of this process: the --device entry at its local rank; for a bare `cuda` on a
// rank, GPU LOCAL_RANK.
c10::Device rankDevice(const DeviceList& devices, const Role& role) {
  if (devices.type == c10::DeviceType::CPU) return c10::Device(c10::kCPU);
  if (devices.indices.empty()) return parseDevice(role.group ? "cuda:" + std::to_string(role.localRank) : "cuda");
  QPIPE_REQUIRE(role.localRank < static_cast<int>(devices.indices.size()), ErrorCode::kUsage, "--device '",
                devices.text, "' lists ", devices.indices.size(), " devices for local rank ", role.localRank,
                "; list one per rank on this host (e.g. cuda:0,1) or give cuda (GPU LOCAL_RANK)");
  return parseDevice("cuda:" + std::to_string(devices.indices[role.localRank]));
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
  if (const char* home = std::getenv("QPIPE_HOME"); home != nullptr && *home != '\0') return fs::path(home) / name;
  return fs::path(QPIPE_SOURCE_DIR) / name;
}

fs::path resolvePipeline(const QuantOptions& options, const fs::path& modelDir) {
  if (!options.configPath.empty()) return options.configPath;
  const std::string modelType =
      options.modelType.empty() ? ModelConfig::fromFile(modelDir / "config.json").modelType : options.modelType;
  const PracticeMatch match = findPractice(resourceDir("configs"), modelType, parseQuantType(options.quantType));
  log::logger()->info("--quant_type ", options.quantType, ": practice ", match.file.string(), " (",
                      match.metadata.configId, ", score ", match.metadata.score, ")");
  return match.file;
}

// Calibration windows as `qpipe eval` cuts them (docs/data.md): the texts joined with blank lines,
// tokenized once without special tokens, cut into `count` windows of `seqLen` tokens.
std::vector<at::Tensor> calibrationSamples(const fs::path& data, const Tokenizer& tokenizer, int64_t count,
                                           int64_t seqLen) {
  std::vector<std::string> texts;
  for (auto& sample : loadDataset(data)) texts.push_back(std::move(sample.text));
  const std::vector<int64_t> ids = tokenizer.encode(joinEvalTexts(texts), /*addSpecialTokens=*/false);
  const int64_t available = static_cast<int64_t>(ids.size()) / seqLen;
  QPIPE_REQUIRE(available > 0, ErrorCode::kInput, data.string(), ": ", ids.size(),
                " tokens, fewer than one window of --seq_len ", seqLen);
  if (available < count) {
    log::logger()->warn(data.string(), ": ", ids.size(), " tokens make ", available, " windows of ", seqLen,
                        ", fewer than --calib_samples ", count, "; calibrating on ", available);
  }
  const at::Tensor all = at::tensor(ids, at::kLong);
  std::vector<at::Tensor> samples;
  for (int64_t i = 0; i < std::min(count, available); ++i) {
    samples.push_back(all.slice(0, i * seqLen, (i + 1) * seqLen).unsqueeze(0).clone());
  }
  return samples;
}

SaverOptions saverOptions(const Pipeline& pipeline) {
  QPIPE_REQUIRE(pipeline.save.size() <= 1, ErrorCode::kConfig, pipeline.file.string(), ": spec.save lists ",
                pipeline.save.size(), " savers; one per run is supported");
  if (pipeline.save.empty()) return {};
  const SaveStep& step = pipeline.save.front();
  return {.format = step.type, .partFileSizeGb = step.config.at("part_file_size").asFloat()};
}

void quantize(const QuantOptions& options) {
  c10::InferenceMode inference;
  const auto logger = log::logger();
  const auto start = std::chrono::steady_clock::now();
  const fs::path modelDir = options.modelPath;
  QPIPE_REQUIRE(fs::is_directory(modelDir), ErrorCode::kInput, "--model_path '", options.modelPath,
                "' is not a folder");
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

  // Everything about the pipeline is checked before the model is touched (and, for a multi-rank
  // run, before any rank starts).
  ProcessorRegistry registry;
  PluginLoader loader(registry);
  loadPlugins(options.plugins, loader);
  const Pipeline pipeline = loadPipeline(resolvePipeline(options, modelDir), registry);
  auto processors = buildProcessors(pipeline, registry, {.logger = logger, .rank = rank, .worldSize = role.worldSize});
  if (role.worldSize > 1) {
    for (size_t i = 0; i < processors.size(); ++i) {
      QPIPE_REQUIRE(processors[i]->supportDistributed(), ErrorCode::kUsage, pipeline.process[i].path, " (",
                    pipeline.process[i].type, ") does not support multi-rank runs; use one device");
    }
  }
  const SaverOptions saving = saverOptions(pipeline);
  const fs::path calibData = !options.calibData.empty()  ? fs::path(options.calibData)
                             : !pipeline.dataset.empty() ? fs::path(pipeline.dataset)
                                                         : resourceDir("data") / "calib.jsonl";

  if (role.launcher) {
    launchRanks({.worldSize = role.worldSize, .timeout = distTimeout(options), .savePath = options.savePath});
    return;
  }

  const c10::Device device = rankDevice(devices, role);
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
  if (role.group || options.threadsPerRank) {
    const int threads = options.threadsPerRank.value_or(std::max(1, usableCores() / role.localWorldSize));
    at::set_num_threads(threads);  // intra-op pool and OpenMP
    logger->info("device ", device.str(), ", ", threads, " threads");
  }
  if (role.group) {
    const auto joined = std::chrono::steady_clock::now();
    dist::setWorld(dist::ProcessGroup::connect(*role.group));
    logger->debug("joined ", role.worldSize, " ranks through ", role.group->masterAddr, ":", role.group->masterPort,
                  " in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - joined).count(), " s");
  }
  dist::ProcessGroup& world = dist::world();

  auto model = CausalLM::open(modelDir, {.dtype = at::kFloat, .device = device});
  // Rank 0 alone saves: after each layer's syncs every rank holds the same quantized layer.
  std::unique_ptr<CheckpointSaver> saver;
  if (rank == 0) saver = CheckpointSaver::create(saving, *model, options.savePath);
  const Tokenizer tokenizer = Tokenizer::fromFile(modelDir / "tokenizer.json");
  const std::vector<at::Tensor> samples =
      calibrationSamples(calibData, tokenizer, options.calibSamples, options.seqLen);
  const std::vector<at::Tensor> share = rankShare(samples, rank, role.worldSize);
  if (role.worldSize > 1) {
    logger->info("calibration: ", share.size(), " of ", samples.size(), " samples x ", options.seqLen, " tokens from ",
                 calibData.string());
    if (share.empty()) {
      logger->warn("no calibration sample for this rank: ", samples.size(), " samples for ", role.worldSize,
                   " ranks; give --calib_samples ", role.worldSize, " or more");
    }
  } else {
    logger->info("calibration: ", samples.size(), " samples x ", options.seqLen, " tokens from ", calibData.string());
  }

  QuantReport report;
  LayerWiseRunner runner(*model, processors,
                         {.rank = rank, .worldSize = role.worldSize, .report = rank == 0 ? &report : nullptr});
  runner.run(share, [&](int64_t index, const std::string& name, Module& layer) {
    if (saver) saver->writeLayer(index, name, layer);
    // Lock-step per layer: no rank runs ahead of rank 0's writing by more than one layer, so
    // every wait stays well inside the collective timeout (a no-op on one rank).
    world.barrier();
  });
  if (saver) saver->addFile("quant_report.json", report.toJson());
  // The directory appears only once every rank got through every layer and the non-layer unit
  // (which has no sink: rank 0's saver writes its modules at finish()).
  world.barrier();
  if (!saver) return;
  saver->finish();

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << report.summary() << "saved " << saving.format << " checkpoint to " << options.savePath << " in "
            << seconds << " s (report: quant_report.json)\n";
}

}  // namespace

Subcommand setupQuant(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("quant", "Quantize a model with a pipeline and save the checkpoint");
  auto options = std::make_shared<QuantOptions>();
  app->add_option("--model_path", options->modelPath, "Model folder (config.json, safetensors, tokenizer.json)")
      ->required();
  app->add_option("--save_path", options->savePath, "Output folder; must not exist or be empty")->required();
  app->add_option("--model_type", options->modelType,
                  "Model family for practice lookup (configs/<model_type>/); default: config.json's model_type");
  auto* quantType = app->add_option("--quant_type", options->quantType,
                                    "w<W>a<A>[c8|f4|f8][s][_fp8], e.g. w8a8, w4a16, w8a8_fp8 (docs/pipeline.md)");
  auto* configPath = app->add_option("--config_path", options->configPath, "Pipeline YAML instead of --quant_type");
  quantType->excludes(configPath);
  configPath->excludes(quantType);
  app->add_option("--device", options->device,
                  "cpu, cuda, cuda:N, or several for one rank each: cpu:0,1,2,3, cuda:0,1 (docs/multirank.md)")
      ->capture_default_str();
  app->add_option("--dist_timeout", options->distTimeoutSeconds,
                  "Seconds a multi-rank run waits for a rendezvous or a collective; default "
                  "QPIPE_DIST_TIMEOUT_S, else 60")
      ->check(CLI::Range(0.001, 604800.0));
  app->add_option("--threads_per_rank", options->threadsPerRank,
                  "Intra-op (and OpenMP) threads of each rank; default: the cores divided among this host's ranks")
      ->check(CLI::Range(1, 4096));
  app->add_flag("--trust_remote_code", options->trustRemoteCode, "Accepted for msmodelslim compatibility");
  app->add_option("--calib_data", options->calibData,
                  "Calibration texts (.jsonl/.json/.txt); default: the pipeline's dataset, else data/calib.jsonl");
  app->add_option("--calib_samples", options->calibSamples, "Calibration windows")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--seq_len", options->seqLen, "Tokens per calibration window")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  addPluginOptions(*app, options->plugins);
  app->callback([app, quantType, configPath] {
    if (quantType->count() == 0 && configPath->count() == 0) {
      throw CLI::RequiredError("one of --quant_type or --config_path");
    }
  });
  return {app, [options] { quantize(*options); }};
}

}  // namespace qpipe::cli
