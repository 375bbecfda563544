// Runs a pipeline's processors on a model in this process, with the plugins linked into the test
// executables statically: what `qpipe quant` does between loading the model and saving it.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/report.h"
#include "qpipe/host/runner.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/plugin.h"
#include "test_helpers.h"

QPIPE_DECLARE_STATIC_PLUGIN(linear_quant);
QPIPE_DECLARE_STATIC_PLUGIN(qat);

namespace qpipe::test {

// `process`: the entries of spec.process, as YAML indented by four spaces. Returns the report.
// The run is model-wise: with no saver writing each layer as it is done, the layers stay in
// `model`, quantized, for the caller to use.
inline QuantReport runPipeline(CausalLM& model, const std::string& process, const std::vector<at::Tensor>& samples) {
  Registry registry;
  PluginLoader loader(registry);
  loader.addStatic(qpipe_plugin_descriptor_linear_quant());
  loader.addStatic(qpipe_plugin_descriptor_qat());
  const Pipeline pipeline = loadPipeline(
      writeTempFile("pipeline.yaml", "apiversion: modelslim_v1\nspec:\n  process:\n" + process), registry);
  auto processors =
      buildProcessors(pipeline, registry, {.logger = std::make_shared<Logger>([](LogLevel, std::string_view) {})});
  QuantReport report;
  LayerWiseRunner(model, processors, {.mode = RunnerMode::kModelWise, .report = &report}).run(samples, {});
  return report;
}

}  // namespace qpipe::test
