// smallLinear (small_gemm.h): blocks of R rows of x by C rows of w, their R × C outputs each held
// as 16 fp32 lanes (one AVX-512 register, a GCC vector type) while k runs, then summed in one fixed
// order. GCC contracts `acc += x · w` into a fused multiply-add (a unit test checks every output
// against std::fma in the same order).
#include "small_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <vector>

#include "lanes.h"
#include "qpipe/module.h"

namespace qpipe::detail {

namespace {

// acc[r][c] += x_r · w_c over 16 columns, for R rows of x and C rows of w at these strides.
template <int R, int C>
[[gnu::always_inline]] inline void step(Lanes (&acc)[R][C], const float* x, int64_t ldx, const float* w, int64_t ldw) {
  Lanes wv[C];
  for (int c = 0; c < C; ++c) wv[c] = *reinterpret_cast<const UnalignedLanes*>(w + c * ldw);
  for (int r = 0; r < R; ++r) {
    const Lanes xv = *reinterpret_cast<const UnalignedLanes*>(x + r * ldx);
    for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
  }
}

// y[r][c] for the R rows of x and the C rows of w (both of stride k) at y (row stride n).
template <int R, int C>
[[gnu::always_inline]] inline void block(const float* x, const float* w, int64_t k, float* y, int64_t n) {
  Lanes acc[R][C] = {};
  int64_t p = 0;
  for (; p + kLanes <= k; p += kLanes) step<R, C>(acc, x + p, k, w + p, k);
  if (p < k) {  // the last columns, zero-padded to 16
    float xTail[R][kLanes] = {}, wTail[C][kLanes] = {};
    for (int r = 0; r < R; ++r) std::copy(x + r * k + p, x + r * k + k, xTail[r]);
    for (int c = 0; c < C; ++c) std::copy(w + c * k + p, w + c * k + k, wTail[c]);
    step<R, C>(acc, xTail[0], kLanes, wTail[0], kLanes);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) y[r * n + c] = sumLanes(acc[r][c]);
  }
}

// block<rows, cols> for 1 ≤ rows ≤ R and 1 ≤ cols ≤ C.
template <int R, int C>
[[gnu::always_inline]] inline void anyBlock(int64_t rows, int64_t cols, const float* x, const float* w, int64_t k,
                                            float* y, int64_t n) {
  if constexpr (R > 1) {
    if (rows < R) return anyBlock<R - 1, C>(rows, cols, x, w, k, y, n);
  }
  if constexpr (C > 1) {
    if (cols < C) return anyBlock<R, C - 1>(rows, cols, x, w, k, y, n);
  }
  block<R, C>(x, w, k, y, n);
}

struct Gemm {
  const float* x;  // [m, k]
  const float* w;  // [n, k]
  float* y;        // [m, n]
  int64_t m, n, k;
};

// Columns [begin, end) of y, every row.
template <int R, int C>
[[gnu::always_inline]] inline void columns(const Gemm& g, int64_t begin, int64_t end) {
  for (int64_t col = begin; col < end; col += C) {
    for (int64_t row = 0; row < g.m; row += R) {
      anyBlock<R, C>(std::min<int64_t>(R, g.m - row), std::min<int64_t>(C, end - col), g.x + row * g.k, g.w + col * g.k,
                     g.k, g.y + row * g.n + col, g.n);
    }
  }
}

// 6 × 4 blocks: 24 accumulators, 4 weight vectors and an input one in the 32 registers.
[[gnu::target("avx512f,fma")]] void columnsAvx512(const Gemm& g, int64_t begin, int64_t end) {
  columns<6, 4>(g, begin, end);
}

// Only with AVX-512: an AVX2 build of the same lanes (two registers each, 3 × 2 blocks) ran 1.3×
// slower than MKL's sgemm on one thread and no faster on two.
bool hostRuns() {
  static const bool runs = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("fma") != 0;
  }();
  return runs;
}

}  // namespace

std::optional<at::Tensor> smallLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const auto fp32Cpu = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); };
  if (!FewRowsGemm::active() || !hostRuns() || !fp32Cpu(x) || !fp32Cpu(w) || w.dim() != 2 || x.dim() == 0 ||
      x.size(-1) != w.size(1) || w.numel() == 0) {
    return std::nullopt;
  }
  const int64_t n = w.size(0), k = w.size(1), m = x.numel() / k;
  if (m == 0 || m > kSmallGemmRows) return std::nullopt;
  if (bias.defined() && (!fp32Cpu(bias) || bias.dim() != 1 || bias.size(0) != n)) return std::nullopt;
  if (at::GradMode::is_enabled() &&
      (x.requires_grad() || w.requires_grad() || (bias.defined() && bias.requires_grad()))) {
    return std::nullopt;
  }
  const at::Tensor rows = x.reshape({m, k}).contiguous();
  const at::Tensor weight = w.contiguous();
  at::Tensor y = at::empty({m, n}, rows.options());
  const Gemm gemm{rows.const_data_ptr<float>(), weight.const_data_ptr<float>(), y.mutable_data_ptr<float>(), m, n, k};
  // Chunks of at least 2^18 multiply-adds, in whole blocks of four columns.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (m * k * 4)) * 4;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { columnsAvx512(gemm, begin, end); });
  if (bias.defined()) y.add_(bias);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return y.view(sizes);
}

}  // namespace qpipe::detail
