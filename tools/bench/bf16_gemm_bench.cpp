// bf16 GEMMs on this CPU, SmolLM2's shapes: what quant::bf16Matmul chose (bf16MatmulKernel), the
// same product on a weight held as quant::Bf16MatmulWeight (packed once by MKL where it runs in
// strict mode, as Fp8Linear holds its weight), qpipe's AVX512-BF16 kernel called directly where
// the CPU can run it, MKL's fp32 GEMM (at::matmul of the widened operands) and oneDNN's bf16 GEMM
// (at::matmul of bf16 tensors), best of 7 calls each, in milliseconds and GFLOP/s. MKL's strict
// mode is asked for first, as `qpipe` does. It decides which kernel bf16Matmul should pick on a
// new kind of host. A second table times a weight-only Linear (int4, groups of 64) the four ways
// QuantLinear can run it: the fp32 GEMM of the dequantized weight, GroupedBf16Linear, Bf16x3Linear
// and GroupedInt8Linear, each with its input split, where the CPU can run them.
//   qpipe_bench_bf16_gemm [THREADS]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bf16_gemm.h"
#include "grouped_int8_gemm.h"
#include "qpipe/quant.h"
#include "qpipe/quant_linear.h"

namespace {

// SmolLM2's Linear shapes (q/o, gate/up, down) at 512 rows (one window), 4096 and 128.
constexpr std::array<std::array<int64_t, 3>, 5> kShapes{
    {{512, 576, 576}, {512, 576, 1536}, {512, 1536, 576}, {4096, 576, 1536}, {128, 1536, 576}}};

template <typename F>
double bestMs(const F& f) {
  double best = 1e30;
  for (int i = 0; i < 7; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

const char* kernelName(qpipe::quant::Bf16Kernel kernel) {
  switch (kernel) {
    case qpipe::quant::Bf16Kernel::kAmx: return "AMX (MKL)";
    case qpipe::quant::Bf16Kernel::kAvx512Bf16: return "qpipe AVX512-BF16";
    case qpipe::quant::Bf16Kernel::kFp32: return "fp32 GEMM (MKL)";
  }
  return "?";
}

// The weight-only table: a W4A16 (groups of 64) Linear's forward, fp32 [M, K] input, each way
// this CPU can run it.
void weightOnlyTable(bool bf16) {
  namespace quant = qpipe::quant;
  const bool int8 = quant::detail::canRunAvx512VnniGemm();
  const quant::QScheme w4{quant::QDtype::kInt4, quant::QScope::kPerGroup, true, 64};
  std::printf(
      "\n| M x K x N, W4A16 g64 | fp32 GEMM ms | GroupedBf16Linear ms | speed-up | Bf16x3Linear ms | speed-up | "
      "GroupedInt8Linear ms | speed-up |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& [m, k, n] : kShapes) {
    const at::Tensor x = at::randn({m, k}), weight = at::randn({n, k}) * 0.05f;
    const quant::QParams params = quant::computeQParams(weight, w4);
    const at::Tensor q = quant::quantize(weight, params, w4), dequantized = quant::dequantize(q, params, w4);
    const double fp32 = bestMs([&] { at::linear(x, dequantized); });
    const auto column = [&](bool runs, const auto& make) {
      if (!runs) return std::string("| n/a | ");
      const auto gemm = make();
      const double ms = bestMs([&] { gemm.forward(x, at::Tensor()); });
      char cell[48];
      std::snprintf(cell, sizeof cell, "| %.2f | %.2fx ", ms, fp32 / ms);
      return std::string(cell);
    };
    std::printf("| %lld x %lld x %lld | %.2f %s%s%s|\n", static_cast<long long>(m), static_cast<long long>(k),
                static_cast<long long>(n), fp32,
                column(bf16, [&] { return qpipe::GroupedBf16Linear(q, params, w4); }).c_str(),
                column(bf16, [&] { return qpipe::Bf16x3Linear(dequantized); }).c_str(),
                column(int8, [&] { return qpipe::GroupedInt8Linear(q, params, w4); }).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  namespace quant = qpipe::quant;
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  if (argc > 2 || threads < 1) {
    std::fprintf(stderr, "usage: qpipe_bench_bf16_gemm [THREADS] (a positive count), got %s\n", argv[1]);
    return 2;
  }
  const bool strict = quant::threadInvariantBlas();
  at::set_num_threads(threads);
  const bool direct = quant::detail::canRunAvx512Bf16Gemm();
  std::printf("threads %d; MKL strict mode: %s; bf16Matmul runs: %s\n\n", at::get_num_threads(), strict ? "yes" : "no",
              kernelName(quant::bf16MatmulKernel()));
  std::printf(
      "| M x K x N | bf16Matmul ms | GFLOP/s | Bf16MatmulWeight ms | GFLOP/s | AVX512-BF16 kernel ms | GFLOP/s | "
      "MKL fp32 ms | GFLOP/s | oneDNN bf16 ms |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: |\n");
  for (const auto& [m, k, n] : kShapes) {
    const at::Tensor a = at::randn({m, k}).to(at::kBFloat16), b = at::randn({n, k}).to(at::kBFloat16);
    const at::Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
    const double gflop = 2.0 * static_cast<double>(m * k * n) / 1e9;
    const double chosen = bestMs([&] { quant::bf16Matmul(a, b); });
    const quant::Bf16MatmulWeight weight(b);
    const at::Tensor input = a.to(weight.inputDtype());
    const double held = bestMs([&] { weight.matmul(input); });
    const double fp32 = bestMs([&] { at::matmul(a32, b32.t()); });
    const double onednn = bestMs([&] { at::matmul(a, b.t()); });
    char kernel[64] = "| n/a | n/a";
    if (direct) {
      at::Tensor out = at::empty({m, n});
      const double ms = bestMs([&] {
        quant::detail::avx512Bf16Gemm(a.const_data_ptr<c10::BFloat16>(), k, b.const_data_ptr<c10::BFloat16>(), k, m,
                                      n, k, false, out.mutable_data_ptr<float>());
      });
      std::snprintf(kernel, sizeof kernel, "| %.2f | %.0f", ms, gflop / ms * 1e3);
    }
    std::printf("| %lld x %lld x %lld | %.2f | %.0f | %.2f%s | %.0f %s | %.2f | %.0f | %.2f |\n",
                static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n), chosen,
                gflop / chosen * 1e3, held, weight.packed() ? " (packed)" : "", gflop / held * 1e3, kernel, fp32,
                gflop / fp32 * 1e3, onednn);
  }
  weightOnlyTable(direct);
  return 0;
}
