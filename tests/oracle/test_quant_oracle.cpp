// qpipe::quant against msmodelslim's formulas written in plain torch (tests/oracle/quant_oracle.py):
// scales, zero points and quantized values byte for byte, for every dtype and scope.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "qpipe/quant.h"
#include "test_helpers.h"

namespace qpipe::quant {
namespace {

std::vector<uint8_t> fromHex(const std::string& hex) {
  std::vector<uint8_t> bytes(hex.size() / 2);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return bytes;
}

std::vector<uint8_t> bytesOf(const at::Tensor& tensor) {
  const at::Tensor t = tensor.contiguous();
  const auto* data = static_cast<const uint8_t*>(t.data_ptr());
  return {data, data + t.nbytes()};
}

TEST(QuantOracle, MatchesMsmodelslimFormulasByteForByte) {
  std::istringstream lines(test::runOracle("quant_oracle.py", ""));
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string name, dtype, scope, xHex, scaleHex, zpHex, qHex;
    int symmetric = 0;
    int64_t group = 0;
    int64_t ndim = 0;
    in >> name >> dtype >> scope >> symmetric >> group >> ndim;
    std::vector<int64_t> shape(ndim);
    for (int64_t& d : shape) in >> d;
    in >> xHex >> scaleHex >> zpHex >> qHex;
    SCOPED_TRACE(name);
    std::vector<uint8_t> xBytes = fromHex(xHex);
    const at::Tensor x = at::from_blob(xBytes.data(), shape, at::kFloat).clone();
    const QScheme scheme{parseQDtype(dtype, name), parseQScope(scope, name), symmetric != 0, group};
    scheme.validate(name);
    const QParams params = computeQParams(x, scheme);
    EXPECT_EQ(bytesOf(params.scale), fromHex(scaleHex));
    EXPECT_EQ(bytesOf(params.zeroPoint), fromHex(zpHex));
    EXPECT_EQ(bytesOf(quantize(x, params, scheme)), fromHex(qHex));
    ++cases;
  }
  EXPECT_EQ(cases, 12);
}

TEST(QuantOracle, SszMatchesMsmodelslimLoop) {
  std::istringstream lines(test::runOracle("quant_oracle.py", "ssz"));
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string name, wHex, scaleHex;
    int bits = 0;
    int64_t rows = 0;
    int64_t cols = 0;
    in >> name >> bits >> rows >> cols >> wHex >> scaleHex;
    SCOPED_TRACE(name);
    std::vector<uint8_t> wBytes = fromHex(wHex);
    std::vector<uint8_t> scaleBytes = fromHex(scaleHex);
    const at::Tensor w = at::from_blob(wBytes.data(), {rows, cols}, at::kFloat).clone();
    const at::Tensor expected = at::from_blob(scaleBytes.data(), {rows, 1}, at::kFloat).clone();
    const QParams params = sszSearch(w, {bits == 4 ? QDtype::kInt4 : QDtype::kInt8, QScope::kPerChannel, true, 0});
    // The reductions run over the other axis of the same data (W.T in msmodelslim): equal up to
    // fp32 summation order.
    EXPECT_TRUE(at::allclose(params.scale, expected, 1e-5, 0)) << (params.scale - expected).abs().max();
    ++cases;
  }
  EXPECT_EQ(cases, 2);
}

}  // namespace
}  // namespace qpipe::quant
