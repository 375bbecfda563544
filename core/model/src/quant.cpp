// Quantization primitives. Reference: msmodelslim/ir/api/impl/int_quantization.py and
// fp_quantization.py (docs/quantization.md); FP8 rounding: c10/util/Float8_e4m3fn.h
// (formats_and_peers.md §A3.1); int4 packing: compressed-tensors pack_quantized/helpers.py (§A1.7).
#include "qpipe/quant.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <type_traits>
#include <vector>

#include "bf16_gemm.h"
#include "qpipe/error.h"
#include "weight_rows.h"

namespace qpipe::quant {
namespace {

constexpr std::array<std::pair<std::string_view, QDtype>, 6> kDtypeNames{{
    {"int8", QDtype::kInt8},
    {"int4", QDtype::kInt4},
    {"fp8_e4m3", QDtype::kFp8E4m3},
    {"nvfp4", QDtype::kNvfp4},
    {"mxfp4", QDtype::kMxfp4},
    {"float", QDtype::kFloat},
}};
constexpr std::array<std::pair<std::string_view, QScope>, 5> kScopeNames{{
    {"per_tensor", QScope::kPerTensor},
    {"per_channel", QScope::kPerChannel},
    {"per_group", QScope::kPerGroup},
    {"per_token", QScope::kPerToken},
    {"per_head", QScope::kPerHead},
}};

constexpr double kFp8Max = 448.0;
constexpr uint32_t kFp8MinNormalBits = 0x3C800000u;  // 2^-6
constexpr uint32_t kFp32InfBits = 0x7F800000u;
constexpr uint32_t kFp32NanBits = 0x7FC00000u;
constexpr double kFp4Max = 6.0;
// MXFP4's scale on the fp32 bits of a block's absmax: adding a quarter of the mantissa's range
// carries into the exponent exactly when the mantissa is ≥ 0.75, and the E8M0 byte is that
// exponent field less floor(log2 6) = 2, within [0, 254]. Byte 0 is 2^-127, the one subnormal
// power of two it holds; any other byte is a normal float's exponent field.
constexpr int32_t kMxRoundUp = 1 << 21;
constexpr int32_t kFp4Emax = 2;
constexpr int32_t kE8m0Max = 254;
constexpr int32_t kTwoToMinus127Bits = 1 << 22;

// The largest magnitude of a range widened to contain 0.
at::Tensor absmaxOf(const at::Tensor& min, const at::Tensor& max) {
  return at::maximum(min.clamp_max(0).abs(), max.clamp_min(0));
}

template <typename T, size_t N>
std::string namesOf(const std::array<std::pair<std::string_view, T>, N>& table) {
  std::string out;
  for (const auto& [name, value] : table) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

std::string shapeOf(const at::Tensor& x) {
  std::ostringstream os;
  os << x.sizes();
  return os.str();
}

int bitsOf(QDtype dtype) {
  return dtype == QDtype::kInt4 ? 4 : 8;
}

// per_group works on a [..., in/group, group] view, so the [..., in/group] parameters broadcast
// (unsqueezed) without copies.
at::Tensor grouped(const at::Tensor& x, const QScheme& scheme) {
  if (scheme.scope != QScope::kPerGroup) return x;
  QPIPE_REQUIRE(x.dim() >= 1 && scheme.groupSize > 0 && x.size(-1) % scheme.groupSize == 0, ErrorCode::kConfig,
                "per_group with group_size ", scheme.groupSize, " needs [..., in] with in a multiple of ",
                scheme.groupSize, ", got shape ", shapeOf(x));
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() /= scheme.groupSize;
  shape.push_back(scheme.groupSize);
  return x.reshape(shape);
}

// The E4M3 block scales for blocks of absmax `absmax` under `global` ([1]).
QParams nvfp4BlockParams(const at::Tensor& absmax, const at::Tensor& global) {
  const at::Tensor blocks = toFp8E4m3(global * (absmax / kFp4Max)).to(at::kFloat);
  const at::Tensor scale = at::where(blocks == 0, at::full_like(blocks, 0.125), blocks);
  return {scale, at::zeros_like(scale, scale.options().dtype(at::kInt)), global};
}

at::Tensor groupedParam(const at::Tensor& t, const QScheme& scheme) {
  return scheme.scope == QScope::kPerGroup ? t.unsqueeze(-1) : t;
}

}  // namespace

at::Tensor fp4Divisor(const QParams& params, QDtype dtype) {
  if (dtype == QDtype::kMxfp4) return params.scale.to(at::kFloat);
  QPIPE_CHECK(params.scale.defined() && params.globalScale.defined(), "nvfp4 parameters without block or global scale");
  return params.scale.to(at::kFloat) / params.globalScale.to(at::kFloat);
}

QDtype parseQDtype(std::string_view name, std::string_view where) {
  for (const auto& [spelling, value] : kDtypeNames) {
    if (spelling == name) return value;
  }
  QPIPE_REQUIRE(false, ErrorCode::kConfig, where, ": unknown dtype '", name, "'; expected one of ",
                namesOf(kDtypeNames));
  return QDtype::kFloat;
}

QScope parseQScope(std::string_view name, std::string_view where) {
  for (const auto& [spelling, value] : kScopeNames) {
    if (spelling == name) return value;
  }
  QPIPE_REQUIRE(false, ErrorCode::kConfig, where, ": unknown scope '", name, "'; expected one of ",
                namesOf(kScopeNames));
  return QScope::kPerTensor;
}

std::string_view qdtypeName(QDtype dtype) {
  for (const auto& [spelling, value] : kDtypeNames) {
    if (value == dtype) return spelling;
  }
  QPIPE_CHECK(false, "unknown QDtype ", static_cast<int>(dtype));
  return {};
}

std::string_view qscopeName(QScope scope) {
  for (const auto& [spelling, value] : kScopeNames) {
    if (value == scope) return spelling;
  }
  QPIPE_CHECK(false, "unknown QScope ", static_cast<int>(scope));
  return {};
}

bool isInt(QDtype dtype) {
  return dtype == QDtype::kInt8 || dtype == QDtype::kInt4;
}

bool isFp4(QDtype dtype) {
  return dtype == QDtype::kNvfp4 || dtype == QDtype::kMxfp4;
}

bool isDynamic(const QScheme& scheme) {
  return scheme.scope == QScope::kPerToken || (scheme.scope == QScope::kPerGroup && scheme.dtype == QDtype::kMxfp4);
}

double qmin(QDtype dtype) {
  if (dtype == QDtype::kFp8E4m3) return -kFp8Max;
  if (isFp4(dtype)) return -kFp4Max;
  QPIPE_CHECK(isInt(dtype), "qmin of ", qdtypeName(dtype));
  return -static_cast<double>(1 << (bitsOf(dtype) - 1));
}

double qmax(QDtype dtype) {
  if (dtype == QDtype::kFp8E4m3) return kFp8Max;
  if (isFp4(dtype)) return kFp4Max;
  QPIPE_CHECK(isInt(dtype), "qmax of ", qdtypeName(dtype));
  return static_cast<double>((1 << (bitsOf(dtype) - 1)) - 1);
}

void QScheme::validate(std::string_view where) const {
  QPIPE_REQUIRE(dtype != QDtype::kFp8E4m3 || symmetric, ErrorCode::kConfig, where,
                ": fp8_e4m3 is symmetric only; set symmetric: true");
  QPIPE_REQUIRE(dtype != QDtype::kNvfp4 || (symmetric && scope == QScope::kPerGroup && groupSize == kNvfp4GroupSize),
                ErrorCode::kConfig, where, ": nvfp4 is symmetric per_group with group_size ", kNvfp4GroupSize);
  QPIPE_REQUIRE(dtype != QDtype::kMxfp4 || (symmetric && scope == QScope::kPerGroup && groupSize == kMxfp4GroupSize),
                ErrorCode::kConfig, where, ": mxfp4 is symmetric per_group with group_size ", kMxfp4GroupSize);
  QPIPE_REQUIRE(scope != QScope::kPerGroup || groupSize > 0, ErrorCode::kConfig, where,
                ": per_group needs group_size > 0, got ", groupSize);
  QPIPE_REQUIRE(scope == QScope::kPerGroup || groupSize == 0, ErrorCode::kConfig, where, ": group_size ", groupSize,
                " only applies to per_group, not ", qscopeName(scope));
}

std::string QScheme::name() const {
  return std::string(qdtypeName(dtype)) + "_" + std::string(qscopeName(scope)) + (symmetric ? "_sym" : "_asym");
}

std::pair<at::Tensor, at::Tensor> minMax(const at::Tensor& x, const QScheme& scheme) {
  // Reduced in the input's dtype (min and max select values exactly) and only then widened to
  // fp32: no fp32 copy of a large activation. Two vectorised passes: ATen's aminmax along a
  // dimension is a scalar loop, about 19× slower on [512, 1536] fp32.
  const auto reduce = [](const at::Tensor& t, at::IntArrayRef dims, bool keepdim) -> std::pair<at::Tensor, at::Tensor> {
    return {t.amin(dims, keepdim).to(at::kFloat), t.amax(dims, keepdim).to(at::kFloat)};
  };
  switch (scheme.scope) {
    case QScope::kPerTensor: {
      const auto [min, max] = reduce(x, {}, false);
      return {min.reshape({1}), max.reshape({1})};
    }
    case QScope::kPerChannel: {
      QPIPE_REQUIRE(x.dim() >= 2, ErrorCode::kConfig, "per_channel needs a weight [out, in], got shape ", shapeOf(x));
      std::vector<int64_t> dims;
      for (int64_t d = 1; d < x.dim(); ++d) dims.push_back(d);
      return reduce(x, dims, true);
    }
    case QScope::kPerGroup:
      return reduce(grouped(x, scheme), {-1}, false);
    case QScope::kPerToken:
      return reduce(x, {-1}, true);
    case QScope::kPerHead:
      QPIPE_REQUIRE(x.dim() == 4, ErrorCode::kConfig, "per_head needs [batch, heads, seq, head_dim], got shape ",
                    shapeOf(x));
      return reduce(x, {0, 2, 3}, true);
  }
  QPIPE_CHECK(false, "unknown QScope ", static_cast<int>(scheme.scope));
  return {};
}

QParams computeQParams(const at::Tensor& min, const at::Tensor& max, const QScheme& scheme) {
  const at::Tensor minF = min.to(at::kFloat);
  const at::Tensor maxF = max.to(at::kFloat);
  const auto zeros = [&] { return at::zeros_like(minF, minF.options().dtype(at::kInt)); };
  if (scheme.dtype == QDtype::kFloat) return {at::ones_like(minF), zeros()};
  if (scheme.dtype == QDtype::kFp8E4m3) {
    return {at::maximum(minF.abs(), maxF.abs()).clamp_min(1e-12) / kFp8Max, zeros()};
  }
  if (scheme.dtype == QDtype::kNvfp4) {
    const at::Tensor absmax = absmaxOf(minF, maxF);
    return nvfp4BlockParams(absmax, nvfp4GlobalScale(absmax.amax()));
  }
  if (scheme.dtype == QDtype::kMxfp4) return {mxfp4Scale(absmaxOf(minF, maxF)), zeros()};
  // The range must contain 0 so that 0 is exactly representable (padding, ReLU zeros).
  const at::Tensor lo = minF.clamp_max(0);
  const at::Tensor hi = maxF.clamp_min(0);
  const double eps = std::numeric_limits<float>::epsilon();
  const int bits = bitsOf(scheme.dtype);
  if (scheme.symmetric) {
    const double range = (1 << (bits - 1)) - 1;
    return {(at::maximum(-lo, hi) / range).clamp_min(eps), zeros()};
  }
  // msmodelslim writes max/qmax - min/qmax rather than (max - min)/qmax; kept for bit parity.
  const double range = (1 << bits) - 1;
  const at::Tensor scale = (hi / range - lo / range).clamp_min(eps);
  const at::Tensor zeroPoint = at::round(-lo / scale) - static_cast<double>(1 << (bits - 1));
  return {scale, zeroPoint.to(at::kInt)};
}

namespace {

// minMax of an fp32 CPU x per token, with 0 in each range, in one pass over x (ATen's amin and
// amax make two): what computeQParams needs of it for int and E4M3 schemes, whose scales take
// the range with 0 in it (int) or the largest magnitude (E4M3). Empty for other schemes and
// inputs, and where x holds a NaN (whose payload bits ATen's reductions carry).
std::optional<std::pair<at::Tensor, at::Tensor>> tokenRanges(const at::Tensor& x, const QScheme& scheme) {
  if (scheme.scope != QScope::kPerToken || !(isInt(scheme.dtype) || scheme.dtype == QDtype::kFp8E4m3) ||
      x.scalar_type() != at::kFloat || !x.device().is_cpu() || x.dim() == 0 || x.numel() == 0) {
    return std::nullopt;
  }
  const at::Tensor input = x.contiguous();
  const int64_t cols = input.size(-1), rows = input.numel() / cols;
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = 1;
  at::Tensor min = at::empty(shape, input.options()), max = at::empty(shape, input.options());
  const float* in = input.const_data_ptr<float>();
  float* lo = min.mutable_data_ptr<float>();
  float* hi = max.mutable_data_ptr<float>();
  std::atomic<bool> nan = false;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      lo[r] = hi[r] = 0.0f;
      if (detail::rowMinMax(in + r * cols, cols, lo[r], hi[r])) nan.store(true);
    }
  });
  if (nan.load()) return std::nullopt;
  return std::pair{min, max};
}

}  // namespace

QParams computeQParams(const at::Tensor& x, const QScheme& scheme) {
  if (const auto ranges = tokenRanges(x, scheme)) return computeQParams(ranges->first, ranges->second, scheme);
  const auto [min, max] = minMax(x, scheme);
  return computeQParams(min, max, scheme);
}

QParams computeQParams(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale) {
  QPIPE_CHECK(scheme.dtype == QDtype::kNvfp4, "a given global scale is for nvfp4, not ", scheme.name());
  const auto [min, max] = minMax(x, scheme);
  return nvfp4BlockParams(absmaxOf(min, max), globalScale.to(at::kFloat));
}

at::Tensor mxfp4Scale(const at::Tensor& absmax) {
  const at::Tensor bits = absmax.to(at::kFloat).contiguous().view(at::kInt);
  const at::Tensor exponent = (bits + kMxRoundUp).bitwise_right_shift(23).bitwise_and(0xFF);
  return fromE8m0((exponent - kFp4Emax).clamp(0, kE8m0Max).to(at::kByte));
}

at::Tensor toE8m0(const at::Tensor& scale) {
  const at::Tensor bits = scale.to(at::kFloat).contiguous().view(at::kInt);
  return bits.bitwise_right_shift(23).bitwise_and(0xFF).to(at::kByte);
}

at::Tensor fromE8m0(const at::Tensor& bytes) {
  QPIPE_CHECK(bytes.scalar_type() == at::kByte, "fromE8m0 takes uint8 exponents, got ", bytes.scalar_type());
  const at::Tensor byte = bytes.to(at::kInt);
  return at::where(byte == 0, at::full_like(byte, kTwoToMinus127Bits), byte.bitwise_left_shift(23))
      .contiguous()
      .view(at::kFloat);
}

at::Tensor nvfp4GlobalScale(const at::Tensor& absmax) {
  const at::Tensor global =
      kFp8Max * kFp4Max / absmax.to(at::kFloat).reshape({1}).clamp_min(std::numeric_limits<float>::min());
  return at::nan_to_num(global, 1.0, 1.0, 1.0);
}

namespace {

// MKL's cblas_gemm_bf16bf16f32 (LP64 ints; CBLAS enums), which LibTorch's MKL build links in and
// exports; absent from LibTorch builds without MKL, where bf16Matmul falls back.
using GemmBf16F32 = void (*)(int layout, int transA, int transB, int m, int n, int k, float alpha, const void* a,
                             int lda, const void* b, int ldb, float beta, float* c, int ldc);
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

GemmBf16F32 mklGemmBf16F32() {
  static const auto gemm = reinterpret_cast<GemmBf16F32>(::dlsym(RTLD_DEFAULT, "cblas_gemm_bf16bf16f32"));
  return gemm;
}

// The Fortran BLAS sgemm (column-major; LP64 ints) that LibTorch's MKL exports likewise.
using Sgemm = void (*)(const char* transA, const char* transB, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

Sgemm blasSgemm() {
  static const auto gemm = reinterpret_cast<Sgemm>(::dlsym(RTLD_DEFAULT, "sgemm_"));
  return gemm;
}

// MKL's fp32 GEMM on a pre-packed operand (CBLAS, LP64 ints), exported likewise.
struct PackedSgemm {
  using Size = size_t (*)(int identifier, int m, int n, int k);
  using Pack = void (*)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                        int ld, float* dest);
  using Compute = void (*)(int layout, int transA, int transB, int m, int n, int k, const float* a, int lda,
                           const float* b, int ldb, float beta, float* c, int ldc);
  Size size;
  Pack pack;
  Compute compute;
};
constexpr int kCblasPacked = 151, kCblasBMatrix = 162;

const PackedSgemm* mklPackedSgemm() {
  static const PackedSgemm functions{
      reinterpret_cast<PackedSgemm::Size>(::dlsym(RTLD_DEFAULT, "cblas_sgemm_pack_get_size")),
      reinterpret_cast<PackedSgemm::Pack>(::dlsym(RTLD_DEFAULT, "cblas_sgemm_pack")),
      reinterpret_cast<PackedSgemm::Compute>(::dlsym(RTLD_DEFAULT, "cblas_sgemm_compute"))};
  return functions.size != nullptr && functions.pack != nullptr && functions.compute != nullptr ? &functions : nullptr;
}

// MKL's conditional numerical reproducibility: mkl_cbwr_set and mkl_cbwr_get, which LibTorch's
// MKL does not export, are these service calls.
using Cbwr = int (*)(int);
constexpr int kCbwrAuto = 2, kCbwrStrict = 0x10000, kCbwrAll = -1, kCbwrSuccess = 0;

Cbwr cbwr(const char* name) {
  return reinterpret_cast<Cbwr>(::dlsym(RTLD_DEFAULT, name));
}

// Whether this process's MKL GEMMs give the same bits on any thread count (threadInvariantBlas).
bool strictBlas() {
  static const Cbwr get = cbwr("mkl_serv_cbwr_get");
  return get != nullptr && (get(kCbwrAll) & kCbwrStrict) != 0;
}

// Holds MKL to one thread on the calling thread while it lives. Inside an OpenMP region MKL runs
// one thread only while its dynamic adjustment is on, and LibTorch's at::set_num_threads turns
// it off; then a call inside the region split its sums as the outer thread count did.
class OneMklThread {
 public:
  OneMklThread() : set_(function()) {
    if (set_ != nullptr) previous_ = set_(1);
  }
  ~OneMklThread() {
    if (set_ != nullptr) set_(previous_);
  }
  OneMklThread(const OneMklThread&) = delete;
  OneMklThread& operator=(const OneMklThread&) = delete;

 private:
  using SetLocal = int (*)(int);
  static SetLocal function() {
    static const auto set = reinterpret_cast<SetLocal>(::dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
    return set;
  }
  SetLocal set_;
  int previous_ = 0;
};

}  // namespace

namespace {

// out = a · bᵀ + beta · out, for a [M, K], b [N, K], both bf16 or both fp32, and fp32 out [M, N].
void bf16Gemm(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, float beta) {
  const bool fp32 = a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat;
  QPIPE_CHECK((fp32 || (a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16)) && a.dim() == 2 &&
                  b.dim() == 2 && a.size(1) == b.size(1),
              "bf16Matmul takes bf16 (or fp32) [M, K] and [N, K], got ", a.sizes(), " ", a.scalar_type(), " and ",
              b.sizes(), " ", b.scalar_type());
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  QPIPE_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == at::IntArrayRef({m, n}),
              "bf16MatmulAdd adds into a contiguous fp32 [", m, ", ", n, "], got ", out.sizes());
  const bool onCpu = a.device().is_cpu() && b.device().is_cpu() && out.device().is_cpu();
  const bool empty = m == 0 || n == 0 || k == 0;
  // Rows may be spaced apart (a view of part of each row) as long as each row is contiguous.
  const auto rowMajor = [](const at::Tensor& t) {
    return t.stride(1) == 1 && t.stride(0) >= t.size(1) && t.stride(0) <= INT_MAX ? t : t.contiguous();
  };
  if (onCpu && !empty && !fp32 && bf16MatmulKernel() == Bf16Kernel::kAvx512Bf16) {
    const at::Tensor lhs = rowMajor(a), rhs = rowMajor(b);
    detail::avx512Bf16Gemm(static_cast<const c10::BFloat16*>(lhs.const_data_ptr()), lhs.stride(0),
                           static_cast<const c10::BFloat16*>(rhs.const_data_ptr()), rhs.stride(0), m, n, k, beta != 0,
                           out.mutable_data_ptr<float>());
    return;
  }
  // Only with bf16 dot products: MKL's AVX2 bf16 kernel runs no faster than the fp32 GEMM, and its
  // sums depend on the thread count (seen on a Zen 3 host), which would break rank invariance.
  const GemmBf16F32 gemm = !fp32 && bf16MatmulKernel() == Bf16Kernel::kAmx ? mklGemmBf16F32() : nullptr;
  if (!onCpu || empty || std::max({m, n, k}) > INT_MAX / 2) {
    out.addmm_(a.to(at::kFloat), b.to(at::kFloat).t(), beta);
    return;
  }
  // Threaded GEMMs split their sums differently for other thread counts: MKL's bf16 GEMM (seen on
  // a Zen 4 host with AVX512-BF16) and, outside MKL's strict mode, its fp32 GEMM where K is long
  // against M and N (seen on an Intel Xeon host without bf16 dot products, e.g. 128 x 1536 x 576:
  // an FP8 static checkpoint of one rank at two threads and of two ranks at one differed). So the
  // output is cut into blocks of kBlockRows rows, whatever the number of threads, and each block
  // is one single-threaded call from a thread of an OpenMP region (or of a single-threaded
  // process): every sum is made the same way. Row blocks over the full width ran as fast as one
  // threaded call or faster on SmolLM2's shapes (MKL's bf16 GEMM, Zen 4); 128 x 512 tiles were
  // 1.5-1.8x slower where N = 576 (the round-robin gave one thread every narrow tile).
  constexpr int64_t kBlockRows = 128;
  float* result = out.mutable_data_ptr<float>();
  const auto inBlocks = [&](const auto& multiply) {
    const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
    const auto run = [&](int64_t first, int64_t step) {
      const OneMklThread oneThread;
      for (int64_t block = first; block < blocks; block += step) {
        const int64_t r = block * kBlockRows;
        multiply(r, std::min(kBlockRows, m - r));
      }
    };
    const int threads = at::get_num_threads();
    if (threads <= 1) {
      run(0, 1);
      return;
    }
#pragma omp parallel num_threads(threads)
    run(omp_get_thread_num(), omp_get_num_threads());
  };
  if (gemm != nullptr) {
    const at::Tensor lhs = rowMajor(a), rhs = rowMajor(b);
    const auto i = [](int64_t v) { return static_cast<int>(v); };
    const auto* left = static_cast<const c10::BFloat16*>(lhs.const_data_ptr());
    inBlocks([&](int64_t r, int64_t rows) {
      gemm(kCblasRowMajor, kCblasNoTrans, kCblasTrans, i(rows), i(n), i(k), 1.0f, left + r * lhs.stride(0),
           i(lhs.stride(0)), rhs.const_data_ptr(), i(rhs.stride(0)), beta, result + r * n, i(n));
    });
    return;
  }
  // The fp32 GEMM (of the widened values of bf16 operands); column-major BLAS computes outᵀ = b · aᵀ.
  const at::Tensor lhs = a.to(at::kFloat).contiguous(), rhs = b.to(at::kFloat).contiguous();
  // In MKL's strict mode one threaded call is thread-invariant already; the blocks re-pack b for
  // each block and leave a thread idle where M <= 128 (an Intel Xeon host: 0.85-1.3x one call's
  // speed at M = 512 on SmolLM2's shapes, half at M = 32).
  const Sgemm sgemm = blasSgemm();
  if (sgemm == nullptr || strictBlas()) {
    out.addmm_(lhs, rhs.t(), beta);
    return;
  }
  const float* left = lhs.const_data_ptr<float>();
  const int columns = static_cast<int>(n), depth = static_cast<int>(k);
  const float one = 1.0f;
  inBlocks([&](int64_t r, int64_t rows) {
    const int count = static_cast<int>(rows);
    sgemm("T", "N", &columns, &count, &depth, &one, rhs.const_data_ptr<float>(), &depth, left + r * k, &depth, &beta,
          result + r * n, &columns);
  });
}

}  // namespace

at::Tensor bf16Matmul(const at::Tensor& a, const at::Tensor& b) {
  // beta = 0 ignores out's contents (NaN included), in MKL and in addmm_.
  at::Tensor out =
      at::empty({a.dim() == 2 ? a.size(0) : 0, b.dim() == 2 ? b.size(0) : 0}, a.options().dtype(at::kFloat));
  bf16Gemm(a, b, out, 0.0f);
  return out;
}

void bf16MatmulAdd(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  bf16Gemm(a, b, out, 1.0f);
}

Bf16MatmulWeight::Bf16MatmulWeight(const at::Tensor& b) {
  QPIPE_CHECK(b.dim() == 2 && (b.scalar_type() == at::kBFloat16 || b.scalar_type() == at::kFloat),
              "Bf16MatmulWeight takes a bf16 or fp32 [N, K], got ", b.sizes(), " ", b.scalar_type());
  n_ = b.size(0);
  k_ = b.size(1);
  inputDtype_ = bf16MatmulKernel() == Bf16Kernel::kFp32 ? at::kFloat : at::kBFloat16;
  b_ = b.to(inputDtype_).contiguous();
  const PackedSgemm* mkl = mklPackedSgemm();
  // Outside MKL's strict mode its packed GEMM's bits may differ from sgemm's for a few rows
  // (seen at M < 100 on an Intel host), which would make a row depend on the call's M. MKL
  // documents strict mode for ?gemm, not ?gemm_compute: that the two agree there was observed,
  // and ThreadInvariantBlas checks it.
  if (inputDtype_ != at::kFloat || mkl == nullptr || !b_.device().is_cpu() || n_ == 0 || k_ == 0 ||
      std::max(n_, k_) > INT_MAX / 2 || !strictBlas()) {
    return;
  }
  // The row count MKL is told to expect; the packed form serves any M.
  constexpr int kExpectedRows = 512;
  const int n = static_cast<int>(n_), k = static_cast<int>(k_);
  // MKL reserves more than it writes (about 10 MB beyond the weight for SmolLM2's shapes); the
  // pages it never touches take no memory.
  const size_t bytes = mkl->size(kCblasBMatrix, kExpectedRows, n, k);
  if (bytes == 0) return;
  packed_ = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  mkl->pack(kCblasRowMajor, kCblasBMatrix, kCblasTrans, kExpectedRows, n, k, 1.0f, b_.const_data_ptr<float>(), k,
            static_cast<float*>(packed_.mutable_data_ptr()));
  b_ = at::Tensor();
}

at::Tensor Bf16MatmulWeight::matmul(const at::Tensor& a) const {
  QPIPE_CHECK(a.dim() == 2 && a.size(1) == k_ && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "Bf16MatmulWeight::matmul takes a bf16 or fp32 [M, ", k_, "], got ", a.sizes(), " ", a.scalar_type());
  if (!packed_.defined()) return bf16Matmul(a.to(inputDtype_), b_);
  QPIPE_CHECK(a.device().is_cpu(), "Bf16MatmulWeight::matmul: a weight packed by MKL takes CPU inputs, got ",
              a.device());
  const int64_t m = a.size(0);
  QPIPE_CHECK(m <= INT_MAX / 2, "Bf16MatmulWeight::matmul: ", m, " rows are more than one MKL call takes");
  at::Tensor out = at::empty({m, n_}, a.options().dtype(at::kFloat));
  if (m == 0) return out;
  const at::Tensor lhs = a.to(at::kFloat).contiguous();
  const int n = static_cast<int>(n_), k = static_cast<int>(k_);
  mklPackedSgemm()->compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, static_cast<int>(m), n, k,
                            lhs.const_data_ptr<float>(), k, static_cast<const float*>(packed_.const_data_ptr()), k,
                            0.0f, out.mutable_data_ptr<float>(), n);
  return out;
}

bool threadInvariantBlas() {
  // MKL documents its strict mode for its Intel code paths only; elsewhere MKL runs as it did.
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel") == 0) return false;
  static const Cbwr set = cbwr("mkl_serv_cbwr_set");
  return set != nullptr && set(kCbwrAuto | kCbwrStrict) == kCbwrSuccess && strictBlas();
}

Bf16Kernel bf16MatmulKernel() {
  static const Bf16Kernel kernel = [] {
    __builtin_cpu_init();
    // With AMX, MKL's bf16 GEMM runs on the tile units, several times faster than vdpbf16ps.
    const bool amx = __builtin_cpu_supports("amx-bf16") != 0;
    if (amx) return mklGemmBf16F32() != nullptr ? Bf16Kernel::kAmx : Bf16Kernel::kFp32;
    // vdpbf16ps outruns fp32 FMAs on AMD Zen 4 (qpipe's kernel: 2x MKL's fp32 GEMM), not on
    // Intel: an Emerald Rapids VM that exposes AVX512-BF16 but not AMX ran it (and oneDNN's bf16
    // GEMM) at half MKL's fp32 speed (docs/benchmarks.md).
    if (detail::canRunAvx512Bf16Gemm() && __builtin_cpu_is("amd") != 0) return Bf16Kernel::kAvx512Bf16;
    return Bf16Kernel::kFp32;
  }();
  return kernel;
}

at::Tensor toFp8E4m3(const at::Tensor& x) {
  // Bit-level round-to-nearest-even on the fp32 pattern, as c10's fp8e4m3fn_from_fp32_value, in
  // tensor ops so it runs on any device.
  const at::Tensor bits = x.to(at::kFloat).clamp(-kFp8Max, kFp8Max).contiguous().view(at::kInt);
  const at::Tensor sign = at::bitwise_and(at::bitwise_right_shift(bits, 24), 0x80);
  const at::Tensor absBits = at::bitwise_and(bits, 0x7FFFFFFF);
  // Normal: drop 20 mantissa bits with RNE (add 0x7FFFF plus the kept lsb), rebias 127 → 7.
  const at::Tensor keptLsb = at::bitwise_and(at::bitwise_right_shift(absBits, 20), 1);
  const at::Tensor normal = at::bitwise_right_shift(absBits + 0x7FFFF + keptLsb, 20) - (120 << 3);
  // Below 2^-6 the code is the multiple of 2^-9; scaling by 512 is exact and at::round is RNE.
  const at::Tensor absValue = absBits.view(at::kFloat);
  const at::Tensor subnormal = at::round(absValue * 512.0f).to(at::kInt);
  at::Tensor code = at::where(absValue < 0.015625f, subnormal, normal);
  code = at::where(absBits > 0x7F800000, at::full_like(code, 0x7F), code);
  return at::bitwise_or(code, sign).to(at::kByte).view(at::kFloat8_e4m3fn);
}

at::Tensor fromFp8E4m3(const at::Tensor& codes) {
  QPIPE_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn, "fromFp8E4m3 takes E4M3FN codes, got ", codes.scalar_type());
  if (!codes.device().is_cpu()) return codes.to(at::kFloat);
  // LibTorch widens E4M3 one element at a time through c10's bit arithmetic; 256 values are a table.
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table{};
    for (int code = 0; code < 256; ++code) {
      table[code] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    }
    return table;
  }();
  const at::Tensor in = codes.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kFloat));
  const auto* c = static_cast<const uint8_t*>(in.const_data_ptr());
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = values[c[i]];
  });
  return out;
}

namespace {

// Over rows of `cols` elements, each row with its own s and z (perRow) or all with the first:
// the code q = clamp(round(x / s + z), lo, hi) (Out = int8_t), or the fake-quantized value
// (q - z) * s (Out = float). The same IEEE operations, in the same order, as quantize() and
// dequantize(quantize()) in tensor ops (clamping before rounding to integer bounds gives the same
// integer), so the same bits in one pass instead of five or nine.
template <typename Out>
[[gnu::always_inline]] inline void intRows(const float* x, Out* out, int64_t begin, int64_t end, int64_t cols,
                                           const float* scale, const float* zero, bool perRow, float lo, float hi) {
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even, for |v| < 2^22.
  constexpr float kRound = 12582912.0f;
  for (int64_t r = begin; r < end; ++r) {
    const float s = scale[perRow ? r : 0];
    const float z = zero[perRow ? r : 0];
    const float* in = x + r * cols;
    Out* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float q = (std::min(std::max(in[c] / s + z, lo), hi) + kRound) - kRound;
      if constexpr (std::is_same_v<Out, float>) {
        o[c] = (q - z) * s;
      } else {
        o[c] = static_cast<Out>(q);
      }
    }
  }
}

// Compiled for AVX-512 (x86-64-v4) and AVX2 beside the baseline, chosen at load time.
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fakeQuantizeRows(const float* x, float* out,
                                                                                  int64_t begin, int64_t end,
                                                                                  int64_t cols, const float* scale,
                                                                                  const float* zero, bool perRow,
                                                                                  float lo, float hi) {
  intRows(x, out, begin, end, cols, scale, zero, perRow, lo, hi);
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void quantizeRows(const float* x, int8_t* out,
                                                                              int64_t begin, int64_t end, int64_t cols,
                                                                              const float* scale, const float* zero,
                                                                              bool perRow, float lo, float hi) {
  intRows(x, out, begin, end, cols, scale, zero, perRow, lo, hi);
}

// c10's E4M3 rounding (toFp8E4m3's, on the fp32 pattern) of a magnitude ≤ 448 or NaN, as the
// fp32 pattern of the rounded value; branch-free so that a row vectorizes. Every E4M3 value has at
// most four significant bits, so the top half of that pattern is its exact bf16.
[[gnu::always_inline]] inline uint32_t fp8RoundedMagnitude(uint32_t magnitude) {
  // Normal (≥ 2^-6): three mantissa bits kept, round to nearest even on the pattern.
  const uint32_t normal = (magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) & 0xFFF00000u;
  // Subnormal: a multiple of 2^-9. Adding 1.5·2^14, where the fp32 spacing is 2^-9, rounds to
  // one with ties to even; subtracting it back is exact.
  constexpr float kSubnormalRound = 24576.0f;
  const float subnormal = (std::bit_cast<float>(magnitude) + kSubnormalRound) - kSubnormalRound;
  const uint32_t value = magnitude < kFp8MinNormalBits ? std::bit_cast<uint32_t>(subnormal) : normal;
  return magnitude > kFp32InfBits ? kFp32NanBits : value;
}

// The E4M3 value of v (clamped to ±448, or NaN) as bf16 bits.
[[gnu::always_inline]] inline uint16_t fp8ValueBf16Bits(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  return static_cast<uint16_t>((fp8RoundedMagnitude(bits & 0x7FFFFFFFu) | (bits & 0x80000000u)) >> 16);
}
// The same value as fp32.
[[gnu::always_inline]] inline float fp8Value(float v) {
  return std::bit_cast<float>(uint32_t{fp8ValueBf16Bits(v)} << 16);
}

// The E4M3 code of v (clamped to ±448, or NaN): toFp8E4m3's byte.
[[gnu::always_inline]] inline uint8_t fp8Code(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = fp8RoundedMagnitude(bits & 0x7FFFFFFFu);
  // A subnormal code is its multiple of 2^-9; a normal one the pattern's exponent rebiased
  // 127 → 7 above its three mantissa bits.
  const float small = rounded < kFp8MinNormalBits ? std::bit_cast<float>(rounded) : 0.0f;
  uint32_t code = rounded < kFp8MinNormalBits ? static_cast<uint32_t>(small * 512.0f) : (rounded >> 20) - (120u << 3);
  code = rounded > kFp32InfBits ? 0x7Fu : code;
  return static_cast<uint8_t>(code | ((bits >> 24) & 0x80u));
}

// Over rows of `cols` elements, each row with its own s or all with the first:
// out = emit(clamp(x / s, -448, 448), s), the FP8 counterpart of intRows.
template <typename Out, typename Emit>
[[gnu::always_inline]] inline void fp8Rows(const float* x, Out* out, int64_t begin, int64_t end, int64_t cols,
                                           const float* scale, bool perRow, const Emit& emit) {
  constexpr float max = kFp8Max;
  for (int64_t r = begin; r < end; ++r) {
    const float s = scale[perRow ? r : 0];
    const float* in = x + r * cols;
    Out* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = emit(std::min(std::max(in[c] / s, -max), max), s);
  }
}

// fp8(clamp(x / s)) · s.
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fakeQuantizeFp8Rows(const float* x, float* out,
                                                                                     int64_t begin, int64_t end,
                                                                                     int64_t cols, const float* scale,
                                                                                     bool perRow) {
  fp8Rows(x, out, begin, end, cols, scale, perRow, [](float v, float s) { return fp8Value(v) * s; });
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fp8CodeRows(const float* x, uint8_t* out,
                                                                             int64_t begin, int64_t end, int64_t cols,
                                                                             const float* scale, bool perRow) {
  fp8Rows(x, out, begin, end, cols, scale, perRow, [](float v, float) { return fp8Code(v); });
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fp8ValueRows(const float* x, uint16_t* out,
                                                                              int64_t begin, int64_t end, int64_t cols,
                                                                              const float* scale, bool perRow) {
  fp8Rows(x, out, begin, end, cols, scale, perRow, [](float v, float) { return fp8ValueBf16Bits(v); });
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fp8FloatValueRows(const float* x, float* out,
                                                                                   int64_t begin, int64_t end,
                                                                                   int64_t cols, const float* scale,
                                                                                   bool perRow) {
  fp8Rows(x, out, begin, end, cols, scale, perRow, [](float v, float) { return fp8Value(v); });
}

// (q - z) · s over rows of `cols` codes, each row with its own s and z or all with the first: the
// tensor ops' one rounding per element (the difference of two small integers is exact).
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void dequantizeRows(const int8_t* q, float* out,
                                                                                int64_t begin, int64_t end,
                                                                                int64_t cols, const float* scale,
                                                                                const float* zero, bool perRow) {
  for (int64_t r = begin; r < end; ++r) {
    const float s = scale[perRow ? r : 0];
    const float z = zero[perRow ? r : 0];
    const int8_t* in = q + r * cols;
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = (static_cast<float>(in[c]) - z) * s;
  }
}

// How a CPU tensor `x` of the row kernels' dtype `dtype` splits into rows of the last dimension
// that share the scheme's parameters (per_tensor: all rows; per_group cuts each weight row into
// rows of group_size), with the parameters as fp32: unset when they do not split so.
struct ParamRows {
  at::Tensor input;  // x, contiguous
  int64_t rows = 0, cols = 0;
  at::Tensor scale, zero;
  bool perRow = false;
};
std::optional<ParamRows> paramRows(const at::Tensor& x, at::ScalarType dtype, const QParams& params,
                                   const QScheme& scheme) {
  const bool weightRows =
      x.dim() == 2 &&
      (scheme.scope == QScope::kPerChannel ||
       (scheme.scope == QScope::kPerGroup && scheme.groupSize > 0 && x.size(1) % scheme.groupSize == 0));
  const bool rowwise = scheme.scope == QScope::kPerTensor || scheme.scope == QScope::kPerToken || weightRows;
  if (!rowwise || x.scalar_type() != dtype || !x.device().is_cpu() || x.dim() == 0 || x.size(-1) == 0) {
    return std::nullopt;
  }
  ParamRows split{.input = x.contiguous()};
  split.cols = scheme.scope == QScope::kPerGroup ? scheme.groupSize : split.input.size(-1);
  split.rows = split.input.numel() / split.cols;
  split.scale = params.scale.to(at::kFloat).contiguous();
  split.zero = params.zeroPoint.to(at::kFloat).contiguous();
  split.perRow = split.scale.numel() != 1;
  if (split.perRow && (split.scale.numel() != split.rows || split.zero.numel() != split.rows)) return std::nullopt;
  return split;
}

// The fast path of dequantize() for int codes: one pass, no temporaries.
bool dequantizeKernel(const at::Tensor& q, const QParams& params, const QScheme& scheme, at::Tensor& out) {
  if (!isInt(scheme.dtype)) return false;
  const std::optional<ParamRows> split = paramRows(q, at::kChar, params, scheme);
  if (!split) return false;
  out = at::empty(split->input.sizes(), split->input.options().dtype(at::kFloat));
  const int8_t* in = split->input.const_data_ptr<int8_t>();
  const float* s = split->scale.const_data_ptr<float>();
  const float* z = split->zero.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, split->rows, std::max<int64_t>(1, 16384 / split->cols), [&](int64_t begin, int64_t end) {
    dequantizeRows(in, o, begin, end, split->cols, s, z, split->perRow);
  });
  return true;
}

// The fast paths of quantize() and fakeQuantize(): an fp32 CPU tensor whose scheme's parameters
// are per row (per_tensor, per_token, per_channel, per_group). Returns false when they do not apply.
bool rowKernel(const at::Tensor& x, const QParams& params, const QScheme& scheme, at::Tensor& out, bool codes) {
  const bool fp8 = scheme.dtype == QDtype::kFp8E4m3;
  if (!(isInt(scheme.dtype) || fp8)) return false;
  const std::optional<ParamRows> split = paramRows(x, at::kFloat, params, scheme);
  if (!split) return false;
  const at::Tensor& input = split->input;
  const int64_t cols = split->cols, rows = split->rows;
  const at::Tensor& scale = split->scale;
  const at::Tensor& zero = split->zero;
  const bool perRow = split->perRow;
  out = at::empty(input.sizes(), input.options().dtype(!codes ? at::kFloat : fp8 ? at::kFloat8_e4m3fn : at::kChar));
  const float lo = fp8 ? 0 : static_cast<float>(qmin(scheme.dtype));
  const float hi = fp8 ? 0 : static_cast<float>(qmax(scheme.dtype));
  const float* in = input.const_data_ptr<float>();
  const float* s = scale.const_data_ptr<float>();
  const float* z = zero.const_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    if (codes && fp8) {
      fp8CodeRows(in, reinterpret_cast<uint8_t*>(out.mutable_data_ptr()), begin, end, cols, s, perRow);
    } else if (codes) {
      quantizeRows(in, out.mutable_data_ptr<int8_t>(), begin, end, cols, s, z, perRow, lo, hi);
    } else if (fp8) {
      fakeQuantizeFp8Rows(in, out.mutable_data_ptr<float>(), begin, end, cols, s, perRow);
    } else {
      fakeQuantizeRows(in, out.mutable_data_ptr<float>(), begin, end, cols, s, z, perRow, lo, hi);
    }
  });
  return true;
}

}  // namespace

at::Tensor quantize(const at::Tensor& x, const QParams& params, const QScheme& scheme) {
  if (scheme.dtype == QDtype::kFloat) return x;
  if (isFp4(scheme.dtype)) {
    return toFp4E2m1(grouped(x.to(at::kFloat), scheme) / groupedParam(fp4Divisor(params, scheme.dtype), scheme))
        .reshape(x.sizes());
  }
  if (at::Tensor out; rowKernel(x, params, scheme, out, /*codes=*/true)) return out;
  const at::Tensor scaled = grouped(x.to(at::kFloat), scheme) / groupedParam(params.scale, scheme);
  if (scheme.dtype == QDtype::kFp8E4m3) return toFp8E4m3(scaled).reshape(x.sizes());
  const at::Tensor zeroPoint = groupedParam(params.zeroPoint, scheme).to(at::kFloat);
  return at::round(scaled + zeroPoint).clamp(qmin(scheme.dtype), qmax(scheme.dtype)).to(at::kChar).reshape(x.sizes());
}

at::Tensor fp8Values(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  QPIPE_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "fp8Values takes a 2-D fp32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  QPIPE_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "fp8Values writes bf16 or fp32, not ", dtype);
  const at::Tensor input = x.contiguous();
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  const int64_t rows = input.size(0), cols = input.size(1);
  const bool perRow = s.numel() != 1;
  QPIPE_CHECK(!perRow || s.numel() == rows, "fp8Values: ", s.numel(), " scales for ", rows, " rows");
  at::Tensor out = at::empty({rows, cols}, input.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const float* in = input.const_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat) {
      fp8FloatValueRows(in, out.mutable_data_ptr<float>(), begin, end, cols, s.const_data_ptr<float>(), perRow);
    } else {
      fp8ValueRows(in, reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()), begin, end, cols,
                   s.const_data_ptr<float>(), perRow);
    }
  });
  return out;
}

namespace {

// c10::BFloat16's rounding of an fp32 pattern, branch-free so that the row loop vectorizes.
inline uint16_t bf16Bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void splitBf16Row(const uint32_t* in, uint16_t* hi,
                                                                              uint16_t* lo, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    const uint16_t top = bf16Bits(in[c]);
    const float rest = std::bit_cast<float>(in[c]) - std::bit_cast<float>(static_cast<uint32_t>(top) << 16);
    hi[c] = top;
    lo[c] = bf16Bits(std::bit_cast<uint32_t>(rest));
  }
}

}  // namespace

at::Tensor splitBf16(const at::Tensor& x, bool hiFirst) {
  QPIPE_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "splitBf16 takes a 2-D fp32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const at::Tensor input = x.contiguous();
  const int64_t rows = input.size(0), cols = input.size(1);
  at::Tensor out = at::empty({rows, 2 * cols}, input.options().dtype(at::kBFloat16));
  if (out.numel() == 0) return out;
  const auto* in = reinterpret_cast<const uint32_t*>(input.const_data_ptr<float>());
  auto* o = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  const int64_t hiAt = hiFirst ? 0 : cols, loAt = hiFirst ? cols : 0;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      splitBf16Row(in + r * cols, o + r * 2 * cols + hiAt, o + r * 2 * cols + loAt, cols);
  });
  return out;
}

namespace detail {

// Min and max are exact in any order, so the row is reduced in 16 independent lanes: four
// accumulators of GCC's 16-byte vector type, a width every x86-64 clone has in registers. (One
// 64-byte vector was native only to the AVX-512 clone; GCC lowered its selects elementwise
// elsewhere, 20× slower on AVX2.)
using Lanes = float __attribute__((vector_size(16)));
using LaneMask = int32_t __attribute__((vector_size(16)));
constexpr int64_t kAccumulators = 4;

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] bool rowMinMax(const float* row, int64_t cols, float& lo,
                                                                           float& hi) {
  constexpr int64_t kLanes = sizeof(Lanes) / sizeof(float);
  Lanes los[kAccumulators]{}, his[kAccumulators]{};
  LaneMask nans[kAccumulators]{};
  int64_t c = 0;
  for (; c + kAccumulators * kLanes <= cols; c += kAccumulators * kLanes) {
    for (int64_t a = 0; a < kAccumulators; ++a) {
      Lanes v;
      std::memcpy(&v, row + c + a * kLanes, sizeof v);
      los[a] = v < los[a] ? v : los[a];
      his[a] = v > his[a] ? v : his[a];
      nans[a] |= v != v;
    }
  }
  bool nan = false;
  for (; c < cols; ++c) {
    lo = std::min(lo, row[c]);
    hi = std::max(hi, row[c]);
    nan = nan || std::isnan(row[c]);
  }
  // The accumulators are folded as vectors first: a group of 32 or 64 elements is short enough
  // that sixteen scalar steps would cost as much as its loop.
  for (int64_t a = 1; a < kAccumulators; ++a) {
    los[0] = los[a] < los[0] ? los[a] : los[0];
    his[0] = his[a] > his[0] ? his[a] : his[0];
    nans[0] |= nans[a];
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    lo = std::min(lo, los[0][l]);
    hi = std::max(hi, his[0][l]);
    nan = nan || nans[0][l] != 0;
  }
  return nan;
}

}  // namespace detail

namespace {

// How symmetricWeightRows applies its column factors: w · diag(c) or w · diag(1 / c), each
// element as LibTorch's mul or div rounds it.
enum class ColumnOp { kMultiply, kDivide };

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void applyColumns(const float* from, const float* by,
                                                                              float* to, int64_t n, ColumnOp op) {
  if (op == ColumnOp::kMultiply) {
    for (int64_t c = 0; c < n; ++c) to[c] = from[c] * by[c];
  } else {
    for (int64_t c = 0; c < n; ++c) to[c] = from[c] / by[c];
  }
}

// quantizeWeight's one pass for fp32 CPU weights under int per_channel / per_group symmetric
// schemes, of w with a column factor applied where `column` is given (each value formed in a
// block that stays in cache); empty where it does not apply or w holds NaN.
std::optional<std::pair<QParams, at::Tensor>> symmetricWeightRows(const at::Tensor& w, const float* column, ColumnOp op,
                                                                  const QScheme& scheme) {
  const bool perGroup = scheme.scope == QScope::kPerGroup;
  const bool fast = isInt(scheme.dtype) && (scheme.scope == QScope::kPerChannel || perGroup) && scheme.symmetric &&
                    w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu() && w.size(0) > 0 &&
                    w.size(1) > 0 && (!perGroup || w.size(1) % scheme.groupSize == 0);
  if (!fast) return std::nullopt;
  const at::Tensor input = w.contiguous();
  const int64_t rows = input.size(0), cols = input.size(1);
  // A channel is one group of the whole row.
  const int64_t group = perGroup ? scheme.groupSize : cols, groups = cols / group;
  at::Tensor scale = at::empty({rows, groups}, input.options());
  at::Tensor codes = at::empty({rows, cols}, input.options().dtype(at::kChar));
  const float qmaxF = static_cast<float>(qmax(scheme.dtype)), qminF = static_cast<float>(qmin(scheme.dtype));
  const float* in = input.const_data_ptr<float>();
  float* scales = scale.mutable_data_ptr<float>();
  int8_t* out = codes.mutable_data_ptr<int8_t>();
  std::atomic<bool> nan = false;
  // Groups are reduced, then quantized, in blocks of up to kBlock: one quantizeRows call a block
  // rather than one a group (whose call and vector tails cost as much as a short group). Scaled
  // blocks hold at most about 64 KiB of products.
  constexpr int64_t kBlock = 256;
  static constexpr std::array<float, kBlock> kZeros{};
  const int64_t block = column == nullptr ? kBlock : std::clamp<int64_t>(16384 / group, 1, kBlock);
  at::parallel_for(0, rows * groups, std::max<int64_t>(1, 16384 / group), [&](int64_t begin, int64_t end) {
    std::vector<float> values(column == nullptr ? 0 : block * group);
    for (int64_t b = begin; b < end; b += block) {
      const int64_t n = std::min(block, end - b);
      const float* source = in + b * group;
      if (column != nullptr) {
        for (int64_t g = 0; g < n; ++g) {
          applyColumns(in + (b + g) * group, column + (b + g) % groups * group, values.data() + g * group, group, op);
        }
        source = values.data();
      }
      for (int64_t g = 0; g < n; ++g) {
        float lo = 0.0f, hi = 0.0f;
        if (detail::rowMinMax(source + g * group, group, lo, hi)) nan.store(true);
        scales[b + g] = detail::symmetricScale(lo, hi, qmaxF);
      }
      quantizeRows(source, out + b * group, 0, n, group, scales + b, kZeros.data(), true, qminF, qmaxF);
    }
  });
  // NaN: ATen's reductions carry payload bits this loop does not reproduce.
  if (nan.load()) return std::nullopt;
  return std::pair{QParams{scale, at::zeros_like(scale, scale.options().dtype(at::kInt))}, codes};
}

}  // namespace

std::pair<QParams, at::Tensor> quantizeWeight(const at::Tensor& w, const QScheme& scheme) {
  if (auto rows = symmetricWeightRows(w, nullptr, ColumnOp::kMultiply, scheme)) return *std::move(rows);
  QParams params = computeQParams(w, scheme);
  at::Tensor codes = quantize(w, params, scheme);
  return {std::move(params), std::move(codes)};
}

std::pair<QParams, at::Tensor> quantizeScaledWeight(const at::Tensor& w, const at::Tensor& columnScale,
                                                    const QScheme& scheme) {
  QPIPE_CHECK(w.dim() == 2 && columnScale.dim() == 1 && columnScale.size(0) == w.size(1),
              "quantizeScaledWeight takes w [N, K] and K column scales, got ", w.sizes(), " and ", columnScale.sizes());
  if (columnScale.scalar_type() == at::kFloat && columnScale.device().is_cpu()) {
    const at::Tensor by = columnScale.contiguous();
    if (auto rows = symmetricWeightRows(w, by.const_data_ptr<float>(), ColumnOp::kMultiply, scheme)) {
      return *std::move(rows);
    }
  }
  return quantizeWeight(w * columnScale.unsqueeze(0), scheme);
}

std::pair<QParams, at::Tensor> quantizeDividedTokens(const at::Tensor& x, const at::Tensor& columnDivisor,
                                                     const QScheme& scheme) {
  QPIPE_CHECK(x.dim() == 2 && columnDivisor.dim() == 1 && columnDivisor.size(0) == x.size(1) &&
                  scheme.scope == QScope::kPerToken,
              "quantizeDividedTokens takes x [M, K], K column divisors and a per_token scheme, got ", x.sizes(), ", ",
              columnDivisor.sizes(), " and ", scheme.name());
  // Per token over x's rows is per channel over a weight's: the same reduction and formula.
  if (columnDivisor.scalar_type() == at::kFloat && columnDivisor.device().is_cpu()) {
    QScheme rows = scheme;
    rows.scope = QScope::kPerChannel;
    const at::Tensor by = columnDivisor.contiguous();
    if (auto quantized = symmetricWeightRows(x, by.const_data_ptr<float>(), ColumnOp::kDivide, rows)) {
      return *std::move(quantized);
    }
  }
  const at::Tensor divided = x / columnDivisor.unsqueeze(0);
  QParams params = computeQParams(divided, scheme);
  at::Tensor codes = quantize(divided, params, scheme);
  return {std::move(params), std::move(codes)};
}

at::Tensor dequantize(const at::Tensor& q, const QParams& params, const QScheme& scheme) {
  if (scheme.dtype == QDtype::kFloat) return q.to(at::kFloat);
  if (isFp4(scheme.dtype)) {
    return (grouped(fromFp4E2m1(q), scheme) * groupedParam(fp4Divisor(params, scheme.dtype), scheme))
        .reshape(q.sizes());
  }
  if (at::Tensor out; dequantizeKernel(q, params, scheme, out)) return out;
  const at::Tensor values = grouped(
      scheme.dtype == QDtype::kFp8E4m3 && q.scalar_type() == at::kFloat8_e4m3fn ? fromFp8E4m3(q) : q.to(at::kFloat),
      scheme);
  const at::Tensor scale = groupedParam(params.scale, scheme);
  if (scheme.dtype == QDtype::kFp8E4m3) return (values * scale).reshape(q.sizes());
  return ((values - groupedParam(params.zeroPoint, scheme).to(at::kFloat)) * scale).reshape(q.sizes());
}

at::Tensor fakeQuantize(const at::Tensor& x, const QParams& params, const QScheme& scheme) {
  if (scheme.dtype == QDtype::kFloat) return x;
  if (at::Tensor out; rowKernel(x, params, scheme, out, /*codes=*/false)) return out;
  return dequantize(quantize(x, params, scheme), params, scheme).to(x.scalar_type());
}

namespace {

// Twice the E2M1 grid magnitude of |u| = a, as an integer: its thresholds (toFp4E2m1's), each
// adding the grid's step there (1 up to 4, then 2, 2 and 4), with no table to look up, so a block's
// loop vectorizes.
inline int32_t e2m1Steps(float a) {
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + 2 * (a > 2.5f) + 2 * (a >= 3.5f) + 4 * (a > 5.0f);
}

// The E2M1 grid value of u, its sign included (fromFp4E2m1's value of toFp4E2m1's code).
inline float e2m1Value(float u) {
  return std::copysign(0.5f * static_cast<float>(e2m1Steps(std::abs(u))), u);
}

// Twice e2m1Value(u), as an integer.
inline int32_t e2m1Code(float u) {
  const int32_t steps = e2m1Steps(std::abs(u));
  return std::signbit(u) ? -steps : steps;
}

// One block's divisor from its absmax: NVFP4's E4M3(clamp(global · (absmax / 6))) (0.125 for
// a zero block) over global, MXFP4's power of two (mxfp4Scale's arithmetic on the fp32 bits).
inline float fp4Divisor(float absmax, QDtype dtype, float global) {
  if (dtype == QDtype::kNvfp4) {
    const float scaled = std::min(std::max(global * (absmax / static_cast<float>(kFp4Max)), -448.0f), 448.0f);
    float block = static_cast<float>(c10::Float8_e4m3fn(scaled));
    if (block == 0.0f) block = 0.125f;
    return block / global;
  }
  const int32_t exponent = ((std::bit_cast<int32_t>(absmax) + kMxRoundUp) >> 23) & 0xFF;
  const int32_t byte = std::min(std::max(exponent - kFp4Emax, 0), kE8m0Max);
  return std::bit_cast<float>(byte == 0 ? kTwoToMinus127Bits : byte << 23);
}

// max|v| over a block's non-NaN inputs (0 for none), as the largest of their magnitudes' bits: an
// integer maximum, which vectorizes (a float one would need reassociation).
[[gnu::always_inline]] inline float blockAbsMax(const float* v, int64_t n) {
  constexpr uint32_t kInfBits = 0x7F800000u;
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(v[i]) & 0x7FFFFFFFu;
    largest = std::max(largest, bits > kInfBits ? 0u : bits);
  }
  return std::bit_cast<float>(largest);
}

// blocks(in, begin, end, global) over the blocks of `group` inputs of an fp32 CPU x, in parallel
// ranges; `global` is NVFP4's global scale (1 for MXFP4). A block's divisor is then
// fp4Divisor(blockAbsMax(...)): computeQParams' arithmetic on its absmax.
template <typename Blocks>
void forFp4BlockRanges(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale,
                       const Blocks& blocks) {
  const float global = scheme.dtype == QDtype::kNvfp4 ? globalScale.to(at::kFloat).item<float>() : 1.0f;
  const int64_t group = scheme.groupSize;
  const float* in = x.const_data_ptr<float>();
  at::parallel_for(0, x.numel() / group, std::max<int64_t>(1, 16384 / group),
                   [&](int64_t begin, int64_t end) { blocks(in, begin, end, global); });
}

// The block size of an FP4 format.
constexpr int64_t fp4Group(QDtype dtype) {
  return dtype == QDtype::kNvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize;
}

// The blocks [begin, end) of the format's kGroup inputs each: fake quantization's values into
// `values` where it is not null, else the codes (twice the E2M1 value) and half divisors. A constant
// block size lets each block's loops vectorize.
template <int64_t kGroup>
[[gnu::always_inline]] inline void fp4BlocksOf(const float* in, int64_t begin, int64_t end, QDtype dtype, float global,
                                               float* values, int8_t* codes, float* halves) {
  for (int64_t b = begin; b < end; ++b) {
    const float* v = in + b * kGroup;
    const float divisor = fp4Divisor(blockAbsMax(v, kGroup), dtype, global);
    if (values != nullptr) {
      for (int64_t i = 0; i < kGroup; ++i) values[b * kGroup + i] = e2m1Value(v[i] / divisor) * divisor;
    } else {
      for (int64_t i = 0; i < kGroup; ++i) codes[b * kGroup + i] = static_cast<int8_t>(e2m1Code(v[i] / divisor));
      halves[b] = divisor * 0.5f;
    }
  }
}

[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void fp4Blocks(const float* in, int64_t begin, int64_t end,
                                                                           QDtype dtype, float global, float* values,
                                                                           int8_t* codes, float* halves) {
  if (dtype == QDtype::kNvfp4) {
    return fp4BlocksOf<kNvfp4GroupSize>(in, begin, end, dtype, global, values, codes, halves);
  }
  fp4BlocksOf<kMxfp4GroupSize>(in, begin, end, dtype, global, values, codes, halves);
}

}  // namespace

at::Tensor fakeQuantizeFp4Dynamic(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale) {
  QPIPE_CHECK(isFp4(scheme.dtype) && scheme.scope == QScope::kPerGroup, "fakeQuantizeFp4Dynamic of ", scheme.name());
  const int64_t group = scheme.groupSize;
  if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || x.dim() == 0 || group != fp4Group(scheme.dtype) ||
      x.size(-1) % group != 0) {
    const QParams params =
        scheme.dtype == QDtype::kNvfp4 ? computeQParams(x, scheme, globalScale) : computeQParams(x, scheme);
    return fakeQuantize(x, params, scheme);
  }
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
  float* values = out.mutable_data_ptr<float>();
  forFp4BlockRanges(input, scheme, globalScale, [&](const float* in, int64_t begin, int64_t end, float global) {
    fp4Blocks(in, begin, end, scheme.dtype, global, values, nullptr, nullptr);
  });
  return out;
}

Fp4Codes fp4CodesDynamic(const at::Tensor& x, const QScheme& scheme, const at::Tensor& globalScale) {
  const int64_t group = scheme.groupSize;
  QPIPE_CHECK(isFp4(scheme.dtype) && scheme.scope == QScope::kPerGroup && group == fp4Group(scheme.dtype) &&
                  x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.size(1) % group == 0,
              "fp4CodesDynamic takes fp32 CPU x [M, K] with K a multiple of the group, got ", x.sizes(), " ",
              x.scalar_type(), " of ", scheme.name(), " in groups of ", group);
  const at::Tensor input = x.contiguous();
  Fp4Codes out{at::empty(input.sizes(), x.options().dtype(at::kChar)),
               at::empty({input.size(0), input.size(1) / group}, x.options())};
  int8_t* codes = out.codes.mutable_data_ptr<int8_t>();
  float* halves = out.halfDivisors.mutable_data_ptr<float>();
  forFp4BlockRanges(input, scheme, globalScale, [&](const float* in, int64_t begin, int64_t end, float global) {
    fp4Blocks(in, begin, end, scheme.dtype, global, nullptr, codes, halves);
  });
  return out;
}

at::Tensor toFp4E2m1(const at::Tensor& x) {
  const at::Tensor v = x.to(at::kFloat);
  const at::Tensor a = v.abs();
  // Each threshold passed adds one step on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}; at a tie the
  // comparison is strict or not so that the even code (an even mantissa) wins.
  at::Tensor code = (a > 0.25).to(at::kByte);
  code.add_(a >= 0.75).add_(a > 1.25).add_(a >= 1.75).add_(a > 2.5).add_(a >= 3.5).add_(a > 5.0);
  return code.bitwise_or_(at::signbit(v).to(at::kByte).mul_(8));
}

at::Tensor fromFp4E2m1(const at::Tensor& codes) {
  QPIPE_CHECK(codes.scalar_type() == at::kByte, "fromFp4E2m1 takes uint8 codes, got ", codes.scalar_type());
  const at::Tensor values = at::tensor(
      {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f},
      at::TensorOptions().device(codes.device()));
  return values.index({at::bitwise_and(codes, 0xF).to(at::kLong)});
}

at::Tensor packFp4(const at::Tensor& codes) {
  QPIPE_CHECK(codes.dim() == 2 && codes.size(1) % 2 == 0 && codes.scalar_type() == at::kByte,
              "packFp4 takes uint8 codes [rows, cols] with cols even, got ", codes.scalar_type(), " ", shapeOf(codes));
  const at::Tensor pairs = codes.reshape({codes.size(0), codes.size(1) / 2, 2});
  return at::bitwise_or(pairs.select(2, 0), at::bitwise_left_shift(pairs.select(2, 1), 4)).contiguous();
}

at::Tensor unpackFp4(const at::Tensor& packed) {
  QPIPE_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "unpackFp4 takes uint8 [rows, cols / 2], got ",
              packed.scalar_type(), " ", shapeOf(packed));
  return at::stack({at::bitwise_and(packed, 0xF), at::bitwise_right_shift(packed, 4)}, 2)
      .reshape({packed.size(0), packed.size(1) * 2});
}

namespace {
constexpr int64_t kInt4PerWord = 8;
}  // namespace

at::Tensor packInt4(const at::Tensor& q, int64_t dim) {
  QPIPE_CHECK(q.dim() == 2 && (dim == 0 || dim == 1), "packInt4 takes a 2-D tensor and dim 0 or 1, got shape ",
              shapeOf(q), " dim ", dim);
  // One pass over the codes in C++: the tensor-op form made int64 copies eight values wide, which
  // was most of a W4A16 save.
  const at::Tensor rows = (dim == 0 ? q.t() : q).to(at::kCPU).to(at::kChar).contiguous();
  const int64_t count = rows.size(0), size = rows.size(1);
  const int64_t words = (size + kInt4PerWord - 1) / kInt4PerWord;
  at::Tensor packed = at::empty({count, words}, rows.options().dtype(at::kInt));
  const int8_t* in = rows.const_data_ptr<int8_t>();
  int32_t* out = packed.mutable_data_ptr<int32_t>();
  std::atomic<bool> inRange = true;
  // Eight codes at a time as the bytes of one word, then the last word's codes (padding nibbles
  // stay 0).
  const int64_t whole = size / kInt4PerWord;
  at::parallel_for(0, count, std::max<int64_t>(1, 65536 / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
    bool bad = false;
    for (int64_t r = begin; r < end; ++r) {
      const int8_t* row = in + r * size;
      int32_t* packedRow = out + r * words;
      for (int64_t w = 0; w < whole; ++w) {
        uint64_t codes = 0;
        std::memcpy(&codes, row + w * kInt4PerWord, sizeof codes);
        // Each byte + 8 modulo 256 (the low seven bits added, the top one flipped back), which is
        // below 16 exactly for the codes in [-8, 7].
        constexpr uint64_t kLow7 = 0x7F7F7F7F7F7F7F7FULL, kTop = 0x8080808080808080ULL;
        const uint64_t biased = ((codes & kLow7) + 0x0808080808080808ULL) ^ (codes & kTop);
        bad |= (biased & 0xF0F0F0F0F0F0F0F0ULL) != 0;
        // Byte k's nibble to bits 4k..4k+3 (little-endian: byte k is code k).
        uint64_t word = (biased | (biased >> 4)) & 0x00FF00FF00FF00FFULL;
        word = (word | (word >> 8)) & 0x0000FFFF0000FFFFULL;
        word = (word | (word >> 16)) & 0xFFFFFFFFULL;
        packedRow[w] = static_cast<int32_t>(static_cast<uint32_t>(word));  // the unsigned pattern, stored as int32
      }
      uint32_t last = 0;
      for (int64_t k = 0; whole * kInt4PerWord + k < size; ++k) {
        const int32_t v = row[whole * kInt4PerWord + k];
        bad |= (v < -8) | (v > 7);
        last |= static_cast<uint32_t>(v + 8) << (4 * k);
      }
      if (whole < words) packedRow[whole] = static_cast<int32_t>(last);
    }
    if (bad) inRange.store(false);
  });
  QPIPE_CHECK(inRange, "packInt4 values must lie in [-8, 7]");
  packed = packed.to(q.device());
  return dim == 0 ? packed.t().contiguous() : packed;
}

at::Tensor unpackInt4(const at::Tensor& packed, int64_t size, int64_t dim) {
  QPIPE_CHECK(packed.dim() == 2 && (dim == 0 || dim == 1), "unpackInt4 takes a 2-D tensor and dim 0 or 1, got shape ",
              shapeOf(packed), " dim ", dim);
  const at::Tensor rows = (dim == 0 ? packed.t() : packed).to(at::kCPU).to(at::kInt).contiguous();
  const int64_t count = rows.size(0), words = rows.size(1);
  QPIPE_CHECK(size <= words * kInt4PerWord && size > (words - 1) * kInt4PerWord, "unpackInt4 size ", size,
              " does not match ", words, " packed words");
  at::Tensor q = at::empty({count, size}, rows.options().dtype(at::kChar));
  const int32_t* in = rows.const_data_ptr<int32_t>();
  int8_t* out = q.mutable_data_ptr<int8_t>();
  // packInt4 backwards: one pass in C++ (the tensor-op form made int64 copies eight values wide,
  // most of the time a synced or loaded int4 weight took).
  const int64_t whole = size / kInt4PerWord;
  at::parallel_for(0, count, std::max<int64_t>(1, 65536 / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* packedRow = in + r * words;
      int8_t* row = out + r * size;
      for (int64_t w = 0; w < whole; ++w) {
        // Nibble k to byte k, then u - 8 per byte: u ^ 8 when u >= 8, else that with the top
        // four bits set (no carry crosses a byte).
        uint64_t u = static_cast<uint32_t>(packedRow[w]);
        u = (u | (u << 16)) & 0x0000FFFF0000FFFFULL;
        u = (u | (u << 8)) & 0x00FF00FF00FF00FFULL;
        u = (u | (u << 4)) & 0x0F0F0F0F0F0F0F0FULL;
        constexpr uint64_t kBit3 = 0x0808080808080808ULL;
        const uint64_t codes = (u ^ kBit3) | (((~u & kBit3) >> 3) * 0xF0);
        std::memcpy(row + w * kInt4PerWord, &codes, sizeof codes);
      }
      const auto last = static_cast<uint32_t>(whole < words ? packedRow[whole] : 0);
      for (int64_t k = 0; whole * kInt4PerWord + k < size; ++k) {
        row[whole * kInt4PerWord + k] = static_cast<int8_t>(static_cast<int32_t>((last >> (4 * k)) & 0xF) - 8);
      }
    }
  });
  q = q.to(packed.device());
  return dim == 0 ? q.t().contiguous() : q;
}

}  // namespace qpipe::quant
