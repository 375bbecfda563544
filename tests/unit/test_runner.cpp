#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qpipe/log.h"
#include "qpipe/runner.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace qpipe {
namespace {

// Records every lifecycle call and the tensors it saw; needs data unless told otherwise.
class Recorder final : public Processor {
 public:
  Recorder(std::string tag, std::vector<std::string>& calls, bool dataFree = false)
      : tag_(std::move(tag)), calls_(calls), dataFree_(dataFree) {}
  void preRun() override { calls_.push_back(tag_ + " preRun"); }
  void preprocess(LayerRequest& r) override {
    calls_.push_back(tag_ + " preprocess " + r.name + " inputs=" + std::to_string(r.inputs.size()));
    firstInputs.push_back(r.inputs.empty() ? at::Tensor() : r.inputs[0][0]);
  }
  void process(LayerRequest& r) override {
    calls_.push_back(tag_ + " process " + r.name);
    Processor::process(r);
  }
  void postprocess(LayerRequest& r) override {
    calls_.push_back(tag_ + " postprocess " + r.name + " outputs=" + std::to_string(r.outputs.size()));
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
            (std::vector<std::string>{"A preRun", "B preRun", "A preprocess model.layers.0 inputs=3",
                                      "A process model.layers.0", "A postprocess model.layers.0 outputs=3",
                                      "B preprocess model.layers.0 inputs=3", "B postprocess model.layers.0 outputs=3",
                                      "A preprocess model.layers.1 inputs=3", "A process model.layers.1",
                                      "A postprocess model.layers.1 outputs=3", "B preprocess model.layers.1 inputs=3",
                                      "B postprocess model.layers.1 outputs=3", "A postRun", "B postRun"}));
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
  ASSERT_EQ(recorder.firstInputs.size(), 2u);
  EXPECT_TRUE(at::equal(recorder.firstInputs[1], recorder.firstOutputs[0]));

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

}  // namespace
}  // namespace qpipe
