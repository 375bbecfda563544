#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qpipe/host/report.h"
#include "qpipe/host/runner.h"
#include "qpipe/log.h"
#include "qpipe/saver.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

// The unit's name in call records: the non-layer unit's is "".
std::string unitName(const LayerRequest& r) {
  return isNonLayerUnit(r) ? "(non-layer)" : r.name;
}

// Records every lifecycle call and the tensors it saw; needs data unless told otherwise.
class Recorder final : public Processor {
 public:
  Recorder(std::string tag, std::vector<std::string>& calls, bool dataFree = false)
      : tag_(std::move(tag)), calls_(calls), dataFree_(dataFree) {}
  void preRun() override { calls_.push_back(tag_ + " preRun"); }
  void preprocess(LayerRequest& r) override {
    calls_.push_back(tag_ + " preprocess " + unitName(r) + " inputs=" + std::to_string(r.inputs.size()));
    firstInputs.push_back(r.inputs.empty() ? at::Tensor() : r.inputs[0][0]);
  }
  void process(LayerRequest& r) override {
    calls_.push_back(tag_ + " process " + unitName(r));
    Processor::process(r);
  }
  void postprocess(LayerRequest& r) override {
    calls_.push_back(tag_ + " postprocess " + unitName(r) + " outputs=" + std::to_string(r.outputs.size()));
    firstOutputs.push_back(r.outputs.empty() ? at::Tensor() : r.outputs[0][0]);
  }
  void postRun() override { calls_.push_back(tag_ + " postRun"); }
  bool isDataFree() const override { return dataFree_; }

  std::vector<at::Tensor> firstInputs, firstOutputs;

 private:
  std::string tag_;
  std::vector<std::string>& calls_;
  bool dataFree_;
};

std::vector<at::Tensor> samples(int count) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < count; ++i) {
    out.push_back(at::arange(5 + i, at::kLong).add(i).remainder(test::kTinyVocab).unsqueeze(0));
  }
  return out;
}

TEST(Runner, SampleIGoesToRankIModWorld) {
  const std::vector<int> all{0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(rankShare(all, 0, 3), (std::vector<int>{0, 3, 6}));
  EXPECT_EQ(rankShare(all, 1, 3), (std::vector<int>{1, 4, 7}));
  EXPECT_EQ(rankShare(all, 2, 3), (std::vector<int>{2, 5}));
  EXPECT_EQ(rankShare(all, 0, 1), all);
}

TEST(Runner, LockStepScheduleAndLayerByLayerRelease) {
  auto model = CausalLM::open(test::tinyLlama("schedule"));
  std::vector<std::string> calls;
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<Recorder>("A", calls));
  processors.push_back(std::make_unique<Recorder>("B", calls, /*dataFree=*/true));
  std::vector<std::string> sunk;
  LayerWiseRunner(*model, processors).run(samples(3), [&](int64_t index, const std::string& name, Module&) {
    sunk.push_back(std::to_string(index) + " " + name);
    EXPECT_TRUE(model->isLoaded(index));
  });
  EXPECT_EQ(calls,
            (std::vector<std::string>{
                "A preRun", "B preRun", "A preprocess model.layers.0 inputs=3", "A process model.layers.0",
                "A postprocess model.layers.0 outputs=3", "B preprocess model.layers.0 inputs=3",
                "B postprocess model.layers.0 outputs=3", "A preprocess model.layers.1 inputs=3",
                "A process model.layers.1", "A postprocess model.layers.1 outputs=3",
                "B preprocess model.layers.1 inputs=3", "B postprocess model.layers.1 outputs=3",
                "A preprocess (non-layer) inputs=3", "A process (non-layer)", "A postprocess (non-layer) outputs=0",
                "B preprocess (non-layer) inputs=3", "B postprocess (non-layer) outputs=0", "A postRun", "B postRun"}));
  EXPECT_EQ(sunk, (std::vector<std::string>{"0 model.layers.0", "1 model.layers.1"}));
  EXPECT_FALSE(model->isLoaded(0));
  EXPECT_FALSE(model->isLoaded(1));
}

TEST(Runner, NextLayerInputsAreTheLastForwardsOutputsAndMatchTheFullForward) {
  auto model = CausalLM::open(test::tinyLlama("propagation"));
  std::vector<std::string> calls;
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<Recorder>("A", calls));
  auto& recorder = static_cast<Recorder&>(*processors[0]);
  const auto data = samples(2);
  LayerWiseRunner(*model, processors).run(data, nullptr);
  ASSERT_EQ(recorder.firstInputs.size(), 3u);  // two layers, then the non-layer unit
  EXPECT_TRUE(at::equal(recorder.firstInputs[1], recorder.firstOutputs[0]));
  EXPECT_TRUE(at::equal(recorder.firstInputs[2], recorder.firstOutputs[1]));

  // The last layer's output, through the final norm and head, is the model's own forward.
  const at::Tensor viaRunner = model->head(recorder.firstOutputs[1]);
  EXPECT_TRUE(at::allclose(viaRunner, model->forward(data[0]), 1e-5, 1e-6));
}

TEST(Runner, ProcessorsSeeEarlierProcessorsReplacements) {
  auto model = CausalLM::open(test::tinyLlama("replacement"));
  std::vector<std::string> calls;
  // Zeroes layer 0's MLP output in preprocess; the recorder's forward runs after it.
  class ZeroMlp final : public Processor {
   public:
    void preprocess(LayerRequest& r) override {
      if (isNonLayerUnit(r)) return;
      auto& down = static_cast<Linear&>(r.module->getSubmodule("mlp.down_proj"));
      r.module->replace("mlp.down_proj", std::make_shared<Linear>(at::zeros_like(down.weight())));
    }
    bool isDataFree() const override { return true; }
  };
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<ZeroMlp>());
  processors.push_back(std::make_unique<Recorder>("A", calls));
  auto& recorder = static_cast<Recorder&>(*processors[1]);
  LayerWiseRunner(*model, processors).run(samples(1), nullptr);

  auto reference = CausalLM::open(test::tinyLlama("replacement-reference"));
  const at::Tensor ids = samples(1)[0];
  const at::Tensor positions = at::arange(ids.size(1), at::kLong).unsqueeze(0);
  const Rotary rotary = reference->rotary(positions);
  const at::Tensor unchanged = reference->layer(0).forward(reference->embed(ids), rotary, at::Tensor());
  EXPECT_FALSE(at::allclose(recorder.firstOutputs[0], unchanged));
}

TEST(Runner, DataFreePipelinesRunNoForward) {
  auto model = CausalLM::open(test::tinyLlama("datafree"));
  std::vector<std::string> calls;
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<Recorder>("B", calls, /*dataFree=*/true));
  LayerWiseRunner(*model, processors).run(samples(4), nullptr);
  EXPECT_EQ(calls[1], "B preprocess model.layers.0 inputs=0");
  EXPECT_EQ(calls[2], "B postprocess model.layers.0 outputs=0");
}

// What a processor sees of the non-layer unit: its modules by name and type, and every input.
class UnitRecorder final : public Processor {
 public:
  void preprocess(LayerRequest& r) override {
    if (!isNonLayerUnit(r)) {
      lastLayerName = r.name;
      return;
    }
    for (auto& [name, module] : r.module->namedModules(r.name)) modules.emplace_back(name, module->typeName());
    for (const TensorList& input : r.inputs) inputs.push_back(input);
  }
  void postprocess(LayerRequest& r) override {
    if (!isNonLayerUnit(r)) {
      for (const TensorList& output : r.outputs) lastLayerOutputs.push_back(output[0]);
    } else {
      unitOutputs = r.outputs.size();
    }
  }
  std::string lastLayerName;
  std::vector<std::pair<std::string, std::string>> modules;
  std::vector<TensorList> inputs;
  std::vector<at::Tensor> lastLayerOutputs;  // of each layer, the last layer's last
  size_t unitOutputs = 99;
};

TEST(Runner, NonLayerUnitOffersTheModulesOutsideTheLayersWithTheLastLayersOutputs) {
  auto model = CausalLM::open(test::tinyLlama("unit"));
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<UnitRecorder>());
  auto& recorder = static_cast<UnitRecorder&>(*processors[0]);
  const auto data = samples(3);
  std::vector<std::string> sunk;
  LayerWiseRunner(*model, processors).run(data, [&](int64_t, const std::string& name, Module&) {
    sunk.push_back(name);
  });
  // HF names, no decoder layer; the sink sees decoder layers only.
  EXPECT_EQ(recorder.modules, (std::vector<std::pair<std::string, std::string>>{{"", "CausalLM"},
                                                                                {"model", "Model"},
                                                                                {"model.embed_tokens", "Embedding"},
                                                                                {"model.norm", "RMSNorm"},
                                                                                {"lm_head", "Linear"}}));
  EXPECT_EQ(sunk, (std::vector<std::string>{"model.layers.0", "model.layers.1"}));
  // One input per sample: the final norm's, the last layer's output for that sample.
  ASSERT_EQ(recorder.inputs.size(), 3u);
  ASSERT_EQ(recorder.lastLayerOutputs.size(), 6u);
  for (size_t s = 0; s < 3; ++s) {
    ASSERT_EQ(recorder.inputs[s].size(), 1u);
    EXPECT_EQ(recorder.inputs[s][0].sizes(), (std::vector<int64_t>{1, 5 + static_cast<int64_t>(s), test::kTinyHidden}));
    EXPECT_TRUE(at::equal(recorder.inputs[s][0], recorder.lastLayerOutputs[3 + s])) << s;
    // Through the final norm and lm_head: the model's own logits.
    EXPECT_TRUE(at::allclose(model->head(recorder.inputs[s][0]), model->forward(data[s]), 1e-5, 1e-6)) << s;
  }
  EXPECT_EQ(recorder.unitOutputs, 0u);  // the logits are not kept
}

// Counts its forwards; returns its input through a Linear of its own.
class CountingHead final : public Module {
 public:
  explicit CountingHead(at::Tensor weight) : Module("CountingHead"), linear_(std::move(weight)) {}
  at::Tensor forward(const at::Tensor& x) override {
    ++calls;
    return linear_(x);
  }
  int calls = 0;

 private:
  Linear linear_;
};

// Replaces lm_head and the final norm in the non-layer unit and registers a step between the
// calibration forwards (as static observers do).
class ReplaceHead final : public Processor {
 public:
  void preprocess(LayerRequest& r) override {
    if (!isNonLayerUnit(r)) return;
    auto& head = static_cast<Linear&>(r.module->getSubmodule("lm_head"));
    replacement = std::make_shared<CountingHead>(head.weight());
    r.module->replace("lm_head", replacement);
    norm = std::make_shared<RMSNorm>(at::full({test::kTinyHidden}, 2.0), 1e-6);
    r.module->replace("model.norm", norm);
    r.betweenForwards.emplace_back([this] { ++steps; });
  }
  std::shared_ptr<CountingHead> replacement;
  std::shared_ptr<RMSNorm> norm;
  int steps = 0;
};

TEST(Runner, NonLayerReplacementsRunInTheUnitsForwardAndReplaceTheModelsModules) {
  auto model = CausalLM::open(test::tinyLlama("unit-replace"));
  int floatHeadCalls = 0;
  model->root().getSubmodule("lm_head").addForwardHook([&](Module&, const at::Tensor&, const at::Tensor&) {
    ++floatHeadCalls;
    return at::Tensor();
  });
  {
    // Nothing replaced: the calibration forward does not compute the logits.
    std::vector<std::string> calls;
    std::vector<std::unique_ptr<Processor>> processors;
    processors.push_back(std::make_unique<Recorder>("A", calls));
    LayerWiseRunner(*model, processors).run(samples(2), nullptr);
    EXPECT_EQ(floatHeadCalls, 0);
  }
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<ReplaceHead>());
  auto& replacer = static_cast<ReplaceHead&>(*processors[0]);
  LayerWiseRunner(*model, processors).run(samples(2), nullptr);
  // Observe, the step, propagate: two forwards of each sample through the replacement.
  EXPECT_EQ(replacer.steps, 1);
  EXPECT_EQ(replacer.replacement->calls, 4);
  EXPECT_EQ(floatHeadCalls, 0);
  EXPECT_EQ(&model->root().getSubmodule("lm_head"), replacer.replacement.get());
  EXPECT_EQ(&model->root().getSubmodule("model.norm"), replacer.norm.get());
  EXPECT_EQ(model->root().getSubmodule("model.embed_tokens").typeName(), "Embedding");
}

// Data-free, changes nothing; `idle` says so of the non-layer unit (Processor::actsOn).
class Bystander final : public Processor {
 public:
  explicit Bystander(bool idle) : idle_(idle) {}
  bool isDataFree() const override { return true; }
  bool actsOn(const LayerRequest& unit) const override { return !idle_ || !isNonLayerUnit(unit); }

 private:
  bool idle_;
};

TEST(Runner, ANonLayerUnitNoProcessorActsOnIsNotProbed) {
  for (const bool idle : {false, true}) {
    auto model = CausalLM::open(test::tinyLlama("unit-idle"));
    int headCalls = 0;
    model->root().getSubmodule("lm_head").addForwardHook([&](Module&, const at::Tensor&, const at::Tensor&) {
      ++headCalls;
      return at::Tensor();
    });
    std::vector<std::unique_ptr<Processor>> processors;
    processors.push_back(std::make_unique<Bystander>(idle));
    QuantReport report;
    LayerWiseRunner(*model, processors, {.report = &report}).run(samples(2), nullptr);
    // The probe records the float lm_head's output unless no processor may change it.
    EXPECT_EQ(headCalls, idle ? 0 : 1) << idle;
    // Either way nothing was replaced, so the report lists the decoder layers alone.
    ASSERT_EQ(report.layers.size(), 2u) << idle;
    EXPECT_EQ(report.layers[1].name, "model.layers.1");
  }
}

// With a saver that takes them first, the non-layer modules go to the sink before layer 0, unless
// a step may change them.
TEST(Runner, NonLayerModulesNoStepActsOnGoToTheSinkFirst) {
  for (const bool idle : {false, true}) {
    auto model = CausalLM::open(test::tinyLlama("unit-first"));
    std::vector<std::unique_ptr<Processor>> processors;
    processors.push_back(std::make_unique<Bystander>(idle));
    std::vector<std::pair<int64_t, std::string>> sunk;
    LayerWiseRunner(*model, processors, {.nonLayerFirst = true})
        .run(samples(2), [&](int64_t index, const std::string& name, Module& module) {
          sunk.emplace_back(index, name);
          if (index == CheckpointSaver::kNonLayer) {
            EXPECT_EQ(&module, &model->root());
          }
        });
    using Sunk = std::vector<std::pair<int64_t, std::string>>;
    Sunk expected{{0, "model.layers.0"}, {1, "model.layers.1"}};
    if (idle) expected.insert(expected.begin(), {CheckpointSaver::kNonLayer, ""});
    EXPECT_EQ(sunk, expected) << idle;
  }
}

// Says no of the non-layer unit, and replaces its lm_head all the same.
class HeadReplacingBystander final : public Processor {
 public:
  bool isDataFree() const override { return true; }
  bool actsOn(const LayerRequest& unit) const override { return !isNonLayerUnit(unit); }
  void preprocess(LayerRequest& r) override {
    if (!isNonLayerUnit(r)) return;
    const at::Tensor weight = r.module->getSubmodule("lm_head").parameter("weight");
    r.module->replace("lm_head", std::make_shared<Linear>(weight.clone()));
  }
};

TEST(Runner, AStepThatSaysNoOfTheNonLayerModulesWrittenFirstMustNotReplaceThem) {
  auto model = CausalLM::open(test::tinyLlama("unit-liar"));
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<HeadReplacingBystander>());
  EXPECT_EQ(test::errorOf(
                [&] {
                  LayerWiseRunner(*model, processors, {.nonLayerFirst = true})
                      .run(samples(2), [](int64_t, const std::string&, Module&) {});
                },
                ErrorCode::kPlugin),
            "a step replaced 'lm_head' in the non-layer unit although every step's actsOn said no of it (the saver "
            "wrote the unit's modules before the first layer)");
}

TEST(Runner, DataFreeProcessorsSeeTheNonLayerUnitWithoutInputs) {
  auto model = CausalLM::open(test::tinyLlama("unit-datafree"));
  std::vector<std::string> calls;
  std::vector<std::unique_ptr<Processor>> processors;
  processors.push_back(std::make_unique<Recorder>("B", calls, /*dataFree=*/true));
  LayerWiseRunner(*model, processors).run(samples(2), nullptr);
  ASSERT_EQ(calls.size(), 2u + 2 * 2 + 2);
  EXPECT_EQ(calls[5], "B preprocess (non-layer) inputs=0");
  EXPECT_EQ(calls[6], "B postprocess (non-layer) outputs=0");
}

}  // namespace
}  // namespace qpipe
