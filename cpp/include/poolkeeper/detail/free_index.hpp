// FreeIndex: where an ArenaPool finds a free chunk for a request.
//
// - 128 exact-size fast bins for chunk sizes alignment*1 .. alignment*128, with a two-word
//   occupancy bitmap: an occupied exact bin is already the best fit, and the next occupied larger
//   bin is found with one count-trailing-zeros.
// - A tree ordered by (size, address) for larger chunks: lower_bound is the best fit, lowest
//   address first (keeps memory packed toward the start of backings).
// Tree nodes come from a node-arena allocator, never the general heap on the hot path.
// Not thread-safe: used under the pool's lock.
#pragma once
#include <bit>
#include <cstdint>
#include <set>

#include "poolkeeper/detail/arena_types.hpp"
#include "poolkeeper/detail/node_arena.hpp"

namespace poolkeeper::detail {

class FreeIndex {
 public:
  static constexpr std::size_t kBins = 128;

  explicit FreeIndex(std::size_t alignment) : align_(alignment) {}

  void insert(ArenaChunk* c) {
    bytes_ += c->size;
    ++count_;
    const std::size_t units = c->size / align_;
    if (units <= kBins) {
      const std::size_t i = units - 1;
      c->bin_prev = nullptr;
      c->bin_next = bins_[i];
      if (bins_[i]) bins_[i]->bin_prev = c;
      bins_[i] = c;
      bitmap_[i >> 6] |= std::uint64_t{1} << (i & 63);
      c->where = ArenaChunk::kBin;
    } else {
      tree_.insert({c->size, c->addr, c});
      c->where = ArenaChunk::kTree;
    }
  }

  void remove(ArenaChunk* c) {
    bytes_ -= c->size;
    --count_;
    if (c->where == ArenaChunk::kBin) {
      const std::size_t i = c->size / align_ - 1;
      if (c->bin_prev) c->bin_prev->bin_next = c->bin_next;
      else bins_[i] = c->bin_next;
      if (c->bin_next) c->bin_next->bin_prev = c->bin_prev;
      if (!bins_[i]) bitmap_[i >> 6] &= ~(std::uint64_t{1} << (i & 63));
      c->bin_prev = c->bin_next = nullptr;
    } else {
      tree_.erase({c->size, c->addr, c});
    }
    c->where = ArenaChunk::kNowhere;
  }

  // A chunk of exactly `size` bytes (a multiple of the alignment), removed; nullptr if none.
  ArenaChunk* take_exact(std::size_t size) {
    const std::size_t units = size / align_;
    ArenaChunk* c = nullptr;
    if (units <= kBins) {
      c = bins_[units - 1];
    } else {
      auto it = tree_.lower_bound({size, 0, nullptr});
      if (it != tree_.end() && it->size == size) c = it->chunk;
    }
    if (c) remove(c);
    return c;
  }

  // Best fit for `size` (a multiple of the alignment), removed from the index; nullptr if none.
  ArenaChunk* take_best_fit(std::size_t size) {
    const std::size_t units = size / align_;
    if (units <= kBins) {
      const std::size_t i = units - 1;
      if (ArenaChunk* c = bins_[i]) {
        remove(c);
        return c;
      }
      // Next occupied larger bin.
      for (std::size_t w = i >> 6; w < 2; ++w) {
        std::uint64_t bits = bitmap_[w];
        if (w == (i >> 6)) bits &= ~std::uint64_t{0} << (i & 63);
        if (bits) {
          const std::size_t j = (w << 6) + static_cast<std::size_t>(std::countr_zero(bits));
          ArenaChunk* c = bins_[j];
          remove(c);
          return c;
        }
      }
    }
    auto it = tree_.lower_bound({size, 0, nullptr});
    if (it == tree_.end()) return nullptr;
    ArenaChunk* c = it->chunk;
    remove(c);
    return c;
  }

  std::size_t largest() const {
    if (!tree_.empty()) return tree_.rbegin()->size;
    for (int w = 1; w >= 0; --w)
      if (bitmap_[w]) return (std::size_t(w) * 64 + 63 - std::countl_zero(bitmap_[w]) + 1) * align_;
    return 0;
  }
  std::size_t bytes() const { return bytes_; }
  std::size_t count() const { return count_; }
  std::size_t tree_size() const { return tree_.size(); }

  // validate(): every indexed chunk is Free and indexed exactly once; totals match.
  template <class Fail>
  void check(Fail&& fail) const {
    std::size_t n = 0, b = 0;
    for (std::size_t i = 0; i < kBins; ++i) {
      const bool bit = bitmap_[i >> 6] >> (i & 63) & 1;
      if (bit != (bins_[i] != nullptr)) fail("fast-bin bitmap disagrees with bin " + std::to_string(i));
      for (ArenaChunk* c = bins_[i]; c; c = c->bin_next) {
        if (c->size != (i + 1) * align_ || c->where != ArenaChunk::kBin || c->st() != ChunkState::Free)
          fail("bad chunk in fast bin " + std::to_string(i));
        ++n;
        b += c->size;
      }
    }
    for (auto& k : tree_) {
      if (k.chunk->size != k.size || k.chunk->addr != k.addr || k.chunk->where != ArenaChunk::kTree ||
          k.chunk->st() != ChunkState::Free || k.size <= kBins * align_)
        fail("bad chunk in the free tree");
      ++n;
      b += k.size;
    }
    if (n != count_ || b != bytes_) fail("free index totals disagree with its contents");
  }

 private:
  struct Key {
    std::size_t size;
    std::uintptr_t addr;
    ArenaChunk* chunk;
    bool operator<(const Key& o) const { return size != o.size ? size < o.size : addr < o.addr; }
  };
  std::size_t align_;
  ArenaChunk* bins_[kBins] = {};
  std::uint64_t bitmap_[2] = {0, 0};
  std::set<Key, std::less<Key>, ArenaAllocator<Key>> tree_;
  std::size_t bytes_ = 0, count_ = 0;
};

}  // namespace poolkeeper::detail
