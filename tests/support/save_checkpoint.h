// Saves every decoder layer of a model with a built-in saver, as the runner's sink does during a
// run, and finishes the checkpoint.
#pragma once

#include <filesystem>

#include "qpipe/host/savers.h"
#include "qpipe/model.h"

namespace qpipe::test {

inline void saveCheckpoint(CausalLM& lm, const std::filesystem::path& out, const SaverOptions& options = {}) {
  auto saver = createBuiltinSaver(options, lm, out);
  for (int64_t i = 0; i < lm.config().numLayers; ++i) saver->writeLayer(i, lm.layerName(i), lm.layer(i));
  saver->finish();
}

}  // namespace qpipe::test
