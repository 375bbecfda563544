// qpipe_gpu_dist_check: the collectives on CUDA tensors (NCCL through libqpipe_dist_nccl.so),
// for a GPU machine (tools/gpu_check.sh); no ctest test, as CI has no GPU.
//
// Run without RANK it launches itself: 1 rank (NCCL sanity) with one GPU, 2 ranks with two or
// more, where each result over NCCL is also compared with the same collective over Gloo.
// Prints one PASS or FAIL line per check; exit status 0 when all pass.
#include <ATen/Functions.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "qpipe/device.h"
#include "qpipe/dist/process_group.h"

extern char** environ;

namespace {

using qpipe::ProcessGroup;
using qpipe::ReduceOp;

int failures = 0;

void check(int rank, const std::string& name, bool ok) {
  std::cout << (ok ? "PASS " : "FAIL ") << "rank " << rank << " " << name << std::endl;
  if (!ok) ++failures;
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.cpu().equal(b.cpu());
}

int runRank(const qpipe::dist::GroupOptions& options) {
  const auto group = qpipe::dist::connect(options);
  const int rank = group->rank();
  const int world = group->worldSize();
  const at::Device cuda(at::kCUDA, static_cast<c10::DeviceIndex>(rank));
  const at::Tensor base = at::arange(1, 7, at::kFloat).reshape({2, 3}).mul(rank + 1);

  const std::pair<ReduceOp, const char*> ops[] = {
      {ReduceOp::kSum, "sum"}, {ReduceOp::kMax, "max"}, {ReduceOp::kMin, "min"}, {ReduceOp::kProd, "prod"}};
  for (const auto& [op, name] : ops) {
    at::Tensor onGpu = base.to(cuda);
    at::Tensor onCpu = base.clone();
    group->allReduce(onGpu, op);
    group->allReduce(onCpu, op);
    at::Tensor expected = base.div(rank + 1);
    if (op == ReduceOp::kSum) expected = expected.mul(world * (world + 1) / 2);
    if (op == ReduceOp::kMax) expected = expected.mul(world);
    if (op == ReduceOp::kProd) expected = expected.pow(world).mul(world == 2 ? 2 : 1);
    check(rank, std::string("allReduce ") + name, same(onGpu, expected) && same(onGpu, onCpu));
  }

  // Rank r holds r + 1 rows.
  const at::Tensor rows = at::full({rank + 1, 4}, static_cast<float>(rank));
  const auto gpuParts = group->allGather(rows.to(cuda));
  const auto cpuParts = group->allGather(rows);
  bool gatherOk = static_cast<int>(gpuParts.size()) == world;
  for (int r = 0; gatherOk && r < world; ++r) {
    gatherOk = gpuParts[r].is_cuda() && same(gpuParts[r], at::full({r + 1, 4}, static_cast<float>(r))) &&
               same(gpuParts[r], cpuParts[r]);
  }
  check(rank, "allGather variable shapes", gatherOk);

  at::Tensor broadcast = at::full({3}, static_cast<float>(rank + 10), at::TensorOptions().device(cuda));
  group->broadcast(broadcast, world - 1);
  check(rank, "broadcast", same(broadcast, at::full({3}, static_cast<float>(world + 9))));
  group->barrier();
  return failures == 0 ? 0 : 1;
}

int launch(int world) {
  const std::string port = std::to_string(29400 + ::getpid() % 500);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", port.c_str(), 1);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    pid_t pid = 0;
    if (::posix_spawn(&pid, self, nullptr, nullptr, argv, environ) != 0) {
      std::cerr << "FAIL cannot start rank " << rank << std::endl;
      return 1;
    }
    children.push_back(pid);
  }
  int status = 0;
  for (pid_t child : children) {
    int childStatus = 0;
    ::waitpid(child, &childStatus, 0);
    if (!WIFEXITED(childStatus) || WEXITSTATUS(childStatus) != 0) status = 1;
  }
  std::cout << (status == 0 ? "PASS" : "FAIL") << " qpipe_gpu_dist_check with " << world << " rank(s)" << std::endl;
  return status;
}

}  // namespace

int main() {
  try {
    if (const auto options = qpipe::dist::optionsFromEnvironment()) {
      if (!qpipe::cudaAvailable()) {
        std::cout << "FAIL no CUDA device" << std::endl;
        return 1;
      }
      return runRank(*options);
    }
    // The GPU count comes from a child so that this process never initialises CUDA before
    // launching the ranks.
    const pid_t probe = ::fork();
    if (probe == 0) ::_exit(qpipe::cudaAvailable() ? std::min<int>(at::detail::getCUDAHooks().deviceCount(), 2) : 0);
    int status = 0;
    ::waitpid(probe, &status, 0);
    const int gpus = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
    if (gpus == 0) {
      std::cout << "FAIL no CUDA device" << std::endl;
      return 1;
    }
    return launch(gpus);
  } catch (const std::exception& e) {
    std::cout << "FAIL " << e.what() << std::endl;
    return 1;
  }
}
