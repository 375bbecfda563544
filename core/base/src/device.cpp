#include "qpipe/device.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "qpipe/error.h"
#include "qpipe/log.h"

namespace qpipe {

namespace {
int gpuCount() {
  return at::detail::getCUDAHooks().deviceCount();
}
}  // namespace

bool cudaAvailable() {
  static std::once_flag once;
  std::call_once(once, [] {
    // RTLD_GLOBAL: its static initialisers register the CUDA hooks that ATen looks up. The bare
    // name is found through libqpipe_core's RUNPATH, the LibTorch folder. Opened before any
    // at::hasCUDA(): ATen settles on its hooks at the first query, so asking first would leave
    // CUDA off for the life of the process.
    if (::dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      log::logger()->debug("LibTorch CUDA backend not loaded: ", ::dlerror());
    }
  });
  return at::hasCUDA() && gpuCount() > 0;
}

c10::Device parseDevice(std::string_view text) {
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(std::string(text));
  } catch (const std::exception&) {
    throw Error(ErrorCode::kUsage, concat("device '", text, "' is not cpu, cuda or cuda:N"));
  }
  QPIPE_REQUIRE(device.is_cpu() || device.is_cuda(), ErrorCode::kUsage, "device '", text,
                "' is not supported; use cpu, cuda or cuda:N");
  if (device.is_cuda()) {
    QPIPE_REQUIRE(cudaAvailable(), ErrorCode::kUsage, "device '", text,
                  "': CUDA is not available (no GPU, or LibTorch without CUDA)");
    QPIPE_REQUIRE(!device.has_index() || device.index() < gpuCount(), ErrorCode::kUsage, "device '", text, "': only ",
                  gpuCount(), " GPUs are visible");
  }
  return device;
}

}  // namespace qpipe
