// The AVX512-VNNI GEMM behind GroupedInt8Linear: fp32 input split into two int8 parts, integer
// weight codes, exact int32 sums. Private to core/model (and its unit test and bench).
#pragma once

#include <cstdint>
#include <vector>

namespace qpipe::quant::detail {

// Whether this CPU can run avx512VnniGroupedGemm (AVX512-VNNI, -BW and -VL).
bool canRunAvx512VnniGemm();

// The input's block: the widest multiple of 4 that divides `group` and is at most 128, or 0 when
// there is none of at least 16. Each block of a row has its own input scale; with at most 128
// columns a block's int32 sum cannot overflow, and below 16 the per-block scaling would outweigh
// the products (grouped_int8_gemm.cpp).
int64_t groupedInt8Block(int64_t group);

// The panels avx512VnniGroupedGemm reads: integer values v [N, K] within [-128, 127] and one fp32
// scale per row and group of `group` columns, laid out once. groupedInt8Block(group) > 0 and group
// divides K.
struct GroupedInt8Panels {
  std::vector<uint8_t> values;  // v + 128
  std::vector<float> scales;
  int64_t n = 0, k = 0, group = 0, block = 0;
};
// values int8 [N, K] (row stride ldv), scales fp32 [N, K / group] (row stride lds).
GroupedInt8Panels packGroupedInt8(const int8_t* values, int64_t ldv, const float* scales, int64_t lds, int64_t n,
                                  int64_t k, int64_t group);

// c [M, N] (row stride N) = Σ_g s[n, g] · Σ_{k ∈ g} x̂[m, k] · v[n, k] (+ bias[n] when bias is not
// null), for fp32 x [M, K] (row stride ldx). x̂ is x held in two int8 parts per block of b.block
// columns: with d = max|x| over the block / 127,
//   x̂ = d · (h + l / 256),  h = round(x / d) ∈ [-127, 127],  l = round(256 · (x / d − h)) ∈ [-128, 127],
// so |x − x̂| ≤ d / 256 plus the rounding of x / d (l = 128, where 256·(x / d − h) ≥ 127.5, is clamped
// to 127). Each block's Σ (256·h + l)·v is an exact
// int32; it is scaled by s · d / 256 and added to the output in block order, so an output's bits
// depend on its row and column only. A block holding a NaN or an infinity gives NaN outputs for
// its row; one whose d is below FLT_MIN (max|x| under about 1.5e-36) counts as zeros. M > 0.
void avx512VnniGroupedGemm(const float* x, int64_t ldx, int64_t m, const GroupedInt8Panels& b, const float* bias,
                           float* c);

}  // namespace qpipe::quant::detail
