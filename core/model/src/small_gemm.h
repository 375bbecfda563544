// The fp32 GEMM of Linear and of QuantLinear's float path for inputs of few rows. Private to
// core/model.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace qpipe::detail {

// Rows (tokens) up to which smallLinear applies.
constexpr int64_t kSmallGemmRows = 64;

// y = x · wᵀ (+ bias) for an fp32 CPU x [..., K] of at most kSmallGemmRows rows and an fp32 w
// [N, K]: where MKL's sgemm packs the whole weight for a few rows (the report's probe, 32 tokens a
// layer), at a cost equal to its arithmetic, this reads the weight rows as they are. Each output
// is 16 fused multiply-add lanes, lane l over k ≡ l (mod 16) in order, then summed in pairs (lanes
// l and l + 8, then + 4, + 2, + 1), plus the bias: its bits depend on its row of x and its row of w
// only, whatever M, N or the thread count. Unset where it does not apply: outside a
// qpipe::FewRowsGemm scope, more rows, another dtype or device, an autograd graph to record, a CPU
// without AVX-512 (there MKL's sgemm, as for more rows).
std::optional<at::Tensor> smallLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

}  // namespace qpipe::detail
