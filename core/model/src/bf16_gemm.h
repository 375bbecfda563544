// The AVX512-BF16 GEMM behind quant::bf16Matmul where bf16MatmulKernel() is kAvx512Bf16.
// Private to core/model (and its unit test).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace qpipe::quant::detail {

// Whether this CPU can run avx512Bf16Gemm (AVX512-BF16); quant::bf16MatmulKernel() says where
// bf16Matmul uses it.
bool canRunAvx512Bf16Gemm();

// c [M, N] (row stride N) = a · bᵀ, or += when accumulate, for bf16 a [M, K] (row stride lda) and
// b [N, K] (row stride ldb), every product exact in fp32 and the sums made in one fixed order per
// output. M, N, K > 0.
void avx512Bf16Gemm(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, int64_t m, int64_t n,
                    int64_t k, bool accumulate, float* c);

}  // namespace qpipe::quant::detail
