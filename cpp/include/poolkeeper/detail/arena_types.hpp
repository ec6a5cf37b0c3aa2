// The records an ArenaPool keeps: chunks (the unit handed out) and backings (upstream pieces).
#pragma once
#include <cstddef>
#include <cstdint>

#include "poolkeeper/core/stream_order.hpp"

namespace poolkeeper::detail {

struct ArenaBacking;

struct ArenaChunk : BlockRecord {
  ArenaChunk* prev_addr = nullptr;  // address order within the backing (tiles it exactly)
  ArenaChunk* next_addr = nullptr;
  ArenaBacking* backing = nullptr;
  ArenaChunk* bin_prev = nullptr;  // fast-bin list links (doubly linked: coalescing removes from the middle)
  ArenaChunk* bin_next = nullptr;
  enum : std::uint8_t { kNowhere = 0, kBin = 1, kTree = 2 } where = kNowhere;
  Stream cache_tag = kNoStream;  // while ThreadCached: the stream it may be reused on (kNoStream: any)
  // The pool's shrink-scan epoch when this chunk was last handed out through the pool's books
  // (or left a thread cache). A merge keeps the later one, a split copies it: a scan can tell a
  // piece that was reused since the previous scan from one that sat free the whole interval.
  std::uint64_t used_epoch = 0;
};

struct ArenaBacking {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  bool resident = false, oversize = false;
  bool dirty = false;            // some free chunk here may have a free neighbour (a merge is owed)
  std::size_t free_scans = 0;    // consecutive shrink scans that found it wholly free and unused (idle_scans_after)
  ArenaChunk* first = nullptr;
  ArenaChunk* last = nullptr;    // the chunk at the end (an expandable backing grows from it)
};

}  // namespace poolkeeper::detail
