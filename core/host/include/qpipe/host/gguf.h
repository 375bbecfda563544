// GGUF files (llama.cpp's format, ggml/docs/gguf.md): a validating, memory-mapped reader and
// dequantisation of its tensors to fp32.
//
// open() maps the file once and checks it whole: magic, version (2 or 3, little-endian), every
// metadata key/value (all value types, arrays included, nested or not), every tensor info
// (dimensions, known ggml type, row length a multiple of the block size, offset aligned to
// general.alignment, data inside the file), unique keys and tensor names. A violation is
// Error(kInput) naming the file, the key or tensor, and the rule.
//
// Shapes: GGUF lists dimensions fastest first (ne[0] is contiguous); TensorInfo::shape() and
// dequantize() use PyTorch's order, the reverse, so a weight [out, in] in PyTorch is ne = {in, out}.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace qpipe::gguf {

// Metadata value types, numbered as in the file.
enum class ValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
std::string_view valueTypeName(ValueType type);

// ggml tensor types, numbered as in ggml.h. Every type listed can be read (its size is known);
// canDequantize() says which dequantize() supports.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};
std::string_view ggmlTypeName(GgmlType type);
bool canDequantize(GgmlType type);

// One metadata value. Integers keep their sign class (uint64_t or int64_t), floats are widened
// to double; an array holds its items (each of `elementType`) in `items`.
struct Value {
  ValueType type = ValueType::kUint8;
  ValueType elementType = ValueType::kUint8;  // arrays only
  std::variant<uint64_t, int64_t, double, bool, std::string> scalar;
  std::vector<Value> items;
};

struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<uint64_t> ne;  // GGUF order: ne[0] is the fastest dimension
  uint64_t offset = 0;       // from the start of the data section
  uint64_t bytes = 0;

  std::vector<int64_t> shape() const;  // PyTorch order
  int64_t numel() const;
};

class File {
 public:
  static std::shared_ptr<const File> open(const std::filesystem::path& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t dataOffset() const { return dataOffset_; }  // file offset of the data section

  const std::vector<std::pair<std::string, Value>>& metadata() const { return metadata_; }  // file order
  const Value* find(std::string_view key) const;

  // Typed metadata. T is int64_t (any integer type that fits), double (any number), bool,
  // std::string, or std::vector of one of those (an array). A missing key (get) or a value of
  // another type is Error(kInput) naming the file and the key.
  template <typename T>
  T get(std::string_view key) const;
  template <typename T>
  std::optional<T> getOptional(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // file order
  const TensorInfo* findTensor(std::string_view name) const;
  const TensorInfo& tensor(std::string_view name) const;  // Error(kInput) if absent

  std::span<const uint8_t> rawData(const TensorInfo& info) const;

  // The tensor as a new contiguous fp32 CPU tensor in PyTorch's shape. A type that
  // canDequantize() rejects is Error(kInput) naming the tensor and the type.
  at::Tensor dequantize(const TensorInfo& info) const;
  at::Tensor dequantize(std::string_view name) const { return dequantize(tensor(name)); }

 private:
  File() = default;
  std::filesystem::path path_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t dataOffset_ = 0;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<TensorInfo> tensors_;
  const uint8_t* bytes_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;
};

// Decodes `blocks` of `type` into `count` floats (a multiple of the type's block size) at `out`.
// The arithmetic follows ggml's reference dequantisation (ggml-quants.c), so results are
// bit-identical to it and to gguf-py's gguf.quants.dequantize.
void dequantizeRow(GgmlType type, const uint8_t* blocks, float* out, int64_t count);

}  // namespace qpipe::gguf
