// Exact int8 GEMMs (quant::Int8Weight, quant::int8Matmul).
//
// Three kernels give the same int32 results, so which one a host runs never shows in a result:
// - ATen's at::_int_mm (oneDNN), on CPUs with VNNI, where it accumulates without saturating.
// - Without VNNI, at::_int_mm either saturates (oneDNN's s8 kernel adds pairs of products in
//   int16) or runs a scalar loop. There the packed AVX2 kernel below widens both operands to int16 and multiplies with
//   vpmaddwd, which adds each pair of products in int32: exact, and on a Zen 3 core about 1.4× MKL's fp32 GEMM of the
//   same shape (docs/benchmarks.md).
// - Elsewhere a GEMM in double, where every partial sum of int8 products is an exact integer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qpipe/error.h"
#include "qpipe/quant.h"

namespace qpipe::quant {

namespace {

// The packed layout: the weight's N rows in panels of kNr; within a panel, for each pair of
// columns k = 2p, 2p+1, the kNr rows' two values side by side ([panel][p][row][2] int8). N is
// padded to a whole panel and K to an even count, with zeros.
constexpr int64_t kNr = 16;
// Rows of the output a micro-kernel call computes: 4 × 16 int32 sums live in 8 registers, with
// room for the operands (5 rows spill under GCC 12 and run 35 % slower).
constexpr int64_t kMr = 4;
// Blocking: a panel's kKc columns (4 KiB packed) stay in L1 while kMc rows of the widened input
// (kMc · kKc · 2 bytes = 96 KiB) stay in L2.
constexpr int64_t kKc = 256, kMc = 192;

// at::_int_mm where it is both exact and fast: oneDNN's VNNI kernel. Without VNNI, LibTorch's CPU
// build runs either oneDNN's saturating s8 kernel or a scalar loop (exact, but some 100× slower
// than an fp32 GEMM: seen on a Zen 3 host), so VNNI is required first; then the worst case is
// tried rather than the flags trusted, which catches an ISA cap set in the environment
// (ONEDNN_MAX_CPU_ISA).
bool intMmIsBest() {
  static const bool best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") == 0 && __builtin_cpu_supports("avxvnni") == 0) return false;
    at::Tensor a = at::full({8, 64}, 127, at::kChar);
    at::Tensor b = at::full({64, 8}, 127, at::kChar);
    a[1].fill_(-128);
    b.select(1, 1).fill_(-128);
    try {
      return at::equal(at::_int_mm(a, b).to(at::kLong), at::matmul(a.to(at::kLong), b.to(at::kLong)));
    } catch (const std::exception&) {
      return false;
    }
  }();
  return best;
}

bool hasAvx2() {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return avx2;
}

// 16 rows × 16 bytes → 8 column pairs × 16 rows: an 8 × 8 transpose of 16-bit units, twice.
[[gnu::target("avx2")]] void packPanelBlock(const int8_t* w, int64_t k, int8_t* dst) {
  for (int half = 0; half < 2; ++half) {
    __m128i r[8];
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (half * 8 + i) * k));
    }
    const __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    const __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    const __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    const __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    const __m128i out[8] = {_mm_unpacklo_epi64(b0, b4), _mm_unpackhi_epi64(b0, b4), _mm_unpacklo_epi64(b1, b5),
                            _mm_unpackhi_epi64(b1, b5), _mm_unpacklo_epi64(b2, b6), _mm_unpackhi_epi64(b2, b6),
                            _mm_unpacklo_epi64(b3, b7), _mm_unpackhi_epi64(b3, b7)};
    for (int p = 0; p < 8; ++p) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + p * kNr * 2 + half * 16), out[p]);
    }
  }
}

// One panel: rows [n0, n0 + rows) of w [N, K] into dst ([pairs][kNr][2]), zero-filled beyond.
[[gnu::target("avx2")]] void packPanel(const int8_t* w, int64_t k, int64_t rows, int8_t* dst) {
  int64_t done = 0;
  if (rows == kNr) {
    for (; done + 16 <= k; done += 16) packPanelBlock(w + done, k, dst + (done / 2) * kNr * 2);
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = done; c < k; ++c) dst[(c / 2) * kNr * 2 + r * 2 + (c & 1)] = w[r * k + c];
  }
}

// c[0..R)[0..16) (+)= Σ_p a[r][2p..2p+1] · b[p][col][0..1], over `pairs` column pairs.
template <int R>
[[gnu::target("avx2"), gnu::always_inline]] inline void microKernel(const int16_t* a, int64_t lda, const int8_t* b,
                                                                    int64_t pairs, int32_t* c, int64_t ldc,
                                                                    bool first) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + p * 32)));
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + p * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m256i av = _mm256_set1_epi32(pair);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, b0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, b1));
    }
  }
  for (int r = 0; r < R; ++r) {
    auto* out = reinterpret_cast<__m256i*>(c + r * ldc);
    if (!first) {
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_loadu_si256(out));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_loadu_si256(out + 1));
    }
    _mm256_storeu_si256(out, acc[r][0]);
    _mm256_storeu_si256(out + 1, acc[r][1]);
  }
}

template <int R>
[[gnu::target("avx2")]] void microKernelCall(const int16_t* a, int64_t lda, const int8_t* b, int64_t pairs, int32_t* c,
                                             int64_t ldc, bool first) {
  microKernel<R>(a, lda, b, pairs, c, ldc, first);
}

// Rows [0, rows) of one kNr-wide output block; rows < kMr at the bottom edge.
[[gnu::target("avx2")]] void rowsKernel(const int16_t* a, int64_t lda, const int8_t* b, int64_t pairs, int64_t rows,
                                        int32_t* c, int64_t ldc, bool first) {
  int64_t r = 0;
  for (; r + kMr <= rows; r += kMr) microKernel<kMr>(a + r * lda, lda, b, pairs, c + r * ldc, ldc, first);
  switch (rows - r) {
    case 3:
      microKernelCall<3>(a + r * lda, lda, b, pairs, c + r * ldc, ldc, first);
      break;
    case 2:
      microKernelCall<2>(a + r * lda, lda, b, pairs, c + r * ldc, ldc, first);
      break;
    case 1:
      microKernelCall<1>(a + r * lda, lda, b, pairs, c + r * ldc, ldc, first);
      break;
    default:
      break;
  }
}

// int8 [M, K] → int16 [M, 2·pairs], the padding column zero.
[[gnu::target("avx2")]] void widenRows(const int8_t* a, int64_t m, int64_t k, int64_t lda, int16_t* out, int64_t ldo) {
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* src = a + i * lda;
    int16_t* dst = out + i * ldo;
    for (int64_t c = 0; c < k; ++c) dst[c] = src[c];
    for (int64_t c = k; c < ldo; ++c) dst[c] = 0;
  }
}

[[gnu::target("avx2")]] void packedGemm(const int8_t* a8, int64_t m, int64_t k, int64_t lda, const int8_t* packed,
                                        int64_t n, int32_t* c) {
  const int64_t pairs = (k + 1) / 2, ldw = 2 * pairs, panels = (n + kNr - 1) / kNr;
  std::vector<int16_t> a(static_cast<size_t>(m * ldw));
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k)), [&](int64_t begin, int64_t end) {
    widenRows(a8 + begin * lda, end - begin, k, lda, a.data() + begin * ldw, ldw);
  });
  // Each thread takes whole panels; a panel's rows run to the end of K before the next panel.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, m * k));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    alignas(32) int32_t edge[kMc * kNr];
    for (int64_t i0 = 0; i0 < m; i0 += kMc) {
      const int64_t rows = std::min(kMc, m - i0);
      for (int64_t p0 = 0; p0 < pairs; p0 += kKc / 2) {
        const int64_t count = std::min(kKc / 2, pairs - p0);
        for (int64_t panel = begin; panel < end; ++panel) {
          const int8_t* b = packed + (panel * pairs + p0) * kNr * 2;
          const int16_t* ap = a.data() + i0 * ldw + 2 * p0;
          const int64_t cols = std::min(kNr, n - panel * kNr);
          int32_t* cp = c + i0 * n + panel * kNr;
          if (cols == kNr) {
            rowsKernel(ap, ldw, b, count, rows, cp, n, p0 == 0);
            continue;
          }
          // The last, partial panel goes through a full-width scratch block.
          for (int64_t r = 0; r < rows && p0 != 0; ++r) std::memcpy(edge + r * kNr, cp + r * n, cols * sizeof(int32_t));
          rowsKernel(ap, ldw, b, count, rows, edge, kNr, p0 == 0);
          for (int64_t r = 0; r < rows; ++r) std::memcpy(cp + r * n, edge + r * kNr, cols * sizeof(int32_t));
        }
      }
    }
  });
}

}  // namespace

Int8Weight::Int8Weight(const at::Tensor& qweight, Int8Kernel kernel) {
  QPIPE_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar,
              "Int8Weight takes a 2-D int8 [N, K] weight, got ", qweight.sizes(), " ", qweight.scalar_type());
  n_ = qweight.size(0);
  k_ = qweight.size(1);
  const bool cpu = qweight.device().is_cpu();
  const bool packedApplies =
      cpu && hasAvx2() && (kernel == Int8Kernel::kPacked || (kernel == Int8Kernel::kBest && !intMmIsBest()));
  if (!packedApplies) {
    kernel_ = kernel == Int8Kernel::kReference || (cpu && !intMmIsBest()) ? Int8Kernel::kReference : Int8Kernel::kBest;
    weight_ = qweight;
    return;
  }
  kernel_ = Int8Kernel::kPacked;
  const at::Tensor w = qweight.contiguous();
  const int64_t pairs = (k_ + 1) / 2, panels = (n_ + kNr - 1) / kNr;
  weight_ = at::zeros({panels * pairs * kNr * 2}, qweight.options());
  const int8_t* src = w.const_data_ptr<int8_t>();
  int8_t* dst = weight_.mutable_data_ptr<int8_t>();
  at::parallel_for(0, panels, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kNr * k_)), [&](int64_t b, int64_t e) {
    for (int64_t panel = b; panel < e; ++panel) {
      packPanel(src + panel * kNr * k_, k_, std::min(kNr, n_ - panel * kNr), dst + panel * pairs * kNr * 2);
    }
  });
}

at::Tensor Int8Weight::matmul(const at::Tensor& a) const {
  QPIPE_CHECK(a.dim() == 2 && a.scalar_type() == at::kChar && a.size(1) == k_, "an int8 GEMM with a [", n_, ", ", k_,
              "] weight takes int8 [M, ", k_, "], got ", a.sizes(), " ", a.scalar_type());
  switch (kernel_) {
    case Int8Kernel::kPacked: {
      const at::Tensor x = a.stride(1) == 1 ? a : a.contiguous();
      at::Tensor out = at::empty({x.size(0), n_}, x.options().dtype(at::kInt));
      if (x.size(0) == 0 || n_ == 0) return out;
      if (k_ == 0) return out.zero_();
      packedGemm(x.const_data_ptr<int8_t>(), x.size(0), k_, x.stride(0), weight_.const_data_ptr<int8_t>(), n_,
                 out.mutable_data_ptr<int32_t>());
      return out;
    }
    case Int8Kernel::kBest:
      if (a.device().is_cpu()) return at::_int_mm(a, weight_.t());
      break;
    case Int8Kernel::kReference:
      break;
  }
  // |product| ≤ 2^14, so a sum of up to 2^38 of them is an exact double.
  return at::matmul(a.to(at::kDouble), weight_.t().to(at::kDouble)).to(at::kInt);
}

at::Tensor int8Matmul(const at::Tensor& a, const at::Tensor& b) {
  QPIPE_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kChar && a.dim() == 2 && b.dim() == 2,
              "int8Matmul takes two 2-D int8 tensors");
  return Int8Weight(b.t()).matmul(a);
}

}  // namespace qpipe::quant
