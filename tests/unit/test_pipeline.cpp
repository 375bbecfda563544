#include <gtest/gtest.h>

#include "qpipe/host/pipeline.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/host/registry.h"
#include "qpipe/log.h"
#include "qpipe/plugin.h"
#include "test_helpers.h"

QPIPE_DECLARE_STATIC_PLUGIN(log_layers);

namespace qpipe {
namespace {

const std::filesystem::path kPipelines = std::filesystem::path(QPIPE_SOURCE_DIR) / "tests/fixtures/pipelines";

// Counts lifecycle calls; needs calibration data, unlike log_layers.
class Recorder final : public Processor {
 public:
  explicit Recorder(std::vector<std::string>& calls) : calls_(calls) {}
  void preRun() override { calls_.push_back("preRun"); }
  void preprocess(LayerRequest& r) override { calls_.push_back("preprocess " + r.name); }
  void postprocess(LayerRequest& r) override { calls_.push_back("postprocess " + r.name); }
  void postRun() override { calls_.push_back("postRun"); }
  bool supportDistributed() const override { return false; }

 private:
  std::vector<std::string>& calls_;
};

class PipelineTest : public ::testing::Test {
 protected:
  PipelineTest() : loader_(registry_) {
    loader_.addStatic(qpipe_plugin_descriptor_log_layers());
    Schema schema;
    schema.includeExclude();
    Schema saver;
    saver.required("path_prefix", ValueType::kString, "a field only this saver has");
    registry_.add({{{nullptr, "test", "test"},
                    {.type = "recorder",
                     .description = "test",
                     .schema = schema,
                     .factory = [this](const ConfigNode&,
                                       const ProcessorContext&) { return std::make_unique<Recorder>(calls_); }}}},
                  {{{nullptr, "test", "test"},
                    {.type = "test_saver",
                     .description = "a plugin's saver",
                     .schema = saver,
                     .factory = [](const ConfigNode&, CausalLM&, const std::filesystem::path&) {
                       return std::unique_ptr<CheckpointSaver>();
                     }}}});
  }

  Pipeline load(const std::string& yaml) { return loadPipeline(test::writeTempFile("p.yaml", yaml), registry_); }
  std::string loadError(const std::string& yaml) {
    return test::errorOf([&] { load(yaml); }, ErrorCode::kConfig);
  }

  Registry registry_;
  PluginLoader loader_;
  std::vector<std::string> calls_;
};

TEST_F(PipelineTest, ValidPipelineResolvesAnchorsGroupsMetadataAndSavers) {
  const Pipeline p = loadPipeline(kPipelines / "log_layers.yaml", registry_);
  EXPECT_EQ(p.apiVersion, "modelslim_v1");
  EXPECT_EQ(p.metadata.configId, "test-log-layers");
  EXPECT_DOUBLE_EQ(p.metadata.score, 90);
  ASSERT_TRUE(p.metadata.label.has_value());
  EXPECT_EQ(p.metadata.label->wBit, 8);
  EXPECT_EQ(p.metadata.label->aBit, 8);
  EXPECT_EQ(p.metadata.verifiedModelTypes, (std::vector<std::string>{"Llama", "Qwen3"}));
  EXPECT_EQ(p.runner, "auto");
  ASSERT_EQ(p.process.size(), 2u);
  EXPECT_EQ(p.process[0].type, "log_layers");
  EXPECT_EQ(p.process[0].config.at("prefix").asString(), "first ");  // from the merged anchor
  EXPECT_EQ(p.process[0].config.at("include").asStringList(), std::vector<std::string>{"model.layers.{0,1}"});
  EXPECT_EQ(p.process[1].type, "group");
  ASSERT_EQ(p.process[1].children.size(), 2u);
  EXPECT_EQ(p.process[1].children[0].config.at("prefix").asString(), "layer ");  // schema default
  EXPECT_EQ(p.process[1].children[1].path, "spec.process[1].configs[1]");
  ASSERT_EQ(p.save.size(), 1u);
  EXPECT_EQ(p.save[0].type, "compressed_tensors");
  EXPECT_DOUBLE_EQ(p.save[0].config.at("part_file_size").asFloat(), 2);

  const std::string resolved = p.resolved.toYaml();
  EXPECT_EQ(resolved.find("first_layers"), std::string::npos) << resolved;  // anchor holders dropped
  EXPECT_NE(resolved.find("prefix: \"layer \""), std::string::npos) << resolved;
}

TEST_F(PipelineTest, UnknownTypeNamesFileLineTypeAndKnownTypes) {
  const std::string message =
      test::errorOf([&] { loadPipeline(kPipelines / "unknown_type.yaml", registry_); }, ErrorCode::kConfig);
  EXPECT_EQ(message, (kPipelines / "unknown_type.yaml").string() +
                         ":6:13: spec.process[1].type: unknown processor type 'awq_magic'; known types: group, "
                         "log_layers, recorder (plugins are searched in --plugin_dir, QPIPE_PLUGIN_PATH, then the "
                         "built-in folder; `qpipe plugins` lists them)");
}

TEST_F(PipelineTest, ProcessorFieldErrorsCarryTheirPath) {
  const std::string message = loadError(
      "apiversion: modelslim_v1\nspec:\n  process:\n    - type: group\n      configs:\n"
      "        - {type: log_layers, prefx: x}\n");
  EXPECT_NE(message.find(":6:37: spec.process[0].configs[0].prefx: unknown field; did you mean 'prefix'?"),
            std::string::npos)
      << message;
}

TEST_F(PipelineTest, DocumentLevelErrors) {
  EXPECT_NE(loadError("apiversion: v2\nspec: {process: [{type: log_layers}]}\n")
                .find(":1:13: apiversion: 'v2' is not one of: modelslim_v1"),
            std::string::npos);
  EXPECT_NE(
      loadError("spec: {process: [{type: log_layers}]}\n").find(":1:1: document: missing required field 'apiversion'"),
      std::string::npos);
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspce: {process: []}\n")
                .find(":2:7: spce: unknown top-level field; did you mean 'spec'?; expected apiversion, metadata, spec"),
            std::string::npos);
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspec: {process: []}\n")
                .find(":2:17: spec.process: the list of processors is empty"),
            std::string::npos);
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspec: {process: {type: log_layers}}\n")
                .find(":2:17: spec.process: expected a list of processors, got a mapping"),
            std::string::npos);
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspec: {process: [{include: ['*']}]}\n")
                .find(":2:18: spec.process[0]: missing required field 'type'"),
            std::string::npos);
  EXPECT_NE(loadError("[1, 2]\n").find(":1:1: document: expected a pipeline mapping"), std::string::npos);
  for (const char* empty : {"", "# nothing but a comment\n", "~\n"}) {
    EXPECT_NE(loadError(empty).find(
                  ": document: expected a pipeline mapping (apiversion, metadata, spec), got an empty document (an "
                  "empty file, only comments, or null)"),
              std::string::npos)
        << loadError(empty);
  }
}

TEST_F(PipelineTest, SaverErrors) {
  const std::string head = "apiversion: modelslim_v1\nspec:\n  process: [{type: log_layers}]\n";
  EXPECT_NE(loadError(head + "  save: [{type: gguf}]\n")
                .find(":4:17: spec.save[0].type: unknown saver type 'gguf'; known types: ascendv1_saver, "
                      "compressed_tensors, test_saver"),
            std::string::npos);
  EXPECT_NE(loadError(head + "  save: [{type: ascendv1_saver, part_file_size: -1}]\n")
                .find(":4:49: spec.save[0].part_file_size: must be >= 0, got -1"),
            std::string::npos);
  EXPECT_NE(loadError(head + "  save: [{type: ascendv1_saver}, {type: compressed_tensors}]\n")
                .find(":4:9: spec.save: lists 2 savers; one per run is supported"),
            std::string::npos);
  EXPECT_NE(
      loadError(head + "  save: [{part_file_size: 1}]\n").find(":4:10: spec.save[0]: missing required field 'type'"),
      std::string::npos);
  EXPECT_NE(loadError(head + "  process: []\n").find(":4:3: duplicate key 'process'"), std::string::npos);
}

TEST_F(PipelineTest, APluginSaverIsValidatedAgainstItsOwnSchema) {
  const std::string head = "apiversion: modelslim_v1\nspec:\n  process: [{type: log_layers}]\n";
  const Pipeline p = load(head + "  save: [{type: test_saver, path_prefix: x}]\n");
  EXPECT_EQ(p.save[0].type, "test_saver");
  EXPECT_EQ(p.save[0].config.at("path_prefix").asString(), "x");
  EXPECT_NE(loadError(head + "  save: [{type: test_saver, part_file_size: 1}]\n")
                .find("spec.save[0].part_file_size: unknown field"),
            std::string::npos);
}

TEST_F(PipelineTest, AnEmptySaveIsTheDefaultSaver) {
  const Pipeline p = load("apiversion: modelslim_v1\nspec:\n  process: [{type: log_layers}]\n");
  ASSERT_EQ(p.save.size(), 1u);
  EXPECT_EQ(p.save[0].type, "compressed_tensors");
  EXPECT_EQ(p.save[0].config.at("part_file_size").asFloat(), 4);
}

// Some msmodelslim practices set spec.calib_dataset, which its V1 service drops: accepted, warned.
TEST_F(PipelineTest, CalibDatasetIsIgnoredWithAWarning) {
  const Pipeline p =
      load("apiversion: modelslim_v1\nspec:\n  process: [{type: log_layers}]\n  calib_dataset: calib_prompt.jsonl\n");
  EXPECT_EQ(p.dataset, "");
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find(":4:18: spec.calib_dataset: msmodelslim does not read it, and neither does qpipe; name "
                               "the calibration data with spec.dataset or --calib_data; ignored"),
            std::string::npos)
      << p.warnings[0];
  EXPECT_TRUE(load("apiversion: modelslim_v1\nspec:\n  process: [{type: log_layers}]\n").warnings.empty());
}

TEST_F(PipelineTest, UnknownRunnerNamesTheFileLineAndTheKnownRunners) {
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspec:\n  runner: bogus\n  process: [{type: log_layers}]\n")
                .find(":3:11: spec.runner: 'bogus' is not one of: auto, layer_wise, model_wise, dp_layer_wise"),
            std::string::npos);
}

TEST_F(PipelineTest, GroupNeedsChildren) {
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspec: {process: [{type: group, configs: []}]}\n")
                .find("spec.process[0].configs: the list of processors is empty"),
            std::string::npos);
  EXPECT_NE(loadError("apiversion: modelslim_v1\nspec: {process: [{type: group}]}\n")
                .find("spec.process[0]: missing required field 'configs'"),
            std::string::npos);
}

TEST_F(PipelineTest, GroupRunsChildrenInOrderOverOneForward) {
  const Pipeline p = load(
      "apiversion: modelslim_v1\nspec:\n  process:\n    - type: group\n      configs:\n"
      "        - {type: recorder}\n        - {type: log_layers}\n");
  std::vector<std::string> logged;
  auto logger = std::make_shared<Logger>([&](LogLevel, std::string_view m) { logged.emplace_back(m); });
  auto processors = buildProcessors(p, registry_, {.logger = logger});
  ASSERT_EQ(processors.size(), 1u);
  Processor& group = *processors[0];
  EXPECT_FALSE(group.isDataFree());          // one child needs data
  EXPECT_FALSE(group.supportDistributed());  // every child must support it

  int forwards = 0;
  LayerRequest request{.name = "model.layers.0", .inputs = {{}, {}}, .forward = [&](LayerRequest&) { ++forwards; }};
  group.preRun();
  group.preprocess(request);
  group.process(request);
  group.postprocess(request);
  group.postRun();
  EXPECT_EQ(forwards, 1);
  EXPECT_EQ(calls_,
            (std::vector<std::string>{"preRun", "preprocess model.layers.0", "postprocess model.layers.0", "postRun"}));
  EXPECT_EQ(logged, (std::vector<std::string>{"layer model.layers.0: 2 calibration samples", "layer 1 layers logged"}));
}

TEST_F(PipelineTest, DataFreeProcessorsNeedNoCalibrationAndTheHostWarnsAboutUnmatchedPatterns) {
  const Pipeline p = load(
      "apiversion: modelslim_v1\nspec:\n  process:\n"
      "    - {type: log_layers, include: ['model.layers.*', 'vision.*'], exclude: ['*.7']}\n");
  std::vector<std::pair<LogLevel, std::string>> logged;
  auto logger = std::make_shared<Logger>([&](LogLevel l, std::string_view m) { logged.emplace_back(l, m); });
  auto processors = buildProcessors(p, registry_, {.logger = logger});
  Processor& processor = *processors[0];
  EXPECT_FALSE(needsCalibration(processor));
  EXPECT_TRUE(processor.supportDistributed());
  LayerRequest request{.name = "model.layers.0"};
  processor.preprocess(request);
  processor.postRun();
  ASSERT_EQ(logged.size(), 4u);
  EXPECT_EQ(logged[2],
            std::make_pair(LogLevel::kWarn,
                           std::string("log_layers (spec.process[0]): include 'vision.*' matched no module")));
  EXPECT_EQ(logged[3], std::make_pair(LogLevel::kWarn,
                                      std::string("log_layers (spec.process[0]): exclude '*.7' matched no module")));
}

}  // namespace
}  // namespace qpipe
