// Basic vocabulary of the core: streams, events, memory kinds, alignment helpers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace poolkeeper {

// A stream is an opaque 64-bit handle (a CUstream, a simulated stream id, ...).
// kNoStream means "the caller guarantees all device work on the block has completed"
// (the stream=None contract): such a release is immediately reusable by every stream.
using Stream = std::uint64_t;
inline constexpr Stream kNoStream = ~Stream{0};

// An event id handed out by an upstream's stream interface. 0 is the null event: already complete.
using EventId = std::uint64_t;
inline constexpr EventId kNullEvent = 0;

enum class MemoryKind : std::uint8_t { Host = 0, Device = 1, Pinned = 2 };

inline const char* memory_kind_name(MemoryKind k) {
  switch (k) {
    case MemoryKind::Host: return "host";
    case MemoryKind::Device: return "device";
    case MemoryKind::Pinned: return "pinned";
  }
  return "?";
}

constexpr bool is_pow2(std::size_t x) { return x != 0 && (x & (x - 1)) == 0; }
constexpr std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) & ~(a - 1); }

// Requests above this are refused as absurd before any arithmetic can overflow (2^62 bytes).
inline constexpr std::size_t kMaxRequest = std::size_t{1} << 62;

}  // namespace poolkeeper
