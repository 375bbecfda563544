#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include "commands.h"
#include "plugin_options.h"
#include "qpipe/dataset.h"
#include "qpipe/device.h"
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
  PluginOptions plugins;
};

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
  QPIPE_REQUIRE(options.device.find(',') == std::string::npos, ErrorCode::kUsage, "--device '", options.device,
                "': several devices (multi-rank) are not supported yet; give one, e.g. cpu or cuda:0");
  const c10::Device device = parseDevice(options.device);
  if (options.trustRemoteCode) logger->info("--trust_remote_code: qpipe runs no model code from the checkpoint");

  // Everything about the pipeline is checked before the model is touched.
  ProcessorRegistry registry;
  PluginLoader loader(registry);
  loadPlugins(options.plugins, loader);
  const Pipeline pipeline = loadPipeline(resolvePipeline(options, modelDir), registry);
  auto processors = buildProcessors(pipeline, registry, {.logger = logger});
  const SaverOptions saving = saverOptions(pipeline);
  const fs::path calibData = !options.calibData.empty()  ? fs::path(options.calibData)
                             : !pipeline.dataset.empty() ? fs::path(pipeline.dataset)
                                                         : resourceDir("data") / "calib.jsonl";

  auto model = CausalLM::open(modelDir, {.dtype = at::kFloat, .device = device});
  auto saver = CheckpointSaver::create(saving, *model, options.savePath);
  const Tokenizer tokenizer = Tokenizer::fromFile(modelDir / "tokenizer.json");
  const std::vector<at::Tensor> samples =
      calibrationSamples(calibData, tokenizer, options.calibSamples, options.seqLen);
  logger->info("calibration: ", samples.size(), " samples x ", options.seqLen, " tokens from ", calibData.string());

  QuantReport report;
  LayerWiseRunner runner(*model, processors, {.report = &report});
  runner.run(samples,
             [&](int64_t index, const std::string& name, Module& layer) { saver->writeLayer(index, name, layer); });
  saver->addFile("quant_report.json", report.toJson());
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
  app->add_option("--device", options->device, "cpu, cuda or cuda:N")->capture_default_str();
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
