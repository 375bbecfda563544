// bf16 · bf16 → fp32 GEMMs with AVX512-BF16 dot products (vdpbf16ps), for quant::bf16Matmul on
// CPUs that have them without AMX.
//
// Why a kernel of our own: MKL's bf16 GEMM does not use vdpbf16ps on AMD CPUs. On a Zen 4 core it
// ran 4096 × 576 × 1536 in 75.9 ms, against 80.7 ms for MKL's fp32 GEMM and 34 ms for oneDNN's
// bf16 kernel (docs/benchmarks.md). oneDNN picks its blocking, K splits included, by shape and
// thread count, and MKL's threaded sums depend on the thread count. Here each output is one
// register's lane, summed over the column pairs in order by one instruction after another, so
// its bits depend on neither the thread count, nor M, nor where its row lies in the call: a
// calibration sample gives the same output on any rank.
#include "bf16_gemm.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "panel_rows.h"

namespace qpipe::quant::detail {

namespace {

// The packed layout of b: its N rows in panels of kNr; within a panel, for each pair of columns
// k = 2p, 2p+1, the kNr rows' two values side by side ([panel][p][row][2]). N is padded to a
// whole panel and K to an even count, with zeros.
constexpr int64_t kNr = 32;
// Output rows per micro-kernel call: 8 × 32 sums in 16 registers, beside the two panel vectors and
// the broadcast.
constexpr int64_t kMr = 8;
// Rows of a kept in L2 while a thread walks its panels (512 × K bf16: 576 KiB at K = 576).
constexpr int64_t kMc = 512;

void packPanel(const uint16_t* b, int64_t ldb, int64_t k, int64_t rows, uint16_t* dst) {
  const int64_t pairs = (k + 1) / 2;
  std::memset(dst, 0, static_cast<size_t>(pairs * kNr * 2) * sizeof(uint16_t));
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = b + r * ldb;
    // A pair of columns moves as one 32-bit unit.
    for (int64_t p = 0; p < k / 2; ++p) std::memcpy(dst + p * kNr * 2 + r * 2, row + 2 * p, 2 * sizeof(uint16_t));
    if (k % 2 != 0) dst[(k / 2) * kNr * 2 + r * 2] = row[k - 1];
  }
}

// The pair of bf16 values at `pair` in every 32-bit lane, as vdpbf16ps reads one operand.
[[gnu::target("avx512f,avx512bf16"), gnu::always_inline]] inline __m512bh broadcastPair(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof bits);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// c[0..R)[0..32) = Σ_p a[r][2p..2p+1] · b[p][col][0..1] (+ c when accumulate); only the first
// `cols` columns of c are read and written.
template <int R>
[[gnu::target("avx512f,avx512bf16")]] void microKernel(const uint16_t* a, int64_t lda, int64_t k, const uint16_t* b,
                                                       float* c, int64_t ldc, int64_t cols, bool accumulate) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t full = k / 2;
  for (int64_t p = 0; p < full; ++p) {
    const auto b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kNr * 2));
    const auto b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kNr * 2 + kNr));
    for (int r = 0; r < R; ++r) {
      const __m512bh av = broadcastPair(a + r * lda + 2 * p);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b0, av);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b1, av);
    }
  }
  if (k % 2 != 0) {
    // The last column alone: its pair's second value is zero in a and in the packed b.
    const auto b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + full * kNr * 2));
    const auto b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + full * kNr * 2 + kNr));
    for (int r = 0; r < R; ++r) {
      const auto av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(a[r * lda + 2 * full]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b0, av);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b1, av);
    }
  }
  const __mmask16 m0 = firstLanes(cols), m1 = firstLanes(cols - 16);
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    if (accumulate) {
      acc[r][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, out), acc[r][0]);
      acc[r][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, out + 16), acc[r][1]);
    }
    _mm512_mask_storeu_ps(out, m0, acc[r][0]);
    _mm512_mask_storeu_ps(out + 16, m1, acc[r][1]);
  }
}

// microKernel<rows> for 1 ≤ rows ≤ R.
template <int R>
[[gnu::target("avx512f,avx512bf16")]] void tailRows(int64_t rows, const uint16_t* a, int64_t lda, int64_t k,
                                                    const uint16_t* b, float* c, int64_t ldc, int64_t cols,
                                                    bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return tailRows<R - 1>(rows, a, lda, k, b, c, ldc, cols, accumulate);
  }
  microKernel<R>(a, lda, k, b, c, ldc, cols, accumulate);
}

// Rows [0, rows) of one panel's output, kMr at a time, then the rest.
[[gnu::target("avx512f,avx512bf16")]] void panelRows(const uint16_t* a, int64_t lda, int64_t k, const uint16_t* b,
                                                     int64_t rows, float* c, int64_t ldc, int64_t cols,
                                                     bool accumulate) {
  int64_t r = 0;
  for (; r + kMr <= rows; r += kMr) microKernel<kMr>(a + r * lda, lda, k, b, c + r * ldc, ldc, cols, accumulate);
  if (r < rows) tailRows<kMr - 1>(rows - r, a + r * lda, lda, k, b, c + r * ldc, ldc, cols, accumulate);
}

// Output rows per grouped micro-kernel call: each row's 32 outputs have two sums per part of the
// input (hi, lo) in registers, 24 for 6 rows, beside the panel vectors and two broadcasts; the
// outputs themselves live in c between groups.
constexpr int64_t kGroupedMr = 6;

// c[0..R)[0..32) = Σ_g s[g] · Σ_{p ∈ g} (hi[r] + lo[r])[2p..2p+1] · b[p], where a row of a holds hi
// and, k columns later, lo; then + bias. Only the first `cols` columns of c are written.
template <int R>
[[gnu::target("avx512f,avx512bf16")]] void groupedMicroKernel(const uint16_t* a, int64_t lda, int64_t k, int64_t group,
                                                              const uint16_t* b, const float* s, const float* bias,
                                                              float* c, int64_t ldc, int64_t cols) {
  const __mmask16 m0 = firstLanes(cols), m1 = firstLanes(cols - 16);
  const int64_t groupPairs = group / 2;
  for (int64_t g0 = 0; g0 < k / 2; g0 += groupPairs) {
    __m512 hi[R][2], lo[R][2];
    for (int r = 0; r < R; ++r) hi[r][0] = hi[r][1] = lo[r][0] = lo[r][1] = _mm512_setzero_ps();
    for (int64_t p = g0; p < g0 + groupPairs; ++p) {
      const auto b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kNr * 2));
      const auto b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * kNr * 2 + kNr));
      for (int r = 0; r < R; ++r) {
        const __m512bh ah = broadcastPair(a + r * lda + 2 * p), al = broadcastPair(a + r * lda + k + 2 * p);
        hi[r][0] = _mm512_dpbf16_ps(hi[r][0], b0, ah);
        hi[r][1] = _mm512_dpbf16_ps(hi[r][1], b1, ah);
        lo[r][0] = _mm512_dpbf16_ps(lo[r][0], b0, al);
        lo[r][1] = _mm512_dpbf16_ps(lo[r][1], b1, al);
      }
    }
    const float* scale = s + (g0 / groupPairs) * kNr;
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    const bool last = g0 + groupPairs >= k / 2;
    for (int r = 0; r < R; ++r) {
      addGroupToRow(c + r * ldc, _mm512_add_ps(hi[r][0], lo[r][0]), _mm512_add_ps(hi[r][1], lo[r][1]), s0, s1, g0 == 0,
                    last, bias, m0, m1);
    }
  }
}

// groupedMicroKernel<rows> for 1 ≤ rows ≤ R.
template <int R>
[[gnu::target("avx512f,avx512bf16")]] void groupedTailRows(int64_t rows, const uint16_t* a, int64_t lda, int64_t k,
                                                           int64_t group, const uint16_t* b, const float* s,
                                                           const float* bias, float* c, int64_t ldc, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return groupedTailRows<R - 1>(rows, a, lda, k, group, b, s, bias, c, ldc, cols);
  }
  groupedMicroKernel<R>(a, lda, k, group, b, s, bias, c, ldc, cols);
}

}  // namespace

bool canRunAvx512Bf16Gemm() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") != 0;
}

void avx512Bf16Gemm(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, int64_t m, int64_t n,
                    int64_t k, bool accumulate, float* c) {
  const auto* a16 = reinterpret_cast<const uint16_t*>(a);
  const auto* b16 = reinterpret_cast<const uint16_t*>(b);
  const int64_t pairs = (k + 1) / 2, panels = (n + kNr - 1) / kNr, panelSize = pairs * kNr * 2;
  // Each thread packs the panels it takes and runs them over every row, kMc rows at a time.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> packed(static_cast<size_t>((end - begin) * panelSize));
    for (int64_t panel = begin; panel < end; ++panel) {
      packPanel(b16 + panel * kNr * ldb, ldb, k, std::min(kNr, n - panel * kNr),
                packed.data() + (panel - begin) * panelSize);
    }
    for (int64_t i0 = 0; i0 < m; i0 += kMc) {
      for (int64_t panel = begin; panel < end; ++panel) {
        panelRows(a16 + i0 * lda, lda, k, packed.data() + (panel - begin) * panelSize, std::min(kMc, m - i0),
                  c + i0 * n + panel * kNr, n, n - panel * kNr, accumulate);
      }
    }
  });
}

GroupedBf16Panels packGroupedBf16(const c10::BFloat16* values, int64_t ldv, const float* scales, int64_t lds, int64_t n,
                                  int64_t k, int64_t group) {
  const int64_t pairs = k / 2, groups = k / group, panels = (n + kNr - 1) / kNr;
  GroupedBf16Panels packed{std::vector<uint16_t>(static_cast<size_t>(panels * pairs * kNr * 2)),
                           std::vector<float>(static_cast<size_t>(panels * groups * kNr)), n, k, group};
  const auto* v16 = reinterpret_cast<const uint16_t*>(values);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t rows = std::min(kNr, n - panel * kNr);
      packPanel(v16 + panel * kNr * ldv, ldv, k, rows, packed.values.data() + panel * pairs * kNr * 2);
      float* dst = packed.scales.data() + panel * groups * kNr;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) dst[g * kNr + r] = scales[(panel * kNr + r) * lds + g];
      }
    }
  });
  return packed;
}

void avx512Bf16GroupedGemm(const c10::BFloat16* a, int64_t lda, int64_t m, const GroupedBf16Panels& b,
                           const float* bias, float* c) {
  const auto* a16 = reinterpret_cast<const uint16_t*>(a);
  const int64_t n = b.n, k = b.k;
  const int64_t valuesSize = (k / 2) * kNr * 2, scalesSize = (k / b.group) * kNr;
  forEachPanelRowBlock(m, n, kNr, kMc, [&](int64_t panel, int64_t i0, int64_t rows, int64_t cols) {
    const uint16_t* values = b.values.data() + panel * valuesSize;
    const float* scales = b.scales.data() + panel * scalesSize;
    const float* panelBias = bias == nullptr ? nullptr : bias + panel * kNr;
    float* out = c + i0 * n + panel * kNr;
    int64_t r = 0;
    for (; r + kGroupedMr <= rows; r += kGroupedMr) {
      groupedMicroKernel<kGroupedMr>(a16 + (i0 + r) * lda, lda, k, b.group, values, scales, panelBias, out + r * n, n,
                                     cols);
    }
    if (r < rows) {
      groupedTailRows<kGroupedMr - 1>(rows - r, a16 + (i0 + r) * lda, lda, k, b.group, values, scales, panelBias,
                                      out + r * n, n, cols);
    }
  });
}

}  // namespace qpipe::quant::detail
