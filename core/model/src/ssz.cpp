// SSZ weight scale search (msmodelslim core/quantizer/impl/ssz.py::ssz_calculate_qparam) as a
// cache-resident kernel: each row runs all its iterations while it stays in cache, instead of
// every iteration making a dozen passes over the whole weight in memory. It reproduces the tensor
// formulation (kept below, and used where the kernel cannot match it) bit for bit; the tests
// compare the two.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "qpipe/error.h"
#include "qpipe/quant.h"
#include "weight_rows.h"

namespace qpipe::quant {

namespace {

// The tensor formulation, msmodelslim's loop as ATen ops. The fast path below reproduces it bit for bit; this stays
// for what that cannot reproduce (other devices, non-contiguous weights, a sum order other than the one probed for).
QParams sszSearchTensor(const at::Tensor& w, const QScheme& scheme, int64_t iterations) {
  const double lo = qmin(scheme.dtype);
  const double hi = qmax(scheme.dtype);
  at::Tensor scale = computeQParams(w, scheme).scale;
  at::Tensor q = at::round(w / scale).clamp(lo, hi);
  const auto mseOf = [&](const at::Tensor& s, const at::Tensor& qv) { return (w - qv * s).square().mean(1, true); };
  at::Tensor bestScale = scale;
  at::Tensor best = mseOf(scale, q);
  for (int64_t i = 0; i < iterations; ++i) {
    scale = (w * q).sum(1, true) / (q * q).sum(1, true).clamp_min(1e-30);
    q = at::round(w / scale).clamp(lo, hi);
    const at::Tensor mse = mseOf(scale, q);
    const at::Tensor gain = best - mse;
    if (((gain / best.clamp_min(1e-4) < 1e-10) | (gain.abs() < 1e-10)).all().item<bool>()) break;
    const at::Tensor better = mse < best;
    bestScale = at::where(better, scale, bestScale);
    best = at::where(better, mse, best);
  }
  return {bestScale, at::zeros_like(bestScale, bestScale.options().dtype(at::kInt))};
}

// ATen's CPU float sum over a contiguous last dim (aten/src/ATen/native/cpu/SumKernel.cpp: cascade_sum →
// vectorized_inner_sum → row_sum → multi_row_sum), operation for operation, because every scale, every comparison
// and the global early break hang on those sums' last bits. A row is read in units of one Vectorized<float>
// (`lanes` floats; a row shorter than that uses 1-float units, scalar_inner_sum), four units per group (ILP 4) into
// four accumulator levels that cascade after every 2^power groups; the units left after the last group go to the
// first partial, the four partials fold in order, and a vector unit's scalar tail and then its lanes are added to
// a float that lands on the zero-filled output.
constexpr int64_t kIlp = 4;
constexpr int64_t kLevels = 4;
constexpr int64_t kAtenGrainSize = 32768;  // at::internal::GRAIN_SIZE (ATen/TensorIterator.h)

// multi_row_sum's level power: max(4, CeilLog2(groups) / 4), where CeilLog2(x) = 1 for x <= 2.
int64_t levelPower(int64_t groups) {
  const int64_t ceilLog2 = groups <= 2 ? 1 : std::bit_width(static_cast<uint64_t>(groups - 1));
  return std::max<int64_t>(4, ceilLog2 / kLevels);
}

// multi_row_sum's carry after `done` complete groups: level j takes level j-1 while the group count is a multiple
// of the j-th power of the chunk length. The width is a constant so that the loops vectorize.
template <int64_t kWidth>
[[gnu::always_inline]] inline void cascadeLevels(float* acc, int64_t done, int64_t power) {
  const int64_t mask = (int64_t{1} << power) - 1;
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int64_t k = 0; k < kWidth; ++k) {
      acc[j * kWidth + k] += acc[(j - 1) * kWidth + k];
      acc[(j - 1) * kWidth + k] = 0.0f;
    }
    if ((done & (mask << (j * power))) != 0) break;
  }
}

// The folds after the groups, up to the lanes (acc: kLevels x kIlp x kLanes, `levels` of them in use; an unused
// level holds zeros, and adding +0 to a sum that started at +0 changes nothing): levels into level 0, then the units
// left after the last group into the first partial, then the other three partials into it.
template <int64_t kLanes>
[[gnu::always_inline]] inline void foldPartials(const float* __restrict acc, int64_t levels,
                                                const float* __restrict rest, int64_t leftoverUnits,
                                                float* __restrict partial) {
  constexpr int64_t kWidth = kIlp * kLanes;
  alignas(64) float level0[kWidth];
  for (int64_t k = 0; k < kWidth; ++k) level0[k] = acc[k];
  for (int64_t j = 1; j < levels; ++j) {
    for (int64_t k = 0; k < kWidth; ++k) level0[k] += acc[j * kWidth + k];
  }
  for (int64_t l = 0; l < kLanes; ++l) partial[l] = level0[l];
  for (int64_t u = 0; u < leftoverUnits; ++u) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += rest[u * kLanes + l];
  }
  for (int64_t k = 1; k < kIlp; ++k) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += level0[k * kLanes + l];
  }
}

// scalar_inner_sum of a row shorter than one vector: under 4 groups of 4, so no level ever cascades.
[[gnu::always_inline]] inline float shortRowSum(const float* p, int64_t n) {
  float acc[kIlp] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t groups = n / kIlp;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t k = 0; k < kIlp; ++k) acc[k] += p[g * kIlp + k];
  }
  for (int64_t t = groups * kIlp; t < n; ++t) acc[0] += p[t];
  for (int64_t k = 1; k < kIlp; ++k) acc[0] += acc[k];
  return 0.0f + acc[0];
}

struct PassSums {
  float sse;  // Σ (w - q·s)²
  float swq;  // Σ w·q
  float sqq;  // Σ q·q
};

// The three sums of q = clamp(round(w / s)) over one row in one cache-resident pass; q itself is not needed. Groups
// are fused, one accumulator set per sum; the rest of the row (under one group and one unit) is buffered. Element
// arithmetic is ATen's: IEEE float division; clamping before rounding gives the same value (rounding is monotone
// and keeps the integer bounds) and keeps NaN as at::clamp does; round half to even is (x + 1.5·2^23) - 1.5·2^23,
// exact for |x| <= 2^22 in the default rounding mode (SSE2 has no roundps and std::nearbyint does not vectorize).
// That gives +0 where round gives -0, which no sum can see: the products are then ±0, and adding ±0 to an
// accumulator that started at +0 leaves it unchanged. Products and sums must stay separate roundings: GCC's C++
// default -ffp-contract=fast fuses them into FMAs once the target ISA has FMA (aarch64, -march=native); then
// fastPathLanes() finds the mismatch and sszSearch keeps the tensor formulation (build with -ffp-contract=off).
template <int64_t kLanes>
[[gnu::always_inline]] inline PassSums rowPass(const float* __restrict w, int64_t n, float scale, float lo, float hi) {
  constexpr int64_t kWidth = kIlp * kLanes;
  constexpr float kRound = 12582912.0f;  // 1.5·2^23: x + kRound has unit spacing for |x| <= 2^22
  const auto quantized = [&](float wv) {
    float x = wv / scale;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    return (x + kRound) - kRound;
  };
  if (n < kLanes) {
    // Shorter than one vector: scalar_inner_sum over the whole row.
    float e2[kLanes], wq[kLanes], q2[kLanes];
    for (int64_t t = 0; t < n; ++t) {
      const float r = quantized(w[t]);
      const float d = w[t] - r * scale;
      e2[t] = d * d;
      wq[t] = w[t] * r;
      q2[t] = r * r;
    }
    return {shortRowSum(e2, n), shortRowSum(wq, n), shortRowSum(q2, n)};
  }
  const int64_t groups = n / kWidth;
  const int64_t power = levelPower(groups);
  // Level j is reached once groups >= 2^(j·power); only those need zeros.
  int64_t levels = 1;
  while (levels < kLevels && (groups >> (levels * power)) > 0) ++levels;
  alignas(64) float sse[kLevels * kWidth];
  alignas(64) float swq[kLevels * kWidth];
  alignas(64) float sqq[kLevels * kWidth];
  std::fill_n(sse, levels * kWidth, 0.0f);
  std::fill_n(swq, levels * kWidth, 0.0f);
  std::fill_n(sqq, levels * kWidth, 0.0f);
  const int64_t chunkMask = (int64_t{1} << power) - 1;
  for (int64_t g = 0; g < groups; ++g) {
    const float* __restrict wg = w + g * kWidth;
    for (int64_t k = 0; k < kWidth; ++k) {
      const float r = quantized(wg[k]);
      const float d = wg[k] - r * scale;
      sse[k] += d * d;
      swq[k] += wg[k] * r;
      sqq[k] += r * r;
    }
    if (((g + 1) & chunkMask) == 0) {
      cascadeLevels<kWidth>(sse, g + 1, power);
      cascadeLevels<kWidth>(swq, g + 1, power);
      cascadeLevels<kWidth>(sqq, g + 1, power);
    }
  }
  const int64_t done = groups * kWidth;
  const int64_t restCount = n - done;
  alignas(64) float e2[kWidth], wq[kWidth], q2[kWidth];  // restCount < 3 units + 1 unit
  for (int64_t t = 0; t < restCount; ++t) {
    const float wv = w[done + t];
    const float r = quantized(wv);
    const float d = wv - r * scale;
    e2[t] = d * d;
    wq[t] = wv * r;
    q2[t] = r * r;
  }
  const int64_t leftoverUnits = restCount / kLanes;
  alignas(64) float pe[kLanes], pw[kLanes], pq[kLanes];
  foldPartials<kLanes>(sse, levels, e2, leftoverUnits, pe);
  foldPartials<kLanes>(swq, levels, wq, leftoverUnits, pw);
  foldPartials<kLanes>(sqq, levels, q2, leftoverUnits, pq);
  // The scalar tail, then the lanes, one after another: three interleaved sequential chains.
  float te = 0.0f, tw = 0.0f, tq = 0.0f;
  for (int64_t t = leftoverUnits * kLanes; t < restCount; ++t) {
    te += e2[t];
    tw += wq[t];
    tq += q2[t];
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    te += pe[l];
    tw += pw[l];
    tq += pq[l];
  }
  return {0.0f + te, 0.0f + tw, 0.0f + tq};
}

// The Vectorized<float> width of this process's sum kernel for which rowPass reproduces ATen exactly: the three sums
// and the mean of the tensor formulation on probe rows of lengths that reach every branch of the sum order, for each
// candidate width. It is 8 even on AVX-512 machines: sum_stub has no AVX-512 kernel (REGISTER_DISPATCH, not
// ALSO_REGISTER_AVX512_DISPATCH), so dispatch falls back to the AVX2 one. 0 when no width matches (another ATen sum
// algorithm, or a build that fuses products into FMAs), and sszSearch keeps the tensor formulation.
int64_t fastPathLanes() {
  static const int64_t lanes = [] {
    constexpr float kLo = -8.0f;
    constexpr float kHi = 7.0f;
    const std::vector<int64_t> lengths{3, 13, 100, 600, 3001, 20000};
    for (const int64_t candidate : {int64_t{8}, int64_t{16}, int64_t{4}}) {
      bool matches = true;
      uint32_t state = 12345;
      for (const int64_t n : lengths) {
        // Values over many binades and both signs: any other summation order rounds differently.
        std::vector<float> values(2 * n);
        for (float& v : values) {
          state = state * 1664525u + 1013904223u;
          v = std::ldexp(static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)), -23 - int(state % 17));
        }
        const at::Tensor w = at::from_blob(values.data(), {2, n}, at::kFloat);
        const at::Tensor s = (w.abs().amax(1, true) / 9.0).contiguous();  // clamps some elements
        const at::Tensor q = at::round(w / s).clamp(kLo, kHi);
        const at::Tensor err = (w - q * s).square();
        const at::Tensor sse = err.sum(1, true).contiguous();
        const at::Tensor mse = err.mean(1, true).contiguous();
        const at::Tensor swq = (w * q).sum(1, true).contiguous();
        const at::Tensor sqq = (q * q).sum(1, true).contiguous();
        for (int64_t r = 0; r < 2; ++r) {
          const float* row = values.data() + r * n;
          const float scale = s.const_data_ptr<float>()[r];
          const PassSums sums = candidate == 8    ? rowPass<8>(row, n, scale, kLo, kHi)
                                : candidate == 16 ? rowPass<16>(row, n, scale, kLo, kHi)
                                                  : rowPass<4>(row, n, scale, kLo, kHi);
          matches = matches && sums.sse == sse.const_data_ptr<float>()[r] &&
                    sums.swq == swq.const_data_ptr<float>()[r] && sums.sqq == sqq.const_data_ptr<float>()[r] &&
                    sums.sse / static_cast<float>(n) == mse.const_data_ptr<float>()[r];
        }
      }
      if (matches) return candidate;
    }
    return int64_t{0};
  }();
  return lanes;
}

// The reference's per-row break test, in float as ATen evaluates it (the double constants become floats).
bool breakCondition(float best, float mse) {
  const float gain = best - mse;
  return gain / std::max(best, static_cast<float>(1e-4)) < static_cast<float>(1e-10) ||
         std::fabs(gain) < static_cast<float>(1e-10);
}

// computeQParams' symmetric per_channel scale of one row, bit for bit, without its eight tensor ops (each a parallel
// region): max(-min(rowMin, 0), max(rowMax, 0)) / qmax in float, at least FLT_EPSILON. A row with a NaN gets a NaN
// scale, as amin, amax, maximum and clamp_min propagate it, but not ATen's payload bits (its vector kernels
// substitute all-ones depending on where they meet the NaN): sszSearch redoes such weights with the tensor
// formulation. Zero signs do not matter: zero ranges become epsilon.
[[gnu::always_inline]] inline float minMaxScale(const float* w, int64_t n, float qmax) {
  float lo = 0.0f, hi = 0.0f;
  if (detail::rowMinMax(w, n, lo, hi)) return std::numeric_limits<float>::quiet_NaN();
  return detail::symmetricScale(lo, hi, qmax);
}

struct RowState {
  float scale = 0.0f;  // the latest scale
  float mse = 0.0f;    // and its mse
  float best = 0.0f;
  float bestScale = 0.0f;
  // A row's future is a function of its latest scale alone: once a new scale has the bits of the latest one, every
  // later iteration repeats the last (same mse, no update, same break condition) and needs no pass. NaN included;
  // an all-zero row gets there within a few steps (scale 0/1e-30 = 0, then NaN).
  bool frozen = false;
  bool frozenCondition = false;
};

// Iterations [first, last) of one row. Records per iteration the row's break condition and its best scale before
// that iteration's update, which is the row's result if the global break falls there.
template <int64_t kLanes>
[[gnu::always_inline]] inline void sszRowWindow(const float* w, int64_t n, float lo, float hi, int64_t first,
                                                int64_t last, RowState& row, float* bestBefore, uint8_t* condition) {
  const float count = static_cast<float>(n);  // mean = sum / numel in float, as ATen's CPU mean
  int64_t i = first;
  if (!row.frozen) {
    if (first == 0) row.scale = minMaxScale(w, n, hi);
    // The sums are not kept between windows: rebuild those of the latest scale.
    PassSums sums = rowPass<kLanes>(w, n, row.scale, lo, hi);
    if (first == 0) {
      row.mse = sums.sse / count;
      row.best = row.mse;
      row.bestScale = row.scale;
    }
    for (; i < last; ++i) {
      bestBefore[i - first] = row.bestScale;
      const float scale = sums.swq / std::max(sums.sqq, 1e-30f);  // NaN stays NaN, as clamp_min
      if (std::bit_cast<uint32_t>(scale) == std::bit_cast<uint32_t>(row.scale)) {
        // The last pass again: best <= its mse already (or NaN), so no update from here on.
        row.frozen = true;
        row.frozenCondition = breakCondition(row.best, row.mse);
        break;
      }
      sums = rowPass<kLanes>(w, n, scale, lo, hi);
      const float mse = sums.sse / count;
      condition[i - first] = breakCondition(row.best, mse);
      if (mse < row.best) {
        row.best = mse;
        row.bestScale = scale;
      }
      row.scale = scale;
      row.mse = mse;
    }
  }
  for (; i < last; ++i) {
    bestBefore[i - first] = row.bestScale;
    condition[i - first] = row.frozenCondition;
  }
}

// sszRowWindow over a chunk of rows, compiled for AVX-512 and AVX2 beside the baseline and chosen
// at load time. The file is built with -ffp-contract=off: contracted multiply-adds would round
// differently from ATen's separate ones. Wider registers change nothing else: every lane keeps
// its own accumulators in the order ATen's 8-lane sum uses.
template <int64_t kLanes>
[[gnu::always_inline]] inline void rowChunk(const float* w, int64_t n, float lo, float hi, int64_t first, int64_t last,
                                            RowState* rows, int64_t begin, int64_t end, float* bestBefore,
                                            uint8_t* condition, int64_t window) {
  for (int64_t r = begin; r < end; ++r) {
    sszRowWindow<kLanes>(w + r * n, n, lo, hi, first, last, rows[r], bestBefore + r * window, condition + r * window);
  }
}
using RowChunkFn = void (*)(const float*, int64_t, float, float, int64_t, int64_t, RowState*, int64_t, int64_t, float*,
                            uint8_t*, int64_t);
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void rowChunk4(const float* w, int64_t n, float lo,
                                                                           float hi, int64_t first, int64_t last,
                                                                           RowState* rows, int64_t begin, int64_t end,
                                                                           float* bestBefore, uint8_t* condition,
                                                                           int64_t window) {
  rowChunk<4>(w, n, lo, hi, first, last, rows, begin, end, bestBefore, condition, window);
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void rowChunk8(const float* w, int64_t n, float lo,
                                                                           float hi, int64_t first, int64_t last,
                                                                           RowState* rows, int64_t begin, int64_t end,
                                                                           float* bestBefore, uint8_t* condition,
                                                                           int64_t window) {
  rowChunk<8>(w, n, lo, hi, first, last, rows, begin, end, bestBefore, condition, window);
}
[[gnu::target_clones("arch=x86-64-v4", "avx2", "default")]] void rowChunk16(const float* w, int64_t n, float lo,
                                                                            float hi, int64_t first, int64_t last,
                                                                            RowState* rows, int64_t begin, int64_t end,
                                                                            float* bestBefore, uint8_t* condition,
                                                                            int64_t window) {
  rowChunk<16>(w, n, lo, hi, first, last, rows, begin, end, bestBefore, condition, window);
}

// Rows run all their iterations one after another with the row in cache; the only coupling, the global break
// (the first iteration at which every row's condition holds), is resolved afterwards from the recorded conditions.
// Windows of iterations bound the records for large iteration counts.
at::Tensor sszRows(const at::Tensor& w, float lo, float hi, int64_t iterations, RowChunkFn rowChunkFn) {
  constexpr int64_t kWindow = 64;
  const int64_t rows = w.size(0);
  const int64_t n = w.size(1);
  const float* wData = w.const_data_ptr<float>();
  at::Tensor out = at::empty({rows, 1}, w.options());
  float* outData = out.data_ptr<float>();
  if (iterations <= 0) {
    for (int64_t r = 0; r < rows; ++r) outData[r] = minMaxScale(wData + r * n, n, hi);
    return out;
  }
  std::vector<RowState> state(rows);
  const int64_t window = std::min(iterations, kWindow);
  std::vector<float> bestBefore(rows * window);
  std::vector<uint8_t> condition(rows * window);
  for (int64_t first = 0; first < iterations; first += window) {
    const int64_t last = std::min(first + window, iterations);
    // Rows are independent, so no split can change a result. Threads take small chunks as they go rather than a
    // fixed share: rows freeze after very different numbers of iterations, and a thread on a busy core would hold
    // up the others.
    const int64_t chunk = (4096 + n - 1) / n;  // a few thousand elements per take
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (rows + chunk - 1) / chunk), 1, [&](int64_t, int64_t) {
      for (int64_t begin = next.fetch_add(chunk); begin < rows; begin = next.fetch_add(chunk)) {
        rowChunkFn(wData, n, lo, hi, first, last, state.data(), begin, std::min(begin + chunk, rows), bestBefore.data(),
                   condition.data(), window);
      }
    });
    for (int64_t t = 0; t < last - first; ++t) {
      bool all = true;
      for (int64_t r = 0; r < rows && all; ++r) all = condition[r * window + t] != 0;
      if (!all) continue;
      for (int64_t r = 0; r < rows; ++r) outData[r] = bestBefore[r * window + t];
      return out;
    }
  }
  for (int64_t r = 0; r < rows; ++r) outData[r] = state[r].bestScale;
  return out;
}

}  // namespace

QParams sszSearch(const at::Tensor& weight, const QScheme& scheme, int64_t iterations) {
  // Reference: msmodelslim core/quantizer/impl/ssz.py::ssz_calculate_qparam (§c.1): a
  // Lloyd-style alternation between the least-squares scale for fixed q and q for fixed scale.
  QPIPE_REQUIRE((scheme.dtype == QDtype::kInt8 || scheme.dtype == QDtype::kInt4) &&
                    scheme.scope == QScope::kPerChannel && scheme.symmetric,
                ErrorCode::kConfig, "ssz supports int8/int4 per_channel symmetric weights only, got ", scheme.name());
  QPIPE_REQUIRE(weight.dim() == 2, ErrorCode::kConfig, "ssz needs a weight [out, in], got shape ", weight.sizes());
  const at::Tensor w = weight.to(at::kFloat);
  // The tensor formulation's sums are only reproduced for contiguous CPU rows that ATen reduces whole: it splits a
  // single row as long as its grain across threads (two_pass_reduction), and reduces a transposed one column-wise.
  // An empty row keeps its error (amin of an empty dimension).
  const bool fastPath =
      w.device().is_cpu() && w.is_contiguous() && w.size(1) > 0 && !(w.size(0) == 1 && w.size(1) >= kAtenGrainSize);
  const int64_t lanes = fastPath ? fastPathLanes() : 0;
  if (lanes == 0) return sszSearchTensor(w, scheme, iterations);
  const float lo = static_cast<float>(qmin(scheme.dtype));
  const float hi = static_cast<float>(qmax(scheme.dtype));
  const at::Tensor bestScale = sszRows(w, lo, hi, iterations,
                                       lanes == 16  ? rowChunk16
                                       : lanes == 8 ? rowChunk8
                                                    : rowChunk4);
  // Only a NaN minmax scale can end NaN (a NaN scale never lowers the mse); see minMaxScale.
  const float* scales = bestScale.const_data_ptr<float>();
  if (std::any_of(scales, scales + bestScale.numel(), [](float s) { return std::isnan(s); })) {
    return sszSearchTensor(w, scheme, iterations);
  }
  return {bestScale, at::zeros_like(bestScale, bestScale.options().dtype(at::kInt))};
}

}  // namespace qpipe::quant
