// DistHelper (docs/multirank.md): which modules of a subtree every rank holds (shared: their statistics
// must be synchronised) and which only some ranks hold (local-only, e.g. expert-parallel experts).
// A snapshot: build it again after a processor changes the structure. Construction is a
// collective, so every rank must build it at the same point.
#pragma once

#include <ATen/core/Tensor.h>

#include <set>
#include <string>
#include <vector>

#include "qpipe/process_group.h"

namespace qpipe {
class Module;
}

namespace qpipe::dist {

class DistHelper {
 public:
  // Module names below `root`, prefixed with `prefix` (as Module::namedModules names them).
  DistHelper(ProcessGroup& group, Module& root, const std::string& prefix = "");

  bool isShared(const std::string& name) const { return shared_.count(name) != 0; }
  bool isLocal(const std::string& name) const { return local_.count(name) != 0; }
  bool isLocalOnly(const std::string& name) const { return isLocal(name) && !isShared(name); }
  // Shared names under `prefix`, sorted, sliced [rank::world]: each rank's share of the work.
  std::vector<std::string> sharedModulesSlice(const std::string& prefix = "") const;
  // Every rank's tensor in rank order, shapes allowed to differ.
  static std::vector<at::Tensor> gatherVariableShapes(ProcessGroup& group, const at::Tensor& tensor);

 private:
  std::set<std::string> local_;
  std::set<std::string> shared_;
  int rank_ = 0;
  int worldSize_ = 1;
};

}  // namespace qpipe::dist
