#include "qpipe/process_group.h"

#include <map>
#include <string>

#include "qpipe/error.h"

namespace qpipe {

namespace {

thread_local const std::string* currentTask = nullptr;

class SingleGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int worldSize() const override { return 1; }
  void allReduce(at::Tensor&, ReduceOp) override { ParallelTaskScope::check("allReduce"); }
  std::vector<at::Tensor> allGather(const at::Tensor& tensor) override {
    ParallelTaskScope::check("allGather");
    return {tensor};
  }
  void broadcast(at::Tensor&, int root) override {
    ParallelTaskScope::check("broadcast");
    QPIPE_CHECK(root == 0, "broadcast from rank ", root, " of 1");
  }
  void barrier() override { ParallelTaskScope::check("barrier"); }
  std::vector<std::string> allGatherBytes(const std::string& bytes) override {
    ParallelTaskScope::check("allGatherBytes");
    return {bytes};
  }
  void reportFailure(const std::string&) noexcept override {}
  Traffic traffic() const override { return {}; }
  int64_t counterAdd(const std::string& key, int64_t delta) override { return counters_[key] += delta; }
  void storeSet(const std::string& key, const std::string& value) override { values_[key] = value; }
  std::string storeGet(const std::string& key) override {
    const auto found = values_.find(key);
    QPIPE_CHECK(found != values_.end(), "storeGet('", key, "') on one rank before any storeSet: it would wait forever");
    return found->second;
  }

 private:
  std::map<std::string, int64_t> counters_;
  std::map<std::string, std::string> values_;
};

}  // namespace

ParallelTaskScope::ParallelTaskScope(std::string task) : task_(std::move(task)), outer_(currentTask) {
  currentTask = &task_;
}

ParallelTaskScope::~ParallelTaskScope() {
  currentTask = outer_;
}

void ParallelTaskScope::check(const char* collective) {
  QPIPE_REQUIRE(currentTask == nullptr, ErrorCode::kPlugin, "task ", *currentTask, " called ", collective,
                " inside a parallel task, where the other ranks run other tasks and would never join it; submit "
                "it with parallel = false or move the collective into its sync");
}

bool ParallelTaskScope::active() {
  return currentTask != nullptr;
}

std::shared_ptr<ProcessGroup> ProcessGroup::single() {
  return std::make_shared<SingleGroup>();
}

}  // namespace qpipe
