// Building blocks of qpipe::Tokenizer (tokenizer.cpp): UTF-8 helpers, the GPT-2 byte-to-unicode
// map, a PCRE2 regex with Oniguruma-like Unicode classes, and the BPE model with its word cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace qpipe::detail::tok {

// Heterogeneous lookup, so that a string_view finds a std::string key without a copy.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Decodes the code point at text[pos] of valid UTF-8 and advances pos past it.
char32_t nextCodePoint(std::string_view text, size_t& pos);
void appendUtf8(std::string& out, char32_t cp);

// Character classes as Rust's char methods define them (HF's added-token matching uses them).
bool isWhitespace(char32_t cp);
bool isAlphanumeric(char32_t cp);
bool isNumeric(char32_t cp);

// GPT-2's reversible map from bytes to printable code points.
class ByteLevelMap {
 public:
  static const ByteLevelMap& get();
  // Appends the mapped form of every byte of `raw`.
  void encode(std::string_view raw, std::string& out) const;
  // The bytes of a mapped token, or nullopt when it holds a code point outside the map.
  bool decode(std::string_view mapped, std::string& out) const;
  static std::vector<std::string> alphabet();

 private:
  ByteLevelMap();
  std::string byteToUtf8_[256];
  std::vector<int16_t> codePointToByte_;
};

// A compiled PCRE2 pattern (UTF, UCP, JIT when available); matching is thread-safe.
class Regex {
 public:
  // `literal` matches the pattern text verbatim. Throws Error(kInput) naming `where` on a bad pattern.
  Regex(const std::string& pattern, bool literal, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Non-empty, non-overlapping matches of valid UTF-8 `text`, left to right, as [begin, end) bytes.
  void findAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

 private:
  void* code_;  // pcre2_code_8, kept opaque so that pcre2.h stays in one translation unit
};

// Byte-level BPE: symbols from the vocabulary, merged pair by pair in rank order (lowest rank
// first, leftmost first among equal ranks), results cached per word.
class BpeModel {
 public:
  struct Options {
    std::optional<std::string> unkToken;
    bool fuseUnk = false;
    bool ignoreMerges = false;
    std::string continuingSubwordPrefix;
    std::string endOfWordSuffix;
  };
  // Throws Error(kInput) naming `source` when a merge refers to a token missing from the vocabulary.
  BpeModel(StringMap<int64_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges, Options options,
           const std::string& source);

  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int64_t>& ids) const;
  const StringMap<int64_t>& vocab() const { return vocab_; }

 private:
  void tokenizeUncached(std::string_view word, std::vector<int64_t>& ids) const;

  StringMap<int64_t> vocab_;
  struct Merge {
    int32_t rank;
    int64_t id;
  };
  std::unordered_map<uint64_t, Merge> merges_;  // key: left id << 32 | right id
  Options options_;
  std::optional<int64_t> unkId_;

  mutable std::shared_mutex cacheMutex_;
  mutable StringMap<std::vector<int64_t>> cache_;
};

}  // namespace qpipe::detail::tok
