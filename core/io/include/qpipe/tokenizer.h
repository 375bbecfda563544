// HF `tokenizer.json` byte-level BPE, as GPT-2, Llama-3, Qwen2/3 and SmolLM2 use it: normalizer,
// pre-tokenizer split regex with Unicode classes, byte-to-unicode map, merges by rank, added and
// special tokens. Other tokenizer types are Error(kInput), never a silent fallback.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qpipe {

class Tokenizer {
 public:
  static Tokenizer fromFile(const std::filesystem::path& tokenizerJson);
  static Tokenizer fromJson(std::string_view json, const std::string& sourceName);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // addSpecialTokens applies the post-processor (e.g. Llama-3's BOS), as HF's
  // encode(add_special_tokens=True) does.
  std::vector<int64_t> encode(std::string_view text, bool addSpecialTokens = false) const;
  std::string decode(const std::vector<int64_t>& ids, bool skipSpecialTokens = false) const;

  int64_t vocabSize() const;  // including added tokens
  std::optional<int64_t> tokenToId(std::string_view token) const;
  std::optional<std::string> idToToken(int64_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace qpipe
