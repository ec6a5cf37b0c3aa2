// VirtualRange: one reserved virtual range with physical pieces mapped into it (backing_source.hpp,
// docs/expandable.md).
//
// Books: `pieces_` lists every mapped piece (one earlier map each, by address); every backing of
// the arena is a *segment*: a maximal run of consecutive mapped pieces, tiled by chunks. The gaps
// between segments are the holes: unmapped, with no chunk over them, so nothing there can be
// handed out. validate() proves that the segments cover exactly the pieces (reserved == mapped,
// no byte reachable twice).
#include <algorithm>
#include <map>

#include "poolkeeper/arena_pool.hpp"

namespace poolkeeper::detail {

class VirtualRange final : public BackingSource {
 public:
  explicit VirtualRange(ArenaPool& arena) : BackingSource(arena) {
    const ArenaOptions& opt = a_.opt_;
    Upstream& up = *a_.upstream_;
    if (!up.supports_virtual())
      throw InvalidArgument("expandable=True needs an upstream with virtual memory; " + up.name() +
                            " has none (supports_virtual() is false)");
    granule_ = up.vm_granularity();
    if (!is_pow2(granule_) || granule_ % opt.alignment)
      throw InvalidArgument("expandable: the upstream's granularity " + std::to_string(granule_) +
                            " is not a power of two multiple of alignment " + std::to_string(opt.alignment));
    if (!(opt.step_fraction >= 0.0) || opt.step_fraction > 16.0) throw InvalidArgument("step_fraction must be in [0, 16]");
    if (opt.max_step == 0) throw InvalidArgument("max_step must be positive");
    piece_ = opt.map_piece ? align_up(opt.map_piece, granule_) : 0;
    const std::size_t cap = up.memory_capacity();
    // Holes fragment the address range, not only the memory: with holes reclaimed, twice the
    // device's memory keeps the range from filling before the device does (addresses cost nothing).
    const std::size_t dflt = cap ? (opt.reclaim_holes ? 2 * cap : cap) : std::size_t{1} << 40;
    va_bytes_ = align_up(opt.va_bytes ? opt.va_bytes : dflt, granule_);
    va_base_ = up.reserve(va_bytes_);  // throws the upstream's typed error; nothing to undo
  }

  // Map memory into the lowest hole where it joins free neighbours into a run that fits (the
  // space after the last segment is the last hole). The step is what the request lacks beyond
  // the free chunk ending at the hole, or a fraction of what is mapped (fewer map calls as the
  // footprint grows), whichever is larger, clamped to max_step and to the hole. It is mapped in
  // pieces of at most map_piece bytes.
  ArenaChunk* grow(std::size_t rounded) override {
    const ArenaOptions& opt = a_.opt_;
    // The free tail stays: this growth extends it. Only when the pieces to go add up to a growth
    // step's worth (mapped * step_fraction, at least a granule): smaller releases would cost an
    // unmap now and a map later for little.
    if (opt.release_on_grow && opt.reclaim_holes && a_.upstream_->captures_underway() == 0)
      unmap_free(false, false, true,
                 std::max(granule_, static_cast<std::size_t>(double(mapped_) * opt.step_fraction)));
    auto& segs = a_.backings_;
    const std::uintptr_t va_end = va_base_ + va_bytes_;
    std::uintptr_t gs = 0, ge = 0;
    ArenaBacking *prev = nullptr, *next = nullptr;
    std::size_t lead = 0;
    bool found = false;
    for (std::size_t i = 0; i <= segs.size() && !found; ++i) {
      gs = i ? segs[i - 1]->addr + segs[i - 1]->size : va_base_;
      ge = i < segs.size() ? segs[i]->addr : va_end;
      if (gs == ge) continue;
      prev = i ? segs[i - 1] : nullptr;
      next = i < segs.size() ? segs[i] : nullptr;
      lead = prev && prev->last->st() == ChunkState::Free ? prev->last->size : 0;
      const std::size_t trail = next && next->first->st() == ChunkState::Free ? next->first->size : 0;
      found = lead + (ge - gs) + trail >= rounded;
    }
    const std::size_t tail_gap = segs.empty() ? va_bytes_ : va_end - (segs.back()->addr + segs.back()->size);
    if (!found)
      throw UpstreamOutOfMemory("ArenaPool #" + std::to_string(a_.id_) + ": its reserved range of " + format_bytes(va_bytes_) +
                                    " is full (" + format_bytes(mapped_) + " mapped, " + format_bytes(tail_gap) +
                                    " left at its end, " + format_bytes(rounded) + " needed; raise va_bytes)",
                                a_.upstream_->name(), "POOLKEEPER_RANGE_FULL", 0);
    const std::size_t hole = ge - gs;
    const std::size_t need = std::min(hole, align_up(rounded > lead ? rounded - lead : granule_, granule_));
    std::size_t step;
    if (!mapped_) {
      step = std::max(need, align_up(opt.initial_backing, granule_));
    } else {
      const std::size_t frac = align_up(static_cast<std::size_t>(double(mapped_) * opt.step_fraction), granule_);
      step = std::max(need, std::min(std::max(frac, granule_), std::max(align_up(opt.max_step, granule_), granule_)));
    }
    if (opt.limit) {
      const std::size_t held = a_.reserved_ + a_.releasing_;
      if (held + need > opt.limit) throw LimitHit{};
      if (held + step > opt.limit) step = std::max(need, (opt.limit - held) / granule_ * granule_);
    }
    step = std::min(step, hole);
    std::size_t target = step, done = 0;
    bool shrunk = false;
    while (done < target) {
      const std::size_t n = piece_ ? std::min(piece_, target - done) : target - done;
      try {
        a_.upstream_->map(gs + done, n);
      } catch (const UpstreamOutOfMemory&) {
        // The step asked for more than needed: ask for just the request, once.
        if (!shrunk && std::max(need, done) < done + n) {
          shrunk = true;
          target = std::max(need, done);
          continue;
        }
        if (ArenaChunk* r = absorb(gs, done, prev, next)) a_.file_free_locked(r);
        throw;
      } catch (...) {
        if (ArenaChunk* r = absorb(gs, done, prev, next)) a_.file_free_locked(r);
        throw;
      }
      ++map_calls_;
      a_.up_allocs_.fetch_add(1, std::memory_order_relaxed);
      pieces_.emplace(gs + done, Piece{n});
      mapped_ += n;
      done += n;
    }
    if (!a_.backings_created_) ++a_.backings_created_;
    return absorb(gs, done, prev, next);
  }

  std::size_t release_free(Detached&, bool hysteresis) override { return unmap_free(hysteresis, false); }

  // The free memory that no request could use lies in pieces the failed growth did not extend:
  // unmapping them frees physical memory for the retry's map.
  // The free tail stays: the retry's growth extends it, and unmapping it would only make that map
  // larger.
  std::size_t release_for_oom(Detached&) override { return a_.opt_.reclaim_holes ? unmap_free(false, false, true) : 0; }

  ArenaChunk* readopt(void*, std::size_t) override {
    throw InvariantViolation("ArenaPool #" + std::to_string(a_.id_) + ": an expandable range never detaches backings");
  }

  void close(Detached&) override { release_all(); }

  // Live blocks remain: only wholly free pieces go (never memory under the user); the range stays
  // reserved unless nothing is left mapped.
  void release_unused(Detached&) override {
    if (a_.upstream_->captures_underway() > 0) return;
    unmap_free(false, true);
    if (pieces_.empty()) release_all();
  }

  void validate(const std::function<void(const std::string&)>& fail) const override {
    std::size_t mapped = 0;
    for (const auto& [at, p] : pieces_) {
      if (!p.size || p.size % granule_ || (at - va_base_) % granule_) fail("mapped piece at " + format_ptr(at) + " is not granule-aligned");
      if (at < va_base_ || at + p.size > va_base_ + va_bytes_) fail("mapped piece outside the reserved range");
      mapped += p.size;
    }
    if (mapped != mapped_) fail("mapped-byte count is off");
    if (mapped != a_.reserved_) fail("mapped " + std::to_string(mapped) + " != reserved " + std::to_string(a_.reserved_));
    // Each segment is exactly a run of consecutive pieces; segments never touch (a hole lies
    // between any two); every piece lies in a segment. With reserved == mapped this proves that
    // chunks cover the mapped bytes and nothing else, each once.
    auto it = pieces_.begin();
    std::uintptr_t prev_end = 0;
    bool first = true;
    for (const ArenaBacking* b : a_.backings_) {
      if (b->oversize) fail("an expandable range holds an oversize backing");
      if (!first && b->addr <= prev_end) fail("segments at " + format_ptr(b->addr) + " touch or overlap (no hole between)");
      if (b->resident != (b->addr == va_base_)) fail("only the segment at the range's base is resident");
      std::uintptr_t at = b->addr;
      while (at < b->addr + b->size) {
        if (it == pieces_.end() || it->first != at) fail("segment " + format_ptr(b->addr) + " covers unmapped bytes at " + format_ptr(at));
        at += it->second.size;
        ++it;
      }
      if (at != b->addr + b->size) fail("segment " + format_ptr(b->addr) + " ends inside a piece");
      prev_end = at;
      first = false;
    }
    if (it != pieces_.end()) fail("piece at " + format_ptr(it->first) + " lies in no segment");
    if (!pieces_.empty() && pieces_.begin()->first != va_base_) fail("the resident first piece is not mapped");
  }

  void stats(PoolStats& st) const override {
    std::size_t holes = 0, hole_bytes = 0;
    const auto& segs = a_.backings_;
    for (std::size_t i = 1; i < segs.size(); ++i) {
      ++holes;
      hole_bytes += segs[i]->addr - (segs[i - 1]->addr + segs[i - 1]->size);
    }
    st.extra.emplace_back("expandable", 1);
    st.extra.emplace_back("mapped_bytes", mapped_);
    st.extra.emplace_back("va_bytes", va_bytes_);
    st.extra.emplace_back("map_calls", map_calls_);
    st.extra.emplace_back("unmap_calls", unmap_calls_);
    st.extra.emplace_back("mapped_pieces", pieces_.size());
    st.extra.emplace_back("unmap_failures", unmap_failures_);
    st.extra.emplace_back("holes", holes);
    st.extra.emplace_back("hole_bytes", hole_bytes);
    st.extra.emplace_back("hole_unmaps", hole_unmaps_);
    st.extra.emplace_back("hole_refills", hole_refills_);
  }

 private:
  struct Piece {
    std::size_t size;
  };

  static void unindex(ArenaPool& a, ArenaChunk* c) {
    if (c->where != ArenaChunk::kNowhere) a.index_.remove(c);
  }

  // Take [at, at + n) (just mapped, at the start of the hole between prev and next) into the
  // books: it extends prev (merging with a free last chunk) or starts a segment, and joins next
  // when it fills the hole. Returns the free chunk holding the new memory, out of the index
  // (nullptr when n == 0).
  ArenaChunk* absorb(std::uintptr_t at, std::size_t n, ArenaBacking* prev, ArenaBacking* next) {
    if (!n) return nullptr;
    const bool middle = next != nullptr;
    if (middle) ++hole_refills_;
    ArenaBacking* seg;
    ArenaChunk* run;
    if (prev) {
      seg = prev;
      ArenaChunk* tail = seg->last;
      seg->size += n;
      a_.reserved_ += n;
      a_.peak_reserved_ = std::max(a_.peak_reserved_, a_.reserved_);
      if (tail->st() == ChunkState::Free) {  // the free tail grows in place: one chunk, not two
        unindex(a_, tail);
        tail->size += n;
        run = tail;
      } else {
        run = a_.chunk_nodes_.create();
        run->addr = at;
        run->size = n;
        run->backing = seg;
        run->prev_addr = tail;
        tail->next_addr = run;
        seg->last = run;
      }
    } else {
      seg = a_.adopt_locked(at, n, false, at == va_base_);
      run = seg->first;
    }
    if (next && at + n == next->addr) {  // the hole is filled: next joins this segment
      ArenaChunk* h = next->first;
      if (h->st() == ChunkState::Free) {
        unindex(a_, h);
        run->size += h->size;
        run->next_addr = h->next_addr;
        if (h->next_addr) h->next_addr->prev_addr = run;
        seg->last = next->last == h ? run : next->last;
        a_.chunk_nodes_.destroy(h);
      } else {
        seg->last->next_addr = h;
        h->prev_addr = seg->last;
        seg->last = next->last;
      }
      for (ArenaChunk* c = run->next_addr; c; c = c->next_addr) c->backing = seg;
      seg->size += next->size;
      if (next->dirty) {
        --a_.dirty_backings_;
        if (!seg->dirty) seg->dirty = true, ++a_.dirty_backings_;
      }
      auto& segs = a_.backings_;
      segs.erase(std::find(segs.begin(), segs.end(), next));
      delete next;
    }
    return run;
  }

  // Unmap wholly free pieces (every chunk over them Free: never live, pending or thread-cached
  // bytes), except the resident first one: all of them, or all of them once shrink_hysteresis
  // consecutive scans found some. With reclaim_holes off, only pieces of the free tail.
  // Under the pool lock; a refused unmap stops the walk with that piece mapped and counted.
  std::size_t unmap_free(bool hysteresis, bool any, bool keep_tail = false, std::size_t min_bytes = 0) {
    std::vector<std::uintptr_t> victims;
    const bool holes = a_.opt_.reclaim_holes || any;
    const auto& segs = a_.backings_;
    // Where the free run ending the range starts (pieces from there on are its free tail).
    std::uintptr_t tail_start = ~std::uintptr_t{0};
    if (!segs.empty()) {
      const ArenaChunk* t = segs.back()->last;
      while (t && t->st() == ChunkState::Free) tail_start = t->addr, t = t->prev_addr;
    }
    for (std::size_t si = 0; si < segs.size(); ++si) {
      const ArenaBacking* b = segs[si];
      const ArenaChunk* c = b->first;
      const std::uintptr_t end = b->addr + b->size;
      for (auto it = pieces_.find(b->addr); it != pieces_.end() && it->first < end; ++it) {
        const std::uintptr_t ps = it->first, pe = ps + it->second.size;
        while (c->addr + c->size <= ps) c = c->next_addr;
        bool free = true;
        for (const ArenaChunk* d = c; d && d->addr < pe; d = d->next_addr)
          if (d->st() != ChunkState::Free) {
            free = false;
            break;
          }
        const bool in_tail = si + 1 == segs.size() && ps >= tail_start;
        if ((!holes && !in_tail) || (keep_tail && in_tail)) free = false;
        if (free && ps != va_base_) victims.push_back(ps);
      }
    }
    // Hysteresis as for separate backings: shrink_hysteresis consecutive scans that found
    // something to give back, then all of it goes.
    if (hysteresis) {
      if (victims.empty() || ++scans_ < a_.opt_.shrink_hysteresis) {
        if (victims.empty()) scans_ = 0;
        return 0;
      }
      scans_ = 0;
    }
    if (min_bytes) {
      std::size_t total = 0;
      for (std::uintptr_t v : victims) total += pieces_.at(v).size;
      if (total < min_bytes) return 0;
    }
    std::size_t released = 0;
    // Last first: a tail given back piece by piece leaves the books as the old tail-only path did.
    for (auto v = victims.rbegin(); v != victims.rend(); ++v) {
      const std::size_t n = pieces_.at(*v).size;
      try {
        a_.upstream_->unmap(*v, n);
      } catch (...) {
        ++unmap_failures_;
        ++a_.upstream_free_failures_;
        break;
      }
      ++unmap_calls_;
      a_.up_frees_.fetch_add(1, std::memory_order_relaxed);
      cut(*v, n);
      released += n;
    }
    return released;
  }

  // [ps, ps + n): one piece, just unmapped, every chunk over it Free. Its chunks go (edge chunks
  // are split at the piece's bounds); the segment keeps what lies before it and a new segment
  // takes what lies after it.
  void cut(std::uintptr_t ps, std::size_t n) {
    const std::uintptr_t pe = ps + n;
    auto& segs = a_.backings_;
    auto sit = std::upper_bound(segs.begin(), segs.end(), ps, [](std::uintptr_t x, const ArenaBacking* b) { return x < b->addr; }) - 1;
    ArenaBacking* seg = *sit;
    const std::uintptr_t seg_end = seg->addr + seg->size;
    ArenaChunk* c = seg->first;
    while (c->addr + c->size <= ps) c = c->next_addr;
    if (c->addr < ps) {
      unindex(a_, c);
      ArenaChunk* r = a_.split_locked(c, ps - c->addr);
      a_.index_.insert(c);
      c = r;
    }
    ArenaChunk* before = c->prev_addr;
    ArenaChunk* d = c;
    while (d && d->addr < pe) {
      unindex(a_, d);
      if (d->addr + d->size > pe) a_.index_.insert(a_.split_locked(d, pe - d->addr));
      ArenaChunk* nx = d->next_addr;
      a_.chunk_nodes_.destroy(d);
      d = nx;
    }
    ArenaChunk* after = d;
    ArenaChunk* old_last = seg->last;
    if (seg != segs.back() || pe != seg_end) ++hole_unmaps_;  // not the range's free tail: a hole
    pieces_.erase(ps);
    mapped_ -= n;
    a_.reserved_ -= n;
    if (before) {
      before->next_addr = nullptr;
      seg->last = before;
      seg->size = ps - seg->addr;
      if (after) {
        auto* r = new ArenaBacking();
        r->addr = pe;
        r->size = seg_end - pe;
        r->first = after;
        r->last = old_last;
        after->prev_addr = nullptr;
        for (ArenaChunk* x = after; x; x = x->next_addr) x->backing = r;
        if (seg->dirty) r->dirty = true, ++a_.dirty_backings_;
        segs.insert(sit + 1, r);
      }
    } else if (after) {  // the piece began the segment: the segment now starts after it
      after->prev_addr = nullptr;
      seg->first = after;
      seg->addr = pe;
      seg->size = seg_end - pe;
    } else {  // the piece was the whole segment
      if (seg->dirty) --a_.dirty_backings_;
      segs.erase(sit);
      delete seg;
    }
  }

  // close/destructor: every chunk gone, every piece unmapped, the range unreserved (failures
  // counted, never thrown; a piece that cannot be unmapped keeps the range reserved).
  void release_all() {
    auto& segs = a_.backings_;
    for (ArenaBacking* b : segs) {
      for (ArenaChunk* c = b->first; c;) {
        ArenaChunk* n = c->next_addr;
        unindex(a_, c);
        a_.chunk_nodes_.destroy(c);
        c = n;
      }
      a_.reserved_ -= b->size;
      if (b->dirty) --a_.dirty_backings_;
      delete b;
    }
    if (!segs.empty()) ++a_.backings_released_;
    segs.clear();
    while (!pieces_.empty()) {
      auto last = std::prev(pieces_.end());
      try {
        a_.upstream_->unmap(last->first, last->second.size);
      } catch (...) {
        ++unmap_failures_;
        ++a_.upstream_free_failures_;
        return;  // the rest stays mapped (leaked and counted); the range cannot be unreserved
      }
      ++unmap_calls_;
      a_.up_frees_.fetch_add(1, std::memory_order_relaxed);
      mapped_ -= last->second.size;
      pieces_.erase(last);
    }
    if (va_base_) {
      try {
        a_.upstream_->unreserve(va_base_, va_bytes_);
        va_base_ = 0;
      } catch (...) {
        ++a_.upstream_free_failures_;
      }
    }
  }

  std::uintptr_t va_base_ = 0;
  std::size_t va_bytes_ = 0, granule_ = 0, piece_ = 0, mapped_ = 0;
  std::size_t scans_ = 0;  // consecutive shrink scans that found free pieces
  std::map<std::uintptr_t, Piece> pieces_;  // every mapped piece, by address
  std::uint64_t map_calls_ = 0, unmap_calls_ = 0, unmap_failures_ = 0, hole_unmaps_ = 0, hole_refills_ = 0;
};

std::unique_ptr<BackingSource> make_virtual_range(ArenaPool& arena) { return std::make_unique<VirtualRange>(arena); }

}  // namespace poolkeeper::detail
