// The C boundary between qpipe_core and libqpipe_dist_nccl.so (dist/nccl/nccl_backend.cpp). A
// C symbol looked up with dlsym; c10d objects cross as raw intrusive pointers, errors as text.
#pragma once

#include <cstddef>
#include <cstdint>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace qpipe::dist::detail {

inline constexpr const char* kNcclLibrary = "libqpipe_dist_nccl.so";
inline constexpr const char* kCreateNcclBackendSymbol = "qpipe_dist_create_nccl_backend";

// Returns a new reference to a ProcessGroupNCCL over `store` (the caller reclaims it), or null
// with a one-line reason in `error`. `store` is borrowed: the backend takes its own reference.
using CreateNcclBackend = c10d::Backend* (*)(c10d::Store* store, int rank, int worldSize, int64_t timeoutMs,
                                             char* error, size_t errorSize);

}  // namespace qpipe::dist::detail
