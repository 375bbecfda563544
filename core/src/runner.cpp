#include "qpipe/runner.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>

#include "qpipe/error.h"
#include "qpipe/log.h"
#include "qpipe/progress.h"

namespace qpipe {

LayerWiseRunner::LayerWiseRunner(CausalLM& model, std::vector<std::unique_ptr<Processor>>& processors,
                                 RunnerOptions options)
    : model_(model), processors_(processors), options_(options) {
  QPIPE_CHECK(options.worldSize >= 1 && options.rank >= 0 && options.rank < options.worldSize, "rank ", options.rank,
              " of ", options.worldSize);
}

void LayerWiseRunner::run(const std::vector<at::Tensor>& samples, const LayerSink& sink) {
  c10::InferenceMode inference;
  const bool needsData = std::any_of(processors_.begin(), processors_.end(),
                                     [](const auto& processor) { return !processor->isDataFree(); });
  for (auto& processor : processors_) processor->preRun();

  // Layer 0's inputs: the embeddings of every sample, with its rotary tables.
  std::vector<TensorList> inputs;
  if (needsData) {
    for (const at::Tensor& ids : samples) {
      QPIPE_CHECK(ids.dim() == 2 && ids.size(0) == 1, "calibration samples are [1, seq] token ids, got ", ids.sizes());
      const at::Tensor positions = at::arange(ids.size(1), at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
      const Rotary rotary = model_.rotary(positions.to(model_.options().device));
      inputs.push_back({model_.embed(ids.to(model_.options().device)), rotary.cos, rotary.sin});
    }
  }

  const int64_t layers = model_.config().numLayers;
  ProgressBar bar("layers", layers, "layers");
  for (int64_t index = 0; index < layers; ++index) {
    DecoderLayer& layer = model_.layer(index);
    LayerRequest request{.name = model_.layerName(index), .module = &layer, .inputs = std::move(inputs)};
    request.forward = [&layer](LayerRequest& r) {
      r.outputs.clear();
      for (const TensorList& input : r.inputs) {
        r.outputs.push_back({layer.forward(input[0], Rotary{input[1], input[2]}, at::Tensor())});
      }
    };
    bool forwarded = false;
    for (auto& processor : processors_) {
      processor->preprocess(request);
      if (!processor->isDataFree()) {
        processor->process(request);
        forwarded = true;
      }
      processor->postprocess(request);
    }
    if (sink) sink(index, request.name, layer);

    inputs = std::move(request.inputs);
    if (forwarded) {
      QPIPE_CHECK(request.outputs.size() == inputs.size(), "layer ", request.name, ": ", request.outputs.size(),
                  " outputs for ", inputs.size(), " inputs");
      for (size_t s = 0; s < inputs.size(); ++s) inputs[s][0] = request.outputs[s][0];
    }
    model_.releaseLayer(index);
    bar.update(index + 1);
  }
  for (auto& processor : processors_) processor->postRun();
  log::logger()->debug("runner: ", layers, " layers, ", samples.size(), " samples on rank ", options_.rank, "/",
                       options_.worldSize);
}

}  // namespace qpipe
