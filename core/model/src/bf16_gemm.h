// The AVX512-BF16 GEMM behind quant::bf16Matmul where bf16MatmulKernel() is kAvx512Bf16.
// Private to core/model (and its unit test).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace qpipe::quant::detail {

// Whether this CPU can run avx512Bf16Gemm (AVX512-BF16); quant::bf16MatmulKernel() says where
// bf16Matmul uses it.
bool canRunAvx512Bf16Gemm();

// c [M, N] (row stride N) = a · bᵀ, or += when accumulate, for bf16 a [M, K] (row stride lda) and
// b [N, K] (row stride ldb), every product exact in fp32 and the sums made in one fixed order per
// output. M, N, K > 0.
void avx512Bf16Gemm(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, int64_t m, int64_t n,
                    int64_t k, bool accumulate, float* c);

// The panels avx512Bf16GroupedGemm reads: b [N, K] (values exact in bf16) and one fp32 scale per
// row and group of `group` columns, laid out once. K and group even, group divides K.
struct GroupedBf16Panels {
  std::vector<uint16_t> values;
  std::vector<float> scales;
  int64_t n = 0, k = 0, group = 0;
};
// values bf16 [N, K] (row stride ldv), scales fp32 [N, K / group] (row stride lds).
GroupedBf16Panels packGroupedBf16(const c10::BFloat16* values, int64_t ldv, const float* scales, int64_t lds, int64_t n,
                                  int64_t k, int64_t group);

// c [M, N] (row stride N) = Σ_g s[n, g] · Σ_{k ∈ g} (a[m, k] + a[m, K + k]) · b[n, k] (+ bias[n] when
// bias is not null), for bf16 a [M, 2K] (row stride lda): two parts of one input side by side.
// Each product is exact; each group's two partial sums (over its column pairs in order) are added,
// scaled and added to the output in group order, so an output's bits depend on its row and column
// only. M > 0.
void avx512Bf16GroupedGemm(const c10::BFloat16* a, int64_t lda, int64_t m, const GroupedBf16Panels& b,
                           const float* bias, float* c);

}  // namespace qpipe::quant::detail
