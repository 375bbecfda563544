// The GGUF reader on hand-built files: every validation rule with its whole message, metadata of
// every type, and dequantisation pinned on blocks computed by hand (the oracle test compares
// every type against gguf-py).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/host/gguf.h"
#include "qpipe/host/gguf_convert.h"
#include "test_helpers.h"

namespace {

using namespace qpipe;
using namespace qpipe::gguf;
using qpipe::test::errorOf;
using qpipe::test::writeTempFile;

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void putString(std::string& out, const std::string& text) {
  put<uint64_t>(out, text.size());
  out += text;
}

// Writes GGUF bytes as the spec lays them out (ggml/docs/gguf.md), with knobs to break them.
class Builder {
 public:
  uint32_t magic = 0x46554747;
  uint32_t version = 3;
  uint32_t alignment = 32;

  void addU32(const std::string& key, uint32_t value) {
    beginKey(key, ValueType::kUint32);
    put(kv_, value);
  }
  void addF32(const std::string& key, float value) {
    beginKey(key, ValueType::kFloat32);
    put(kv_, value);
  }
  void addString(const std::string& key, const std::string& value) {
    beginKey(key, ValueType::kString);
    putString(kv_, value);
  }
  // The value bytes after the key and its type, for types and layouts the helpers do not cover.
  void addRaw(const std::string& key, uint32_t type, const std::string& bytes) {
    beginKey(key, static_cast<ValueType>(type));
    kv_ += bytes;
  }

  // Data is placed at the next aligned offset unless `offset` says otherwise.
  void addTensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, const std::string& bytes,
                 std::optional<uint64_t> offset = std::nullopt) {
    const uint64_t at = offset.value_or((data_.size() + alignment - 1) / alignment * alignment);
    putString(infos_, name);
    put<uint32_t>(infos_, ne.size());
    for (uint64_t n : ne) put(infos_, n);
    put(infos_, type);
    put(infos_, at);
    if (data_.size() < at) data_.resize(at, '\0');
    data_ += bytes;
    ++tensors_;
  }

  std::string build() const {
    std::string out;
    put(out, magic);
    put(out, version);
    put<uint64_t>(out, tensors_);
    put<uint64_t>(out, keys_);
    out += kv_ + infos_;
    out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
    return out + data_;
  }

 private:
  void beginKey(const std::string& key, ValueType type) {
    putString(kv_, key);
    put(kv_, static_cast<uint32_t>(type));
    ++keys_;
  }
  std::string kv_, infos_, data_;
  uint64_t keys_ = 0, tensors_ = 0;
};

std::string floats(std::initializer_list<float> values) {
  std::string out;
  for (float v : values) put(out, v);
  return out;
}

std::string half(float value) {
  std::string out;
  put(out, c10::Half(value).x);
  return out;
}

// The message of opening `bytes` as this test's x.gguf, whose path is badPath().
std::string openError(const std::string& bytes) {
  const auto path = writeTempFile("x.gguf", bytes);
  return errorOf([&] { File::open(path); }, ErrorCode::kInput);
}

std::string badPath() {
  return writeTempFile("x.gguf", "").string();
}

TEST(Gguf, ReadsMetadataOfEveryTypeAndTensorInfos) {
  Builder b;
  b.addU32("general.alignment", 64);
  b.alignment = 64;
  b.addString("general.architecture", "llama");
  b.addF32("eps", 1e-5f);
  std::string nested;  // array of 2 arrays of int16: [[1, -2], [3, 4]]
  put<uint32_t>(nested, 9);
  put<uint64_t>(nested, 2);
  for (auto pair : {std::pair<int16_t, int16_t>{1, -2}, {3, 4}}) {
    put<uint32_t>(nested, 3);
    put<uint64_t>(nested, 2);
    put(nested, pair.first);
    put(nested, pair.second);
  }
  b.addRaw("nested", 9, nested);
  std::string strings;
  put<uint32_t>(strings, 8);
  put<uint64_t>(strings, 2);
  putString(strings, "a b");
  putString(strings, "");
  b.addRaw("strings", 9, strings);
  std::string scalars;
  put<uint8_t>(scalars, 1);
  b.addRaw("flag", 7, scalars);
  b.addRaw("i64", 11, std::string("\xff\xff\xff\xff\xff\xff\xff\xff", 8));
  b.addRaw("f64", 12, [] {
    std::string s;
    put(s, 2.5);
    return s;
  }());
  b.addTensor("w", {2, 3}, 0, floats({1, 2, 3, 4, 5, 6}));
  b.addTensor("v", {4}, 0, floats({7, 8, 9, 10}));
  const auto path = writeTempFile("ok.gguf", b.build());

  const auto file = File::open(path);
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->alignment(), 64u);
  EXPECT_EQ(file->dataOffset() % 64, 0u);
  EXPECT_EQ(file->get<std::string>("general.architecture"), "llama");
  EXPECT_EQ(file->get<int64_t>("general.alignment"), 64);
  EXPECT_EQ(file->get<double>("eps"), static_cast<double>(1e-5f));
  EXPECT_TRUE(file->get<bool>("flag"));
  EXPECT_EQ(file->get<int64_t>("i64"), -1);
  EXPECT_EQ(file->get<double>("f64"), 2.5);
  EXPECT_EQ(file->get<std::vector<std::string>>("strings"), (std::vector<std::string>{"a b", ""}));
  const Value* value = file->find("nested");
  ASSERT_NE(value, nullptr);
  ASSERT_EQ(value->items.size(), 2u);
  EXPECT_EQ(value->items[0].elementType, ValueType::kInt16);
  EXPECT_EQ(std::get<int64_t>(value->items[0].items[1].scalar), -2);
  EXPECT_FALSE(file->getOptional<int64_t>("absent").has_value());

  ASSERT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->tensors()[1].offset, 64u);
  // ne = {2, 3}: three rows of two in PyTorch's order.
  const at::Tensor w = file->dequantize("w");
  EXPECT_EQ(w.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_TRUE(at::equal(w, at::arange(1, 7, at::kFloat).reshape({3, 2})));
  EXPECT_TRUE(at::equal(file->dequantize("v"), at::arange(7, 11, at::kFloat)));

  const std::string p = path.string();
  EXPECT_EQ(errorOf([&] { file->get<int64_t>("general.architecture"); }, ErrorCode::kInput),
            p + ": metadata 'general.architecture' is string (expected an integer)");
  EXPECT_EQ(errorOf([&] { file->get<std::vector<int64_t>>("strings"); }, ErrorCode::kInput),
            p + ": metadata 'strings' is an array of string (expected an array of integers)");
  EXPECT_EQ(errorOf([&] { file->get<std::string>("absent"); }, ErrorCode::kInput),
            p + ": metadata 'absent' is missing");
  EXPECT_EQ(errorOf([&] { file->tensor("absent"); }, ErrorCode::kInput), p + ": tensor 'absent' is missing");
}

TEST(Gguf, DequantizesBlocksComputedByHand) {
  Builder b;
  // Q8_0: d = 0.5, q = -16..15 -> q / 2.
  std::string q8 = half(0.5f);
  for (int i = 0; i < 32; ++i) q8 += static_cast<char>(static_cast<int8_t>(i - 16));
  b.addTensor("q8_0", {32}, 8, q8);
  // Q4_0: d = 2, byte j holds q[j] (low nibble) and q[j + 16] (high): value (q - 8) * d.
  std::string q4 = half(2.0f);
  for (int j = 0; j < 16; ++j) q4 += static_cast<char>(j | ((15 - j) << 4));
  b.addTensor("q4_0", {32}, 2, q4);
  // Q4_1: d = 0.25, m = -1: value q * d + m.
  std::string q41 = half(0.25f) + half(-1.0f);
  for (int j = 0; j < 16; ++j) q41 += static_cast<char>(j | (j << 4));
  b.addTensor("q4_1", {32}, 3, q41);
  const auto file = File::open(writeTempFile("q.gguf", b.build()));

  std::vector<float> expected8, expected4, expected41(32);
  for (int i = 0; i < 32; ++i) expected8.push_back((i - 16) * 0.5f);
  for (int j = 0; j < 16; ++j) expected4.push_back((j - 8) * 2.0f);
  for (int j = 0; j < 16; ++j) expected4.push_back((15 - j - 8) * 2.0f);
  for (int j = 0; j < 16; ++j) expected41[j] = expected41[j + 16] = j * 0.25f - 1.0f;
  auto asTensor = [](std::vector<float>& v) { return at::from_blob(v.data(), {32}, at::kFloat); };
  EXPECT_TRUE(at::equal(file->dequantize("q8_0"), asTensor(expected8)));
  EXPECT_TRUE(at::equal(file->dequantize("q4_0"), asTensor(expected4)));
  EXPECT_TRUE(at::equal(file->dequantize("q4_1"), asTensor(expected41)));
}

TEST(Gguf, RejectsBrokenHeadersWithOneLine) {
  std::string path = badPath();
  EXPECT_EQ(openError("GGU"), path + ": truncated file: magic at byte 0 needs 4 bytes but the file ends at byte 3");

  Builder b;
  b.magic = 0x4c4d4747;  // "GGML"
  EXPECT_EQ(openError(b.build()), path + ": not a GGUF file: it starts with 'GGML' (expected 'GGUF')");

  b = Builder();
  b.version = 1;
  EXPECT_EQ(openError(b.build()), path + ": GGUF version 1 is not supported (expected 2 or 3)");
  b.version = 0x03000000;
  EXPECT_EQ(openError(b.build()), path + ": big-endian GGUF is not supported (convert it with gguf-convert-endian)");

  b = Builder();
  b.addString("general.name", "tiny");
  b.addTensor("w", {4}, 0, floats({1, 2, 3, 4}));
  const std::string whole = b.build();
  // Cut inside the string value: 24 header bytes, key (8 + 12), type (4), length (8), 2 of 4 chars.
  EXPECT_EQ(openError(whole.substr(0, 58)),
            path + ": truncated file: metadata 'general.name' at byte 56 needs 4 bytes but the file ends at byte 58");
  EXPECT_EQ(openError(whole.substr(0, 60)),
            path + ": truncated file: tensor info 0 at byte 60 needs 8 bytes but the file ends at byte 60");
  EXPECT_EQ(openError(whole.substr(0, whole.size() - 1)),
            path + ": tensor 'w': data runs past the end of the file (bytes 96 to 112, file size 111)");
}

TEST(Gguf, RejectsBadMetadataAndTensorInfos) {
  std::string path = badPath();
  Builder b;
  b.addRaw("k", 13, "");
  EXPECT_EQ(openError(b.build()), path + ": metadata 'k': unknown value type 13");

  b = Builder();
  b.addU32("k", 1);
  b.addU32("k", 2);
  EXPECT_EQ(openError(b.build()), path + ": metadata 'k' appears twice");

  b = Builder();
  b.addRaw("flag", 7, "\x02");
  EXPECT_EQ(openError(b.build()), path + ": metadata 'flag': bool byte is 2 (expected 0 or 1)");

  b = Builder();
  b.addU32("general.alignment", 48);
  EXPECT_EQ(openError(b.build()), path + ": metadata 'general.alignment' is 48 (expected a power of two)");

  b = Builder();
  b.addTensor("w", {4}, 99, floats({1, 2, 3, 4}));
  EXPECT_EQ(openError(b.build()), path + ": tensor 'w': unknown ggml type 99");

  b = Builder();
  b.addTensor("w", {16}, 8, std::string(34, '\0'));
  EXPECT_EQ(openError(b.build()), path + ": tensor 'w': row length 16 is not a multiple of the Q8_0 block size 32");

  b = Builder();
  b.addTensor("w", {4}, 0, floats({1, 2, 3, 4}), 16);
  EXPECT_EQ(openError(b.build()), path + ": tensor 'w': data offset 16 is not a multiple of the alignment 32");

  b = Builder();
  b.addTensor("w", {4}, 0, floats({1, 2, 3, 4}));
  b.addTensor("w", {4}, 0, floats({1, 2, 3, 4}));
  EXPECT_EQ(openError(b.build()), path + ": tensor 'w' appears twice");

  b = Builder();
  b.addTensor("w", {1, 2, 3, 4, 5}, 0, "");
  EXPECT_EQ(openError(b.build()), path + ": tensor 'w': 5 dimensions (expected 1 to 4)");

  b = Builder();
  b.addTensor("q2", {256}, 10, std::string(84, '\0'));
  path = writeTempFile("q2.gguf", b.build()).string();
  const auto file = File::open(path);
  EXPECT_EQ(errorOf([&] { file->dequantize("q2"); }, ErrorCode::kInput),
            path +
                ": tensor 'q2': ggml type Q2_K cannot be dequantized (supported: F32, F16, BF16, Q8_0, Q4_0, "
                "Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
}

TEST(GgufConvert, MapsLlamaTensorNames) {
  EXPECT_EQ(hfTensorName("token_embd.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(hfTensorName("output.weight"), "lm_head.weight");
  EXPECT_EQ(hfTensorName("output_norm.weight"), "model.norm.weight");
  EXPECT_EQ(hfTensorName("blk.12.attn_q.weight"), "model.layers.12.self_attn.q_proj.weight");
  EXPECT_EQ(hfTensorName("blk.0.attn_output.weight"), "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(hfTensorName("blk.3.ffn_down.weight"), "model.layers.3.mlp.down_proj.weight");
  EXPECT_EQ(hfTensorName("blk.3.attn_norm.weight"), "model.layers.3.input_layernorm.weight");
  EXPECT_EQ(hfTensorName("blk.3.ffn_norm.weight"), "model.layers.3.post_attention_layernorm.weight");
  EXPECT_EQ(hfTensorName("blk.03.attn_q.weight"), "");
  EXPECT_EQ(hfTensorName("blk.1.attn_q.bias"), "");
  EXPECT_EQ(hfTensorName("rope_freqs.weight"), "");
}

TEST(GgufConvert, UndoesTheRotaryRowInterleaving) {
  // One head of dimension 4, rows r0..r3: llama.cpp stores the halves {r0, r1} and {r2, r3}
  // interleaved as r0, r2, r1, r3; two heads are handled independently.
  const at::Tensor stored = at::tensor({0.f, 2.f, 1.f, 3.f, 4.f, 6.f, 5.f, 7.f}).reshape({8, 1}).expand({8, 2});
  const at::Tensor hf = unpermuteRotary(stored, 2);
  EXPECT_TRUE(at::equal(hf, at::arange(8, at::kFloat).reshape({8, 1}).expand({8, 2})));
}

}  // namespace
