// The grouped int8 GEMM of weight-only Linears (GroupedInt8Linear) and of W4A4 FP4 ones
// (Fp4Linear) on CPUs with AVX512-VNNI.
//
// Why: on AMD CPUs MKL's fp32 GEMM runs its AVX2 code, and on Zen 4 a bf16 dot product (vdpbf16ps)
// is only twice an fp32 FMA, so an input split into two bf16 parts gains nothing there. vpdpbusd
// makes 64 int8 products a zmm instruction against an FMA's 16: two int8 parts of the input against
// the weight's integer codes are half an fp32 GEMM's instructions, with exact integer sums.
//
// The arithmetic per output, block after block: vpdpbusd multiplies unsigned by signed bytes, and
// only its second operand can be a broadcast, so the weight is stored as v + 128 (unsigned) and
// the input parts h, l stay signed:
//   Σ h·(v + 128) = Σ h·v + 128·Σ h,
// so T = 256·S_h + S_l − 128·(256·Σh + Σl) = Σ (256·h + l)·v, whose magnitude is at most
// 128 · 32640 · 128 < 2³¹ for a block of 128 columns; no partial sum leaves int32 either
// (|256·S_h| ≤ 1.07e9, |S_l − 128·(256·Σh + Σl)| ≤ 5.4e8). The correction, subtracted, starts the
// l sums; T is scaled by s · d / 256 and added to the output in fp32. An input of one part (FP4
// codes) has T = S_h − 128·Σh, the correction starting the h sums.
// GCC 12.2 warns that the "undefined" register behind several AVX-512 intrinsics (_mm512_cvtepi32_ps,
// _mm512_roundscale_ps, …) may be used uninitialized: its bug 105593, fixed in 12.3. The pragma has
// to precede the intrinsics' header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "grouped_int8_gemm.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "panel_rows.h"
#include "qpipe/error.h"

namespace qpipe::quant::detail {

namespace {

// The packed layout of the weight: its N rows in panels of kNr; within a panel, for each run of
// four columns k = 4p..4p+3, the kNr rows' four bytes side by side ([panel][p][row][4]). N is
// padded to a whole panel with zeros (v = −128: those outputs are never stored).
constexpr int64_t kNr = 32;
// Output rows per micro-kernel call: each row's 32 outputs have two int32 sums per part (h, l) in
// registers, 16 for 4 rows. 5 or 6 rows ran no faster on Zen 4 (38.5–39 ms against 38 for
// 4096 × 576 × 1536, one thread).
constexpr int64_t kMr = 4;
// Rows of the input kept in L2 while a thread walks its panels (256 × 2K bytes for two parts: 768
// KiB at K = 1536).
constexpr int64_t kMc = 256;

// The widest block whose sums stay within int32 (above); the narrowest worth its per-block
// scaling step (one per 4 quads of products at 16, as NVFP4's blocks: 1.23× the fp32 GEMM in a
// SmolLM2 eval, docs/benchmarks.md).
constexpr int64_t kMaxBlock = 128, kMinBlock = 16;

[[gnu::target("avx512f,avx512bw,avx512vl")]] void splitRow(const float* x, int64_t k, int64_t block, int8_t* h,
                                                           int8_t* l, float* scales, int32_t* offsets) {
  for (int64_t b0 = 0; b0 < k; b0 += block) {
    // max_ps would drop a NaN; x · 0 keeps a NaN or an infinity as NaN in the probe's sum.
    __m512 maxAbs = _mm512_setzero_ps(), probe = _mm512_setzero_ps();
    for (int64_t j = 0; j < block; j += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(firstLanes(block - j), x + b0 + j);
      maxAbs = _mm512_max_ps(maxAbs, _mm512_abs_ps(v));
      probe = _mm512_add_ps(probe, _mm512_mul_ps(v, _mm512_setzero_ps()));
    }
    const float d = _mm512_reduce_max_ps(maxAbs) / 127.0F;
    const int64_t index = b0 / block;
    const bool finite = std::isfinite(_mm512_reduce_add_ps(probe));
    // A subnormal d is too coarse for x / d to stay within ±127.5.
    if (!finite || d < std::numeric_limits<float>::min()) {
      scales[index] = finite ? 0.0F : std::numeric_limits<float>::quiet_NaN();
      offsets[index] = 0;
      std::memset(h + b0, 0, static_cast<size_t>(block));
      std::memset(l + b0, 0, static_cast<size_t>(block));
      continue;
    }
    const __m512 dv = _mm512_set1_ps(d), lMax = _mm512_set1_ps(127.0F), two8 = _mm512_set1_ps(256.0F);
    __m512i hSum = _mm512_setzero_si512(), lSum = _mm512_setzero_si512();
    for (int64_t j = 0; j < block; j += 16) {
      const __mmask16 mj = firstLanes(block - j);
      const __m512 t = _mm512_div_ps(_mm512_maskz_loadu_ps(mj, x + b0 + j), dv);
      const __m512 hf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // t − hf is exact (|t| < 128, |t − hf| ≤ 1/2), and so is its product with 256.
      const __m512 lf = _mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t, hf), two8),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                      lMax);
      const __m512i hi = _mm512_cvtps_epi32(hf), li = _mm512_cvtps_epi32(lf);
      hSum = _mm512_add_epi32(hSum, hi);
      lSum = _mm512_add_epi32(lSum, li);
      _mm_mask_storeu_epi8(h + b0 + j, mj, _mm512_cvtepi32_epi8(hi));
      _mm_mask_storeu_epi8(l + b0 + j, mj, _mm512_cvtepi32_epi8(li));
    }
    scales[index] = d / 256.0F;
    offsets[index] = 128 * (256 * _mm512_reduce_add_epi32(hSum) + _mm512_reduce_add_epi32(lSum));
  }
}

// The four input bytes at `p` in every 32-bit lane, as vpdpbusd's signed operand.
[[gnu::target("avx512f"), gnu::always_inline]] inline __m512i broadcastQuad(const int8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm512_set1_epi32(bits);
}

// c[0..R)[0..32) = Σ_blocks s[g] · scale[r] · T[r] (+ bias), for the R rows of the input at `row`
// (T = 256·S_h + S_l, or S_h for one part, each less its correction). Only the first `cols`
// columns of c are written.
template <int R, int Parts>
[[gnu::target("avx512f,avx512bw,avx512vnni")]] void microKernel(const GroupedInt8Input& x, int64_t row, int64_t k,
                                                                const GroupedInt8Panels& b, const uint8_t* values,
                                                                const float* s, const float* bias, float* c,
                                                                int64_t ldc, int64_t cols) {
  const __mmask16 m0 = firstLanes(cols), m1 = firstLanes(cols - 16);
  const int64_t block = b.block, blocks = k / block, blockQuads = block / 4;
  const int8_t* a = x.parts.data() + row * Parts * k;
  const float* d = x.scales.data() + row * blocks;
  const int32_t* off = x.offsets.data() + row * blocks;
  for (int64_t i = 0; i < blocks; ++i) {
    // With two parts the correction starts the l sums, with one the h sums.
    __m512i hs[R][2], ls[R][2];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-off[r * blocks + i]);
      hs[r][0] = hs[r][1] = Parts == 2 ? _mm512_setzero_si512() : start;
      if constexpr (Parts == 2) ls[r][0] = ls[r][1] = start;
    }
    for (int64_t p = i * blockQuads; p < (i + 1) * blockQuads; ++p) {
      const __m512i w0 = _mm512_loadu_si512(values + p * kNr * 4);
      const __m512i w1 = _mm512_loadu_si512(values + p * kNr * 4 + 64);
      for (int r = 0; r < R; ++r) {
        const __m512i ah = broadcastQuad(a + r * Parts * k + 4 * p);
        hs[r][0] = _mm512_dpbusd_epi32(hs[r][0], w0, ah);
        hs[r][1] = _mm512_dpbusd_epi32(hs[r][1], w1, ah);
        if constexpr (Parts == 2) {
          const __m512i al = broadcastQuad(a + r * 2 * k + k + 4 * p);
          ls[r][0] = _mm512_dpbusd_epi32(ls[r][0], w0, al);
          ls[r][1] = _mm512_dpbusd_epi32(ls[r][1], w1, al);
        }
      }
    }
    const float* scale = s + (i * block / b.group) * kNr;
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    const bool last = i + 1 == blocks;
    for (int r = 0; r < R; ++r) {
      const __m512 dr = _mm512_set1_ps(d[r * blocks + i]);
      __m512i sum0 = hs[r][0], sum1 = hs[r][1];
      if constexpr (Parts == 2) {
        sum0 = _mm512_add_epi32(_mm512_slli_epi32(sum0, 8), ls[r][0]);
        sum1 = _mm512_add_epi32(_mm512_slli_epi32(sum1, 8), ls[r][1]);
      }
      const __m512 t0 = _mm512_cvtepi32_ps(sum0), t1 = _mm512_cvtepi32_ps(sum1);
      addGroupToRow(c + r * ldc, t0, t1, _mm512_mul_ps(s0, dr), _mm512_mul_ps(s1, dr), i == 0, last, bias, m0, m1);
    }
  }
}

// microKernel<rows, Parts> for 1 ≤ rows ≤ R.
template <int R, int Parts>
[[gnu::target("avx512f,avx512bw,avx512vnni")]] void tailRows(int64_t rows, const GroupedInt8Input& x, int64_t row,
                                                             int64_t k, const GroupedInt8Panels& b,
                                                             const uint8_t* values, const float* s, const float* bias,
                                                             float* c, int64_t ldc, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return tailRows<R - 1, Parts>(rows, x, row, k, b, values, s, bias, c, ldc, cols);
  }
  microKernel<R, Parts>(x, row, k, b, values, s, bias, c, ldc, cols);
}

// The GEMM over the input's `Parts` parts.
template <int Parts>
void gemmParts(const GroupedInt8Input& x, const GroupedInt8Panels& b, const float* bias, float* c) {
  const int64_t n = b.n, k = b.k;
  const int64_t valuesSize = (k / 4) * kNr * 4, scalesSize = (k / b.group) * kNr;
  forEachPanelRowBlock(x.m, n, kNr, kMc, [&](int64_t panel, int64_t i0, int64_t rows, int64_t cols) {
    const uint8_t* values = b.values.data() + panel * valuesSize;
    const float* scales = b.scales.data() + panel * scalesSize;
    const float* panelBias = bias == nullptr ? nullptr : bias + panel * kNr;
    float* out = c + i0 * n + panel * kNr;
    int64_t r = 0;
    for (; r + kMr <= rows; r += kMr) {
      microKernel<kMr, Parts>(x, i0 + r, k, b, values, scales, panelBias, out + r * n, n, cols);
    }
    if (r < rows) tailRows<kMr - 1, Parts>(rows - r, x, i0 + r, k, b, values, scales, panelBias, out + r * n, n, cols);
  });
}

}  // namespace

bool canRunAvx512VnniGemm() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
         __builtin_cpu_supports("avx512vl") != 0;
}

int64_t groupedInt8Block(int64_t group) {
  if (group <= 0 || group % 4 != 0) return 0;
  for (int64_t block = std::min(group, kMaxBlock) / 4 * 4; block >= kMinBlock; block -= 4) {
    if (group % block == 0) return block;
  }
  return 0;
}

GroupedInt8Panels packGroupedInt8(const int8_t* values, int64_t ldv, const float* scales, int64_t lds, int64_t n,
                                  int64_t k, int64_t group) {
  const int64_t quads = k / 4, groups = k / group, panels = (n + kNr - 1) / kNr;
  GroupedInt8Panels packed{std::vector<uint8_t>(static_cast<size_t>(panels * quads * kNr * 4), 0),
                           std::vector<float>(static_cast<size_t>(panels * groups * kNr), 0.0F),
                           n,
                           k,
                           group,
                           groupedInt8Block(group)};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // Locals: a store through dst (bytes) may alias a captured value, which is then read again.
    const int64_t panelQuads = quads, rowStride = ldv;
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t rows = std::min(kNr, n - panel * kNr);
      uint8_t* dst = packed.values.data() + panel * quads * kNr * 4;
      float* scaleDst = packed.scales.data() + panel * groups * kNr;
      // Four codes at a time, the panel's rows side by side, so that the stores run on: a code plus
      // 128, as a byte, is the code with its sign bit flipped. (Row by row, every store was to
      // another cache line: 9 % of a data-free W4A16 run's samples.)
      const int8_t* src = values + panel * kNr * rowStride;
      for (int64_t p = 0; p < panelQuads; ++p) {
        for (int64_t r = 0; r < rows; ++r) {
          uint32_t word = 0;
          std::memcpy(&word, src + r * rowStride + 4 * p, sizeof word);
          word ^= 0x80808080U;
          std::memcpy(dst + (p * kNr + r) * 4, &word, sizeof word);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) scaleDst[g * kNr + r] = scales[(panel * kNr + r) * lds + g];
      }
    }
  });
  return packed;
}

GroupedInt8Input splitGroupedInt8(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t block) {
  const int64_t blocks = k / block;
  GroupedInt8Input split{std::vector<int8_t>(static_cast<size_t>(m * 2 * k)),
                         std::vector<float>(static_cast<size_t>(m * blocks)),
                         std::vector<int32_t>(static_cast<size_t>(m * blocks)),
                         m,
                         k,
                         block,
                         2};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* row = split.parts.data() + r * 2 * k;
      splitRow(x + r * ldx, k, block, row, row + k, split.scales.data() + r * blocks,
               split.offsets.data() + r * blocks);
    }
  });
  return split;
}

GroupedInt8Input groupedInt8Codes(const int8_t* codes, int64_t ldc, const float* scales, int64_t m, int64_t k,
                                  int64_t block) {
  const int64_t blocks = k / block;
  GroupedInt8Input input{std::vector<int8_t>(static_cast<size_t>(m * k)),
                         std::vector<float>(scales, scales + m * blocks),
                         std::vector<int32_t>(static_cast<size_t>(m * blocks)),
                         m,
                         k,
                         block,
                         1};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(input.parts.data() + r * k, codes + r * ldc, static_cast<size_t>(k));
      for (int64_t i = 0; i < blocks; ++i) {
        int32_t sum = 0;
        for (int64_t j = i * block; j < (i + 1) * block; ++j) sum += codes[r * ldc + j];
        input.offsets[r * blocks + i] = 128 * sum;
      }
    }
  });
  return input;
}

void avx512VnniGroupedGemm(const GroupedInt8Input& x, const GroupedInt8Panels& b, const float* bias, float* c) {
  QPIPE_CHECK(x.count == 1 || x.count == 2, "a grouped int8 input of ", x.count, " parts");
  if (x.count == 2) return gemmParts<2>(x, b, bias, c);
  gemmParts<1>(x, b, bias, c);
}

}  // namespace qpipe::quant::detail
