// The quantization core against compressed-tensors, the library vLLM loads our checkpoints with:
// FP8 scales and values bit for bit, asymmetric int8 scales, zero points and values, and
// compressed-tensors' dequantize of qpipe's own tensors equal to qpipe's dequantize (the on-disk
// convention x ≈ (q − zp)·s). Symmetric int8 scales differ by design: msmodelslim (and qpipe)
// use absmax/127, compressed-tensors absmax/127.5; only the convention is checked there.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "qpipe/quant.h"
#include "qpipe/safetensors.h"
#include "test_helpers.h"

namespace qpipe::quant {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;
  QScheme scheme;
};

TEST(CompressedTensorsOracle, FormatsAgreeWithCompressedTensors) {
  at::manual_seed(11);
  const at::Tensor weight = at::randn({16, 64}) * at::linspace(0.1, 4, 16).unsqueeze(1) + 0.3;
  const std::vector<Case> cases{
      {"int8_channel_asym", {.dtype = QDtype::kInt8, .scope = QScope::kPerChannel, .symmetric = false}},
      {"int8_channel_sym", {.dtype = QDtype::kInt8, .scope = QScope::kPerChannel}},
      {"fp8_channel", {.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerChannel}},
      {"fp8_tensor", {.dtype = QDtype::kFp8E4m3, .scope = QScope::kPerTensor}},
  };
  const fs::path dir = test::testDir();
  std::vector<QParams> params;
  std::vector<at::Tensor> quantized;
  {
    safetensors::Writer writer(dir, {.filePrefix = "in"});
    writer.add("weight", weight);
    for (const auto& c : cases) {
      params.push_back(computeQParams(weight, c.scheme));
      quantized.push_back(quantize(weight, params.back(), c.scheme));
      writer.add(c.name + ".our_q", quantized.back().to(at::kFloat));
      writer.add(c.name + ".our_scale", params.back().scale);
      writer.add(c.name + ".our_zero_point", params.back().zeroPoint.to(at::kFloat));
    }
    writer.finish();
  }
  test::runOracle("compressed_tensors_oracle.py",
                  "run " + (dir / "in.safetensors").string() + " " + (dir / "out.safetensors").string());
  const auto reference = safetensors::File::open(dir / "out.safetensors");

  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string& name = cases[i].name;
    const at::Tensor ours = dequantize(quantized[i], params[i], cases[i].scheme);
    EXPECT_TRUE(at::allclose(reference->tensor(name + ".dequant_of_ours"), ours, 0, 1e-6)) << name;
    if (name == "int8_channel_sym") continue;  // absmax/127 against absmax/127.5, by design
    const at::Tensor scale = reference->tensor(name + ".scale").view_as(params[i].scale);
    EXPECT_TRUE(at::allclose(scale, params[i].scale, 1e-7, 0)) << name << " scale";
    EXPECT_TRUE(at::equal(reference->tensor(name + ".zero_point").view_as(params[i].zeroPoint),
                          params[i].zeroPoint.to(at::kFloat)))
        << name << " zero point";
    EXPECT_TRUE(at::equal(reference->tensor(name + ".q"), quantized[i].to(at::kFloat))) << name << " values";
  }
}

}  // namespace
}  // namespace qpipe::quant
