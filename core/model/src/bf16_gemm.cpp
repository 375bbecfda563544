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
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const auto av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
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
  const auto mask = [](int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1); };
  const __mmask16 m0 = mask(cols), m1 = mask(cols - 16);
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

}  // namespace qpipe::quant::detail
