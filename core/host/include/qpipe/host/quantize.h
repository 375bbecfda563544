// `qpipe quant` as a library call (docs/architecture.md): plugins → pipeline → processors → model
// → calibration windows → runner → saver → report. The CLI parses flags, launches ranks and calls
// it; tests call it in-process.
//
// Everything about the pipeline is checked before the model is touched: the plugins load, the
// pipeline validates, every processor is built, and on several ranks every processor supports
// them and spec.runner allows them. Only then is the group joined (joinGroup) and the model
// opened. Rank 0 alone saves: after each layer's syncs every rank holds the same quantized layer.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/report.h"
#include "qpipe/process_group.h"

namespace qpipe {

struct QuantizeOptions {
  std::filesystem::path modelPath;
  std::filesystem::path savePath;
  // The pipeline: a YAML file, or a --quant_type matched against the practices in practiceDir
  // (docs/pipeline.md), for modelType (default: config.json's model_type).
  std::filesystem::path configPath;
  std::string quantType;
  std::string modelType;
  std::filesystem::path practiceDir;
  // Calibration texts: calibData, else the pipeline's spec.dataset, else defaultCalibData.
  std::filesystem::path calibData;
  std::filesystem::path defaultCalibData;
  int64_t calibSamples = 128;
  int64_t seqLen = 512;
  int64_t probeTokens = 32;  // RunnerOptions::probeTokens: 0, no error probe in the report
  c10::Device device = c10::Device(c10::kCPU);
  bool checkFinite = true;                  // ModelOptions::checkFinite
  std::vector<PluginSearchDir> pluginPath;  // searched in order (PluginLoader::searchPath)
  // This process's place in the run, known before any rank joins.
  int rank = 0;
  int worldSize = 1;
  // Joins the ranks of a multi-rank run (worldSize > 1); called once the pipeline is accepted.
  std::function<std::shared_ptr<ProcessGroup>()> joinGroup;
};

// Checks what quantize() checks before it opens the model (no group is joined), e.g. in the
// parent of a local multi-rank run before it starts the ranks.
void checkQuantize(const QuantizeOptions& options);

struct QuantizeResult {
  QuantReport report;  // filled on rank 0, saved beside the checkpoint as quant_report.json
  std::string saver;   // the spec.save type that wrote it
  bool saved = false;  // this rank wrote the checkpoint (rank 0)
};

// Quantizes the model and, on rank 0, saves it to savePath.
QuantizeResult quantize(const QuantizeOptions& options);

}  // namespace qpipe
