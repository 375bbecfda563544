#include "qpipe/tokenizer.h"

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <unordered_set>

#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"
#include "qpipe/utf8.h"
#include "tokenizer_internal.h"

namespace qpipe {

namespace {

using Json = nlohmann::json;
using detail::tok::BpeModel;
using detail::tok::ByteLevelMap;
using detail::tok::nextCodePoint;
using detail::tok::Regex;
using detail::tok::StringMap;

// GPT-2's split, which HF's ByteLevel pre-tokenizer applies when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- JSON access with messages that name the file and the field ----

std::string typeName(const Json& value) {
  return value.is_null() ? "null" : value.type_name();
}

const Json& member(const std::string& source, const Json& object, const char* key, const std::string& path) {
  QPIPE_REQUIRE(object.is_object(), ErrorCode::kInput, source, ": ", path, " must be an object, not ",
                typeName(object));
  const auto it = object.find(key);
  QPIPE_REQUIRE(it != object.end(), ErrorCode::kInput, source, ": ", path, ".", key, " is missing");
  return *it;
}

std::string stringAt(const std::string& source, const Json& value, const std::string& path) {
  QPIPE_REQUIRE(value.is_string(), ErrorCode::kInput, source, ": ", path, " must be a string, not ", typeName(value));
  return value.get<std::string>();
}

// An optional flag: absent or null means `fallback`.
bool flagAt(const std::string& source, const Json& object, const char* key, const std::string& path, bool fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  QPIPE_REQUIRE(it->is_boolean(), ErrorCode::kInput, source, ": ", path, ".", key, " must be true or false, not ",
                typeName(*it));
  return it->get<bool>();
}

// `path` + `name` says where `value` is (only an error spells it out: a vocabulary's 50k tokens).
int64_t idAt(const std::string& source, const Json& value, std::string_view path, std::string_view name = {}) {
  QPIPE_REQUIRE(value.is_number_integer() && value.get<int64_t>() >= 0, ErrorCode::kInput, source, ": ", path, name,
                " must be a non-negative integer id, not ", value.dump());
  return value.get<int64_t>();
}

// An optional string: absent or null means empty.
std::string optionalStringAt(const std::string& source, const Json& object, const char* key, const std::string& path) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return {};
  return stringAt(source, *it, path + "." + key);
}

std::string typeOf(const std::string& source, const Json& object, const std::string& path) {
  return stringAt(source, member(source, object, "type", path), path + ".type");
}

// ---- normalizers ----

enum class Normalization { kNfc, kNfd, kNfkc, kNfkd };

void parseNormalizer(const std::string& source, const Json& node, const std::string& path,
                     std::vector<Normalization>& out) {
  if (node.is_null()) return;
  const auto type = typeOf(source, node, path);
  if (type == "Sequence") {
    const auto& list = member(source, node, "normalizers", path);
    QPIPE_REQUIRE(list.is_array(), ErrorCode::kInput, source, ": ", path, ".normalizers must be a list");
    for (size_t i = 0; i < list.size(); ++i) {
      parseNormalizer(source, list[i], path + ".normalizers[" + std::to_string(i) + "]", out);
    }
  } else if (type == "NFC") {
    out.push_back(Normalization::kNfc);
  } else if (type == "NFD") {
    out.push_back(Normalization::kNfd);
  } else if (type == "NFKC") {
    out.push_back(Normalization::kNfkc);
  } else if (type == "NFKD") {
    out.push_back(Normalization::kNfkd);
  } else {
    QPIPE_REQUIRE(false, ErrorCode::kInput, source, ": ", path, " type '", type,
                  "' is not supported (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

std::string normalize(std::string text, const std::vector<Normalization>& steps) {
  for (const auto step : steps) {
    utf8proc_option_t options = UTF8PROC_STABLE;
    switch (step) {
      case Normalization::kNfc:
        options = utf8proc_option_t(options | UTF8PROC_COMPOSE);
        break;
      case Normalization::kNfd:
        options = utf8proc_option_t(options | UTF8PROC_DECOMPOSE);
        break;
      case Normalization::kNfkc:
        options = utf8proc_option_t(options | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
        break;
      case Normalization::kNfkd:
        options = utf8proc_option_t(options | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
        break;
    }
    utf8proc_uint8_t* result = nullptr;
    const auto length = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                     static_cast<utf8proc_ssize_t>(text.size()), &result, options);
    QPIPE_CHECK(length >= 0, "utf8proc_map failed on valid UTF-8: ", utf8proc_errmsg(length));
    text.assign(reinterpret_cast<const char*>(result), static_cast<size_t>(length));
    std::free(result);
  }
  return text;
}

// ---- pre-tokenizers ----

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kDigits, kByteLevel };
  Kind kind;
  std::shared_ptr<const Regex> regex;  // Split's pattern, or GPT-2's for ByteLevel with use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool addPrefixSpace = false;
};

using Range = std::pair<size_t, size_t>;

// Cuts `piece` at `matches` (sorted, disjoint) and appends the parts `behavior` keeps.
void splitPiece(std::string_view piece, const std::vector<Range>& matches, SplitBehavior behavior, bool invert,
                std::vector<std::string>& out) {
  struct Part {
    size_t begin, end;
    bool isMatch;
  };
  std::vector<Part> parts;
  size_t cursor = 0;
  for (const auto& [begin, end] : matches) {
    if (begin > cursor) parts.push_back({cursor, begin, invert});
    parts.push_back({begin, end, !invert});
    cursor = end;
  }
  if (cursor < piece.size()) parts.push_back({cursor, piece.size(), invert});

  std::vector<Range> kept;
  bool previousMatch = false;
  for (const auto& part : parts) {
    bool extend = false;
    switch (behavior) {
      case SplitBehavior::kRemoved:
        if (part.isMatch) continue;
        break;
      case SplitBehavior::kIsolated:
        break;
      case SplitBehavior::kContiguous:
        // Neighbours of the same kind join; without invert only matches can be neighbours.
        extend = !kept.empty() && part.isMatch == previousMatch;
        break;
      case SplitBehavior::kMergedWithPrevious:
        extend = part.isMatch && !previousMatch && !kept.empty();
        break;
      case SplitBehavior::kMergedWithNext:
        extend = !part.isMatch && previousMatch && !kept.empty();
        break;
    }
    if (extend) {
      kept.back().second = part.end;
    } else {
      kept.emplace_back(part.begin, part.end);
    }
    previousMatch = part.isMatch;
  }
  for (const auto& [begin, end] : kept) out.emplace_back(piece.substr(begin, end - begin));
}

void parsePreTokenizer(const std::string& source, const Json& node, const std::string& path,
                       std::vector<PreTokenizerStep>& out) {
  if (node.is_null()) return;
  const auto type = typeOf(source, node, path);
  if (type == "Sequence") {
    const auto& list = member(source, node, "pretokenizers", path);
    QPIPE_REQUIRE(list.is_array(), ErrorCode::kInput, source, ": ", path, ".pretokenizers must be a list");
    for (size_t i = 0; i < list.size(); ++i) {
      parsePreTokenizer(source, list[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
    }
  } else if (type == "ByteLevel") {
    PreTokenizerStep step{.kind = PreTokenizerStep::Kind::kByteLevel};
    step.addPrefixSpace = flagAt(source, node, "add_prefix_space", path, true);
    if (flagAt(source, node, "use_regex", path, true)) {
      step.regex = std::make_shared<Regex>(kGpt2Pattern, false, source + ": " + path);
    }
    out.push_back(std::move(step));
  } else if (type == "Digits") {
    PreTokenizerStep step{.kind = PreTokenizerStep::Kind::kDigits};
    step.behavior =
        flagAt(source, node, "individual_digits", path, false) ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
    out.push_back(std::move(step));
  } else if (type == "Split") {
    PreTokenizerStep step{.kind = PreTokenizerStep::Kind::kSplit};
    const auto& pattern = member(source, node, "pattern", path);
    QPIPE_REQUIRE(
        pattern.is_object() && pattern.size() == 1 && (pattern.contains("Regex") || pattern.contains("String")),
        ErrorCode::kInput, source, ": ", path, ".pattern must be {\"Regex\": ...} or {\"String\": ...}, not ",
        pattern.dump());
    const bool literal = pattern.contains("String");
    const auto text = stringAt(source, pattern.begin().value(), path + ".pattern." + pattern.begin().key());
    step.regex = std::make_shared<Regex>(text, literal, source + ": " + path + ".pattern");
    const auto behavior = stringAt(source, member(source, node, "behavior", path), path + ".behavior");
    static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    const auto* found = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                                     [&](const auto& entry) { return behavior == entry.first; });
    QPIPE_REQUIRE(found != std::end(kBehaviors), ErrorCode::kInput, source, ": ", path, ".behavior '", behavior,
                  "' is not supported (supported: Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
    step.behavior = found->second;
    step.invert = flagAt(source, node, "invert", path, false);
    out.push_back(std::move(step));
  } else {
    QPIPE_REQUIRE(false, ErrorCode::kInput, source, ": ", path, " type '", type,
                  "' is not supported (supported: ByteLevel, Split, Digits, Sequence)");
  }
}

void applyPreTokenizer(const PreTokenizerStep& step, const std::vector<std::string>& pieces,
                       std::vector<std::string>& out) {
  std::vector<Range> matches;
  std::string prefixed;
  for (const auto& piece : pieces) {
    matches.clear();
    switch (step.kind) {
      case PreTokenizerStep::Kind::kSplit:
        step.regex->findAll(piece, matches);
        splitPiece(piece, matches, step.behavior, step.invert, out);
        break;
      case PreTokenizerStep::Kind::kDigits:
        for (size_t pos = 0; pos < piece.size();) {
          const size_t begin = pos;
          if (detail::tok::isNumeric(nextCodePoint(piece, pos))) matches.emplace_back(begin, pos);
        }
        splitPiece(piece, matches, step.behavior, false, out);
        break;
      case PreTokenizerStep::Kind::kByteLevel: {
        std::string_view text = piece;
        if (step.addPrefixSpace && !piece.starts_with(' ')) {
          prefixed = " " + piece;
          text = prefixed;
        }
        const size_t first = out.size();
        if (step.regex) {
          step.regex->findAll(text, matches);
          splitPiece(text, matches, SplitBehavior::kIsolated, false, out);
        } else if (!text.empty()) {
          out.emplace_back(text);
        }
        const auto& map = ByteLevelMap::get();
        for (size_t i = first; i < out.size(); ++i) {
          std::string mapped;
          mapped.reserve(out[i].size() * 2);
          map.encode(out[i], mapped);
          out[i] = std::move(mapped);
        }
        break;
      }
    }
  }
}

// ---- added tokens ----

struct AddedToken {
  std::string content;
  std::string text;  // what decode and idToToken give: the content, normalized when `normalized` is set
  int64_t id;
  bool special, singleWord, lstrip, rstrip, normalized;
};

// Finds added tokens in text as HF does: leftmost-longest, non-overlapping matches; a single_word
// token is dropped where a word character touches it; lstrip/rstrip take the whitespace beside it.
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token, std::string content) {
    if (content.empty()) return;
    auto& bucket = byFirstByte_[static_cast<unsigned char>(content[0])];
    bucket.emplace_back(std::move(content), token);
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
  bool empty() const {
    return std::all_of(std::begin(byFirstByte_), std::end(byFirstByte_), [](const auto& b) { return b.empty(); });
  }

  struct Piece {
    std::string_view text;
    const AddedToken* token;  // null for text between added tokens
  };
  void split(std::string_view text, std::vector<Piece>& out) const {
    size_t plainStart = 0;  // start of the text not yet emitted
    for (size_t pos = 0; pos < text.size();) {
      const auto* found = longestAt(text, pos);
      if (found == nullptr) {
        ++pos;
        continue;
      }
      size_t begin = pos, end = pos + found->first.size();
      pos = end;
      const AddedToken* token = found->second;
      if (token->singleWord && (touchesWordBefore(text, begin) || touchesWordAfter(text, end))) continue;
      if (token->lstrip) begin = stripBackward(text, begin, plainStart);
      if (token->rstrip) end = stripForward(text, end);
      if (begin > plainStart) out.push_back({text.substr(plainStart, begin - plainStart), nullptr});
      out.push_back({text.substr(begin, end - begin), token});
      plainStart = pos = end;
    }
    if (plainStart < text.size()) out.push_back({text.substr(plainStart), nullptr});
  }

 private:
  using Entry = std::pair<std::string, const AddedToken*>;
  const Entry* longestAt(std::string_view text, size_t pos) const {
    for (const auto& entry : byFirstByte_[static_cast<unsigned char>(text[pos])]) {
      if (text.substr(pos).starts_with(entry.first)) return &entry;
    }
    return nullptr;
  }
  static char32_t codePointBefore(std::string_view text, size_t end, size_t& begin) {
    begin = end - 1;
    while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
    size_t pos = begin;
    return nextCodePoint(text, pos);
  }
  static bool isWordChar(char32_t cp) { return cp == U'_' || detail::tok::isAlphanumeric(cp); }
  static bool touchesWordBefore(std::string_view text, size_t begin) {
    size_t previous = 0;
    return begin > 0 && isWordChar(codePointBefore(text, begin, previous));
  }
  static bool touchesWordAfter(std::string_view text, size_t end) {
    return end < text.size() && isWordChar(nextCodePoint(text, end));
  }
  static size_t stripBackward(std::string_view text, size_t begin, size_t limit) {
    while (begin > limit) {
      size_t previous = 0;
      if (!detail::tok::isWhitespace(codePointBefore(text, begin, previous))) break;
      begin = previous;
    }
    return begin;
  }
  static size_t stripForward(std::string_view text, size_t end) {
    while (end < text.size()) {
      size_t next = end;
      if (!detail::tok::isWhitespace(nextCodePoint(text, next))) break;
      end = next;
    }
    return end;
  }

  std::vector<Entry> byFirstByte_[256];
};

// model.vocab and model.merges, where the parse streamed them (TokenizerParse) instead of building
// them into the document.
struct StreamedModel {
  bool vocabStreamed = false;
  bool mergesStreamed = false;
  StringMap<int64_t> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
};

// A SAX handler for Json::sax_parse that builds the document as Json::parse does, except that
// model.vocab's entries and model.merges' items go straight into a StreamedModel (the document
// keeps model.vocab and model.merges, empty): their 100k small document nodes, built, read once and
// destroyed, were a third of a tokenizer's load. Anything there that is not a vocabulary id or a
// merge in one of its two forms, or a second model.vocab or model.merges, stops the parse (an event
// returns false): fromJson then builds the whole document and checks it as before, so what is
// accepted and every message stay the same. The same nesting limit as jsonDepthLimit.
class TokenizerParse {
  enum class Section { kNone, kVocab, kMerges, kMergePair };

 public:
  TokenizerParse(Json& root, const std::string& source, StreamedModel& out) : root_(root), source_(source), out_(out) {}

  bool null() { return section_ == Section::kNone && place(nullptr); }
  bool boolean(bool value) { return section_ == Section::kNone && place(value); }
  bool number_integer(Json::number_integer_t value) { return section_ == Section::kNone && place(value); }
  bool number_float(Json::number_float_t value, const Json::string_t& /*text*/) {
    return section_ == Section::kNone && place(value);
  }
  bool binary(Json::binary_t& value) { return section_ == Section::kNone && place(Json::binary(std::move(value))); }

  // Non-negative integers arrive here, negative ones at number_integer.
  bool number_unsigned(Json::number_unsigned_t value) {
    if (section_ != Section::kVocab) return section_ == Section::kNone && place(value);
    if (value > static_cast<Json::number_unsigned_t>(INT64_MAX)) return false;
    // A repeated token keeps its last id, as in the document.
    out_.vocab.insert_or_assign(std::move(key_), static_cast<int64_t>(value));
    return true;
  }

  bool string(Json::string_t& value) {
    switch (section_) {
      case Section::kNone:
        return place(std::move(value));
      case Section::kMerges: {
        const size_t space = value.find(' ');
        if (space == std::string::npos || value.find(' ', space + 1) != std::string::npos) return false;
        out_.merges.emplace_back(value.substr(0, space), value.substr(space + 1));
        return true;
      }
      case Section::kMergePair:
        if (pair_.size() == 2) return false;
        pair_.push_back(std::move(value));
        return true;
      case Section::kVocab:
        return false;
    }
    return false;
  }

  bool key(Json::string_t& value) {
    checkDepth();
    if (section_ == Section::kNone && open_.size() <= 2) keys_[open_.size()] = value;
    key_ = std::move(value);
    return true;
  }

  bool start_object(std::size_t /*elements*/) {
    if (!open(Json::object())) return false;
    if (at("vocab")) {
      if (out_.vocabStreamed) return false;
      out_.vocabStreamed = true;
      // LLM vocabularies hold 32k-256k tokens: 64k buckets to start with, not a dozen rehashes.
      out_.vocab.reserve(size_t{1} << 16);
      section_ = Section::kVocab;
    }
    return true;
  }

  bool start_array(std::size_t /*elements*/) {
    if (section_ == Section::kMerges) {
      pair_.clear();
      section_ = Section::kMergePair;
      return true;
    }
    if (!open(Json::array())) return false;
    if (at("merges")) {
      if (out_.mergesStreamed) return false;
      out_.mergesStreamed = true;
      section_ = Section::kMerges;
    }
    return true;
  }

  bool end_object() {
    section_ = Section::kNone;  // the end of model.vocab, or of an object outside any section
    open_.pop_back();
    return true;
  }

  bool end_array() {
    if (section_ == Section::kMergePair) {
      if (pair_.size() != 2) return false;
      out_.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      section_ = Section::kMerges;
      return true;
    }
    section_ = Section::kNone;
    open_.pop_back();
    return true;
  }

  // Json::parse's exception, whose type (parse_error, out_of_range) fromJson tells apart.
  template <typename Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/, const Exception& error) {
    throw error;
  }

 private:
  // As jsonDepthLimit: no key or value inside more than kMaxJsonDepth open containers (an empty
  // container may still open there).
  void checkDepth() const {
    QPIPE_REQUIRE(open_.size() <= static_cast<size_t>(kMaxJsonDepth), ErrorCode::kInput, source_,
                  ": JSON nested deeper than ", kMaxJsonDepth, " levels");
  }
  // `value` in the open container (under the last key in an object), or as the root.
  Json* place(Json value) {
    checkDepth();
    if (open_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    Json& slot = parent[std::move(key_)];
    slot = std::move(value);
    return &slot;
  }
  // A container opens below the open ones (none inside a streamed section but a merge's pair,
  // which start_array takes).
  bool open(Json container) {
    if (section_ != Section::kNone) return false;
    open_.push_back(place(std::move(container)));
    if (open_.size() <= 2) keys_[open_.size()].clear();
    return true;
  }
  // The container just opened is model.<name>.
  bool at(std::string_view name) const { return open_.size() == 3 && keys_[1] == "model" && keys_[2] == name; }

  Json& root_;
  const std::string& source_;
  StreamedModel& out_;
  Section section_ = Section::kNone;
  std::vector<Json*> open_;        // the open containers, outermost first
  std::string keys_[3];            // the last key of the open object at depth 1 and 2
  std::string key_;                // the last key: where the next value goes, or a vocabulary token
  std::vector<std::string> pair_;  // a [left, right] merge so far
};

}  // namespace

// ---- the tokenizer ----

struct Tokenizer::Impl {
  std::string source;
  std::vector<Normalization> normalizers;
  std::vector<PreTokenizerStep> preTokenizers;
  std::unique_ptr<BpeModel> model;
  std::unordered_map<int64_t, std::string_view> modelTokens;  // id -> token, views into model's vocab
  std::vector<AddedToken> addedTokens;
  std::unordered_map<int64_t, const AddedToken*> addedById;
  StringMap<int64_t> addedByContent;
  AddedTokenMatcher rawMatcher;               // added tokens with normalized=false, matched in the input
  AddedTokenMatcher normalizedMatcher;        // normalized=true, matched after the normalizer
  std::vector<int64_t> prefixIds, suffixIds;  // the post-processor's special tokens around a sequence
  bool byteLevelDecoder = false;
  int64_t vocabSize = 0;

  void parse(const Json& root, StreamedModel& streamed);
  void parseModel(const Json& node, StreamedModel& streamed);
  void parseAddedTokens(const Json& node);
  void parsePostProcessor(const Json& node, const std::string& path);
  void parseDecoder(const Json& node, const std::string& path);
  std::optional<int64_t> findId(std::string_view token) const;
  void encodePlain(std::string_view text, std::vector<int64_t>& ids) const;
};

void Tokenizer::Impl::parse(const Json& root, StreamedModel& streamed) {
  QPIPE_REQUIRE(root.is_object(), ErrorCode::kInput, source, ": expected a JSON object at the top, not ",
                typeName(root));
  for (const char* option : {"truncation", "padding"}) {
    const auto it = root.find(option);
    QPIPE_REQUIRE(it == root.end() || it->is_null(), ErrorCode::kInput, source, ": ", option,
                  " is not supported (set it to null)");
  }
  parseModel(member(source, root, "model", "tokenizer"), streamed);
  parseNormalizer(source, root.value("normalizer", Json()), "normalizer", normalizers);
  parsePreTokenizer(source, root.value("pre_tokenizer", Json()), "pre_tokenizer", preTokenizers);
  parseAddedTokens(root.value("added_tokens", Json::array()));
  parsePostProcessor(root.value("post_processor", Json()), "post_processor");
  parseDecoder(root.value("decoder", Json()), "decoder");

  std::unordered_set<int64_t> ids;
  for (const auto& [id, token] : modelTokens) ids.insert(id);
  for (const auto& [id, token] : addedById) ids.insert(id);
  vocabSize = static_cast<int64_t>(ids.size());
}

void Tokenizer::Impl::parseModel(const Json& node, StreamedModel& streamed) {
  const auto type = typeOf(source, node, "model");
  QPIPE_REQUIRE(type == "BPE", ErrorCode::kInput, source, ": model type '", type,
                "' is not supported (only byte-level BPE)");
  const auto dropout = node.value("dropout", Json());
  QPIPE_REQUIRE(dropout.is_null() || (dropout.is_number() && dropout.get<double>() == 0.0), ErrorCode::kInput, source,
                ": model.dropout ", dropout.dump(), " is not supported (set it to null)");
  QPIPE_REQUIRE(!flagAt(source, node, "byte_fallback", "model", false), ErrorCode::kInput, source,
                ": model.byte_fallback true is not supported (only byte-level BPE)");

  BpeModel::Options options;
  if (const auto unk = optionalStringAt(source, node, "unk_token", "model"); !unk.empty()) options.unkToken = unk;
  options.fuseUnk = flagAt(source, node, "fuse_unk", "model", false);
  options.ignoreMerges = flagAt(source, node, "ignore_merges", "model", false);
  options.continuingSubwordPrefix = optionalStringAt(source, node, "continuing_subword_prefix", "model");
  options.endOfWordSuffix = optionalStringAt(source, node, "end_of_word_suffix", "model");

  const auto& vocabNode = member(source, node, "vocab", "model");
  QPIPE_REQUIRE(vocabNode.is_object(), ErrorCode::kInput, source, ": model.vocab must be an object, not ",
                typeName(vocabNode));
  StringMap<int64_t> vocab = std::move(streamed.vocab);
  vocab.reserve(vocabNode.size());
  for (const auto& [token, id] : vocabNode.items()) vocab.emplace(token, idAt(source, id, "model.vocab.", token));

  const auto& mergesNode = member(source, node, "merges", "model");
  QPIPE_REQUIRE(mergesNode.is_array(), ErrorCode::kInput, source, ": model.merges must be a list, not ",
                typeName(mergesNode));
  std::vector<std::pair<std::string, std::string>> merges = std::move(streamed.merges);
  merges.reserve(mergesNode.size());
  for (size_t i = 0; i < mergesNode.size(); ++i) {
    const auto& merge = mergesNode[i];
    // Older files write a merge as "left right"; newer ones (tokenizers >= 0.20) as ["left", "right"].
    if (merge.is_string()) {
      const auto& text = merge.get_ref<const std::string&>();
      const auto space = text.find(' ');
      QPIPE_REQUIRE(space != std::string::npos && text.find(' ', space + 1) == std::string::npos, ErrorCode::kInput,
                    source, ": model.merges[", i, "] '", text, "' must be two tokens separated by one space");
      merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else {
      QPIPE_REQUIRE(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                    ErrorCode::kInput, source, ": model.merges[", i, "] must be \"left right\" or [left, right], not ",
                    merge.dump());
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    }
  }
  model = std::make_unique<BpeModel>(std::move(vocab), merges, std::move(options), source);
  // An id several tokens share decodes to the least of them, whatever order the map holds them in.
  for (const auto& [token, id] : model->vocab()) {
    const auto [it, fresh] = modelTokens.emplace(id, token);
    if (!fresh && token < it->second) it->second = token;
  }
}

void Tokenizer::Impl::parseAddedTokens(const Json& node) {
  QPIPE_REQUIRE(node.is_array(), ErrorCode::kInput, source, ": added_tokens must be a list, not ", typeName(node));
  addedTokens.reserve(node.size());
  for (size_t i = 0; i < node.size(); ++i) {
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    const auto& entry = node[i];
    AddedToken token{.content = stringAt(source, member(source, entry, "content", path), path + ".content"),
                     .id = idAt(source, member(source, entry, "id", path), path + ".id"),
                     .special = flagAt(source, entry, "special", path, false),
                     .singleWord = flagAt(source, entry, "single_word", path, false),
                     .lstrip = flagAt(source, entry, "lstrip", path, false),
                     .rstrip = flagAt(source, entry, "rstrip", path, false),
                     .normalized = flagAt(source, entry, "normalized", path, false)};
    QPIPE_REQUIRE(!findInvalidUtf8(token.content), ErrorCode::kInput, source, ": ", path,
                  ".content is not valid UTF-8");
    addedTokens.push_back(std::move(token));
  }
  for (auto& token : addedTokens) {
    addedById[token.id] = &token;
    addedByContent[token.content] = token.id;
    // HF keeps a normalized token in its normalized form, which is then what it matches and decodes.
    token.text = token.normalized ? normalize(token.content, normalizers) : token.content;
    (token.normalized ? normalizedMatcher : rawMatcher).add(&token, token.text);
  }
}

std::optional<int64_t> Tokenizer::Impl::findId(std::string_view token) const {
  if (const auto it = addedByContent.find(token); it != addedByContent.end()) return it->second;
  const auto& vocab = model->vocab();
  if (const auto it = vocab.find(token); it != vocab.end()) return it->second;
  return std::nullopt;
}

void Tokenizer::Impl::parsePostProcessor(const Json& node, const std::string& path) {
  if (node.is_null()) return;
  const auto type = typeOf(source, node, path);
  // Every supported processor puts special tokens around the single sequence; a Sequence of them
  // wraps the earlier ones' result.
  std::vector<int64_t> before, after;
  const auto tokenId = [&](const Json& pair, const std::string& where) {
    QPIPE_REQUIRE(pair.is_array() && pair.size() == 2, ErrorCode::kInput, source, ": ", where,
                  " must be [token, id], not ", pair.dump());
    return idAt(source, pair[1], where + "[1]");
  };
  if (type == "Sequence") {
    const auto& list = member(source, node, "processors", path);
    QPIPE_REQUIRE(list.is_array(), ErrorCode::kInput, source, ": ", path, ".processors must be a list");
    for (size_t i = 0; i < list.size(); ++i) {
      parsePostProcessor(list[i], path + ".processors[" + std::to_string(i) + "]");
    }
    return;
  } else if (type == "ByteLevel") {
    return;  // it only trims offsets, which qpipe does not produce
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    before.push_back(tokenId(member(source, node, "cls", path), path + ".cls"));
    after.push_back(tokenId(member(source, node, "sep", path), path + ".sep"));
  } else if (type == "TemplateProcessing") {
    const auto& single = member(source, node, "single", path);
    const auto& specials = member(source, node, "special_tokens", path);
    QPIPE_REQUIRE(single.is_array(), ErrorCode::kInput, source, ": ", path, ".single must be a list");
    bool seenSequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string where = path + ".single[" + std::to_string(i) + "]";
      const auto& item = single[i];
      QPIPE_REQUIRE(item.is_object() && item.size() == 1, ErrorCode::kInput, source, ": ", where,
                    " must be {\"SpecialToken\": ...} or {\"Sequence\": ...}, not ", item.dump());
      // The key and value through the iterator itself: a structured binding of items()'s proxy
      // keeps a reference into a temporary (AddressSanitizer: stack-use-after-scope).
      const std::string kind = item.begin().key();
      const Json& body = item.begin().value();
      const auto name = stringAt(source, member(source, body, "id", where + "." + kind), where + "." + kind + ".id");
      if (kind == "Sequence") {
        QPIPE_REQUIRE(name == "A" && !seenSequence, ErrorCode::kInput, source, ": ", where,
                      " must be the one sequence A of a single template");
        seenSequence = true;
      } else {
        QPIPE_REQUIRE(kind == "SpecialToken", ErrorCode::kInput, source, ": ", where, " kind '", kind,
                      "' is not supported (SpecialToken or Sequence)");
        QPIPE_REQUIRE(specials.is_object() && specials.contains(name), ErrorCode::kInput, source, ": ", where,
                      " names special token '", name, "', which ", path, ".special_tokens does not define");
        const auto& ids = member(source, specials[name], "ids", path + ".special_tokens." + name);
        QPIPE_REQUIRE(ids.is_array(), ErrorCode::kInput, source, ": ", path, ".special_tokens.", name,
                      ".ids must be a list");
        for (const auto& id : ids) {
          (seenSequence ? after : before).push_back(idAt(source, id, path + ".special_tokens." + name + ".ids"));
        }
      }
    }
    QPIPE_REQUIRE(seenSequence, ErrorCode::kInput, source, ": ", path, ".single has no sequence A");
  } else {
    QPIPE_REQUIRE(false, ErrorCode::kInput, source, ": ", path, " type '", type,
                  "' is not supported (supported: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, "
                  "Sequence)");
  }
  prefixIds.insert(prefixIds.begin(), before.begin(), before.end());
  suffixIds.insert(suffixIds.end(), after.begin(), after.end());
}

void Tokenizer::Impl::parseDecoder(const Json& node, const std::string& path) {
  if (node.is_null()) return;
  const auto type = typeOf(source, node, path);
  QPIPE_REQUIRE(type == "ByteLevel", ErrorCode::kInput, source, ": ", path, " type '", type,
                "' is not supported (only ByteLevel)");
  byteLevelDecoder = true;
}

void Tokenizer::Impl::encodePlain(std::string_view text, std::vector<int64_t>& ids) const {
  std::vector<std::string> pieces{normalize(std::string(text), normalizers)};
  std::vector<AddedTokenMatcher::Piece> parts;
  if (normalizedMatcher.empty()) {
    parts.push_back({pieces[0], nullptr});
  } else {
    normalizedMatcher.split(pieces[0], parts);
  }
  std::vector<std::string> current, next;
  for (const auto& part : parts) {
    if (part.token != nullptr) {
      ids.push_back(part.token->id);
      continue;
    }
    current.assign(1, std::string(part.text));
    for (const auto& step : preTokenizers) {
      next.clear();
      applyPreTokenizer(step, current, next);
      current.swap(next);
    }
    for (const auto& word : current) model->tokenize(word, ids);
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::fromFile(const std::filesystem::path& tokenizerJson) {
  return fromJson(readInputFile(tokenizerJson), tokenizerJson.string());
}

Tokenizer Tokenizer::fromJson(std::string_view json, const std::string& sourceName) {
  Json root;
  StreamedModel streamed;
  try {
    TokenizerParse parse(root, sourceName, streamed);
    if (!Json::sax_parse(json, &parse)) {
      // A model.vocab or model.merges of another shape: the whole document, checked as ever.
      streamed = {};
      root = Json::parse(json, jsonDepthLimit<Json>(sourceName));
    }
  } catch (const Json::parse_error& e) {
    QPIPE_REQUIRE(false, ErrorCode::kInput, sourceName, ": not valid JSON (syntax error at byte ", e.byte, ")");
  } catch (const Json::exception& e) {  // a number out of range
    QPIPE_REQUIRE(false, ErrorCode::kInput, sourceName, ": not valid JSON (", e.what(), ")");
  }
  auto impl = std::make_unique<Impl>();
  impl->source = sourceName;
  impl->parse(root, streamed);
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool addSpecialTokens) const {
  const auto invalid = findInvalidUtf8(text);
  QPIPE_REQUIRE(!invalid, ErrorCode::kInput, impl_->source, ": cannot encode text that is not valid UTF-8 (byte ",
                invalid.value_or(0), ")");
  std::vector<int64_t> ids;
  if (addSpecialTokens) ids = impl_->prefixIds;
  std::vector<AddedTokenMatcher::Piece> parts;
  impl_->rawMatcher.split(text, parts);
  for (const auto& part : parts) {
    if (part.token != nullptr) {
      ids.push_back(part.token->id);
    } else {
      impl_->encodePlain(part.text, ids);
    }
  }
  if (addSpecialTokens) ids.insert(ids.end(), impl_->suffixIds.begin(), impl_->suffixIds.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skipSpecialTokens) const {
  // Like HF, ids that name no token are left out.
  std::string out;
  bool first = true;
  for (const auto id : ids) {
    std::string_view token;
    if (const auto added = impl_->addedById.find(id); added != impl_->addedById.end()) {
      if (skipSpecialTokens && added->second->special) continue;
      token = added->second->text;
    } else if (const auto it = impl_->modelTokens.find(id); it != impl_->modelTokens.end()) {
      token = it->second;
    } else {
      continue;
    }
    if (impl_->byteLevelDecoder) {
      // A token outside the byte map (an added token such as "<|im_start|>" or one with CJK text)
      // contributes its own UTF-8 bytes.
      if (!ByteLevelMap::get().decode(token, out)) out.append(token);
    } else {
      if (!first) out += ' ';
      out.append(token);
    }
    first = false;
  }
  return impl_->byteLevelDecoder ? utf8Lossy(out) : out;
}

int64_t Tokenizer::vocabSize() const {
  return impl_->vocabSize;
}

std::optional<int64_t> Tokenizer::tokenToId(std::string_view token) const {
  return impl_->findId(token);
}

std::optional<std::string> Tokenizer::idToToken(int64_t id) const {
  if (const auto added = impl_->addedById.find(id); added != impl_->addedById.end()) return added->second->text;
  if (const auto it = impl_->modelTokens.find(id); it != impl_->modelTokens.end()) return std::string(it->second);
  return std::nullopt;
}

}  // namespace qpipe
