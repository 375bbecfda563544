// 16 fp32 lanes as a GCC vector type, and their sum in one fixed order: one AVX-512 register, two
// AVX2 or four SSE ones, whichever a function's target has. Private to core/model.
#pragma once

#include <cstdint>

namespace qpipe::detail {

constexpr int64_t kLanes = 16;
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
using UnalignedLanes = float __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));

// Lanes l and l + 8, then + 4, + 2, + 1 (as vectors: summed through memory, the lanes cost as many
// instructions as the multiply-adds of a short row).
[[gnu::always_inline]] inline float sumLanes(const Lanes& a) {
  using HalfLanes = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
  using QuarterLanes = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));
  const HalfLanes half = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const QuarterLanes quarter =
      __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

}  // namespace qpipe::detail
