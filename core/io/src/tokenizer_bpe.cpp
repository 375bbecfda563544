#include <mutex>
#include <queue>

#include "qpipe/error.h"
#include "tokenizer_internal.h"

namespace qpipe::detail::tok {

namespace {

// Beyond this many cached words the cache stops growing: memory stays bounded on odd input
// (long random strings), while natural text keeps hitting the words already cached.
constexpr size_t kMaxCachedWords = 200000;

uint64_t pairKey(int64_t left, int64_t right) {
  return (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(static_cast<uint32_t>(right));
}

}  // namespace

BpeModel::BpeModel(StringMap<int64_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
                   Options options, const std::string& source)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  for (const auto& [token, id] : vocab_) {
    QPIPE_REQUIRE(id >= 0 && id <= INT32_MAX, ErrorCode::kInput, source, ": model.vocab: id ", id, " of token '", token,
                  "' is out of range");
  }
  if (options_.unkToken) {
    const auto it = vocab_.find(*options_.unkToken);
    QPIPE_REQUIRE(it != vocab_.end(), ErrorCode::kInput, source, ": model.unk_token '", *options_.unkToken,
                  "' is not in model.vocab");
    unkId_ = it->second;
  }
  const auto& prefix = options_.continuingSubwordPrefix;
  merges_.reserve(merges.size());
  std::string merged;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const auto leftIt = vocab_.find(left);
    const auto rightIt = vocab_.find(right);
    // The merged token drops the right part's continuation prefix: "a" + "##b" gives "ab".
    const std::string_view rightTail =
        !prefix.empty() && right.starts_with(prefix) ? std::string_view(right).substr(prefix.size()) : right;
    merged.assign(left).append(rightTail);
    const auto mergedIt = vocab_.find(merged);
    QPIPE_REQUIRE(leftIt != vocab_.end() && rightIt != vocab_.end() && mergedIt != vocab_.end(), ErrorCode::kInput,
                  source, ": model.merges[", rank, "] ('", left, "', '", right,
                  "') refers to a token missing from model.vocab");
    // A repeated pair takes its last rank, as HF's map built from the merge list does.
    merges_.insert_or_assign(pairKey(leftIt->second, rightIt->second),
                             Merge{static_cast<int32_t>(rank), mergedIt->second});
  }
}

void BpeModel::tokenize(std::string_view word, std::vector<int64_t>& ids) const {
  {
    std::shared_lock lock(cacheMutex_);
    if (const auto it = cache_.find(word); it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int64_t> wordIds;
  tokenizeUncached(word, wordIds);
  ids.insert(ids.end(), wordIds.begin(), wordIds.end());
  std::unique_lock lock(cacheMutex_);
  if (cache_.size() < kMaxCachedWords) cache_.try_emplace(std::string(word), std::move(wordIds));
}

void BpeModel::tokenizeUncached(std::string_view word, std::vector<int64_t>& ids) const {
  if (options_.ignoreMerges) {
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }

  // Initial symbols: one per character, with the continuation prefix on all but the first and the
  // end-of-word suffix on the last. A character outside the vocabulary becomes unk_token (runs of
  // them fused into one with fuse_unk) or, without unk_token, is dropped.
  struct Symbol {
    int64_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  std::string piece;
  bool lastWasUnk = false;
  for (size_t pos = 0; pos < word.size();) {
    const size_t begin = pos;
    nextCodePoint(word, pos);
    piece.clear();
    if (begin > 0) piece += options_.continuingSubwordPrefix;
    piece.append(word.substr(begin, pos - begin));
    if (pos == word.size()) piece += options_.endOfWordSuffix;
    if (const auto it = vocab_.find(piece); it != vocab_.end()) {
      symbols.push_back({it->second, 0, 0, true});
      lastWasUnk = false;
    } else if (unkId_) {
      if (!(options_.fuseUnk && lastWasUnk)) symbols.push_back({*unkId_, 0, 0, true});
      lastWasUnk = true;
    }
  }
  const auto count = static_cast<int32_t>(symbols.size());
  for (int32_t i = 0; i < count; ++i) {
    symbols[i].prev = i - 1;
    symbols[i].next = i + 1 < count ? i + 1 : -1;
  }

  // Candidate merges ordered by (rank, position); entries made stale by an earlier merge are
  // recognised on pop because the pair at their position no longer yields the same merge.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    bool operator>(const Candidate& other) const { return rank != other.rank ? rank > other.rank : pos > other.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto findMerge = [&](int32_t pos) -> const Merge* {
    const int32_t next = symbols[pos].next;
    if (next < 0) return nullptr;
    const auto it = merges_.find(pairKey(symbols[pos].id, symbols[next].id));
    return it == merges_.end() ? nullptr : &it->second;
  };
  const auto push = [&](int32_t pos) {
    if (pos < 0) return;
    if (const Merge* merge = findMerge(pos)) queue.push({merge->rank, pos});
  };
  for (int32_t i = 0; i + 1 < count; ++i) push(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (!symbols[top.pos].alive) continue;
    const Merge* merge = findMerge(top.pos);
    if (merge == nullptr || merge->rank != top.rank) continue;
    Symbol& left = symbols[top.pos];
    Symbol& right = symbols[left.next];
    left.id = merge->id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    push(left.prev);
    push(top.pos);
  }
  for (int32_t i = count > 0 ? 0 : -1; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

}  // namespace qpipe::detail::tok
