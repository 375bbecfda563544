// The AVX512-VNNI GEMM behind GroupedInt8Linear (an fp32 input split into two int8 parts) and
// Fp4Linear (FP4 input codes, one part): integer weight codes, exact int32 sums per block. Private
// to core/model (and its unit test and bench).
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

// An input for avx512VnniGroupedGemm: per row its `count` int8 parts of K, side by side; per row and
// block of `block` columns the scale of one unit of the combined part and the correction
// 128·Σ(combined part), which the kernel subtracts for the weight's +128.
struct GroupedInt8Input {
  std::vector<int8_t> parts;
  std::vector<float> scales;
  std::vector<int32_t> offsets;
  int64_t m = 0, k = 0, block = 0;
  int count = 0;  // 1 or 2
};

// fp32 x [M, K] (row stride ldx) in two int8 parts per block: with d = max|x| over the block / 127,
//   x̂ = d · (h + l / 256),  h = round(x / d) ∈ [-127, 127],  l = round(256 · (x / d − h)) ∈ [-128, 127],
// so |x − x̂| ≤ d / 256 plus the rounding of x / d (l = 128, where 256·(x / d − h) ≥ 127.5, is clamped
// to 127). The combined part is 256·h + l, its unit d / 256. A block holding a NaN or an infinity
// gets a NaN scale (NaN outputs for its row); one whose d is below FLT_MIN (max|x| under about
// 1.5e-36) counts as zeros.
GroupedInt8Input splitGroupedInt8(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t block);
// Integer codes [M, K] (row stride ldc) within [-127, 127], each block's unit scales[m, block]
// (contiguous [M, K / block]): an input already quantized, one part.
GroupedInt8Input groupedInt8Codes(const int8_t* codes, int64_t ldc, const float* scales, int64_t m, int64_t k,
                                  int64_t block);

// c [M, N] (row stride N) = Σ_blocks s[n, g] · unit[m, block] · Σ_{k ∈ block} part[m, k] · v[n, k]
// (+ bias[n] when bias is not null), part the input's combined part, with x.block == b.block and
// x.k == b.k. Each block's sum is an exact int32 (|part| ≤ 32640 and a block of at most 128: below
// 2³¹); it is scaled and added to the output in block order, so an output's bits depend on its row
// and column only. M > 0.
void avx512VnniGroupedGemm(const GroupedInt8Input& x, const GroupedInt8Panels& b, const float* bias, float* c);

}  // namespace qpipe::quant::detail
