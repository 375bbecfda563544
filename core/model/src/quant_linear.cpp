#include "qpipe/quant_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <cpuid.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <utility>
#include <vector>

#include "bf16_gemm.h"
#include "grouped_int8_gemm.h"
#include "qpipe/error.h"
#include "small_gemm.h"

namespace qpipe {

namespace {

// A [rows, n] result shaped as the input x with n outputs.
at::Tensor shapedAs(const at::Tensor& x, const at::Tensor& out, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

// One output row of the quantized GEMMs: y[j] = v[j] · (s·sw[j]) + b[j] in fp32, b optional.
template <typename Sum>
[[gnu::always_inline]] inline void outputRow(const Sum& v, float s, const float* sw, const float* b, float* y,
                                             int64_t n) {
  if (b == nullptr) {
    for (int64_t j = 0; j < n; ++j) y[j] = v(j) * (s * sw[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) y[j] = v(j) * (s * sw[j]) + b[j];
  }
}

// v[j] = a[j] − z·rs[j], the int8 GEMM's zero-point correction, in 32 bits: exact, since no term
// exceeds 2^31 in magnitude (kMaxInt8K), and it vectorizes where 64-bit products do not (AVX2).
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void int8OutputRow(const int32_t* a, int32_t z,
                                                                               const int32_t* rs, float s,
                                                                               const float* sw, const float* b,
                                                                               float* y, int64_t n) {
  outputRow([&](int64_t j) { return static_cast<float>(a[j] - z * rs[j]); }, s, sw, b, y, n);
}

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fp32OutputRow(const float* a, float s, const float* sw,
                                                                               const float* b, float* y, int64_t n) {
  outputRow([&](int64_t j) { return a[j]; }, s, sw, b, y, n);
}

// Σ_k w[k] of one int8 weight row, for the zero-point correction. ATen's int8 → int32 sum
// goes through a casting reduction at a quarter of memory speed: 7 % of a data-free W8A8 run,
// whose probe builds an Int8Linear per module.
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] int32_t int8RowSum(const int8_t* w, int64_t k) {
  int32_t sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += w[i];
  return sum;
}

at::Tensor int8RowSums(const at::Tensor& qweight) {
  // Off the CPU the forward declines anyway; a malformed weight meets the constructor's check.
  if (qweight.dim() != 2 || qweight.scalar_type() != at::kChar || !qweight.device().is_cpu()) {
    return qweight.sum(-1, false, at::kInt);
  }
  const at::Tensor w = qweight.contiguous();
  const int64_t rows = w.size(0), k = w.size(1);
  at::Tensor sums = at::empty({rows}, at::TensorOptions().dtype(at::kInt));
  const int8_t* data = w.const_data_ptr<int8_t>();
  int32_t* out = sums.data_ptr<int32_t>();
  // The same grain as quant.cpp's row kernels: a large weight splits over the threads as
  // ATen's sum did.
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = int8RowSum(data + r * k, k);
  });
  return sums;
}

// The GEMMs' shared end: row(m, sx[m], b, y) writes output row m (n values) into y, for every m
// over the threads; sx holds one scale or one per row. y is row m of `out` where out is given,
// else a thread's scratch row, which visit(m, y) then reads.
template <typename Row>
void outputRows(int64_t rows, int64_t n, const at::Tensor& inputScale, const at::Tensor& bias, const Row& row,
                float* out, const std::function<void(int64_t, const float*)>* visit) {
  const at::Tensor sx = inputScale.to(at::kFloat).reshape({-1}).contiguous();
  const bool perRow = sx.numel() != 1;
  const at::Tensor b = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const float* pb = b.defined() ? b.const_data_ptr<float>() : nullptr;
  const float* s = sx.const_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(out == nullptr ? static_cast<size_t>(n) : 0);
    for (int64_t m = begin; m < end; ++m) {
      float* y = out == nullptr ? scratch.data() : out + m * n;
      row(m, s[perRow ? m : 0], pb, y);
      if (visit != nullptr) (*visit)(m, y);
    }
  });
}

// outputRows into a new fp32 [rows, n] tensor.
template <typename Row>
at::Tensor scaledOutput(int64_t rows, int64_t n, const at::Tensor& inputScale, const at::Tensor& bias, const Row& row) {
  at::Tensor out = at::empty({rows, n}, at::kFloat);
  outputRows(rows, n, inputScale, bias, row, out.mutable_data_ptr<float>(), nullptr);
  return out;
}

// Static per_tensor with its parameters, or dynamic per_token, in `dtype`.
bool quantizedInput(const std::optional<ActivationQuant>& input, quant::QDtype dtype) {
  return input && input->scheme.dtype == dtype &&
         (input->scheme.scope == quant::QScope::kPerToken ||
          (input->scheme.scope == quant::QScope::kPerTensor && input->params.scale.defined()));
}

}  // namespace

bool Int8Linear::supports(const quant::QScheme& weight, const std::optional<ActivationQuant>& input) {
  using quant::QDtype, quant::QScope;
  // int4 codes are held in int8 ([-8, 7]), so W4A8 per channel is the same integer GEMM.
  return (weight.dtype == QDtype::kInt8 || weight.dtype == QDtype::kInt4) && weight.scope == QScope::kPerChannel &&
         weight.symmetric && quantizedInput(input, QDtype::kInt8);
}

Int8Linear::Int8Linear(const at::Tensor& qweight, const at::Tensor& scale)
    : weight_(qweight), rowSums_(int8RowSums(qweight)), scale_(scale.to(at::kFloat).reshape({-1}).contiguous()) {
  QPIPE_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && scale_.numel() == qweight.size(0),
              "Int8Linear takes an int8 [N, K] weight and N scales, got ", qweight.sizes(), " and ", scale.sizes());
}

std::optional<Int8Linear::InputCodes> Int8Linear::inputCodes(const at::Tensor& x, const ActivationQuant& input) const {
  const int64_t k = weight_.k();
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || !rowSums_.device().is_cpu() || k > kMaxInt8K) {
    return std::nullopt;
  }
  const at::Tensor flat = x.reshape({-1, k});
  const quant::QParams params = input.isDynamic() ? quant::computeQParams(flat, input.scheme) : input.params;
  return InputCodes{quant::quantize(flat, params, input.scheme), params};
}

std::optional<at::Tensor> Int8Linear::forward(const at::Tensor& x, const ActivationQuant& input,
                                              const at::Tensor& bias) const {
  const std::optional<InputCodes> in = inputCodes(x, input);
  if (!in) return std::nullopt;
  return shapedAs(x, forwardCodes(in->codes, in->params, bias), weight_.n());
}

namespace {

// Int8Linear's exact int32 sums and, per output row m, the function that turns row m of them
// into fp32 for scaledOutput / outputRows.
struct Int8Sums {
  at::Tensor acc, zx, rowSums, weightScale;

  Int8Sums(const quant::Int8Weight& weight, at::Tensor sums, at::Tensor scale, const at::Tensor& codes,
           const quant::QParams& params)
      : rowSums(std::move(sums)), weightScale(std::move(scale)) {
    const int64_t k = weight.k();
    QPIPE_CHECK(codes.dim() == 2 && codes.size(1) == k && codes.scalar_type() == at::kChar && codes.device().is_cpu() &&
                    rowSums.device().is_cpu() && k <= Int8Linear::kMaxInt8K,
                "Int8Linear::forwardCodes takes int8 CPU codes [M, ", k, "], got ", codes.sizes(), " ",
                codes.scalar_type());
    acc = weight.matmul(codes).contiguous();
    zx = params.zeroPoint.to(at::kInt).reshape({-1}).contiguous();
  }
  auto row() const {
    return [a = acc.const_data_ptr<int32_t>(), n = acc.size(1), z = zx.const_data_ptr<int32_t>(),
            perRowZero = zx.numel() != 1, rs = rowSums.const_data_ptr<int32_t>(),
            sw = weightScale.const_data_ptr<float>()](int64_t m, float s, const float* b, float* y) {
      int8OutputRow(a + m * n, z[perRowZero ? m : 0], rs, s, sw, b, y, n);
    };
  }
};

}  // namespace

at::Tensor Int8Linear::forwardCodes(const at::Tensor& codes, const quant::QParams& params,
                                    const at::Tensor& bias) const {
  const Int8Sums sums(weight_, rowSums_, scale_, codes, params);
  return scaledOutput(sums.acc.size(0), weight_.n(), params.scale, bias, sums.row());
}

void Int8Linear::forwardCodesRows(const at::Tensor& codes, const quant::QParams& params, const at::Tensor& bias,
                                  const std::function<void(int64_t, const float*)>& visit) const {
  const Int8Sums sums(weight_, rowSums_, scale_, codes, params);
  outputRows(sums.acc.size(0), weight_.n(), params.scale, bias, sums.row(), nullptr, &visit);
}

bool Fp8Linear::supports(const quant::QScheme& weight, const std::optional<ActivationQuant>& input) {
  using quant::QDtype, quant::QScope;
  return weight.dtype == QDtype::kFp8E4m3 && weight.symmetric &&
         (weight.scope == QScope::kPerTensor || weight.scope == QScope::kPerChannel) && input &&
         input->scheme.symmetric && quantizedInput(input, QDtype::kFp8E4m3);
}

namespace {

const at::Tensor& checkedFp8Weight(const at::Tensor& qweight, const at::Tensor& scale) {
  QPIPE_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kFloat8_e4m3fn &&
                  (scale.numel() == 1 || scale.numel() == qweight.size(0)),
              "Fp8Linear takes an E4M3 [N, K] weight and 1 or N scales, got ", qweight.sizes(), " ",
              qweight.scalar_type(), " and ", scale.sizes());
  return qweight;
}

}  // namespace

// The weight is widened (and, with MKL, packed) once here, not on every call (docs/benchmarks.md,
// "Fewer passes over memory").
Fp8Linear::Fp8Linear(const at::Tensor& qweight, const at::Tensor& scale)
    : values_(quant::fromFp8E4m3(checkedFp8Weight(qweight, scale))),
      scale_(scale.to(at::kFloat).reshape({-1}).expand({qweight.size(0)}).contiguous()) {}

std::optional<at::Tensor> Fp8Linear::forward(const at::Tensor& x, const ActivationQuant& input,
                                             const at::Tensor& bias) const {
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || !values_.device().is_cpu()) return std::nullopt;
  const int64_t k = values_.k(), n = values_.n();
  const at::Tensor flat = x.reshape({-1, k});
  const at::Tensor sx = input.isDynamic() ? quant::computeQParams(flat, input.scheme).scale : input.params.scale;
  const at::Tensor acc = values_.matmul(quant::fp8Values(flat, sx.reshape({-1}), values_.inputDtype()));
  const float* a = acc.const_data_ptr<float>();
  const float* sw = scale_.const_data_ptr<float>();
  return shapedAs(
      x,
      scaledOutput(acc.size(0), n, sx, bias,
                   [&](int64_t m, float s, const float* b, float* y) { fp32OutputRow(a + m * n, s, sw, b, y, n); }),
      n);
}

namespace {

// The GEMMs of codes below write their output through raw pointers, which records no autograd
// history: where a forward is being recorded (QAT's end2end step through quantized layers it does
// not train), the caller's differentiable path runs instead.
bool recordsGradient(const at::Tensor& x, const at::Tensor& bias) {
  return at::GradMode::is_enabled() && (x.requires_grad() || (bias.defined() && bias.requires_grad()));
}

}  // namespace

Bf16x3Linear::Bf16x3Linear(const at::Tensor& weight) {
  QPIPE_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "Bf16x3Linear takes an fp32 [N, K] weight, got ",
              weight.sizes(), " ", weight.scalar_type());
  parts_ = quant::splitBf16(weight, /*hiFirst=*/true);
}

std::optional<at::Tensor> Bf16x3Linear::forward(const at::Tensor& x, const at::Tensor& bias) const {
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || !parts_.device().is_cpu() || recordsGradient(x, bias)) {
    return std::nullopt;
  }
  const int64_t k = parts_.size(1) / 2, n = parts_.size(0);
  // [x_lo | x_hi] · [w_hi | w_lo]ᵀ is the two small terms in one GEMM; x_hi · w_hiᵀ, the largest,
  // is added to their sum.
  const at::Tensor xParts = quant::splitBf16(x.reshape({-1, k}), /*hiFirst=*/false);
  at::Tensor out;
  if (bias.defined()) {
    out = bias.to(at::kFloat).expand({xParts.size(0), n}).contiguous();
    quant::bf16MatmulAdd(xParts, parts_, out);
  } else {
    out = quant::bf16Matmul(xParts, parts_);
  }
  quant::bf16MatmulAdd(xParts.slice(1, k), parts_.slice(1, 0, k), out);
  return shapedAs(x, out, n);
}

namespace {

// A Linear's integer or FP4 codes and scheme as exact values and one scale per row and group of inputs,
// w[n, k] = s[n, g] · v[n, k]: an integer code minus its zero point, or an FP4 code's E2M1 value with
// its block's divisor. group is 0 where the scheme has no such form.
struct GroupedCodes {
  // [N, K]: the int8 codes themselves where no zero point shifts them (no copy), int16 codes less
  // their zero points otherwise, FP4's E2M1 values in fp32. A symmetric weight's codes never pass
  // through fp32: its probe and loading made three passes of 4-byte values over every weight (13 %
  // of a data-free W4A16 run's samples on two ranks).
  at::Tensor values;
  at::Tensor scales;  // fp32 [N, K / group], contiguous
  int64_t group = 0;
};

int64_t codesGroup(const quant::QScheme& weight, const at::Tensor& qweight) {
  using quant::QDtype, quant::QScope;
  const bool integer = weight.dtype == QDtype::kInt8 || weight.dtype == QDtype::kInt4;
  // FP4 codes: E2M1 values in blocks of 16 or 32 with one divisor each.
  const bool fp4 = quant::isFp4(weight.dtype) && weight.scope == QScope::kPerGroup;
  if (qweight.dim() != 2 ||
      !(integer ? qweight.scalar_type() == at::kChar : fp4 && qweight.scalar_type() == at::kByte) ||
      (weight.scope != QScope::kPerTensor && weight.scope != QScope::kPerChannel &&
       weight.scope != QScope::kPerGroup)) {
    return 0;
  }
  const int64_t group = weight.scope == QScope::kPerGroup ? weight.groupSize : qweight.size(1);
  return group > 0 && qweight.size(1) % group == 0 ? group : 0;
}

// Whether any zero point shifts a code: a symmetric scheme's parameters carry zeros.
bool hasZeroPoints(const quant::QParams& params) {
  return params.zeroPoint.defined() && params.zeroPoint.numel() > 0 && params.zeroPoint.ne(0).any().item<bool>();
}

GroupedCodes groupedCodes(const at::Tensor& qweight, const quant::QParams& params, const quant::QScheme& scheme) {
  const int64_t n = qweight.size(0), k = qweight.size(1), group = codesGroup(scheme, qweight), groups = k / group;
  // One value per row and group, whatever the scope's own shape (per_tensor: one for all rows).
  const auto perGroup = [&](const at::Tensor& t, at::ScalarType dtype) {
    return t.to(dtype).reshape({t.numel() == 1 ? 1 : n, groups}).expand({n, groups});
  };
  const bool fp4 = quant::isFp4(scheme.dtype);
  at::Tensor values = fp4 ? quant::fromFp4E2m1(qweight) : qweight.contiguous();
  if (!fp4 && hasZeroPoints(params)) {
    values = (values.to(at::kShort).reshape({n, groups, group}) - perGroup(params.zeroPoint, at::kShort).unsqueeze(2))
                 .reshape({n, k});
  }
  const at::Tensor scales = perGroup(fp4 ? quant::fp4Divisor(params, scheme.dtype) : params.scale, at::kFloat);
  return {values, scales.contiguous(), group};
}

// The forward of GroupedBf16Linear, GroupedInt8Linear and Fp4Linear, whose kernels write their
// output through raw pointers.
template <typename Gemm>
std::optional<at::Tensor> groupedForward(const at::Tensor& x, const at::Tensor& bias, int64_t k, int64_t n,
                                         const Gemm& gemm) {
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || recordsGradient(x, bias)) return std::nullopt;
  QPIPE_CHECK(x.dim() > 0 && x.size(-1) == k, "a quantized Linear of ", k, " inputs got an input of shape ", x.sizes());
  const at::Tensor rows = x.reshape({-1, k});
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  if (rows.size(0) > 0) {
    const at::Tensor b = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
    gemm(rows, b.defined() ? b.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>());
  }
  return shapedAs(x, out, n);
}

// The int8 GEMM's panels of integer or FP4 codes: FP4's E2M1 values doubled, with half the scale.
std::shared_ptr<const quant::detail::GroupedInt8Panels> int8Panels(const at::Tensor& qweight,
                                                                   const quant::QParams& params,
                                                                   const quant::QScheme& scheme) {
  const GroupedCodes codes = groupedCodes(qweight, params, scheme);
  const int64_t n = qweight.size(0), k = qweight.size(1);
  const bool fp4 = quant::isFp4(scheme.dtype);
  const at::Tensor values = (fp4 ? codes.values * 2 : codes.values).to(at::kChar).contiguous();
  const at::Tensor scales = fp4 ? (codes.scales * 0.5).contiguous() : codes.scales;
  return std::make_shared<const quant::detail::GroupedInt8Panels>(quant::detail::packGroupedInt8(
      values.const_data_ptr<int8_t>(), k, scales.const_data_ptr<float>(), k / codes.group, n, k, codes.group));
}

// The family in CPUID leaf 1: Zen 4 is 0x19, Zen 5 0x1A; 0 off AMD.
unsigned amdFamily() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0 || ebx != signature_AMD_ebx) return 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0;
  const unsigned base = (eax >> 8) & 0xF;
  return base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
}

}  // namespace

bool GroupedBf16Linear::supports(const quant::QScheme& weight, const at::Tensor& qweight,
                                 const quant::QParams& params) {
  const int64_t group = codesGroup(weight, qweight);
  if (group == 0 || group % 2 != 0) return false;
  // |q| ≤ 128 in int8, so |q − z| ≤ 256, exact in bf16, for any zero point within ±128 (a loaded
  // checkpoint's may not be).
  return quant::isFp4(weight.dtype) || !hasZeroPoints(params) || params.zeroPoint.abs().max().item<int64_t>() <= 128;
}

bool GroupedBf16Linear::cpuRuns() {
  // On Zen 4 the kernel runs at about 2× MKL's fp32 GEMM, which two bf16 products for one fp32 one
  // would only match.
  static const bool runs = quant::bf16MatmulKernel() == quant::Bf16Kernel::kAvx512Bf16 && amdFamily() >= 0x1A;
  return runs;
}

GroupedBf16Linear::GroupedBf16Linear(const at::Tensor& qweight, const quant::QParams& params,
                                     const quant::QScheme& scheme) {
  QPIPE_CHECK(supports(scheme, qweight, params),
              "GroupedBf16Linear takes int8, int4 or FP4 codes [N, K] with an even group and zero points within "
              "±128, got ",
              qweight.sizes(), " ", qweight.scalar_type(), " of w ", scheme.name());
  const GroupedCodes codes = groupedCodes(qweight, params, scheme);
  const int64_t n = qweight.size(0), k = qweight.size(1);
  const at::Tensor bf16 = codes.values.to(at::kBFloat16).contiguous();
  panels_ = std::make_shared<const quant::detail::GroupedBf16Panels>(
      quant::detail::packGroupedBf16(bf16.const_data_ptr<c10::BFloat16>(), k, codes.scales.const_data_ptr<float>(),
                                     k / codes.group, n, k, codes.group));
}

std::optional<at::Tensor> GroupedBf16Linear::forward(const at::Tensor& x, const at::Tensor& bias) const {
  return groupedForward(x, bias, panels_->k, panels_->n, [&](const at::Tensor& rows, const float* b, float* out) {
    const at::Tensor parts = quant::splitBf16(rows, /*hiFirst=*/true);
    quant::detail::avx512Bf16GroupedGemm(static_cast<const c10::BFloat16*>(parts.const_data_ptr()), parts.stride(0),
                                         parts.size(0), *panels_, b, out);
  });
}

bool GroupedInt8Linear::supports(const quant::QScheme& weight, const at::Tensor& qweight,
                                 const quant::QParams& params) {
  const int64_t group = codesGroup(weight, qweight);
  if (group == 0 || quant::detail::groupedInt8Block(group) == 0) return false;
  // FP4: twice an E2M1 value is an integer within ±12.
  if (quant::isFp4(weight.dtype) || !hasZeroPoints(params)) return true;
  // max(q) − min(z) and min(q) − max(z) bound every q − z (a loaded checkpoint's zero points may be anywhere).
  const auto [qMin, qMax] = at::aminmax(qweight);
  const auto [zMin, zMax] = at::aminmax(params.zeroPoint.to(at::kLong));
  return qMax.item<int64_t>() - zMin.item<int64_t>() <= 127 && qMin.item<int64_t>() - zMax.item<int64_t>() >= -128;
}

bool GroupedInt8Linear::cpuRuns() {
  static const bool runs = quant::detail::canRunAvx512VnniGemm() && amdFamily() == 0x19;
  return runs;
}

GroupedInt8Linear::GroupedInt8Linear(const at::Tensor& qweight, const quant::QParams& params,
                                     const quant::QScheme& scheme) {
  QPIPE_CHECK(supports(scheme, qweight, params),
              "GroupedInt8Linear takes int8, int4 or FP4 codes [N, K] with blocks of 16 to 128 inputs dividing the "
              "group and every q − z within [-128, 127], got ",
              qweight.sizes(), " ", qweight.scalar_type(), " of w ", scheme.name());
  panels_ = int8Panels(qweight, params, scheme);
}

std::optional<at::Tensor> GroupedInt8Linear::forward(const at::Tensor& x, const at::Tensor& bias) const {
  return groupedForward(x, bias, panels_->k, panels_->n, [&](const at::Tensor& rows, const float* b, float* out) {
    const at::Tensor input = rows.stride(1) == 1 ? rows : rows.contiguous();
    quant::detail::avx512VnniGroupedGemm(quant::detail::splitGroupedInt8(input.const_data_ptr<float>(), input.stride(0),
                                                                         input.size(0), panels_->k, panels_->block),
                                         *panels_, b, out);
  });
}

bool Fp4Linear::supports(const quant::QScheme& weight, const at::Tensor& qweight,
                         const std::optional<ActivationQuant>& input) {
  return quant::isFp4(weight.dtype) && input && input->scheme.dtype == weight.dtype &&
         input->scheme.scope == quant::QScope::kPerGroup && input->scheme.groupSize == weight.groupSize &&
         codesGroup(weight, qweight) == weight.groupSize &&
         quant::detail::groupedInt8Block(weight.groupSize) == weight.groupSize;
}

bool Fp4Linear::cpuRuns() {
  static const bool runs = quant::detail::canRunAvx512VnniGemm() && amdFamily() >= 0x19;
  return runs;
}

Fp4Linear::Fp4Linear(const at::Tensor& qweight, const quant::QParams& params, const quant::QScheme& scheme,
                     const ActivationQuant& input)
    : input_(input) {
  QPIPE_CHECK(supports(scheme, qweight, input),
              "Fp4Linear takes FP4 codes [N, K] per group and an input of the same format and group, got ",
              qweight.sizes(), " ", qweight.scalar_type(), " of w ", scheme.name(), " and a ", input.scheme.name());
  panels_ = int8Panels(qweight, params, scheme);
}

std::optional<at::Tensor> Fp4Linear::forward(const at::Tensor& x, const at::Tensor& bias) const {
  return groupedForward(x, bias, panels_->k, panels_->n, [&](const at::Tensor& rows, const float* b, float* out) {
    const quant::Fp4Codes codes = quant::fp4CodesDynamic(rows, input_.scheme, input_.params.globalScale);
    quant::detail::avx512VnniGroupedGemm(
        quant::detail::groupedInt8Codes(codes.codes.const_data_ptr<int8_t>(), codes.codes.stride(0),
                                        codes.halfDivisors.const_data_ptr<float>(), rows.size(0), panels_->k,
                                        panels_->block),
        *panels_, b, out);
  });
}

namespace {

std::variant<Int8Linear, Fp8Linear> makeGemm(const at::Tensor& qweight, const at::Tensor& scale,
                                             const quant::QScheme& weight,
                                             const std::optional<ActivationQuant>& input) {
  if (Int8Linear::supports(weight, input)) return Int8Linear(qweight, scale);
  QPIPE_CHECK(Fp8Linear::supports(weight, input), "QuantGemm for an unsupported scheme: w ", weight.name());
  return Fp8Linear(qweight, scale);
}

// The GEMM of an fp32 Linear of codes on the CPU that QuantGemm does not run, if one pays here.
// W4A4 MXFP4: Fp4Linear on AMD CPUs with VNNI (exact products in place of fake quantization's fp32
// GEMM), unless QPIPE_FP4_FAKE_QUANT=1 asks for fake quantization. NVFP4 only in an inference-only
// Linear: its input's global scale is calibrated on the inputs that the forward through earlier
// Linears computes, and QAT's differentiable forward (fake quantization) must see the same inputs
// for its zero-learning-rate run to be linear_quant's checkpoint bit for bit; MXFP4's block scales
// come from each input and its checkpoint from the weights alone. Weight-only, unless QPIPE_WEIGHT_ONLY_FP32=1 asks
// for the fp32 GEMM of the dequantized weight: bf16x3 makes three times the products of one fp32 GEMM, so it pays only
// where bf16 GEMMs run several times faster: with AMX. With AVX512-BF16 alone, at about 2× on Zen 4, a W4A16 eval ran
// at 0.75× the fp32 GEMM's speed; integer and FP4 codes then take GroupedBf16Linear (two bf16 products) where that
// kernel runs about 4× (Zen 5), GroupedInt8Linear (two int8 products, each a quarter of an FMA's cost) on Zen 4, and
// the fp32 GEMM elsewhere (docs/benchmarks.md).
std::optional<CodesGemm> codesGemm(const at::Tensor& qweight, const quant::QParams& params,
                                   const quant::QScheme& scheme, const std::optional<ActivationQuant>& input,
                                   at::ScalarType computeDtype, bool inferenceOnly) {
  const auto envIsOne = [](const char* name) {
    const char* env = std::getenv(name);
    return env != nullptr && std::string_view(env) == "1";
  };
  static const bool fp32 = envIsOne("QPIPE_WEIGHT_ONLY_FP32"), fakeFp4 = envIsOne("QPIPE_FP4_FAKE_QUANT");
  if (computeDtype != at::kFloat || !qweight.device().is_cpu()) return std::nullopt;
  if (input && input->scheme.dtype != quant::QDtype::kFloat) {
    const bool fp4 = scheme.dtype == quant::QDtype::kMxfp4 || (inferenceOnly && scheme.dtype == quant::QDtype::kNvfp4);
    if (!fakeFp4 && fp4 && Fp4Linear::cpuRuns() && Fp4Linear::supports(scheme, qweight, input)) {
      return CodesGemm(std::in_place_type<Fp4Linear>, qweight, params, scheme, *input);
    }
    return std::nullopt;
  }
  if (fp32) return std::nullopt;
  if (quant::bf16MatmulKernel() == quant::Bf16Kernel::kAmx) {
    return CodesGemm(std::in_place_type<Bf16x3Linear>, quant::dequantize(qweight, params, scheme));
  }
  if (GroupedBf16Linear::cpuRuns() && GroupedBf16Linear::supports(scheme, qweight, params)) {
    return CodesGemm(std::in_place_type<GroupedBf16Linear>, qweight, params, scheme);
  }
  if (GroupedInt8Linear::cpuRuns() && GroupedInt8Linear::supports(scheme, qweight, params)) {
    return CodesGemm(std::in_place_type<GroupedInt8Linear>, qweight, params, scheme);
  }
  return std::nullopt;
}

}  // namespace

QuantGemm::QuantGemm(const at::Tensor& qweight, const at::Tensor& scale, const quant::QScheme& weight,
                     const std::optional<ActivationQuant>& input)
    : gemm_(makeGemm(qweight, scale, weight, input)) {}

std::optional<at::Tensor> QuantGemm::forward(const at::Tensor& x, const ActivationQuant& input,
                                             const at::Tensor& bias) const {
  return std::visit([&](const auto& gemm) { return gemm.forward(x, input, bias); }, gemm_);
}

SharedInputGemm::SharedInputGemm(const std::vector<Member>& members, const quant::QScheme& weight,
                                 const std::optional<ActivationQuant>& input) {
  QPIPE_CHECK(!members.empty() && QuantGemm::supports(weight, input),
              "a SharedInputGemm needs Linears of a scheme QuantGemm runs, got ", members.size(), " of w ",
              weight.name());
  const bool int8 = Int8Linear::supports(weight, input);
  std::vector<at::Tensor> qweights, scales, biases;
  for (const Member& member : members) {
    modules_.push_back(member.module);
    outFeatures_.push_back(member.qweight.size(0));
    if (int8) {
      int8_.emplace_back(member.qweight, member.scale);
      biases_.push_back(member.bias);
      continue;
    }
    qweights.push_back(member.qweight);
    // A per-tensor scale becomes one per output, as each Fp8Linear holds it.
    scales.push_back(member.scale.to(at::kFloat).reshape({-1}).expand({member.qweight.size(0)}));
    if (member.bias.defined()) biases.push_back(member.bias);
  }
  if (int8) return;
  QPIPE_CHECK(biases.empty() || biases.size() == members.size(), "a stacked FP8 GEMM of Linears with and without bias");
  fp8_.emplace(at::cat(qweights), at::cat(scales));
  if (!biases.empty()) fp8Bias_ = at::cat(biases);
}

std::optional<std::vector<at::Tensor>> SharedInputGemm::forward(const at::Tensor& x,
                                                                const ActivationQuant& input) const {
  std::vector<at::Tensor> outputs;
  if (fp8_) {
    const std::optional<at::Tensor> y = fp8_->forward(x, input, fp8Bias_);
    if (!y) return std::nullopt;
    int64_t offset = 0;
    for (const int64_t n : outFeatures_) {
      outputs.push_back(y->narrow(-1, offset, n));
      offset += n;
    }
    return outputs;
  }
  const std::optional<Int8Linear::InputCodes> in = int8_.front().inputCodes(x, input);
  if (!in) return std::nullopt;
  for (size_t i = 0; i < int8_.size(); ++i) {
    outputs.push_back(shapedAs(x, int8_[i].forwardCodes(in->codes, in->params, biases_[i]), outFeatures_[i]));
  }
  return outputs;
}

bool sameActivationQuant(const std::optional<ActivationQuant>& a, const std::optional<ActivationQuant>& b) {
  if (!a || !b) return !a && !b;
  const auto same = [](const at::Tensor& s, const at::Tensor& t) {
    return s.defined() == t.defined() && (!s.defined() || at::equal(s, t));
  };
  return a->scheme == b->scheme && same(a->params.scale, b->params.scale) &&
         same(a->params.zeroPoint, b->params.zeroPoint) && same(a->params.globalScale, b->params.globalScale);
}

at::Tensor ActivationQuant::apply(const at::Tensor& x) const {
  if (scheme.dtype == quant::QDtype::kFloat) return x;
  if (quant::isFp4(scheme.dtype)) return quant::fakeQuantizeFp4Dynamic(x, scheme, params.globalScale);
  return quant::fakeQuantize(x, isDynamic() ? quant::computeQParams(x, scheme) : params, scheme);
}

QuantLinear::QuantLinear(at::Tensor qweight, quant::QParams weightParams, quant::QScheme weightScheme,
                         std::optional<ActivationQuant> input, at::Tensor bias, at::ScalarType computeDtype)
    : Module("QuantLinear"), weightScheme_(weightScheme), input_(std::move(input)), computeDtype_(computeDtype) {
  QPIPE_CHECK(qweight.dim() == 2, "QuantLinear weight must be 2-D, got ", qweight.sizes());
  QPIPE_CHECK(weightParams.scale.defined() && weightParams.zeroPoint.defined(), "QuantLinear without weight params");
  addParameter("weight", std::move(qweight));
  addParameter("weight_scale", weightParams.scale.to(at::kFloat));
  if (weightParams.globalScale.defined()) addParameter("weight_global_scale", weightParams.globalScale.to(at::kFloat));
  if (!weightScheme_.symmetric) addParameter("weight_zero_point", weightParams.zeroPoint.to(at::kInt));
  if (input_ && input_->scheme.dtype == quant::QDtype::kNvfp4) {
    QPIPE_CHECK(input_->params.globalScale.defined(), "nvfp4 activation quantization without a global scale");
    addParameter("input_global_scale", input_->params.globalScale.to(at::kFloat));
  } else if (input_ && !input_->isDynamic() && input_->scheme.dtype != quant::QDtype::kFloat) {
    QPIPE_CHECK(input_->params.scale.defined(), "static activation quantization without a scale");
    addParameter("input_scale", input_->params.scale.to(at::kFloat));
    if (!input_->scheme.symmetric) addParameter("input_zero_point", input_->params.zeroPoint.to(at::kInt));
  }
  if (bias.defined()) addParameter("bias", std::move(bias));
}

std::shared_ptr<QuantLinear> QuantLinear::fromLinear(Linear& linear, const quant::QParams& weightParams,
                                                     const quant::QScheme& weightScheme,
                                                     std::optional<ActivationQuant> input) {
  const at::Tensor weight = linear.weight();
  return std::make_shared<QuantLinear>(quant::quantize(weight, weightParams, weightScheme), weightParams, weightScheme,
                                       std::move(input), linear.bias(), weight.scalar_type());
}

quant::QParams QuantLinear::weightParams() {
  const at::Tensor scale = parameter("weight_scale");
  return {scale,
          hasParameter("weight_zero_point") ? parameter("weight_zero_point")
                                            : at::zeros_like(scale, scale.options().dtype(at::kInt)),
          hasParameter("weight_global_scale") ? parameter("weight_global_scale") : at::Tensor()};
}

at::Tensor QuantLinear::bias() {
  return hasParameter("bias") ? parameter("bias") : at::Tensor();
}

at::Tensor QuantLinear::dequantizedWeight() {
  const at::Tensor& q = parameter("weight");
  if (!dequantized_.defined() || dequantized_.device() != q.device()) {
    dequantized_ = quant::dequantize(q, weightParams(), weightScheme_).to(computeDtype_);
  }
  return dequantized_;
}

void QuantLinear::setInferenceOnly() {
  if (inferenceOnly_) return;
  inferenceOnly_ = true;
  codesGemmChecked_ = false;
  codesGemm_.reset();
}

at::Tensor QuantLinear::forward(const at::Tensor& input) {
  if (!gemm_ && QuantGemm::supports(weightScheme_, input_) && parameter("weight").device().is_cpu()) {
    gemm_.emplace(parameter("weight"), parameter("weight_scale"), weightScheme_, input_);
  }
  if (gemm_) {
    if (std::optional<at::Tensor> y = gemm_->forward(input, *input_, bias())) return *y;
  }
  // Decided once the weight is on the CPU, where these GEMMs run.
  if (!codesGemmChecked_ && parameter("weight").device().is_cpu()) {
    codesGemm_ = codesGemm(parameter("weight"), weightParams(), weightScheme_, input_, computeDtype_, inferenceOnly_);
    codesGemmChecked_ = true;
  }
  if (codesGemm_) {
    const at::Tensor b = bias();
    if (std::optional<at::Tensor> y =
            std::visit([&](const auto& gemm) { return gemm.forward(input, b); }, *codesGemm_)) {
      return *y;
    }
  }
  const at::Tensor x = input_ ? input_->apply(input) : input;
  if (std::optional<at::Tensor> y = detail::smallLinear(x, dequantizedWeight(), bias())) return *y;
  return at::linear(x, dequantizedWeight(), bias());
}

std::optional<std::vector<at::Tensor>> QuantLinear::forwardSiblings(const at::Tensor& input,
                                                                    const std::vector<Module*>& siblings) {
  if (!QuantGemm::supports(weightScheme_, input_) || !SharedInputGemm::runs(input, parameter("weight"))) {
    return std::nullopt;
  }
  if (!shared_ || !shared_->madeFor(siblings)) {
    std::vector<SharedInputGemm::Member> members;
    for (Module* module : siblings) {
      auto* sibling = dynamic_cast<QuantLinear*>(module);
      if (sibling == nullptr || sibling->weightScheme_ != weightScheme_ ||
          !sameActivationQuant(sibling->input_, input_) || sibling->computeDtype_ != computeDtype_ ||
          sibling->bias().defined() != bias().defined() || !sibling->parameter("weight").device().is_cpu()) {
        return std::nullopt;
      }
      members.push_back({sibling, sibling->parameter("weight"), sibling->parameter("weight_scale"), sibling->bias()});
    }
    shared_.emplace(members, weightScheme_, input_);
  }
  return shared_->forward(input, *input_);
}

}  // namespace qpipe
