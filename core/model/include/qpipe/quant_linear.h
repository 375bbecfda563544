// Deployed quantized modules: what `linear_quant` leaves in a layer after calibration, what the
// savers write, and what a quantized checkpoint loads back into for `qpipe eval`.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <variant>

#include "qpipe/module.h"
#include "qpipe/quant.h"

namespace qpipe {

namespace quant::detail {
struct GroupedBf16Panels;
struct GroupedInt8Panels;
}

// How a module's input is quantized at inference: static (per_tensor, calibrated params) or
// dynamic (per_token, MXFP4 blocks: params computed from each input as it arrives). NVFP4 is
// both: a static global scale (params.globalScale) and block scales computed from each input.
struct ActivationQuant {
  quant::QScheme scheme;
  quant::QParams params;  // static only; undefined when dynamic

  bool isDynamic() const { return quant::isDynamic(scheme); }
  // Fake-quantizes `x` in its own dtype.
  at::Tensor apply(const at::Tensor& x) const;
};

// The int8 GEMM of a Linear whose weight is int8 or int4 (codes held in int8) per_channel
// symmetric and whose input is quantized to int8 (per_tensor static or per_token dynamic), for
// fp32 inputs on the CPU:
//   y[m, n] = float(Σ_k qx[m, k]·qw[n, k] − zx[m]·Σ_k qw[n, k]) · (sx[m]·sw[n]) + b[n]
// with the integer sums exact (quant::Int8Weight). Fake quantization computes the same real
// number through an fp32 GEMM of dequantized values; the two differ only by that GEMM's rounding
// (docs/quantization.md).
class Int8Linear {
 public:
  // Σ_k (qx − z)·qw, each term at most 255·128 in magnitude, fits in 32 bits up to this K (and
  // so do Σ_k qx·qw and z·Σ_k qw); beyond it forward() declines.
  static constexpr int64_t kMaxInt8K = 65536;
  static bool supports(const quant::QScheme& weight, const std::optional<ActivationQuant>& input);
  // qweight int8 [N, K] (int8 or int4 codes), scale fp32 with N elements.
  Int8Linear(const at::Tensor& qweight, const at::Tensor& scale);
  int64_t outFeatures() const { return weight_.n(); }
  // Empty when x is not an fp32 CPU tensor or K exceeds kMaxInt8K (the caller fake-quantizes then).
  std::optional<at::Tensor> forward(const at::Tensor& x, const ActivationQuant& input, const at::Tensor& bias) const;
  struct InputCodes {
    at::Tensor codes;  // int8 [M, K]
    quant::QParams params;
  };
  // forward's quantized input: x's codes under `input` (dynamic parameters computed from x), or
  // empty where forward declines.
  std::optional<InputCodes> inputCodes(const at::Tensor& x, const ActivationQuant& input) const;
  // forward's product for an input already quantized: int8 codes [M, K] on the CPU with their
  // params (one scale and zero point, or one per row) → fp32 [M, N]. K at most kMaxInt8K.
  at::Tensor forwardCodes(const at::Tensor& codes, const quant::QParams& params, const at::Tensor& bias) const;
  // forwardCodes without its [M, N] output: visit(m, y) receives output row m (N values, the same
  // bits as forwardCodes' row m, valid during the call) once for each m, rows spread over the
  // threads. For a reduction over the output, which then reads each row from cache instead of
  // writing and re-reading M × N floats.
  void forwardCodesRows(const at::Tensor& codes, const quant::QParams& params, const at::Tensor& bias,
                        const std::function<void(int64_t m, const float* y)>& visit) const;

 private:
  quant::Int8Weight weight_;
  at::Tensor rowSums_;  // int32 [N]: Σ_k qw[n, k]
  at::Tensor scale_;    // fp32 [N]
};

// The FP8 GEMM of a Linear whose weight is E4M3 (per_tensor or per_channel) and whose input is
// quantized to E4M3 (per_tensor static or per_token dynamic), for fp32 inputs on the CPU:
//   y[m, n] = (Σ_k fx[m, k]·fw[n, k]) · (sx[m]·sw[n]) + b[n]
// with fx, fw the E4M3 values, each product exact and the sum in fp32 (quant::bf16Matmul: the
// values are exact in bf16). Fake quantization computes the same real number through an fp32
// GEMM of fx·sx and fw·sw, rounded first; the two differ by fp32 rounding (docs/quantization.md).
class Fp8Linear {
 public:
  static bool supports(const quant::QScheme& weight, const std::optional<ActivationQuant>& input);
  // qweight kFloat8_e4m3fn [N, K], scale fp32 with N elements or one.
  Fp8Linear(const at::Tensor& qweight, const at::Tensor& scale);
  // Empty when x is not an fp32 CPU tensor (the caller fake-quantizes then).
  std::optional<at::Tensor> forward(const at::Tensor& x, const ActivationQuant& input, const at::Tensor& bias) const;

 private:
  quant::Bf16MatmulWeight values_;  // the weight's E4M3 values
  at::Tensor scale_;   // fp32 [N]
};

// The GEMM of a weight-only quantized Linear (float inputs, a weight known to fp32 as its
// dequantized values) on CPUs with AMX (quant::Bf16Kernel::kAmx). "bf16x3": x and w
// are each split into bf16 parts, v = hi + lo + δ with |δ| ≤ 2⁻¹⁶·|v|, and
//   y = b + (x_lo·w_hiᵀ + x_hi·w_loᵀ) + x_hi·w_hiᵀ
// in two bf16 GEMMs with exact products and fp32 sums. Each dropped term is below 2⁻¹⁶ of
// |x·w|, so y is within about 3·2⁻¹⁶ of the fp32 GEMM relative to Σ|x·w| (docs/quantization.md);
// the GEMMs take about 0.55× an fp32 GEMM's time (AMX). The weight's parts take the 4 bytes per
// element the dequantized fp32 weight would.
class Bf16x3Linear {
 public:
  // weight fp32 [N, K].
  explicit Bf16x3Linear(const at::Tensor& weight);
  // Empty when x is not an fp32 CPU tensor, or where autograd records x or the bias.
  std::optional<at::Tensor> forward(const at::Tensor& x, const at::Tensor& bias) const;

 private:
  at::Tensor parts_;  // bf16 [N, 2K]: [w_hi | w_lo]
};

// The GEMM of a weight-only Linear whose weight is integer codes (int8 or int4, symmetric or not)
// with one fp32 scale per output, per group of inputs or per tensor, or FP4 codes (NVFP4, MXFP4:
// E2M1 values, each block's divisor as its scale), for fp32 inputs, on AMD CPUs
// whose vdpbf16ps outruns fp32 FMAs about fourfold (Zen 5: qpipe's kernel 4.5× MKL's fp32 GEMM,
// docs/benchmarks.md). The codes minus their zero points are exact in bf16; x is split into two
// bf16 parts, x = hi + lo + δ with |δ| ≤ 2⁻¹⁶·|x|, and
//   y[m, n] = b[n] + Σ_g s[n, g] · Σ_{k ∈ g} (hi + lo)[m, k] · (q − z)[n, k]
// with exact products and fp32 sums in one order per output (its bits depend on its row and
// column only). So y is within about 2⁻¹⁶ of the fp32 GEMM of the dequantized weight relative to
// Σ|x·w|, plus fp32 rounding, in two bf16 products for one fp32 one (bf16x3 makes three). The
// weight takes 2 bytes per element.
class GroupedBf16Linear {
 public:
  // Whether the scheme, codes and parameters are ones it runs (the CPU aside): integer codes in
  // kChar or FP4 codes in kByte, a group size and input width that are even, zero points within
  // ±128 (q − z exact in bf16).
  static bool supports(const quant::QScheme& weight, const at::Tensor& qweight, const quant::QParams& params);
  // Whether QuantLinear runs it on this CPU (AMD Zen 5 or later with AVX512-BF16 and no AMX). The
  // kernel itself needs AVX512-BF16: a direct caller checks quant::detail::canRunAvx512Bf16Gemm().
  static bool cpuRuns();
  // Requires supports(scheme, qweight, params); params as QuantLinear holds them.
  GroupedBf16Linear(const at::Tensor& qweight, const quant::QParams& params, const quant::QScheme& scheme);
  // Empty when x is not an fp32 CPU tensor, or where autograd records x or the bias.
  std::optional<at::Tensor> forward(const at::Tensor& x, const at::Tensor& bias) const;

 private:
  std::shared_ptr<const quant::detail::GroupedBf16Panels> panels_;
};

// The GEMM of a weight-only Linear with integer or FP4 codes on AMD CPUs whose int8 dot products
// (vpdpbusd) make four times an fp32 FMA's products while bf16 ones make only twice (Zen 4; there
// MKL's fp32 GEMM runs its AVX2 code). The codes minus their zero points (twice the E2M1 value for
// FP4, with half the scale) are integers v within [-128, 127]; x is split per block of at most 128
// inputs into two int8 parts, x̂ = d·(h + l/256) with d = max|x| over the block / 127, so
// |x − x̂| ≤ d/256, and
//   y[m, n] = b[n] + Σ_blocks s[n, g] · (d / 256) · Σ_{k ∈ block} (256·h + l)[m, k] · v[n, k]
// with every block's sum an exact int32 and the blocks added in fp32 in one order per output (its
// bits depend on its row and column only). So y is within Σ_blocks (max|x| · Σ|w|) / 32512 of the
// exact product plus fp32 rounding: finer than a bf16 or fp16 activation for every input above
// about 2⁻⁷ (bf16) or 2⁻⁴ (fp16) of its block's largest (docs/quantization.md). Half the instructions
// of an fp32 GEMM; the weight takes 1 byte per element.
class GroupedInt8Linear {
 public:
  // Whether the scheme, codes and parameters are ones it runs (the CPU aside): integer codes in
  // kChar with every q − z within [-128, 127], or FP4 codes in kByte; groups with a divisor of 16 to
  // 128 inputs that is a multiple of 4 (quant::detail::groupedInt8Block).
  static bool supports(const quant::QScheme& weight, const at::Tensor& qweight, const quant::QParams& params);
  // Whether QuantLinear runs it on this CPU (AMD Zen 4, family 0x19, with AVX512-VNNI). The kernel
  // itself needs AVX512-VNNI: a direct caller checks quant::detail::canRunAvx512VnniGemm().
  static bool cpuRuns();
  // Requires supports(scheme, qweight, params); params as QuantLinear holds them.
  GroupedInt8Linear(const at::Tensor& qweight, const quant::QParams& params, const quant::QScheme& scheme);
  // Empty when x is not an fp32 CPU tensor, or where autograd records x or the bias.
  std::optional<at::Tensor> forward(const at::Tensor& x, const at::Tensor& bias) const;

 private:
  std::shared_ptr<const quant::detail::GroupedInt8Panels> panels_;
};

// The GEMM of a Linear whose weight and input are both FP4 of one format (W4A4 NVFP4 or MXFP4,
// the input's blocks computed from each input as fake quantization does), for fp32 inputs on AMD
// CPUs with AVX512-VNNI (Zen 4 and later), where MKL's fp32 GEMM runs its AVX2 code. QuantLinear
// runs it for MXFP4, and for NVFP4 where it is inference-only (quant_linear.cpp says why). Both
// sides' E2M1 values doubled are integers within ±12, so with d the blocks' divisors
//   y[m, n] = b[n] + Σ_blocks (d_x[m, b] / 2)·(d_w[n, b] / 2) · Σ_{k ∈ b} (2·e_x[m, k])·(2·e_w[n, k])
// with every block's sum an exact int32 (one int8 part, quant::detail::groupedInt8Codes), summed in
// fp32 over the blocks only: within that rounding of the exact Σ x̂·ŵ of fake quantization's
// values (x̂ = e_x·d_x, ŵ = e_w·d_w, each exact in fp32 for MXFP4; NVFP4's d_w·e_w and fake
// quantization's own products round once more), which fake quantization's fp32 GEMM rounds at every
// addition. An output's bits depend on its row and column only. QPIPE_FP4_FAKE_QUANT=1 keeps fake
// quantization.
class Fp4Linear {
 public:
  // FP4 codes (kByte) per group for the weight, and input quantization of the same format and
  // group size.
  static bool supports(const quant::QScheme& weight, const at::Tensor& qweight,
                       const std::optional<ActivationQuant>& input);
  // Whether QuantLinear runs it (for MXFP4) on this CPU: AMD family 0x19 (Zen 4) or later with
  // AVX512-VNNI.
  static bool cpuRuns();
  // Requires supports(scheme, qweight, input); params as QuantLinear holds them.
  Fp4Linear(const at::Tensor& qweight, const quant::QParams& params, const quant::QScheme& scheme,
            const ActivationQuant& input);
  // Empty when x is not an fp32 CPU tensor, or where autograd records x or the bias.
  std::optional<at::Tensor> forward(const at::Tensor& x, const at::Tensor& bias) const;

 private:
  std::shared_ptr<const quant::detail::GroupedInt8Panels> panels_;
  ActivationQuant input_;
};

// The GEMM of a Linear of integer or FP4 codes that is neither an Int8Linear nor an Fp8Linear,
// where one pays on this CPU: the weight-only GEMMs and W4A4 FP4.
using CodesGemm = std::variant<Bf16x3Linear, GroupedBf16Linear, GroupedInt8Linear, Fp4Linear>;

// Whichever of Int8Linear and Fp8Linear runs a quantized Linear's weight and input schemes.
class QuantGemm {
 public:
  static bool supports(const quant::QScheme& weight, const std::optional<ActivationQuant>& input) {
    return Int8Linear::supports(weight, input) || Fp8Linear::supports(weight, input);
  }
  // Requires supports(weight, input).
  QuantGemm(const at::Tensor& qweight, const at::Tensor& scale, const quant::QScheme& weight,
            const std::optional<ActivationQuant>& input);
  std::optional<at::Tensor> forward(const at::Tensor& x, const ActivationQuant& input, const at::Tensor& bias) const;

 private:
  std::variant<Int8Linear, Fp8Linear> gemm_;
};

// The QuantGemm work of Linears that read one input (q/k/v, gate/up) with one weight scheme and
// one input quantization, shared: the input is quantized once. FP8 weights are stacked along the
// output dimension into one GEMM (Fp8Linear keeps an fp32 copy of the values anyway, so the stack
// costs no memory); int8 GEMMs run one per Linear on the shared codes, each reading its weight where
// it is (a stack would be a second copy: the int8 kernels read the weight in place). Each output has
// the bits of the Linear's own QuantGemm: the int8 sums are exact; an FP8 output is one fp32 dot
// product over K, whose bits did not depend on the columns beside it with MKL in strict mode
// (tested), and may differ by fp32 rounding outside it.
class SharedInputGemm {
 public:
  struct Member {
    const Module* module;  // what it was made for (madeFor)
    at::Tensor qweight, scale, bias;
  };
  // Requires QuantGemm::supports(weight, input) and, for FP8, the members' biases all defined or none.
  SharedInputGemm(const std::vector<Member>& members, const quant::QScheme& weight,
                  const std::optional<ActivationQuant>& input);
  // Whether x, against weights where `weight` is, is an input forward runs (fp32, on the CPU):
  // where it is not, a caller need not make one.
  static bool runs(const at::Tensor& x, const at::Tensor& weight) {
    return x.scalar_type() == at::kFloat && x.device().is_cpu() && weight.device().is_cpu();
  }
  // Whether it was made for these modules, in this order.
  bool madeFor(const std::vector<Module*>& siblings) const {
    return std::equal(siblings.begin(), siblings.end(), modules_.begin(), modules_.end());
  }
  // Each member's output for x (FP8: views into one tensor), or empty where QuantGemm::forward is.
  std::optional<std::vector<at::Tensor>> forward(const at::Tensor& x, const ActivationQuant& input) const;

 private:
  std::vector<const Module*> modules_;
  std::vector<int64_t> outFeatures_;
  std::vector<Int8Linear> int8_;    // int8: one per member
  std::vector<at::Tensor> biases_;  // int8: one per member
  std::optional<Fp8Linear> fp8_;    // FP8: the stack
  at::Tensor fp8Bias_;
};

// True when both quantize an input the same way (scheme and static parameters), or both are absent.
bool sameActivationQuant(const std::optional<ActivationQuant>& a, const std::optional<ActivationQuant>& b);

// typeName "QuantLinear". Its parameters carry compressed-tensors' names:
//   weight             kChar (int8, or int4 values in [-8, 7], unpacked), kFloat8_e4m3fn, or kByte
//                      E2M1 codes for nvfp4 (unpacked)
//   weight_scale       fp32, the weight scope's shape (quant.h); nvfp4: the E4M3 block scales
//   weight_global_scale  fp32 [1]; nvfp4 only
//   weight_zero_point  int32, same shape; asymmetric weights only
//   input_global_scale fp32 [1]; nvfp4 activations only
//   input_scale        fp32 [1]; static activations only (not nvfp4)
//   input_zero_point   int32 [1]; static asymmetric activations only
//   bias               compute dtype; when the layer has one
// forward: y = actQuant(x) · dequantize(weight)ᵀ + b in the compute dtype; by QuantGemm where it
// applies, for weight-only fp32 Linears by GroupedBf16Linear, GroupedInt8Linear or Bf16x3Linear
// where the CPU runs them fast (unless QPIPE_WEIGHT_ONLY_FP32=1), and for W4A4 FP4 by Fp4Linear
// there (NVFP4 only once setInferenceOnly() was called). The dequantized weight is cached on first
// use (it is not a parameter, so savers never see it).
class QuantLinear : public Module, public InputSharing {
 public:
  QuantLinear(at::Tensor qweight, quant::QParams weightParams, quant::QScheme weightScheme,
              std::optional<ActivationQuant> input, at::Tensor bias, at::ScalarType computeDtype);
  // Quantizes the float weight of `linear` with `weightParams`.
  static std::shared_ptr<QuantLinear> fromLinear(Linear& linear, const quant::QParams& weightParams,
                                                 const quant::QScheme& weightScheme,
                                                 std::optional<ActivationQuant> input);

  at::Tensor forward(const at::Tensor& input) override;
  // QuantLinear siblings of this one's weight scheme, input quantization and compute dtype, where
  // QuantGemm applies: one SharedInputGemm, made on the first call.
  std::optional<std::vector<at::Tensor>> forwardSiblings(const at::Tensor& input,
                                                         const std::vector<Module*>& siblings) override;

  const quant::QScheme& weightScheme() const { return weightScheme_; }
  const std::optional<ActivationQuant>& inputQuant() const { return input_; }
  quant::QParams weightParams();
  at::ScalarType computeDtype() const { return computeDtype_; }
  // Undefined when the layer has no bias.
  at::Tensor bias();
  // The weight as the forward uses it: dequantized, in the compute dtype.
  at::Tensor dequantizedWeight();
  // Marks a Linear whose forward only infers and so need not be fake quantization's bit for bit:
  // one the model loader made from a quantized checkpoint for qpipe eval
  // (ModelOptions::inferenceOnly), never a quantizer's deploy, whose forward linear_quant's
  // calibration and QAT's zero-rate run must compute alike. W4A4 NVFP4 then runs through Fp4Linear
  // too where the CPU runs it. Call it before the first forward, never beside one.
  void setInferenceOnly();
  bool inferenceOnly() const { return inferenceOnly_; }

 private:
  quant::QScheme weightScheme_;
  std::optional<ActivationQuant> input_;
  at::ScalarType computeDtype_;
  at::Tensor dequantized_;
  std::optional<QuantGemm> gemm_;               // made on the first forward where QuantGemm::supports
  // Made on the first forward where one applies.
  std::optional<CodesGemm> codesGemm_;
  bool codesGemmChecked_ = false;
  bool inferenceOnly_ = false;
  std::optional<SharedInputGemm> shared_;       // made by forwardSiblings, for the siblings it names
};

}  // namespace qpipe
