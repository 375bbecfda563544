// Per-row pieces of computeQParams for symmetric per_channel weights, shared by the one-pass
// weight quantization (quant.cpp) and the SSZ kernel (ssz.cpp). Private to core/model.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace qpipe::quant::detail {

// lo = min(0, row), hi = max(0, row); true when the row holds a NaN (whose payload bits ATen's
// reductions carry and this does not: callers take the tensor-op path then).
bool rowMinMax(const float* row, int64_t cols, float& lo, float& hi);

// computeQParams' symmetric scale from them, bit for bit: max(-lo, hi) / qmax, at least FLT_EPSILON.
inline float symmetricScale(float lo, float hi, float qmax) {
  return std::max(std::max(-lo, hi) / qmax, std::numeric_limits<float>::epsilon());
}

}  // namespace qpipe::quant::detail
