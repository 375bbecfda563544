// Quantizing a model by hand in tests, the way linear_quant deploys: every Linear of every
// decoder layer is offered to a function that returns its replacement.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qpipe/model.h"

namespace qpipe::test {

// `make(fullName, linear)` returns the module to put in the Linear's place, or null to keep it.
inline void replaceLinears(CausalLM& lm,
                           const std::function<std::shared_ptr<Module>(const std::string&, Linear&)>& make) {
  for (int64_t i = 0; i < lm.config().numLayers; ++i) {
    DecoderLayer& layer = lm.layer(i);
    std::vector<std::pair<std::string, Linear*>> linears;
    for (auto& [name, module] : layer.namedModules()) {
      if (auto* linear = dynamic_cast<Linear*>(module)) linears.emplace_back(name, linear);
    }
    for (auto& [name, linear] : linears) {
      if (auto replacement = make(lm.layerName(i) + "." + name, *linear)) layer.replace(name, std::move(replacement));
    }
  }
}

}  // namespace qpipe::test
