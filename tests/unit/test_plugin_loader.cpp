#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

#include "qpipe/config_node.h"
#include "qpipe/host/plugin_loader.h"
#include "qpipe/log.h"
#include "qpipe/plugin.h"
#include "test_helpers.h"

QPIPE_DECLARE_STATIC_PLUGIN(log_layers);

namespace qpipe {
namespace {

namespace fs = std::filesystem;

const fs::path kFaults = fs::path(QPIPE_TEST_PLUGIN_DIR) / "faults";
const fs::path kExample = fs::path(QPIPE_TEST_PLUGIN_DIR) / "example";

fs::path fault(const std::string& kind) {
  return kFaults / ("libfault_" + kind + ".so");
}

std::string loadError(const fs::path& library) {
  Registry registry;
  PluginLoader loader(registry);
  const std::string message = test::errorOf([&] { loader.loadLibrary(library); }, ErrorCode::kPlugin);
  EXPECT_TRUE(registry.processors().empty());
  return message;
}

std::string prefix(const fs::path& library) {
  return "plugin library '" + library.string() + "': ";
}

TEST(PluginLoader, LibraryWithoutDescriptorIsRejected) {
  EXPECT_EQ(loadError(fault("no_descriptor")),
            prefix(fault("no_descriptor")) +
                "no qpipe plugin descriptor (symbol 'qpipe_plugin_descriptor_v1' is not exported); build the plugin "
                "with qpipe_add_plugin() and QPIPE_PLUGIN(...)");
}

TEST(PluginLoader, AbiMajorMismatchIsRejectedBeforeAnyPluginCode) {
  // The fixture declares the host's major + 1.
  EXPECT_EQ(loadError(fault("abi_major")),
            prefix(fault("abi_major")) + concat("plugin ABI ", QPIPE_PLUGIN_ABI_MAJOR + 1, ".", QPIPE_PLUGIN_ABI_MINOR,
                                                " is not compatible with this qpipe (plugin ABI ",
                                                QPIPE_PLUGIN_ABI_MAJOR, ".", QPIPE_PLUGIN_ABI_MINOR,
                                                "); rebuild the plugin against qpipe " QPIPE_VERSION));
}

TEST(PluginLoader, FingerprintMismatchIsRejected) {
  EXPECT_EQ(loadError(fault("fingerprint")),
            prefix(fault("fingerprint")) +
                "build fingerprint 'gcc-4.8|cxx11abi=0|torch=1.13.1|qpipe=0.0.1' does not "
                "match this qpipe's '" QPIPE_BUILD_FINGERPRINT
                "'; rebuild the plugin with the same compiler, LibTorch and qpipe");
}

TEST(PluginLoader, FileThatIsNotASharedLibraryIsRejected) {
  EXPECT_EQ(loadError(kFaults / "libfault_not_elf.so"),
            prefix(kFaults / "libfault_not_elf.so") + "not a shared library (not an ELF file for this platform)");
  EXPECT_EQ(loadError(kFaults / "missing.so"), prefix(kFaults / "missing.so") + "not a regular file");
  // Links that lead round in a loop are one rejected library in a scan, not an error of every command.
  const fs::path loop = test::testDir() / "plugin_loop";
  fs::remove_all(loop);
  fs::create_directories(loop);
  fs::create_symlink("b.so", loop / "a.so");
  fs::create_symlink("a.so", loop / "b.so");
  EXPECT_EQ(loadError(loop / "a.so"), prefix(loop / "a.so") + "Too many levels of symbolic links");
  Registry registry;
  PluginLoader loader(registry);
  loader.loadDirectories({{loop, "--plugin_dir"}});
  EXPECT_EQ(loader.rejected().size(), 2u);
}

// A library cut short (an interrupted copy or build) is refused before dlopen, which would map its
// missing pages and die of SIGBUS on the first touch.
TEST(PluginLoader, TruncatedLibraryIsRejectedBeforeItIsMapped) {
  const fs::path whole = kExample / "libmodule_stats.so";
  const std::string bytes = test::slurp(whole);
  for (const size_t keep : {size_t{1000}, size_t{20000}, bytes.size() - 1}) {
    const fs::path cut = test::testDir() / ("libcut_" + std::to_string(keep) + ".so");
    std::ofstream(cut, std::ios::binary) << bytes.substr(0, keep);
    const std::string message = loadError(cut);
    EXPECT_EQ(
        message.rfind(prefix(cut) + "truncated (" + std::to_string(keep) + " bytes; its ELF headers describe ", 0), 0u)
        << message;
    EXPECT_NE(message.find("): copy or build it again"), std::string::npos) << message;
  }
}

TEST(PluginLoader, DuplicateTypeRejectsTheSecondPluginWhole) {
  Registry registry;
  PluginLoader loader(registry);
  loader.loadLibrary(fault("duplicate_a"));
  const std::string message = test::errorOf([&] { loader.loadLibrary(fault("duplicate_b")); }, ErrorCode::kPlugin);
  EXPECT_EQ(message, prefix(fault("duplicate_b")) +
                         "processor type 'duplicate_type' is registered by plugin "
                         "'fault_duplicate_b' (" +
                         fault("duplicate_b").string() + ") and already by plugin 'fault_duplicate_a' (" +
                         fault("duplicate_a").string() +
                         "); so plugin 'fault_duplicate_b' is not loaded, nor any of its types (duplicate_type)");
  ASSERT_EQ(registry.processors().size(), 1u);
  EXPECT_EQ(registry.processors()[0].plugin, "fault_duplicate_a");
  EXPECT_EQ(loader.loaded().size(), 1u);
}

TEST(PluginLoader, ThrowingFactoryBecomesOneErrorNamingTheProcessor) {
  Registry registry;
  PluginLoader loader(registry);
  loader.loadLibrary(fault("factory_throws"));
  const ConfigNode config = ConfigNode::parseYaml("{}", "f.yaml");
  const std::string message = test::errorOf(
      [&] { registry.createProcessor("factory_throws", config, "spec.process[0]", {.logger = log::logger()}); },
      ErrorCode::kPlugin);
  EXPECT_EQ(message,
            "f.yaml:1:1: spec.process[0]: processor 'factory_throws' (plugin 'fault_factory_throws') could "
            "not be created: cannot build: no device");
}

TEST(PluginLoader, ThrowingProcessBecomesOneErrorNamingProcessorCallAndLayer) {
  Registry registry;
  PluginLoader loader(registry);
  loader.loadLibrary(fault("process_throws"));
  auto processor = registry.createProcessor("process_throws", ConfigNode::map(), "p", {.logger = log::logger()});
  LayerRequest request{.name = "model.layers.3"};
  processor->preprocess(request);  // the default implementations run fine
  const std::string message = test::errorOf([&] { processor->process(request); }, ErrorCode::kPlugin);
  EXPECT_EQ(message,
            "processor 'process_throws' (plugin 'fault_process_throws') failed in process(model.layers.3): "
            "calibration exploded");
}

TEST(PluginLoader, ProcessorsKeepTheirLibraryLoadedAfterLoaderAndRegistryAreGone) {
  std::unique_ptr<Processor> processor;
  std::vector<std::string> logged;
  auto logger = std::make_shared<Logger>([&](LogLevel, std::string_view m) { logged.emplace_back(m); });
  {
    Registry registry;
    PluginLoader loader(registry);
    loader.loadLibrary(kExample / "liblog_layers.so");
    const ConfigNode config = registry.findProcessor("log_layers")->info.schema.validate(ConfigNode::map(), "p");
    processor = registry.createProcessor("log_layers", config, "p", {.logger = logger});
  }
  LayerRequest request{.name = "model.layers.0"};
  processor->preprocess(request);  // code in the library: it must still be mapped
  processor.reset();
  EXPECT_EQ(logged, std::vector<std::string>{"layer model.layers.0: 0 calibration samples"});
}

TEST(PluginLoader, DirectoryScanLoadsGoodLibrariesAndRecordsEveryRejection) {
  Registry registry;
  PluginLoader loader(registry);
  loader.loadDirectories({{kFaults, "--plugin_dir"}, {kExample, "built-in"}});
  std::vector<std::string> loaded;
  for (const auto& record : loader.loaded()) loaded.push_back(record.name);
  EXPECT_EQ(loaded, (std::vector<std::string>{"fault_duplicate_a", "fault_factory_throws", "fault_process_throws",
                                              "log_layers", "module_stats"}));
  std::vector<std::string> rejected;
  for (const auto& record : loader.rejected()) rejected.push_back(fs::path(record.path).filename().string());
  EXPECT_EQ(rejected,
            (std::vector<std::string>{"libfault_abi_major.so", "libfault_duplicate_b.so", "libfault_fingerprint.so",
                                      "libfault_no_descriptor.so", "libfault_not_elf.so"}));
  EXPECT_EQ(registry.processorTypes(), (std::vector<std::string>{"duplicate_type", "factory_throws", "group",
                                                                 "log_layers", "module_stats", "process_throws"}));
}

TEST(PluginLoader, EarlierSearchDirectoryShadowsASamePluginLater) {
  const fs::path copy = fs::temp_directory_path() / "qpipe-test-shadow";
  fs::create_directories(copy);
  fs::copy_file(kExample / "liblog_layers.so", copy / "liblog_layers.so", fs::copy_options::overwrite_existing);
  Registry registry;
  PluginLoader loader(registry);
  loader.loadDirectories({{copy, "--plugin_dir"}, {kExample, "built-in"}});
  ASSERT_EQ(loader.loaded().size(), 2u);  // the copy of log_layers, then module_stats
  EXPECT_EQ(loader.loaded()[0].origin, (copy / "liblog_layers.so").string());
  ASSERT_EQ(loader.rejected().size(), 1u);
  EXPECT_EQ(loader.rejected()[0].reason, "plugin 'log_layers' is already loaded from " +
                                             (copy / "liblog_layers.so").string() +
                                             ", which comes first in the search order; this copy is ignored");
}

TEST(PluginLoader, StaticallyLinkedPluginRegistersLikeALibrary) {
  Registry registry;
  PluginLoader loader(registry);
  const PluginRecord record = loader.addStatic(qpipe_plugin_descriptor_log_layers());
  EXPECT_EQ(record.name, "log_layers");
  EXPECT_EQ(record.version, "1.0.0");
  EXPECT_EQ(record.origin, "static:log_layers");
  EXPECT_EQ(record.types, std::vector<std::string>{"log_layers"});
  ASSERT_NE(registry.findProcessor("log_layers"), nullptr);
}

TEST(PluginLoader, SearchPathOrderIsPluginDirThenEnvironmentThenBuiltIn) {
  const fs::path envDir = fs::temp_directory_path() / "qpipe-test-env-plugins";
  fs::create_directories(envDir);
  ::setenv("QPIPE_PLUGIN_PATH", (envDir.string() + "::/nonexistent/dir").c_str(), 1);
  const auto dirs = PluginLoader::searchPath(kFaults, kExample);
  ::unsetenv("QPIPE_PLUGIN_PATH");
  ASSERT_EQ(dirs.size(), 3u);
  EXPECT_EQ(dirs[0].dir, kFaults);
  EXPECT_EQ(dirs[0].source, "--plugin_dir");
  EXPECT_EQ(dirs[1].dir, envDir);
  EXPECT_EQ(dirs[1].source, "QPIPE_PLUGIN_PATH");
  EXPECT_EQ(dirs[2].dir, kExample);
  EXPECT_EQ(dirs[2].source, "built-in");
  EXPECT_EQ(test::errorOf([] { PluginLoader::searchPath(fs::path("/nonexistent/plugins"), {}); }, ErrorCode::kUsage),
            "--plugin_dir '/nonexistent/plugins' is not a directory");
}

TEST(Registry, CoreTypesAreReserved) {
  Registry registry;
  ProcessorInfo info{.type = "group", .factory = [](const ConfigNode&, const ProcessorContext&) {
                       return std::make_unique<Processor>();
                     }};
  EXPECT_EQ(test::errorOf(
                [&] {
                  registry.add({{{nullptr, "mine", "static:mine"}, info}}, {});
                },
                ErrorCode::kPlugin),
            "plugin 'mine' registers processor type 'group', which is reserved by qpipe's core");
}

// A plugin saver's checkPlanned runs guarded: its configuration error passes as it is (the host
// puts the step in front), anything else becomes a plugin error naming the saver and the plugin.
TEST(Registry, ASaverCheckOfPlannedOutputsIsGuarded) {
  Registry registry;
  const auto saver = [](std::function<void(const PlannedOutputs&)> check) {
    return SaverInfo{
        .type = "mine_saver",
        .factory = [](const ConfigNode&, CausalLM&, const fs::path&) { return std::unique_ptr<CheckpointSaver>(); },
        .checkPlanned = std::move(check)};
  };
  registry.add({}, {{{nullptr, "mine", "static:mine"}, saver([](const PlannedOutputs& planned) {
                       if (planned.normBias) throw std::runtime_error("norms are beyond me");
                       QPIPE_REQUIRE(planned.linears.empty(), ErrorCode::kConfig, "mine_saver: no Linear, please");
                     })}});
  EXPECT_EQ(test::errorOf([&] { registry.checkPlanned("mine_saver", {.normBias = true}); }, ErrorCode::kPlugin),
            "saver 'mine_saver' (plugin 'mine') failed in checkPlanned: norms are beyond me");
  EXPECT_EQ(test::errorOf([&] { registry.checkPlanned("mine_saver", {.linears = {{}}}); }, ErrorCode::kConfig),
            "mine_saver: no Linear, please");
  registry.checkPlanned("mine_saver", {});
}

}  // namespace
}  // namespace qpipe
