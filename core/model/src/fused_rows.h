// One pass per row for the decoder layers' elementwise chains, where ATen makes three to five over
// the whole tensor (and, for a head view's rotary embedding, copies). Private to core/model.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace qpipe::detail {

// transformers' RMSNorm, weight · (x · 1/√(mean(x²) + eps)), for an fp32 CPU x whose last dimension
// is contiguous and an fp32 weight of that length; the output is contiguous. A row's sum of squares
// runs in 16 lanes (lane l over the elements ≡ l mod 16, in order), summed in pairs (lanes l and
// l + 8, then + 4, + 2, + 1); every other operation is ATen's, in ATen's order. So the output
// differs from ATen's only through that sum, and its bits depend on the row alone: not on the
// number of rows, the thread count or the CPU. Unset where it does not apply: another dtype or
// device, another weight, an autograd graph to record.
std::optional<at::Tensor> rmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// t · cos + rotateHalf(t) · sin, the rotary embedding, for an fp32 CPU t [batch, seq, heads, dim]
// whose last dimension is contiguous and fp32 cos, sin [batch or 1, seq, dim], contiguous: the
// result as [batch, heads, seq, dim], contiguous (what attention reads). Each element is ATen's
// operations in ATen's order, so the bits are ATen's. Unset where it does not apply (as rmsNorm).
std::optional<at::Tensor> rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace qpipe::detail
