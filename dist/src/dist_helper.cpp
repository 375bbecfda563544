#include "qpipe/dist/dist_helper.h"

#include <algorithm>
#include <iterator>

#include "qpipe/module.h"

namespace qpipe::dist {

DistHelper::DistHelper(ProcessGroup& group, Module& root, const std::string& prefix) {
  rank_ = group.rank();
  worldSize_ = group.worldSize();
  for (const auto& [name, module] : root.namedModules(prefix)) local_.insert(name);
  if (worldSize_ == 1) {
    shared_ = local_;
    return;
  }
  // Names are joined with '\n', which no module name contains.
  std::string names;
  for (const std::string& name : local_) names += name + '\n';
  shared_ = local_;
  for (const std::string& peerNames : group.allGatherBytes(names)) {
    std::set<std::string> peer;
    for (size_t start = 0, end; start < peerNames.size(); start = end + 1) {
      end = peerNames.find('\n', start);
      peer.insert(peerNames.substr(start, end - start));
    }
    std::set<std::string> common;
    std::set_intersection(shared_.begin(), shared_.end(), peer.begin(), peer.end(),
                          std::inserter(common, common.end()));
    shared_ = std::move(common);
  }
}

std::vector<std::string> DistHelper::sharedModulesSlice(const std::string& prefix) const {
  std::vector<std::string> slice;
  size_t index = 0;
  // std::set iterates sorted, so every rank numbers the shared names alike.
  for (const std::string& name : shared_) {
    if (name.rfind(prefix, 0) != 0) continue;
    if (index++ % static_cast<size_t>(worldSize_) == static_cast<size_t>(rank_)) slice.push_back(name);
  }
  return slice;
}

std::vector<at::Tensor> DistHelper::gatherVariableShapes(ProcessGroup& group, const at::Tensor& tensor) {
  return group.allGather(tensor);
}

}  // namespace qpipe::dist
