// fused_rows.h. The row kernels are cloned for AVX-512, AVX2 and the baseline; with
// -ffp-contract=off (CMakeLists.txt) no clone fuses a multiply with an add, so all give the same bits.
#include "fused_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lanes.h"

namespace qpipe::detail {

namespace {

bool applies(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() >= 1 && t.stride(-1) == 1 &&
         !(at::GradMode::is_enabled() && t.requires_grad());
}

// Where each row (every index but the last) of t starts, in elements.
std::vector<int64_t> rowOffsets(const at::Tensor& t) {
  const int64_t dims = t.dim() - 1;
  std::vector<int64_t> offsets(static_cast<size_t>(t.numel() / std::max<int64_t>(t.size(-1), 1)));
  for (size_t row = 0; row < offsets.size(); ++row) {
    int64_t rest = static_cast<int64_t>(row), offset = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      offset += rest % t.size(d) * t.stride(d);
      rest /= t.size(d);
    }
    offsets[row] = offset;
  }
  return offsets;
}

// Rows per task: about ATen's grain (32,768 elements), so that a short tensor stays on one thread.
int64_t grain(int64_t rowLength) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(rowLength, 1));
}

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void rmsRow(const float* x, const float* w, int64_t n,
                                                                        float eps, float* y) {
  Lanes sums = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes v = *reinterpret_cast<const UnalignedLanes*>(x + j);
    sums += v * v;
  }
  if (j < n) {  // the last elements, zero-padded to 16: a lane plus 0 · 0 is the lane
    float tail[kLanes] = {};
    std::copy(x + j, x + n, tail);
    const Lanes v = *reinterpret_cast<const UnalignedLanes*>(tail);
    sums += v * v;
  }
  const float scale = 1.0f / std::sqrt(sumLanes(sums) / static_cast<float>(n) + eps);
  for (j = 0; j < n; ++j) y[j] = w[j] * (x[j] * scale);
}

// transformers' apply_rotary_pos_emb on one head's row: t·cos + cat(-t[h:], t[:h])·sin.
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void rotaryRow(const float* t, const float* c,
                                                                           const float* s, int64_t dim, float* y) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) y[j] = t[j] * c[j] + -t[j + half] * s[j];
  for (int64_t j = half; j < dim; ++j) y[j] = t[j] * c[j] + t[j - half] * s[j];
}

}  // namespace

std::optional<at::Tensor> rmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!applies(x) || !applies(weight) || weight.dim() != 1 || weight.size(0) != x.size(-1)) return std::nullopt;
  const int64_t n = x.size(-1);
  const std::vector<int64_t> offsets = rowOffsets(x);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* src = x.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  float* dst = y.mutable_data_ptr<float>();
  // ATen adds eps as a float scalar to a float tensor.
  const auto epsilon = static_cast<float>(eps);
  at::parallel_for(0, static_cast<int64_t>(offsets.size()), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) rmsRow(src + offsets[row], w, n, epsilon, dst + row * n);
  });
  return y;
}

std::optional<at::Tensor> rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  if (!applies(t) || !applies(cos) || !applies(sin) || t.dim() != 4 || cos.dim() != 3 || !cos.is_contiguous() ||
      !sin.is_contiguous() || cos.sizes() != sin.sizes()) {
    return std::nullopt;
  }
  const int64_t batch = t.size(0), seq = t.size(1), heads = t.size(2), dim = t.size(3);
  if (dim % 2 != 0 || (cos.size(0) != 1 && cos.size(0) != batch) || cos.size(1) != seq || cos.size(2) != dim) {
    return std::nullopt;
  }
  at::Tensor y = at::empty({batch, heads, seq, dim}, t.options().memory_format(at::MemoryFormat::Contiguous));
  const float* src = t.const_data_ptr<float>();
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  float* dst = y.mutable_data_ptr<float>();
  const int64_t cosBatchStride = cos.size(0) == 1 ? 0 : seq * dim;
  at::parallel_for(0, batch * seq * heads, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (seq * heads), p = row / heads % seq, h = row % heads;
      const int64_t at = b * cosBatchStride + p * dim;
      rotaryRow(src + b * t.stride(0) + p * t.stride(1) + h * t.stride(2), c + at, s + at, dim,
                dst + ((b * heads + h) * seq + p) * dim);
    }
  });
  return y;
}

}  // namespace qpipe::detail
