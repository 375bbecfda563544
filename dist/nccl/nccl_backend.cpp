// libqpipe_dist_nccl.so: the NCCL backend, apart from qpipe_core so that only runs with CUDA
// tensors load libtorch_cuda (and NCCL). qpipe_core opens it with dlopen (process_group.cpp).
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdio>
#include <cstdlib>

#include "../src/nccl_abi.h"

extern "C" __attribute__((visibility("default"))) c10d::Backend* qpipe_dist_create_nccl_backend(
    c10d::Store* store, int rank, int worldSize, int64_t timeoutMs, char* error, size_t errorSize) {
  static_assert(std::is_same_v<decltype(&qpipe_dist_create_nccl_backend), qpipe::dist::detail::CreateNcclBackend>);
  try {
    // Blocking waits make a collective whose peer is gone fail at the timeout instead of
    // leaving the host to wait on the stream for ever.
    ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = std::chrono::milliseconds(timeoutMs);
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::intrusive_ptr<c10d::Store>::reclaim_copy(store),
                                                               rank, worldSize, options);
    return backend.release();
  } catch (const c10::Error& e) {
    std::snprintf(error, errorSize, "%s", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::snprintf(error, errorSize, "%s", e.what());
  }
  // Keep the first line: c10 messages can run on.
  for (size_t i = 0; i < errorSize && error[i] != '\0'; ++i) {
    if (error[i] == '\n') error[i] = '\0';
  }
  return nullptr;
}
