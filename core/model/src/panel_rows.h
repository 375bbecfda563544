// What the AVX-512 GEMMs of 32-output panels (bf16_gemm.cpp, grouped_int8_gemm.cpp) share: the
// masks of a panel's last columns, the grouped kernels' step that adds one group's sums to a row
// of the output, and their loop over panels and rows. Private to core/model.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace qpipe::quant::detail {

// The grouped kernels' loop over an [m, n] output in panels of `nr` outputs: each thread takes
// whole panels and runs them over every row, `mc` rows at a time (so a block of the input's rows
// stays in cache across the thread's panels). visit(panel, i0, rows, cols) with cols counted from
// the panel's first output (more than nr for all but the last panel).
template <typename Visit>
void forEachPanelRowBlock(int64_t m, int64_t n, int64_t nr, int64_t mc, const Visit& visit) {
  at::parallel_for(0, (n + nr - 1) / nr, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += mc) {
      for (int64_t panel = begin; panel < end; ++panel) visit(panel, i0, std::min(mc, m - i0), n - panel * nr);
    }
  });
}

// The first n of 16 lanes (none for n ≤ 0).
inline __mmask16 firstLanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1U << n) - 1); }

// out[0..32) = y·s for the first group, out + y·s (one rounding, FMA) after it; then + bias after
// the last group. Only the columns in m0, m1 are read and written. A file that includes this must
// not let the compiler fuse the multiply with the bias's add (-ffp-contract=off): the bias is
// added to the finished sum.
[[gnu::target("avx512f"), gnu::always_inline]] inline void addGroupToRow(float* out, __m512 y0, __m512 y1, __m512 s0,
                                                                        __m512 s1, bool first, bool last,
                                                                        const float* bias, __mmask16 m0,
                                                                        __mmask16 m1) {
  y0 = first ? _mm512_mul_ps(y0, s0) : _mm512_fmadd_ps(y0, s0, _mm512_maskz_loadu_ps(m0, out));
  y1 = first ? _mm512_mul_ps(y1, s1) : _mm512_fmadd_ps(y1, s1, _mm512_maskz_loadu_ps(m1, out + 16));
  if (last && bias != nullptr) {
    y0 = _mm512_add_ps(y0, _mm512_maskz_loadu_ps(m0, bias));
    y1 = _mm512_add_ps(y1, _mm512_maskz_loadu_ps(m1, bias + 16));
  }
  _mm512_mask_storeu_ps(out, m0, y0);
  _mm512_mask_storeu_ps(out + 16, m1, y1);
}

}  // namespace qpipe::quant::detail
