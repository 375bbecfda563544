// Devices. qpipe links LibTorch's CPU library only; the CUDA backend is loaded on first use.
#pragma once

#include <c10/core/Device.h>

#include <string_view>

namespace qpipe {

// Loads LibTorch's CUDA backend (libtorch_cuda.so) once; false when it is not installed or no
// GPU is visible. Safe to call repeatedly.
bool cudaAvailable();

// "cpu", "cuda" or "cuda:N". A CUDA device loads the backend; an unavailable one, or any other
// text, is Error(kUsage) naming the value.
c10::Device parseDevice(std::string_view text);

}  // namespace qpipe
