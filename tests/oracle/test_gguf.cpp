// Dequantisation against gguf-py (llama.cpp's Python package): it writes one tensor of each
// supported ggml type and dequantises it itself; ours must match bit for bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "qpipe/host/gguf.h"
#include "test_helpers.h"

namespace {

using namespace qpipe::gguf;

std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(GgufOracle, DequantizationIsBitIdenticalToGgufPy) {
  const auto dir = qpipe::test::writeTempFile("quants/.keep", "").parent_path();
  const std::string listing = qpipe::test::runOracle("gguf_oracle.py", "quants " + dir.string());
  const auto file = File::open(dir / "quants.gguf");

  std::set<std::string> types;
  for (const TensorInfo& info : file->tensors()) {
    SCOPED_TRACE(info.name);
    const at::Tensor ours = file->dequantize(info);
    const std::string theirs = slurp(dir / (info.name + ".f32"));
    std::string shape;
    for (int64_t n : ours.sizes()) shape += (shape.empty() ? "" : "x") + std::to_string(n);
    // The oracle prints each tensor's name, type and its numpy shape: ours must be the same.
    EXPECT_NE(listing.find(info.name + " " + std::string(ggmlTypeName(info.type)) + " " + shape + "\n"),
              std::string::npos)
        << listing;
    ASSERT_EQ(theirs.size(), static_cast<size_t>(ours.numel()) * sizeof(float));
    EXPECT_EQ(std::memcmp(theirs.data(), ours.data_ptr<float>(), theirs.size()), 0);
    types.insert(std::string(ggmlTypeName(info.type)));
  }
  EXPECT_EQ(types, (std::set<std::string>{"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                          "Q6_K"}));
}

}  // namespace
