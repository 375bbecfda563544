// FNV-1a, 64 bits: the hash the ranks compare or agree on without exchanging the hashed bytes (the
// scheduler's agreement, the shared-memory channel's collective tags and counter slots, the
// layouts of an exchange's parts). Not for anything a user or a checkpoint sees.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qpipe {

inline constexpr uint64_t kFnv1aBasis = 0xcbf29ce484222325ULL;

// `size` bytes at `data` folded into `hash`; chained calls hash the concatenation. (Named apart
// from fnv1a: a string literal and a hash would otherwise bind to (data, size).)
inline uint64_t fnv1aBytes(const void* data, size_t size, uint64_t hash = kFnv1aBasis) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ULL;
  return hash;
}

inline uint64_t fnv1a(std::string_view text, uint64_t hash = kFnv1aBasis) {
  return fnv1aBytes(text.data(), text.size(), hash);
}

}  // namespace qpipe
