// The SDK's helpers (qpipe/processor.h, qpipe/module.h): forEach, checked casts, the context's
// filters and configuration errors.
#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include "qpipe/plugin.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

// A layer with two Linear modules and a norm, under model.layers.2.
std::shared_ptr<Module> layer() {
  auto attn = std::make_shared<Module>("Attention");
  attn->addChild("q_proj", std::make_shared<Linear>(at::ones({2, 2})));
  attn->addChild("k_proj", std::make_shared<Linear>(at::ones({2, 2})));
  auto root = std::make_shared<Module>("DecoderLayer");
  root->addChild("self_attn", attn);
  root->addChild("input_layernorm", std::make_shared<RMSNorm>(at::ones({2}), 1e-6));
  return root;
}

TEST(Sdk, ForEachOffersOnlyModulesOfTheTypeToTheFilter) {
  const auto module = layer();
  LayerRequest request{.name = "model.layers.2", .module = module.get()};
  ModuleFilter filter({"*proj", "*layernorm"}, {"*k_proj"});
  std::vector<std::string> seen;
  forEach<Linear>(request, filter, [&](const std::string& path, const std::string& name, Linear& linear) {
    seen.push_back(path + " " + name + " " + std::to_string(linear.inFeatures()));
  });
  EXPECT_EQ(seen, std::vector<std::string>{"self_attn.q_proj model.layers.2.self_attn.q_proj 2"});
  // The norm is not a Linear: '*layernorm' matched nothing it was offered.
  EXPECT_EQ(filter.unmatchedPatterns(), std::vector<std::string>{"include '*layernorm'"});
}

TEST(Sdk, ForEachLetsTheCallbackReplaceTheModuleItVisits) {
  const auto module = layer();
  LayerRequest request{.name = "model.layers.2", .module = module.get()};
  ModuleFilter filter({"*"}, {});
  int visited = 0;
  forEach<Linear>(request, filter, [&](const std::string& path, const std::string&, Linear&) {
    ++visited;
    request.module->replace(path, std::make_shared<HookPoint>());
  });
  EXPECT_EQ(visited, 2);
  EXPECT_EQ(module->getSubmodule("self_attn.k_proj").typeName(), "HookPoint");
}

TEST(Sdk, ForEachVisitsNothingBelowAModuleTheCallbackReplaced) {
  const auto module = layer();
  LayerRequest request{.name = "model.layers.2", .module = module.get()};
  ModuleFilter filter({"*"}, {});
  std::vector<std::string> seen;
  forEach<Module>(request, filter, [&](const std::string& path, const std::string&, Module&) {
    seen.push_back(path);
    if (path == "self_attn") request.module->replace(path, std::make_shared<HookPoint>());
  });
  EXPECT_EQ(seen, (std::vector<std::string>{"", "self_attn", "input_layernorm"}));
}

TEST(Sdk, CheckedCastNamesTheModuleItsTypeAndTheTypeAskedFor) {
  const auto module = layer();
  EXPECT_EQ(&module->getSubmodule("self_attn.q_proj").as<Linear>("q"), &module->getSubmodule("self_attn.q_proj"));
  EXPECT_EQ(test::errorOf([&] { module->getSubmodule("input_layernorm").as<Linear>("model.layers.2.input_layernorm"); },
                          ErrorCode::kConfig),
            "module 'model.layers.2.input_layernorm' is a RMSNorm, not a qpipe::Linear (did an earlier processor of "
            "the pipeline replace it?)");
}

TEST(Sdk, ContextFiltersAreKeptForTheHostAndConfigErrorsNameTheField) {
  const ConfigNode config = ConfigNode::parseYaml("include: ['*q_proj']\nexclude: []\nalpha: 2\n", "p.yaml");
  const ProcessorContext context{.configPath = "spec.process[1]"};
  const auto filter = context.moduleFilter(config);
  ASSERT_EQ(context.filters->size(), 1u);
  EXPECT_EQ(context.filters->front(), filter);
  EXPECT_TRUE(filter->matches("model.layers.0.self_attn.q_proj"));
  EXPECT_EQ(context.configError(config, "alpha", "must be in [0, 1]").what(),
            std::string("p.yaml:3:8: spec.process[1].alpha: must be in [0, 1]"));
  EXPECT_EQ(context.configError(config, "beta", "is needed with alpha").what(),
            std::string("p.yaml:1:1: spec.process[1].beta: is needed with alpha"));
  EXPECT_EQ(context.rank(), 0);
  EXPECT_EQ(context.worldSize(), 1);
}

TEST(Sdk, OnlyProcessorsThatAreNotDataFreeNeedCalibration) {
  struct DataFree final : Processor {
    bool isDataFree() const override { return true; }
  };
  EXPECT_FALSE(needsCalibration(DataFree()));
  EXPECT_TRUE(needsCalibration(Processor()));
}

}  // namespace
}  // namespace qpipe
