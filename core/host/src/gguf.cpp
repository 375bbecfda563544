// GGUF reader and dequantisation. Format: ggml/docs/gguf.md (llama.cpp); block layouts:
// ggml/src/ggml-common.h; dequantisation arithmetic: ggml/src/ggml-quants.c (dequantize_row_*).
#include "qpipe/host/gguf.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_set>

#include "qpipe/error.h"
#include "qpipe/input_file.h"

namespace qpipe::gguf {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;        // nested arrays deeper than this are not plausible metadata

struct TypeTraits {
  GgmlType type;
  std::string_view name;
  int64_t blockSize;  // elements per block
  int64_t typeSize;   // bytes per block
};

// Sizes as ggml's type_traits (ggml.c) and gguf-py's GGML_QUANT_SIZES.
constexpr std::array kTypes{
    TypeTraits{GgmlType::kF32, "F32", 1, 4},
    TypeTraits{GgmlType::kF16, "F16", 1, 2},
    TypeTraits{GgmlType::kQ4_0, "Q4_0", 32, 18},
    TypeTraits{GgmlType::kQ4_1, "Q4_1", 32, 20},
    TypeTraits{GgmlType::kQ5_0, "Q5_0", 32, 22},
    TypeTraits{GgmlType::kQ5_1, "Q5_1", 32, 24},
    TypeTraits{GgmlType::kQ8_0, "Q8_0", 32, 34},
    TypeTraits{GgmlType::kQ8_1, "Q8_1", 32, 40},
    TypeTraits{GgmlType::kQ2_K, "Q2_K", 256, 84},
    TypeTraits{GgmlType::kQ3_K, "Q3_K", 256, 110},
    TypeTraits{GgmlType::kQ4_K, "Q4_K", 256, 144},
    TypeTraits{GgmlType::kQ5_K, "Q5_K", 256, 176},
    TypeTraits{GgmlType::kQ6_K, "Q6_K", 256, 210},
    TypeTraits{GgmlType::kQ8_K, "Q8_K", 256, 292},
    TypeTraits{GgmlType::kIQ2_XXS, "IQ2_XXS", 256, 66},
    TypeTraits{GgmlType::kIQ2_XS, "IQ2_XS", 256, 74},
    TypeTraits{GgmlType::kIQ3_XXS, "IQ3_XXS", 256, 98},
    TypeTraits{GgmlType::kIQ1_S, "IQ1_S", 256, 50},
    TypeTraits{GgmlType::kIQ4_NL, "IQ4_NL", 32, 18},
    TypeTraits{GgmlType::kIQ3_S, "IQ3_S", 256, 110},
    TypeTraits{GgmlType::kIQ2_S, "IQ2_S", 256, 82},
    TypeTraits{GgmlType::kIQ4_XS, "IQ4_XS", 256, 136},
    TypeTraits{GgmlType::kI8, "I8", 1, 1},
    TypeTraits{GgmlType::kI16, "I16", 1, 2},
    TypeTraits{GgmlType::kI32, "I32", 1, 4},
    TypeTraits{GgmlType::kI64, "I64", 1, 8},
    TypeTraits{GgmlType::kF64, "F64", 1, 8},
    TypeTraits{GgmlType::kIQ1_M, "IQ1_M", 256, 56},
    TypeTraits{GgmlType::kBF16, "BF16", 1, 2},
    TypeTraits{GgmlType::kTQ1_0, "TQ1_0", 256, 54},
    TypeTraits{GgmlType::kTQ2_0, "TQ2_0", 256, 66},
    TypeTraits{GgmlType::kMXFP4, "MXFP4", 32, 17},
};

constexpr std::array kDequantizable{GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ8_0,
                                    GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                                    GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

const TypeTraits* traitsOf(uint32_t id) {
  for (const auto& traits : kTypes) {
    if (static_cast<uint32_t>(traits.type) == id) return &traits;
  }
  return nullptr;
}

const TypeTraits& traitsOf(GgmlType type) {
  const TypeTraits* traits = traitsOf(static_cast<uint32_t>(type));
  QPIPE_CHECK(traits != nullptr, "ggml type ", static_cast<uint32_t>(type), " has no traits");
  return *traits;
}

std::string dequantizableNames() {
  std::string names;
  for (GgmlType type : kDequantizable) names += (names.empty() ? "" : ", ") + std::string(ggmlTypeName(type));
  return names;
}

// Bytes of a magic number as text, with anything unprintable escaped.
std::string printable(const uint8_t* bytes, size_t count) {
  std::ostringstream os;
  for (size_t i = 0; i < count; ++i) {
    if (bytes[i] >= 0x20 && bytes[i] < 0x7f) {
      os << static_cast<char>(bytes[i]);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      os << "\\x" << kHex[bytes[i] >> 4] << kHex[bytes[i] & 15];
    }
  }
  return os.str();
}

// Reads the header and tensor infos with bounds checks; every read names what it reads so that
// a truncated file says where it ends.
class Cursor {
 public:
  Cursor(const std::filesystem::path& path, const uint8_t* bytes, size_t size)
      : path_(path), bytes_(bytes), size_(size) {}

  size_t position() const { return position_; }
  size_t remaining() const { return size_ - position_; }

  void need(uint64_t count, std::string_view what) const {
    QPIPE_REQUIRE(count <= remaining(), ErrorCode::kInput, path_.string(), ": truncated file: ", what, " at byte ",
                  position_, " needs ", count, " bytes but the file ends at byte ", size_);
  }

  template <typename T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_ + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }

  std::string readString(std::string_view what) {
    const auto length = read<uint64_t>(what);
    need(length, what);
    std::string text(reinterpret_cast<const char*>(bytes_ + position_), length);
    position_ += length;
    return text;
  }

 private:
  const std::filesystem::path& path_;
  const uint8_t* bytes_;
  size_t size_;
  size_t position_ = 0;
};

class Parser {
 public:
  Parser(const std::filesystem::path& path, Cursor& cursor) : path_(path), cursor_(cursor) {}

  Value readValue(const std::string& key, ValueType type, int depth) {
    const std::string what = "metadata '" + key + "'";
    Value value;
    value.type = type;
    switch (type) {
      case ValueType::kUint8:
        value.scalar = uint64_t{cursor_.read<uint8_t>(what)};
        break;
      case ValueType::kInt8:
        value.scalar = int64_t{cursor_.read<int8_t>(what)};
        break;
      case ValueType::kUint16:
        value.scalar = uint64_t{cursor_.read<uint16_t>(what)};
        break;
      case ValueType::kInt16:
        value.scalar = int64_t{cursor_.read<int16_t>(what)};
        break;
      case ValueType::kUint32:
        value.scalar = uint64_t{cursor_.read<uint32_t>(what)};
        break;
      case ValueType::kInt32:
        value.scalar = int64_t{cursor_.read<int32_t>(what)};
        break;
      case ValueType::kUint64:
        value.scalar = cursor_.read<uint64_t>(what);
        break;
      case ValueType::kInt64:
        value.scalar = cursor_.read<int64_t>(what);
        break;
      case ValueType::kFloat32:
        value.scalar = double{cursor_.read<float>(what)};
        break;
      case ValueType::kFloat64:
        value.scalar = cursor_.read<double>(what);
        break;
      case ValueType::kBool: {
        const auto byte = cursor_.read<uint8_t>(what);
        QPIPE_REQUIRE(byte <= 1, ErrorCode::kInput, path_.string(), ": ", what, ": bool byte is ", int{byte},
                      " (expected 0 or 1)");
        value.scalar = byte == 1;
        break;
      }
      case ValueType::kString:
        value.scalar = cursor_.readString(what);
        break;
      case ValueType::kArray: {
        QPIPE_REQUIRE(depth < kMaxArrayDepth, ErrorCode::kInput, path_.string(), ": ", what,
                      ": arrays nested deeper than ", kMaxArrayDepth, " levels");
        value.elementType = readType(key, cursor_.read<uint32_t>(what));
        const auto count = cursor_.read<uint64_t>(what);
        // Every item takes at least one byte: a count beyond the rest of the file is truncation,
        // caught here before anything is allocated for it.
        cursor_.need(count, what);
        value.items.reserve(count);
        for (uint64_t i = 0; i < count; ++i) value.items.push_back(readValue(key, value.elementType, depth + 1));
        break;
      }
    }
    return value;
  }

  ValueType readType(const std::string& key, uint32_t id) {
    QPIPE_REQUIRE(id <= static_cast<uint32_t>(ValueType::kFloat64), ErrorCode::kInput, path_.string(), ": metadata '",
                  key, "': unknown value type ", id);
    return static_cast<ValueType>(id);
  }

 private:
  const std::filesystem::path& path_;
  Cursor& cursor_;
};

// numpy's float16 -> float32 and ggml's GGML_FP16_TO_FP32 are both exact.
inline float halfToFloat(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// get_scale_min_k4 (ggml-quants.c): eight 6-bit scales and mins packed into 12 bytes.
inline void scaleMinK4(int j, const uint8_t* q, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of each type; `y` receives blockSize floats. The order of the float operations is
// ggml's, which gguf-py mirrors, so results are bit-identical (the build does not contract
// a*b+c into fused multiply-adds: -std=c++20 implies -ffp-contract=off).
void blockQ8_0(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

void blockQ4_0(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void blockQ4_1(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  const float m = halfToFloat(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0xF) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void blockQ5_0(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int high0 = ((qh >> j) & 1) << 4;
    const int high1 = ((qh >> (j + 16)) & 1) << 4;
    y[j] = static_cast<float>(((qs[j] & 0xF) | high0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | high1) - 16) * d;
  }
}

void blockQ5_1(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  const float m = halfToFloat(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int high0 = ((qh >> j) & 1) << 4;
    const int high1 = ((qh >> (j + 16)) & 1) << 4;
    y[j] = static_cast<float>((qs[j] & 0xF) | high0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | high1) * d + m;
  }
}

// block_q4_K: d, dmin (fp16), scales[12], qs[128]; 8 sub-blocks of 32. Each 32 bytes of qs
// hold two sub-blocks: the low nibbles, then the high nibbles.
void blockQ4_K(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  const float dmin = halfToFloat(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t sc, m;
    scaleMinK4(sub, scales, sc, m);
    const float dl = d * static_cast<float>(sc);
    const float ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) y[32 * sub + l] = dl * static_cast<float>((q[l] >> shift) & 0xF) - ml;
  }
}

// block_q5_K: d, dmin, scales[12], qh[32], qs[128]; bit `sub` of qh[l] is the fifth bit.
void blockQ5_K(const uint8_t* b, float* y) {
  const float d = halfToFloat(b);
  const float dmin = halfToFloat(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t sc, m;
    scaleMinK4(sub, scales, sc, m);
    const float dl = d * static_cast<float>(sc);
    const float ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) {
      const int value = ((q[l] >> shift) & 0xF) | (((qh[l] >> sub) & 1) << 4);
      y[32 * sub + l] = dl * static_cast<float>(value) - ml;
    }
  }
}

// block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16). Each half of 128 values takes 64
// bytes of ql (low nibbles for values 0..63, high for 64..127) and 32 bytes of qh (2 bits per
// value, four groups of 32); one scale per 16 values.
void blockQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = halfToFloat(b + 208);
  for (int half = 0; half < 2; ++half) {
    for (int r = 0; r < 128; ++r) {
      const int low = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0xF;
      const int high = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 3;
      const int p = 128 * half + r;
      const float dl = d * static_cast<float>(scales[p / 16]);
      y[p] = dl * static_cast<float>((low | (high << 4)) - 32);
    }
  }
}

}  // namespace

std::string_view valueTypeName(ValueType type) {
  static constexpr std::array<std::string_view, 13> kNames{"uint8",  "int8",    "uint16", "int16",  "uint32",
                                                           "int32",  "float32", "bool",   "string", "array",
                                                           "uint64", "int64",   "float64"};
  const auto index = static_cast<uint32_t>(type);
  return index < kNames.size() ? kNames[index] : "unknown";
}

std::string_view ggmlTypeName(GgmlType type) {
  const TypeTraits* traits = traitsOf(static_cast<uint32_t>(type));
  return traits != nullptr ? traits->name : "unknown";
}

bool canDequantize(GgmlType type) {
  return std::find(kDequantizable.begin(), kDequantizable.end(), type) != kDequantizable.end();
}

std::vector<int64_t> TensorInfo::shape() const {
  return {ne.rbegin(), ne.rend()};
}

int64_t TensorInfo::numel() const {
  int64_t count = 1;
  for (uint64_t n : ne) count *= static_cast<int64_t>(n);
  return count;
}

void dequantizeRow(GgmlType type, const uint8_t* blocks, float* out, int64_t count) {
  const TypeTraits& traits = traitsOf(type);
  QPIPE_CHECK(count % traits.blockSize == 0, count, " values are not whole ", traits.name, " blocks");
  const int64_t nBlocks = count / traits.blockSize;
  void (*block)(const uint8_t*, float*) = nullptr;
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(out, blocks, count * sizeof(float));
      return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < count; ++i) out[i] = halfToFloat(blocks + 2 * i);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, blocks + 2 * i, 2);
        out[i] = std::bit_cast<float>(uint32_t{bits} << 16);
      }
      return;
    case GgmlType::kQ8_0:
      block = blockQ8_0;
      break;
    case GgmlType::kQ4_0:
      block = blockQ4_0;
      break;
    case GgmlType::kQ4_1:
      block = blockQ4_1;
      break;
    case GgmlType::kQ5_0:
      block = blockQ5_0;
      break;
    case GgmlType::kQ5_1:
      block = blockQ5_1;
      break;
    case GgmlType::kQ4_K:
      block = blockQ4_K;
      break;
    case GgmlType::kQ5_K:
      block = blockQ5_K;
      break;
    case GgmlType::kQ6_K:
      block = blockQ6_K;
      break;
    default:
      QPIPE_CHECK(false, "dequantizeRow called for ", traits.name);
  }
  for (int64_t i = 0; i < nBlocks; ++i) block(blocks + i * traits.typeSize, out + i * traits.blockSize);
}

std::shared_ptr<const File> File::open(const std::filesystem::path& path) {
  std::shared_ptr<File> file(new File());
  file->path_ = path;
  const std::string name = path.string();

  requireRegularFile(path);
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
  QPIPE_REQUIRE(fd >= 0, ErrorCode::kIo, name, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    QPIPE_REQUIRE(false, ErrorCode::kIo, name, ": not a regular file");
  }
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* mapping = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int mapError = errno;
    ::close(fd);
    QPIPE_REQUIRE(mapping != MAP_FAILED, ErrorCode::kIo, name, ": cannot map: ", std::strerror(mapError));
    file->mapping_ = mapping;
    file->bytes_ = static_cast<const uint8_t*>(mapping);
  } else {
    ::close(fd);
  }

  Cursor cursor(path, file->bytes_, file->size_);
  cursor.need(4, "magic");
  const auto magic = cursor.read<uint32_t>("magic");
  QPIPE_REQUIRE(magic == kMagic, ErrorCode::kInput, name, ": not a GGUF file: it starts with '",
                printable(file->bytes_, 4), "' (expected 'GGUF')");
  const auto version = cursor.read<uint32_t>("version");
  QPIPE_REQUIRE(__builtin_bswap32(version) != 2 && __builtin_bswap32(version) != 3, ErrorCode::kInput, name,
                ": big-endian GGUF is not supported (convert it with gguf-convert-endian)");
  QPIPE_REQUIRE(version == 2 || version == 3, ErrorCode::kInput, name, ": GGUF version ", version,
                " is not supported (expected 2 or 3)");
  file->version_ = version;
  const auto tensorCount = cursor.read<uint64_t>("tensor count");
  const auto kvCount = cursor.read<uint64_t>("metadata count");

  Parser parser(path, cursor);
  std::unordered_set<std::string> keys;
  for (uint64_t i = 0; i < kvCount; ++i) {
    std::string key = cursor.readString("metadata key " + std::to_string(i));
    QPIPE_REQUIRE(keys.insert(key).second, ErrorCode::kInput, name, ": metadata '", key, "' appears twice");
    const ValueType type = parser.readType(key, cursor.read<uint32_t>("metadata '" + key + "'"));
    Value value = parser.readValue(key, type, 0);
    file->metadata_.emplace_back(std::move(key), std::move(value));
  }

  if (const Value* alignment = file->find("general.alignment")) {
    QPIPE_REQUIRE(alignment->type == ValueType::kUint32, ErrorCode::kInput, name, ": metadata 'general.alignment' is ",
                  valueTypeName(alignment->type), " (expected uint32)");
    const uint64_t value = std::get<uint64_t>(alignment->scalar);
    QPIPE_REQUIRE(value != 0 && std::has_single_bit(value), ErrorCode::kInput, name,
                  ": metadata 'general.alignment' is ", value, " (expected a power of two)");
    file->alignment_ = static_cast<uint32_t>(value);
  }

  std::unordered_set<std::string> names;
  for (uint64_t i = 0; i < tensorCount; ++i) {
    TensorInfo info;
    info.name = cursor.readString("tensor info " + std::to_string(i));
    const std::string what = "tensor '" + info.name + "'";
    QPIPE_REQUIRE(names.insert(info.name).second, ErrorCode::kInput, name, ": ", what, " appears twice");
    const auto nDims = cursor.read<uint32_t>(what);
    QPIPE_REQUIRE(nDims >= 1 && nDims <= kMaxDims, ErrorCode::kInput, name, ": ", what, ": ", nDims,
                  " dimensions (expected 1 to ", kMaxDims, ")");
    uint64_t elements = 1;
    for (uint32_t d = 0; d < nDims; ++d) {
      const auto n = cursor.read<uint64_t>(what);
      QPIPE_REQUIRE(n >= 1 && n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / elements,
                    ErrorCode::kInput, name, ": ", what, ": dimension ", d, " is ", n,
                    " (expected at least 1, and at most 2^63 elements in all)");
      elements *= n;
      info.ne.push_back(n);
    }
    const auto typeId = cursor.read<uint32_t>(what);
    const TypeTraits* traits = traitsOf(typeId);
    QPIPE_REQUIRE(traits != nullptr, ErrorCode::kInput, name, ": ", what, ": unknown ggml type ", typeId);
    info.type = traits->type;
    QPIPE_REQUIRE(info.ne[0] % traits->blockSize == 0, ErrorCode::kInput, name, ": ", what, ": row length ", info.ne[0],
                  " is not a multiple of the ", traits->name, " block size ", traits->blockSize);
    info.bytes = elements / traits->blockSize * traits->typeSize;
    info.offset = cursor.read<uint64_t>(what);
    QPIPE_REQUIRE(info.offset % file->alignment_ == 0, ErrorCode::kInput, name, ": ", what, ": data offset ",
                  info.offset, " is not a multiple of the alignment ", file->alignment_);
    file->tensors_.push_back(std::move(info));
  }

  // The data section starts at the next multiple of the alignment after the tensor infos.
  const uint64_t headerEnd = cursor.position();
  file->dataOffset_ = (headerEnd + file->alignment_ - 1) / file->alignment_ * file->alignment_;
  for (const TensorInfo& info : file->tensors_) {
    const uint64_t available = file->size_ > file->dataOffset_ ? file->size_ - file->dataOffset_ : 0;
    QPIPE_REQUIRE(info.offset <= available && info.bytes <= available - info.offset, ErrorCode::kInput, name,
                  ": tensor '", info.name, "': data runs past the end of the file (bytes ",
                  file->dataOffset_ + info.offset, " to ", file->dataOffset_ + info.offset + info.bytes, ", file size ",
                  file->size_, ")");
  }
  return file;
}

File::~File() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

const Value* File::find(std::string_view key) const {
  for (const auto& [name, value] : metadata_) {
    if (name == key) return &value;
  }
  return nullptr;
}

namespace {

template <typename T>
struct Converter;

template <>
struct Converter<int64_t> {
  static constexpr std::string_view kExpected = "an integer";
  static constexpr std::string_view kItems = "integers";
  static std::optional<int64_t> convert(const Value& value) {
    if (value.type == ValueType::kArray) return std::nullopt;
    if (const auto* v = std::get_if<int64_t>(&value.scalar)) return *v;
    if (const auto* v = std::get_if<uint64_t>(&value.scalar)) {
      if (*v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return static_cast<int64_t>(*v);
    }
    return std::nullopt;
  }
};

template <>
struct Converter<double> {
  static constexpr std::string_view kExpected = "a number";
  static constexpr std::string_view kItems = "numbers";
  static std::optional<double> convert(const Value& value) {
    if (value.type == ValueType::kArray) return std::nullopt;
    if (const auto* v = std::get_if<double>(&value.scalar)) return *v;
    if (const auto* v = std::get_if<int64_t>(&value.scalar)) return static_cast<double>(*v);
    if (const auto* v = std::get_if<uint64_t>(&value.scalar)) return static_cast<double>(*v);
    return std::nullopt;
  }
};

template <>
struct Converter<bool> {
  static constexpr std::string_view kExpected = "a bool";
  static constexpr std::string_view kItems = "bools";
  static std::optional<bool> convert(const Value& value) {
    if (const auto* v = std::get_if<bool>(&value.scalar); v && value.type == ValueType::kBool) return *v;
    return std::nullopt;
  }
};

template <>
struct Converter<std::string> {
  static constexpr std::string_view kExpected = "a string";
  static constexpr std::string_view kItems = "strings";
  static std::optional<std::string> convert(const Value& value) {
    if (const auto* v = std::get_if<std::string>(&value.scalar); v && value.type == ValueType::kString) return *v;
    return std::nullopt;
  }
};

template <typename T>
struct Converter<std::vector<T>> {
  static std::string expected() { return "an array of " + std::string(Converter<T>::kItems); }
  static std::optional<std::vector<T>> convert(const Value& value) {
    if (value.type != ValueType::kArray) return std::nullopt;
    std::vector<T> items;
    items.reserve(value.items.size());
    for (const Value& item : value.items) {
      auto converted = Converter<T>::convert(item);
      if (!converted) return std::nullopt;
      items.push_back(std::move(*converted));
    }
    return items;
  }
};

template <typename T>
std::string expectedOf() {
  if constexpr (requires { Converter<T>::kExpected; }) {
    return std::string(Converter<T>::kExpected);
  } else {
    return Converter<T>::expected();
  }
}

std::string describe(const Value& value) {
  if (value.type != ValueType::kArray) return std::string(valueTypeName(value.type));
  return "an array of " + std::string(valueTypeName(value.elementType));
}

}  // namespace

template <typename T>
std::optional<T> File::getOptional(std::string_view key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  auto converted = Converter<T>::convert(*value);
  QPIPE_REQUIRE(converted.has_value(), ErrorCode::kInput, path_.string(), ": metadata '", key, "' is ",
                describe(*value), " (expected ", expectedOf<T>(), ")");
  return converted;
}

template <typename T>
T File::get(std::string_view key) const {
  auto value = getOptional<T>(key);
  QPIPE_REQUIRE(value.has_value(), ErrorCode::kInput, path_.string(), ": metadata '", key, "' is missing");
  return std::move(*value);
}

template int64_t File::get<int64_t>(std::string_view) const;
template double File::get<double>(std::string_view) const;
template bool File::get<bool>(std::string_view) const;
template std::string File::get<std::string>(std::string_view) const;
template std::vector<int64_t> File::get<std::vector<int64_t>>(std::string_view) const;
template std::vector<double> File::get<std::vector<double>>(std::string_view) const;
template std::vector<std::string> File::get<std::vector<std::string>>(std::string_view) const;
template std::optional<int64_t> File::getOptional<int64_t>(std::string_view) const;
template std::optional<double> File::getOptional<double>(std::string_view) const;
template std::optional<bool> File::getOptional<bool>(std::string_view) const;
template std::optional<std::string> File::getOptional<std::string>(std::string_view) const;
template std::optional<std::vector<int64_t>> File::getOptional<std::vector<int64_t>>(std::string_view) const;
template std::optional<std::vector<double>> File::getOptional<std::vector<double>>(std::string_view) const;
template std::optional<std::vector<std::string>> File::getOptional<std::vector<std::string>>(std::string_view) const;

const TensorInfo* File::findTensor(std::string_view name) const {
  for (const TensorInfo& info : tensors_) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

const TensorInfo& File::tensor(std::string_view name) const {
  const TensorInfo* info = findTensor(name);
  QPIPE_REQUIRE(info != nullptr, ErrorCode::kInput, path_.string(), ": tensor '", name, "' is missing");
  return *info;
}

std::span<const uint8_t> File::rawData(const TensorInfo& info) const {
  return {bytes_ + dataOffset_ + info.offset, info.bytes};
}

at::Tensor File::dequantize(const TensorInfo& info) const {
  QPIPE_REQUIRE(canDequantize(info.type), ErrorCode::kInput, path_.string(), ": tensor '", info.name, "': ggml type ",
                ggmlTypeName(info.type), " cannot be dequantized (supported: ", dequantizableNames(), ")");
  at::Tensor out = at::empty(info.shape(), at::TensorOptions().dtype(at::kFloat));
  const TypeTraits& traits = traitsOf(info.type);
  const uint8_t* data = rawData(info).data();
  float* values = out.data_ptr<float>();
  const int64_t nBlocks = info.numel() / traits.blockSize;
  // Blocks are independent: split them in chunks of whole blocks across threads.
  at::parallel_for(0, nBlocks, 4096, [&](int64_t begin, int64_t end) {
    dequantizeRow(info.type, data + begin * traits.typeSize, values + begin * traits.blockSize,
                  (end - begin) * traits.blockSize);
  });
  return out;
}

}  // namespace qpipe::gguf
