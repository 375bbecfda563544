// Quantized checkpoints: the conventions the savers (saver*.cpp) and the loader (model.cpp)
// share, so a checkpoint qpipe writes is read back by the same rules.
// - compressed-tensors: docs/formats.md (quantization_config, tensor names,
//   int4/int8 pack-quantized), checked against compressed-tensors 0.20's compressors.
// - ascendv1: msmodelslim save/ascendv1.py (docs/formats.md).
// docs/formats.md describes both layouts.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/attention_quant.h"
#include "qpipe/model.h"
#include "qpipe/quant_linear.h"

namespace qpipe::detail {

// Sorted keys, as compressed-tensors dumps its config (json.dump(sort_keys=True)).
using SortedJson = nlohmann::json;

// The version of compressed-tensors whose loader the oracle tests run against; the config we
// write uses no field newer than 0.12 (no scale_dtype / zp_dtype).
inline constexpr const char* kCompressedTensorsVersion = "0.20.0";
inline constexpr const char* kAscendWeightsPrefix = "quant_model_weights";
inline constexpr const char* kAscendDescription = "quant_model_description.json";

// The activation quantization a saver writes: absent when the input stays in float.
std::optional<ActivationQuant> writtenInputQuant(const QuantLinear& linear);

// compressed-tensors' CompressionFormat for a module, as compressed-tensors 0.20 infers it
// (compressors/format.py priority): int weights with input quantization → int-quantized, int
// weight-only → pack-quantized, fp8 with input quantization → float-quantized, fp8 weight-only →
// naive-quantized.
std::string compressedTensorsFormat(const quant::QScheme& weight, const std::optional<ActivationQuant>& input);
// QuantizationArgs objects (quant_args.py), every key written so old and new loaders agree.
SortedJson compressedTensorsWeightArgs(const quant::QScheme& weight);
SortedJson compressedTensorsInputArgs(const ActivationQuant& input);
// The target of the config group that quantizes the attention modules' Q (with K and V).
inline constexpr const char* kAttentionTarget = "re:.*self_attn$";
// kv_cache_scheme (and the attention group's input_activations) for attention inputs quantized
// per_tensor ("tensor") or per_head ("attn_head"), static.
SortedJson compressedTensorsKvCacheArgs(const quant::QScheme& scheme);
// compressed-tensors' / vLLM's target and ignore matching for a Linear module: "Linear" (the
// class), "re:<regex>" (Python re.match: anchored at the start only) or the exact name.
bool compressedTensorsMatches(const std::string& target, const std::string& moduleName);

// int8 pack-quantized: u = q + 128, element 4j+k in bits 8k..8k+7 of int32 word j along dim 1
// (compressed-tensors pack_to_int32 with num_bits 8; packInt4 in quant.h is the 4-bit case).
at::Tensor packInt8(const at::Tensor& q, int64_t dim = 1);
at::Tensor unpackInt8(const at::Tensor& packed, int64_t size, int64_t dim = 1);

// msmodelslim's W4A8_DYNAMIC weight (save/utils/pack.py w4a8_pack_int4): int4 values q [out, in]
// (out even) as int8 [out/2, in], rows 2j and 2j+1 in byte j of each column, 2j in the low nibble
// (two's complement nibbles). vllm-ascend's W4A8_DYNAMIC loader reads this layout (version 1.0.0).
at::Tensor packInt4Rows(const at::Tensor& q);
at::Tensor unpackInt4Rows(const at::Tensor& packed);

// msmodelslim's bit cast of an fp32 deq_scale into int64 (save/utils/deqscale.py), and back.
at::Tensor deqScaleToInt64(const at::Tensor& deqScale);
at::Tensor deqScaleFromInt64(const at::Tensor& stored);

// Where a quantized Linear's weight is stored, and the shape its format gives an [out, in] weight
// there.
struct StoredWeight {
  std::string tensor;
  std::vector<int64_t> shape;
  std::string layout;  // how the format packs the codes, for messages; empty for one code a value
};

// Reads the quantized modules of a checkpoint back into QuantLinear (dequantized weights,
// activation fake quantization as declared) for CausalLM.
class QuantizedCheckpoint {
 public:
  using TensorFn = std::function<at::Tensor(const std::string& name)>;  // as stored; Error if absent
  using HasFn = std::function<bool(const std::string& name)>;

  // nullptr for a plain checkpoint. A quantization this loader does not run is Error(kInput)
  // naming the file and the field.
  static std::unique_ptr<QuantizedCheckpoint> detect(const std::filesystem::path& dir);
  virtual ~QuantizedCheckpoint() = default;

  // The weights' file prefix: "model", or "quant_model_weights" for ascendv1.
  virtual std::string weightsPrefix() const = 0;
  // Whether a norm's or a projection's `.bias` that config.json does not declare is part of the
  // model where the checkpoint holds one (ascendv1: msmodelslim's asymmetric smoothing writes them).
  virtual bool loadsUndeclaredBiases() const { return false; }
  // Module `name` (e.g. model.layers.0.mlp.up_proj) as a QuantLinear computing in
  // `computeDtype`, or nullptr when the checkpoint keeps it in float.
  virtual std::shared_ptr<QuantLinear> linear(const std::string& name, bool hasBias, const TensorFn& tensor,
                                              const HasFn& has, at::ScalarType computeDtype) const = 0;
  // Module `name`'s stored weight for a Linear of [out, in], from the description alone (no tensor
  // is read), or nullopt where the checkpoint keeps it in float: what CausalLM::open checks the
  // safetensors headers against, before any layer loads.
  virtual std::optional<StoredWeight> storedWeight(const std::string& name, int64_t out, int64_t in) const = 0;
  // The quantization of `attention`'s input 'q', 'k' or 'v' (its q_hook, k_hook, v_hook), which
  // has `heads` heads, or nullptr where the checkpoint keeps it in float (compressed-tensors:
  // kv_cache_scheme with `<attention>.k_scale` / `v_scale`; ascendv1: FAQuant and C8 entries).
  virtual std::shared_ptr<AttentionQuant> attentionInput(const std::string& attention, char input, int64_t heads,
                                                         const TensorFn& tensor) const = 0;
};

}  // namespace qpipe::detail
