#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "option_checks.h"
#include "plugin_options.h"
#include "qpipe/config_node.h"
#include "qpipe/host/pipeline.h"
#include "qpipe/host/registry.h"
#include "qpipe/log.h"

namespace qpipe::cli {

namespace {

struct CheckOptions {
  std::string configPath;
  PluginOptions plugins;
};

size_t countProcessors(const std::vector<ProcessStep>& steps) {
  size_t count = 0;
  for (const auto& step : steps) count += step.children.empty() ? 1 : countProcessors(step.children);
  return count;
}

void checkPipeline(const CheckOptions& options) {
  Registry registry;
  PluginLoader loader(registry);
  loadPlugins(options.plugins, loader);

  const Pipeline pipeline = loadPipeline(options.configPath, registry);
  // Constructing every processor runs the plugins' own checks of their configuration; the saver
  // then checks what each step plans to leave for it.
  const ProcessorContext context{.logger = log::logger()};
  const auto processors = buildProcessors(pipeline, registry, context);
  for (const std::string& warning : *context.configWarnings) log::logger()->warn(warning);
  checkPlannedOutputs(pipeline, processors, registry);

  std::cout << pipeline.resolved.toYaml() << std::flush;
  log::logger()->info(options.configPath, ": valid (", countProcessors(pipeline.process), " processors, ",
                      pipeline.save.size(), " savers)");
}

}  // namespace

Subcommand setupCheck(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "check", "Validate a pipeline YAML against the loaded plugins and print it with defaults filled in");
  auto options = std::make_shared<CheckOptions>();
  app->add_option("--config_path", options->configPath, "Pipeline YAML to validate")->required()->check(path());
  addPluginOptions(*app, options->plugins);
  return {app, [options] { checkPipeline(*options); }};
}

}  // namespace qpipe::cli
