// Quantization core: schemes, quantization parameters, (fake) quantization and int4 packing.
//
// Contract:
// - Scales are divisors: x ≈ (q - zeroPoint) · scale. Statistics and scales are fp32.
// - The math follows msmodelslim (docs/quantization.md;
//   msmodelslim/ir/api/impl/{int,fp}_quantization.py): int rounding is round-half-to-even like
//   torch.round; FP8 E4M3 clamps to ±448 and then rounds to nearest even, bit-identical to
//   LibTorch's `.to(at::kFloat8_e4m3fn)` of the clamped value.
// - Shapes of scale / zero point per scope (keepdim, so they broadcast against the input):
//   per_tensor [1]; per_channel (weight [out, in]) [out, 1]; per_group (weight [out, in])
//   [out, in/group]; per_token (activations [..., hidden]) [..., 1];
//   per_head ([batch, heads, seq, head_dim]) [1, heads, 1, 1]. per_group also takes activations
//   [..., in]: [..., in/group].
// - NVFP4 (compressed-tensors 0.20's tensor_group, docs/quantization.md): E2M1 codes in blocks of
//   16 along the input dimension, each block with an E4M3 scale, and one fp32 global scale per
//   tensor. QParams::scale holds the block scales (fp32 values, each exactly an E4M3 value) and
//   globalScale the global one; the divisor is scale / globalScale, so x ≈ e2m1(q) · (scale /
//   globalScale). Activations: the global scale is static (calibrated), the block scales are
//   computed from each input.
// - MXFP4 (OCP Microscaling, compressed-tensors' MXFP4 presets): E2M1 codes in blocks of 32, each
//   block with a power-of-two scale stored as an E8M0 byte, no global scale. QParams::scale holds
//   the block scales as fp32 powers of two (2^-127 … 2^127, all exact). Activations: the block
//   scales are computed from each input (dynamic).
// - Functions are pure and device-agnostic; user-input errors are qpipe::Error(kConfig).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace qpipe::quant {

enum class QDtype { kInt8, kInt4, kFp8E4m3, kNvfp4, kMxfp4, kFloat };  // kFloat: quantization off
enum class QScope { kPerTensor, kPerChannel, kPerGroup, kPerToken, kPerHead };

// The msmodelslim YAML spellings: int8, int4, fp8_e4m3, nvfp4, mxfp4, float; per_tensor, per_channel,
// per_group, per_token, per_head. `where` names the input in errors (file:line:col and key).
QDtype parseQDtype(std::string_view name, std::string_view where);
QScope parseQScope(std::string_view name, std::string_view where);
std::string_view qdtypeName(QDtype dtype);
std::string_view qscopeName(QScope scope);

// Integer range of a dtype ([-128, 127], [-8, 7]); FP8 gives [-448, 448], NVFP4 and MXFP4 [-6, 6].
double qmin(QDtype dtype);
double qmax(QDtype dtype);

struct QScheme {
  QDtype dtype = QDtype::kInt8;
  QScope scope = QScope::kPerTensor;
  bool symmetric = true;
  int64_t groupSize = 0;  // > 0 exactly for per_group

  // Throws kConfig for impossible combinations; `where` prefixes the message.
  void validate(std::string_view where) const;
  // msmodelslim's constant naming, e.g. "int8_per_channel_sym".
  std::string name() const;
  bool operator==(const QScheme&) const = default;
};

struct QParams {
  at::Tensor scale;        // fp32, the scope's keepdim shape
  at::Tensor zeroPoint;    // int32, same shape; zeros when symmetric
  at::Tensor globalScale;  // NVFP4 only: fp32 [1]; undefined otherwise
};

// NVFP4's group size (the E4M3 block scales' blocks along the input dimension).
inline constexpr int64_t kNvfp4GroupSize = 16;
// MXFP4's group size (the E8M0 block scales' blocks along the input dimension).
inline constexpr int64_t kMxfp4GroupSize = 32;

// Integer codes: int8 or int4.
bool isInt(QDtype dtype);
// E2M1 codes with block scales: NVFP4 or MXFP4.
bool isFp4(QDtype dtype);
// An FP4 block's divisor, what one E2M1 unit of the block stands for (fp32, the scale's shape):
// NVFP4's block scale over the global scale, as compressed-tensors computes it; MXFP4's
// power-of-two block scale.
at::Tensor fp4Divisor(const QParams& params, QDtype dtype);
// Activation parameters computed from each input as it arrives: per_token, and MXFP4's per_group
// blocks. (NVFP4's block scales are too, but its global scale is calibrated: not dynamic.)
bool isDynamic(const QScheme& scheme);

// Per-scope minimum and maximum of `x` in fp32, in the scope's scale shape. Throws kConfig when
// `x` does not fit the scope (per_group: [..., in] with in % group == 0; per_head: 4-D), naming the shape.
std::pair<at::Tensor, at::Tensor> minMax(const at::Tensor& x, const QScheme& scheme);

// QParams from reduced min/max (msmodelslim calculate_int_qparam / fp8 qparam). NVFP4 (min/max
// per group, compressed-tensors calculate_qparams): globalScale = nvfp4GlobalScale of the groups'
// absmax, each block scale = E4M3(clamp(globalScale · (absmax / 6), ±448)), and 0.125 (its eps for
// an E4M3 scale) for a zero block.
QParams computeQParams(const at::Tensor& min, const at::Tensor& max, const QScheme& scheme);
// minMax + computeQParams.
QParams computeQParams(const at::Tensor& x, const QScheme& scheme);
// NVFP4 block scales of `x` under a given global scale: a static activation global scale, or the
// one global scale that fused shards (q/k/v, gate/up) share because vLLM runs them as one GEMM.
QParams computeQParams(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale);
// MXFP4 block scales from block absmax (compressed-tensors generate_mx_scales): absmax rounded to a
// power of two (up where its mantissa is ≥ 1.75, i.e. where 1.75 · 2^e would otherwise saturate
// past 6 · 2^(e-2)), over 4 (floor(log2 6) = 2), as the E8M0 exponent clamped to [0, 254]. A zero
// block gets 2^-127, the smallest E8M0 scale.
at::Tensor mxfp4Scale(const at::Tensor& absmax);
// NVFP4's global scale from a tensor's absmax (compressed-tensors generate_gparam):
// 448 · 6 / max(absmax, FLT_MIN), fp32 [1]; NaN or inf → 1.
at::Tensor nvfp4GlobalScale(const at::Tensor& absmax);

// int8/int4 → kChar (int4 values in [-8, 7]); fp8 → kFloat8_e4m3fn; nvfp4, mxfp4 → kByte E2M1
// codes (toFp4E2m1); float → x unchanged.
at::Tensor quantize(const at::Tensor& x, const QParams& params, const QScheme& scheme);
// Back to fp32: (q - zeroPoint) · scale.
at::Tensor dequantize(const at::Tensor& q, const QParams& params, const QScheme& scheme);
// dequantize(quantize(x)) in x's dtype.
at::Tensor fakeQuantize(const at::Tensor& x, const QParams& params, const QScheme& scheme);
// FP4 activations, whose block scales come from the input itself:
// fakeQuantize(x, computeQParams(x, scheme[, globalScale]), scheme), with NVFP4's static global
// scale. For fp32 CPU inputs each block is reduced, scaled and rounded while it is in cache, one
// pass instead of some thirty tensor ops, with the same IEEE operations and so the same bits
// (for finite inputs).
at::Tensor fakeQuantizeFp4Dynamic(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale = {});
// fakeQuantizeFp4Dynamic's numbers as integers: for fp32 CPU x [M, K] (K a multiple of the group)
// the codes 2·e (e each input's E2M1 value, so within ±12) as int8 [M, K] and half of each block's
// divisor as fp32 [M, K / group], from the same one pass: fakeQuantizeFp4Dynamic(x) = codes ·
// halfDivisors in value, wherever half a divisor is exact (always for MXFP4; for NVFP4 unless the
// divisor is below 2⁻¹²⁵).
struct Fp4Codes {
  at::Tensor codes, halfDivisors;
};
Fp4Codes fp4CodesDynamic(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale = {});
// computeQParams(w) and quantize(w) of a weight: {params, codes}. For fp32 CPU [out, in] weights
// with int8/int4 per_channel or per_group symmetric schemes each row (group) is reduced and
// quantized while it is in cache, one pass over memory instead of two, with the same bits.
std::pair<QParams, at::Tensor> quantizeWeight(const at::Tensor& w, const QScheme& scheme);
// quantizeWeight(w · diag(columnScale)) (w [N, K], columnScale [K]) with the same bits; on the
// one-pass path the scaled weight is formed a cache-sized block at a time, never as a whole.
std::pair<QParams, at::Tensor> quantizeScaledWeight(const at::Tensor& w, const at::Tensor& columnScale,
                                                    const QScheme& scheme);
// computeQParams and quantize of x / columnDivisor (x [M, K], columnDivisor [K]) under a per_token
// scheme, {params, codes}, with the same bits; for fp32 CPU x and int symmetric schemes each
// token is divided, reduced and quantized while it is in cache.
std::pair<QParams, at::Tensor> quantizeDividedTokens(const at::Tensor& x, const at::Tensor& columnDivisor,
                                                     const QScheme& scheme);
// How Int8Weight multiplies. Every kernel gives the same int32 results (int8_gemm.cpp):
// kBest picks at::_int_mm off the CPU and on CPUs with VNNI (exact and fast there), else kPacked where the
// CPU has AVX2, else kReference. kPacked: an AVX2 kernel on a weight packed once (vpmaddwd, int32
// sums). kReference: a GEMM in double. Asking for kPacked without AVX2 gets kReference.
enum class Int8Kernel { kBest, kPacked, kReference };
// An int8 weight w [N, K], prepared once for exact GEMMs a · wᵀ with int8 inputs a [M, K]. Sums
// are exact in int32 up to K = 2^17 (|product| ≤ 2^14).
class Int8Weight {
 public:
  explicit Int8Weight(const at::Tensor& qweight, Int8Kernel kernel = Int8Kernel::kBest);
  // a [M, K] int8 → int32 [M, N].
  at::Tensor matmul(const at::Tensor& a) const;
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  // The kernel this weight runs (kBest: at::_int_mm).
  Int8Kernel kernel() const { return kernel_; }

 private:
  at::Tensor weight_;  // w itself; with kPacked, its packed panels
  int64_t n_ = 0, k_ = 0;
  Int8Kernel kernel_ = Int8Kernel::kBest;
};
// a [M, K] int8 · b [K, N] int8 → int32 [M, N], exactly: Int8Weight(bᵀ).matmul(a).
at::Tensor int8Matmul(const at::Tensor& a, const at::Tensor& b);

// a [M, K] bf16 · bᵀ (b [N, K] bf16) → fp32 [M, N]; views whose rows are contiguous but spaced
// apart are read in place. Each product of two bf16 values is exact in fp32; only the fp32
// accumulation rounds, as in an fp32 GEMM. On AMD CPUs with AVX512-BF16, qpipe's own vdpbf16ps
// kernel (about 2× an fp32 GEMM on Zen 4; a row's bits do not depend on the other rows of the
// call); with AMX, MKL's bf16 GEMM where LibTorch links it in (5–10× an fp32 GEMM); elsewhere an
// fp32 GEMM of the widened operands. fp32 a and b (both) take that fp32 GEMM on any CPU: where
// bf16MatmulKernel() is kFp32, an operand kept across calls is best kept widened.
// The same bits for any thread count.
at::Tensor bf16Matmul(const at::Tensor& a, const at::Tensor& b);
// out (fp32 [M, N], contiguous) += a · bᵀ, under bf16Matmul's contract.
void bf16MatmulAdd(const at::Tensor& a, const at::Tensor& b, at::Tensor& out);
// b [N, K] (bf16, or fp32 holding bf16 values) kept for many bf16Matmul(a, b) calls, in the form
// this CPU's kernel reads: bf16 where bf16Matmul has bf16 dot products, else widened to fp32 and,
// where MKL runs in its strict mode (threadInvariantBlas, or MKL_CBWR set so), packed once by MKL
// for its GEMM, which otherwise packs b on every call (5–8 % of an fp32 GEMM at M = 512 on
// SmolLM2's shapes). matmul(a) gives the bits of bf16Matmul with both operands in inputDtype(),
// for any M and thread count.
class Bf16MatmulWeight {
 public:
  explicit Bf16MatmulWeight(const at::Tensor& b);
  // a [M, K], bf16 or fp32 holding bf16 values as b does → fp32 [M, N].
  at::Tensor matmul(const at::Tensor& a) const;
  // The dtype a is best given in (bf16 or fp32), saving matmul a conversion.
  at::ScalarType inputDtype() const { return inputDtype_; }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  at::Device device() const { return packed_.defined() ? packed_.device() : b_.device(); }
  // Whether MKL holds b packed.
  bool packed() const { return packed_.defined(); }

 private:
  at::Tensor b_;       // b in inputDtype_; undefined once packed
  at::Tensor packed_;  // MKL's packed b (bytes), or undefined
  int64_t n_ = 0, k_ = 0;
  at::ScalarType inputDtype_ = at::kFloat;
};
// A 2-D fp32 CPU x [R, C] as two bf16 parts side by side, [R, 2C]: hi = bf16(x) and
// lo = bf16(x − hi), each rounded to nearest even as LibTorch's cast (NaN → NaN), in one pass;
// [hi | lo] when hiFirst, else [lo | hi]. |x − hi − lo| ≤ 2⁻¹⁶·|x|.
at::Tensor splitBf16(const at::Tensor& x, bool hiFirst);
// What bf16Matmul runs on this CPU: AMX through MKL (5–10× an fp32 GEMM), qpipe's AVX512-BF16
// kernel (AMD only: about 2× on Zen 4, half on an Intel host without AMX), or an fp32 GEMM of
// the widened operands (a little slower than one).
enum class Bf16Kernel { kAmx, kAvx512Bf16, kFp32 };
Bf16Kernel bf16MatmulKernel();
// Asks MKL, before its first computation in this process, for GEMMs whose bits do not depend on
// the thread count (its strict conditional numerical reproducibility, which MKL_CBWR=AUTO,STRICT
// would ask at process start), on Intel CPUs, the only ones MKL documents it for. Returns whether
// MKL took it; false elsewhere and in LibTorch builds without MKL.
// The CLI calls it unless the user set MKL_CBWR: ranks run cores / ranks threads each.
bool threadInvariantBlas();
// quantize()'s E4M3 values of a 2-D fp32 CPU x (x / scale clamped to ±448, rounded to nearest
// even) as `dtype`, bf16 or fp32, which hold each exactly. scale: one value, or one per row.
at::Tensor fp8Values(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype);

// Clamps to ±448 and rounds to nearest even into E4M3FN. ±inf saturate to ±448 (as the clamp
// does); NaN stays NaN (0x7F, or 0xFF with the sign bit), as LibTorch's cast.
at::Tensor toFp8E4m3(const at::Tensor& x);
// The fp32 values of E4M3FN codes: LibTorch's cast, from a table on the CPU.
at::Tensor fromFp8E4m3(const at::Tensor& codes);

// E2M1 codes (kByte, one per element: sign << 3 | magnitude index into {0, 0.5, 1, 1.5, 2, 3, 4,
// 6}) of x rounded to nearest, ties to even (compressed-tensors cast_to_fp4's thresholds),
// saturating at ±6. The sign bit is x's, also where the magnitude rounds to 0 (as
// compressed-tensors packs it); NaN gives 0.
at::Tensor toFp4E2m1(const at::Tensor& x);
// The fp32 values of E2M1 codes.
at::Tensor fromFp4E2m1(const at::Tensor& codes);
// compressed-tensors nvfp4-pack-quantized: codes [rows, cols] (cols even) → uint8 [rows, cols / 2],
// element 2j in the low nibble of byte j, 2j + 1 in the high one. And back.
at::Tensor packFp4(const at::Tensor& codes);
at::Tensor unpackFp4(const at::Tensor& packed);
// E8M0 (compressed-tensors' uint8 MX scales: the biased exponent, 2^(byte - 127)) of fp32 powers
// of two in [2^-127, 2^127], and back. Exact both ways.
at::Tensor toE8m0(const at::Tensor& scale);
at::Tensor fromE8m0(const at::Tensor& bytes);

// compressed-tensors pack-quantized for int4 (formats_and_peers.md §A1.7): along `dim` of a 2-D
// kChar tensor in [-8, 7], u = q + 8, element 8j+k goes to bits 4k..4k+3 of int32 word j; the
// last word is padded with u = 0. Weights pack along dim 1; asymmetric zero points along dim 0.
at::Tensor packInt4(const at::Tensor& q, int64_t dim = 1);
// Inverse of packInt4; `size` is the unpacked length of `dim`.
at::Tensor unpackInt4(const at::Tensor& packed, int64_t size, int64_t dim = 1);

// SSZ weight scale search (msmodelslim core/quantizer/impl/ssz.py::ssz_calculate_qparam):
// per output channel of a weight [out, in], int8/int4 per_channel symmetric only.
QParams sszSearch(const at::Tensor& weight, const QScheme& scheme, int64_t iterations = 50);

}  // namespace qpipe::quant
