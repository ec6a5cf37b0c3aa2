// VirtualRange: the expandable arena's backing source, one reserved virtual range with physical
// pieces mapped into it (backing_source.hpp, docs/expandable.md). A header private to the two files
// that implement it: backing_source_virtual.cpp (the main range: growth, unmapping, the books and
// their invariants, close) and backing_source_virtual_stitch.cpp (stitched ranges).
// Thread safety: every member runs under the growing shard's lock (the arena's), as the
// BackingSource contract says; validate() and close need quiescence.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "poolkeeper/pools/arena_pool.hpp"

namespace poolkeeper::detail {

class VirtualRange final : public BackingSource {
 public:
  explicit VirtualRange(ArenaPool& arena);

  // Map memory into the lowest hole where it joins free neighbours into a run that fits (the
  // space after the last segment is the last hole). The step is what the request lacks beyond
  // the free chunk ending at the hole, or a fraction of what is mapped (fewer map calls as the
  // footprint grows), whichever is larger, clamped to max_step and to the hole. It is mapped in
  // pieces of at most map_piece bytes.
  // Maps under the lock (`g` stays held): the range's holes and pieces are its books.
  ArenaChunk* grow(std::size_t rounded, std::unique_lock<SpinMutex>&, Stream s) override;

  // A shrink scan (hysteresis) takes only the stale aliases that must go (those of the pieces it
  // unmaps: unmap_free()); trim takes every one it may.
  std::size_t release_free(Detached&, bool hysteresis) override;

  // The free memory that no request could use lies in pieces the failed growth did not extend:
  // unmapping them frees physical memory for the retry's map.
  // The free tail stays: the retry's growth extends it, and unmapping it would only make that map
  // larger.
  std::size_t release_for_oom(Detached&) override;

  ArenaChunk* readopt(void*, std::size_t) override {
    throw InvariantViolation("ArenaPool #" + std::to_string(a_.id_) + ": an expandable range never detaches backings");
  }

  void close(Detached&) override { release_all(); }

  // Live blocks remain: only wholly free pieces go (never memory under the user); the range stays
  // reserved unless nothing is left mapped.
  void release_unused(Detached&) override;

  // The last block of a stitched range freed: the range goes now (its pieces rejoin their
  // neighbours in the main range), not at the next growth.
  void released(std::uintptr_t backing_addr) override;

  bool wants_release(const ArenaChunk* c) const override;

  void validate(const std::function<void(const std::string&)>& fail) const override;

  void stats(PoolStats& st) const override;

 private:
  struct Piece {
    std::size_t size;
    std::uintptr_t lent_to = 0;  // the stitched range whose Active part holds it (0: in the main range)
    std::size_t idle_scans = 0;  // consecutive shrink scans that found it free and unused since the last
    std::size_t aliases = 0;     // its parts that are still mapped (Active or Stale), over every stitched range
    // While lent: the bytes [lent_lo, lent_hi) of it that its Active part uses (all of it, or,
    // with stitch_fragments, its free end or its free start); the rest stays in the main range.
    std::size_t lent_lo = 0, lent_hi = 0;
  };
  // A part of a stitched range: one piece's alias. Active: its bytes are in the books (a stitched
  // backing tiles them). Stale: the piece moved on to a later stitched range while this alias was
  // still mapped; its bytes are out of the books, and the alias stays until something needs it
  // gone and home's queued work can no longer reach it (Sweep). Gone: unaliased.
  enum class PartState : std::uint8_t { Active, Stale, Gone };
  // A part aliases its whole piece (maps are granule-sized), but the range's backing may use
  // only [lo, hi) of it: a fragment (lo > 0: the piece's free end, only the first part of a
  // backing; hi < n: its free start, only the last). The other bytes are reachable through this
  // alias too but lie in no chunk of it: they are the main range's.
  struct Part {
    std::uintptr_t src;
    std::size_t n;
    PartState st = PartState::Active;
    std::uint64_t stale_epoch = 0;  // the arena's scan epoch when it went Stale
    std::size_t lo = 0, hi = 0;     // the bytes the range's backing uses (0, n: all)
    bool partial() const { return lo != 0 || hi != n; }
  };
  struct Stitch {
    std::vector<Part> parts;  // laid end to end over the range's stretch of the stitch area
    std::size_t size = 0;     // the stretch: every part's bytes, whatever its state
  };

  // `part` (Active) goes Stale: its alias stays mapped, its bytes leave the books.
  void go_stale(Part& part) {
    part.st = PartState::Stale;
    part.stale_epoch = a_.scan_epoch_;
    ++stale_;
  }
  std::size_t stitch_area_used() const {
    std::size_t n = 0;
    for (const auto& [dst, st] : stitches_) n += st.size;
    return n;
  }

  static void unindex(ArenaPool& a, ArenaChunk* c) {
    if (c->where != ArenaChunk::kNowhere) a.index_.remove(c);
  }

  bool in_main(std::uintptr_t at) const { return at >= va_base_ && at < va_base_ + va_bytes_; }

  // The backings that are segments of the main range, by address (the rest are stitched ranges).
  std::vector<ArenaBacking*> main_segments() const;

  // [at, at + n) backed by fresh physical memory in pieces of at most `piece` bytes, one upstream
  // call for the run (its pieces are granted access at once: upstream.hpp, "Runs"), pieces of
  // the books (not yet of a segment: absorb() takes them in). `done` gets the bytes mapped; a
  // refusal rethrows with the pieces mapped before it in the books.
  void map_pieces(std::uintptr_t at, std::size_t n, std::size_t piece, std::size_t& done);

  // Map [at, at + n) (the start of the gap between prev and next) in pieces of at most `piece`
  // bytes and file it free, merged with its free neighbours. A refusal files what was mapped
  // before it and rethrows.
  void map_free(std::uintptr_t at, std::size_t n, std::size_t piece, ArenaBacking* prev, ArenaBacking* next);

  // Take [at, at + n) (just mapped, or a lent piece coming back, at the start of the gap between
  // prev and next) into the books: it extends prev (merging with a free last chunk) or starts a
  // segment, and joins next when it fills the gap. Returns the free chunk holding the new
  // memory, out of the index (nullptr when n == 0).
  ArenaChunk* absorb(std::uintptr_t at, std::size_t n, ArenaBacking* prev, ArenaBacking* next, bool refill = true);

  // Every chunk over [ps, pe) is Free (never a live, pending or thread-cached byte)? `used` gets
  // the latest epoch in which one of them was handed out (ArenaChunk::used_epoch).
  static bool chunks_free(const ArenaChunk* c, std::uintptr_t ps, std::uintptr_t pe, std::uint64_t& used) {
    while (c->addr + c->size <= ps) c = c->next_addr;
    used = 0;
    for (const ArenaChunk* d = c; d && d->addr < pe; d = d->next_addr) {
      if (d->st() != ChunkState::Free) return false;
      used = std::max(used, d->used_epoch);
    }
    return true;
  }

  // Unmap wholly free pieces (every chunk over them Free: never live, pending or thread-cached
  // bytes), except the resident first one: all of them, or (hysteresis: a shrink scan) those that
  // sat free and unused for shrink_hysteresis consecutive scan intervals. "Unused" matters: a
  // piece a steady loop reuses between scans is free at every scan that lands between its rounds,
  // and giving it back each time cost a map and an unmap per scan (measured: ~2,600 of each in
  // 0.4 s under 16 threads of 32 MiB blocks on the H200, benchmarks/results/thread_scaling_h200.txt).
  // With reclaim_holes off, only pieces of the free tail. A piece with Stale aliases counts as free
  // (they hold none of its bytes; its idle scans count on) and goes once they can go (stale_swept:
  // the caller's sweep already asked for all of them, so a refused one is not asked again in this
  // pass). Under the pool lock; a refused unmap stops the walk with that piece mapped and counted.
  std::size_t unmap_free(bool hysteresis, bool any, bool keep_tail = false, std::size_t min_bytes = 0, bool stale_swept = false);

  // [ps, ps + n): one piece, just unmapped, every chunk over it Free: out of the books.
  void cut(std::uintptr_t ps, std::size_t n);

  // [ps, ps + n): one piece of a segment, every chunk over it Free. Its chunks go (edge chunks
  // are split at the piece's bounds; reserved drops by n); the segment keeps what lies before it
  // and a new segment takes what lies after it. Returns whether it was not the range's free tail.
  bool detach(std::uintptr_t ps, std::size_t n);

  // A backing whose chunks are all Free leaves the books (chunks out of the index; reserved drops).
  void drop_backing(ArenaBacking* b);

  // The backing whose bytes hold `at` (there is one: `at` lies in the books).
  ArenaBacking* containing(std::uintptr_t at) const {
    const auto& segs = a_.backings_;
    return *(std::upper_bound(segs.begin(), segs.end(), at, [](std::uintptr_t x, const ArenaBacking* b) { return x < b->addr; }) - 1);
  }

  ArenaBacking* backing_at(std::uintptr_t at) const {
    const auto& segs = a_.backings_;
    auto it = std::lower_bound(segs.begin(), segs.end(), at, [](const ArenaBacking* b, std::uintptr_t x) { return b->addr < x; });
    return it != segs.end() && (*it)->addr == at ? *it : nullptr;
  }

  // A lent piece's lent bytes come back to the main range: filed free, merged with free
  // neighbours (a fragment's with the rest of its piece, which stayed in a segment).
  void give_back(std::uintptr_t src);

  // What a pass of dissolve() over the stitched ranges takes down. Stale aliases: every one that
  // queued work can no longer reach (`all_stale`), or only those of the pieces in `stale_of`.
  // Wholly free stitched backings (home's releases settled) are torn down, unless `keep_free`
  // (the caller holds books that must not change). Tearing them down by sending them home instead
  // (parts Stale, no call) held random_lifetime higher (seeds 1-8 at 4,000 steps: worst 1.094x ->
  // 1.102x peak / live): a stitched range that keeps its Stale parts keeps its stretch of the
  // stitch area, and the next ranges are placed with less room to grow in place.
  struct Sweep {
    bool all_stale = false;
    const std::set<std::uintptr_t>* stale_of = nullptr;
    bool keep_free = false;
  };

  // A pass that comes by anyway (a growth, a shrink scan, a stitched range freed) takes down every
  // Stale alias it may only once more than stale_alias_cap are left. Unmapping one is a driver
  // call that rewrites the device's page tables (~14 us a piece on the H200:
  // benchmarks/results/vmm_latency_h200.txt) and gains no memory; keeping one costs a mapping in
  // the driver's books and addresses in the stitch area. The default cap bounds the driver's extra
  // mappings while staying above what a serving loop leaves behind as it settles into its layout
  // (the BERT serving log of the H200 run: 978 at most; docs/expandable.md, "Stale aliases stay").
  // Past half the stitch area spoken for, they go as well: a stitch that finds no room for its
  // range can take them down only where queued work can no longer reach them, which in
  // single-stream mode is a shrink scan's pass, not the growth that needs the room.
  Sweep passing_sweep() const {
    const bool tight = stale_ && stitch_area_used() * 2 > sva_bytes_;
    return {stale_ > a_.opt_.stale_alias_cap || tight, nullptr, false};
  }

  // dissolve() over every stitched range (never while a capture scope is open). Returns whether
  // any piece came back to the main range.
  bool dissolve_free_stitches(const Sweep& how);

  // Every wholly free stitched backing goes home at once, without waiting for queued work: its
  // parts go Stale (their aliases stay mapped until dissolve() may unmap them, so work queued on
  // them still reaches the same memory) and its pieces rejoin the main range, merged with their
  // free neighbours, where a growth at their edge maps only what they lack. For a request that no
  // stitch can serve (more than stitch_max_parts pieces): else the free pieces sit in stitched
  // ranges while it maps the whole request beside them (the Llama-style trace with top-ups: 326
  // MiB of free stitched ranges beside a 989 MiB growth). Returns whether any piece came back.
  // With only_fragments, only the backings that hold a fragment go.
  bool send_home(bool only_fragments = false);

  // Each part's offset in its range's stretch (the parts lie end to end).
  static std::vector<std::size_t> part_offsets(const Stitch& st) {
    std::vector<std::size_t> offs(st.parts.size());
    for (std::size_t j = 0, off = 0; j < st.parts.size(); off += st.parts[j++].n) offs[j] = off;
    return offs;
  }

  // The parts [j0, j1) under b, a stitched backing of the range at dst (`offs`: part_offsets();
  // b may begin inside its first part and end inside its last, fragments).
  static std::pair<std::size_t, std::size_t> parts_over(const std::vector<std::size_t>& offs, const Stitch& st, std::uintptr_t dst,
                                                        const ArenaBacking* b) {
    std::size_t j0 = 0;
    while (dst + offs[j0] + st.parts[j0].n <= b->addr) ++j0;
    std::size_t j1 = j0;
    while (j1 < offs.size() && dst + offs[j1] < b->addr + b->size) ++j1;
    return {j0, j1};
  }

  // The stitched backings over the stretch [dst, dst + size), by address.
  std::vector<ArenaBacking*> stitch_backings(std::uintptr_t dst, std::size_t size) const;

  // The stitched range whose stretch holds `at`, or end().
  std::map<std::uintptr_t, Stitch>::iterator stitch_of(std::uintptr_t at);

  // The stitched range at `it`: the Stale aliases `how` names unmapped, and each of its backings
  // that is wholly free torn down unless `how` keeps them (aliases unmapped last first, pieces back
  // in the main range); once every part is gone the range's stretch is free again. A
  // refused unalias is counted and keeps that alias (an Active run keeps its first parts as a
  // shorter backing, still free). Advances `it`. Returns whether any piece came back.
  // Single-stream mode: free memory may still be in use by the home stream's queued work until the
  // arena has waited for it (the paths that must release wait first; the others skip). A shrink
  // scan whose settle point has passed (fence_passed_) may still unmap the aliases that went Stale
  // before the previous scan: their last use was queued before that scan's event. So stale aliases
  // do not pile up on a server whose home stream never idles.
  bool dissolve(std::map<std::uintptr_t, Stitch>::iterator& it, const Sweep& how);

  // The stitch area, reserved on first use. False when the upstream refused it (not asked again:
  // every growth would pay a refused call).
  bool stitch_area();

  // The free stitch-area bytes right after the stitched range at `it`.
  std::size_t room_after(std::map<std::uintptr_t, Stitch>::const_iterator it) const;

  // Where a new stitched range of n bytes goes: the lowest free stretch of the stitch area that
  // leaves the range before it room to grow in place by its own size and the new one room to grow
  // by n (extend_stitch()), else the lowest stretch that holds n; 0 when none does. Addresses cost
  // nothing: the area is as large as the main range.
  std::uintptr_t stitch_slot(std::size_t n);

  struct Cand {
    std::uintptr_t at;    // where the bytes it gives are in the books now
    std::uintptr_t src;   // the piece (its main-range address)
    std::size_t n;        // the piece's size (what its alias maps)
    std::uintptr_t from;  // the stitched range holding it, 0: the main range
    std::size_t part;
    std::size_t lo, hi;   // the bytes of the piece it gives (0, n: all of it; else a fragment)
    std::size_t bytes() const { return hi - lo; }
  };

  // Each piece of the main range a stitch may take from, by address, with the first chunk over it
  // (f(address, size, chunk)): never the resident first piece, one lent (in part: the rest of it
  // holds memory in use, or did when it was lent), or one in [keep_lo, keep_hi).
  template <class F>
  void each_main_piece(std::uintptr_t keep_lo, std::uintptr_t keep_hi, F&& f) const {
    for (const ArenaBacking* b : main_segments()) {
      const std::uintptr_t end = b->addr + b->size;
      const ArenaChunk* c = b->first;
      for (auto it = std::prev(pieces_.upper_bound(b->addr)); it != pieces_.end() && it->first < end; ++it) {
        const std::uintptr_t ps = it->first, pe = ps + it->second.size;
        if (ps == va_base_ || it->second.lent_to || (pe > keep_lo && ps < keep_hi)) continue;
        while (c->addr + c->size <= ps) c = c->next_addr;
        f(ps, it->second.size, c);
      }
    }
  }

  // Every wholly free piece that a stitch may take, by address: in the main range (never the
  // resident first piece, never one in [keep_lo, keep_hi)), and the Active parts of stitched
  // ranges, except those of the range at `skip` that end after `skip_from` (the chunk a growth in
  // place extends). `total` gets their bytes.
  std::vector<Cand> stitch_candidates(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::uintptr_t skip, std::uintptr_t skip_from,
                                      std::size_t& total) const;

  // Candidates adding up to `need` bytes, by address, or none (short, or more than `max_parts`).
  // Runs of address-adjacent free pieces, smallest first: fragments no contiguous request can use
  // go into the stitch, long free runs stay whole for the requests that fit them. Pieces already
  // lent go first: moving them on leaves the main range as it is, where taking main-range pieces
  // cuts holes into it (measured: the Llama-style trace 1.309x -> 1.126x peak / live, the other
  // committed traces the same; docs/expandable.md).
  static std::vector<Cand> choose(const std::vector<Cand>& cand, std::size_t need, std::size_t max_parts);

  // Alias the chosen pieces end to end from `dst` in one upstream call (one access grant for the
  // run; stopping at the first refusal, counted) and move the bytes they give there in the books:
  // out of their segment or stitched backing (an earlier stitched range's part goes Stale), lent
  // to the range at `owner`, appended to its parts. A fragment gives only its free end (the first
  // chosen) or its free start (the last); the rest of its piece stays in its segment. Returns the
  // bytes given, which lie end to end from `dst` plus the first part's `lo`; the caller adds them
  // to a backing (reserved dropped by them here).
  std::size_t alias_in(std::uintptr_t dst, std::vector<Cand>& chosen, std::uintptr_t owner, Stitch& into);

  // A stitched range whose stretch ends in a free chunk (its last part Active) and that has free
  // stitch-area room after it takes the request by growing in place: only what that chunk lacks
  // is aliased after it. Serving a request a little larger than the last from the same range
  // then costs a few alias calls, not one per piece of the whole request (measured on the BERT
  // serving log: most of a stitch's pieces were an earlier free stitched range's, moved on).
  // Returns the grown free chunk, out of the index, or nullptr (nothing fit; or a refused alias,
  // then what was aliased stays, filed free).
  ArenaChunk* extend_stitch(std::size_t rounded, std::uintptr_t keep_lo, std::uintptr_t keep_hi);

  // With stitch_fragments: the fragments a stitch may take beside whole pieces. A head is the free
  // end of a piece (its bytes after the last one in use; it may begin a stitched backing), a tail
  // the free start of one (up to its first byte in use; it may end one). Only Free bytes (never
  // pending or cached) of pieces of the main range that are not wholly free (those are whole
  // candidates), not lent, not the resident first, outside [keep_lo, keep_hi). The kFragments
  // largest of each kind, largest first.
  static constexpr std::size_t kFragments = 8;
  // A top-up with fragments may map into the growth's own hole when it maps at most this fraction
  // of what the growth would. Chosen on the committed traces (docs/expandable.md, "Fragments"):
  // 3 to 6 held the Llama-style log lowest with random_lifetime's seeds within 1.10x at 5 and 6.
  static constexpr std::size_t kOwnHoleSaving = 6;
  struct Fragments {
    Cand head{}, tail{};
    std::size_t bytes() const { return head.bytes() + tail.bytes(); }
    std::size_t parts() const { return (head.bytes() != 0) + (tail.bytes() != 0); }
  };
  void fragments(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::vector<Cand>& heads, std::vector<Cand>& tails) const;

  // Whole pieces from `cand` (choose()) and the fragments `fr` around them (the head first, the
  // tail last) that together give `need` bytes, within stitch_max_parts; none when they cannot.
  // Each fragment gives only what the whole pieces lack, the head first, and the rest of each
  // stays in the main range, free for the requests that fit there.
  std::vector<Cand> choose_around(const std::vector<Cand>& cand, Fragments fr, std::size_t need) const;

  // The head and tail (either may be missing) for whole pieces that fall `short_by` bytes short:
  // the fewest fresh granules still to map (0: the pair makes up the shortfall), then the fewest
  // bytes, so larger fragments stay for later requests. None when no pair spares a granule.
  // `fresh` gets the granules' bytes still to map.
  Fragments pick_fragments(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::size_t short_by, std::size_t& fresh,
                           bool with_head = true) const;

  // Serve `rounded` bytes from wholly free pieces (never the resident first one) mapped a second
  // time, end to end, into the stitch area: by growing a stitched range in place
  // (extend_stitch()), else as a fresh stitched range. A piece may come from the main range or
  // from an earlier stitched range whose part over it is wholly free: that part's alias stays
  // mapped (Stale, Sweep), so moving it on costs one alias and no wait. With stitch_fragments,
  // when the whole pieces fall short, the fresh range may begin with one piece's free end and end
  // with another's free start (fragments()), the fewest of them that make up the shortfall. At most stitch_max_parts pieces (each is an
  // upstream call); never a piece of the main range in [keep_lo, keep_hi). Returns the stitched
  // chunk, out of the index, or nullptr (then the caller maps more). Pieces aliased before a
  // refusal stay stitched, filed free.
  ArenaChunk* stitch(std::size_t rounded, std::uintptr_t keep_lo, std::uintptr_t keep_hi);

  // close: the mappings lying end to end from `base` (sizes) taken down by `down` (unmap_pieces or
  // unalias_pieces) as one run; if the run is refused, those it left go one by one, last first, as
  // before runs, so a refusal costs one mapping, never the rest. fate(i, ok) is told each one's.
  template <class Fate>
  void close_run(std::uintptr_t base, const std::vector<std::size_t>& sizes,
                 void (Upstream::*down)(std::uintptr_t, const std::size_t*, std::size_t, std::size_t&), Fate&& fate) {
    std::size_t done = 0;
    try {
      (a_.upstream_.get()->*down)(base, sizes.data(), sizes.size(), done);
    } catch (...) {
    }
    std::size_t left = sizes.size() - done;
    for (std::size_t i = left; i < sizes.size(); ++i) fate(i, true);
    std::uintptr_t end = base;
    for (std::size_t i = 0; i < left; ++i) end += sizes[i];
    while (left--) {
      end -= sizes[left];
      std::size_t one = 0;
      bool ok = true;
      try {
        (a_.upstream_.get()->*down)(end, &sizes[left], 1, one);
      } catch (...) {
        ok = false;
      }
      fate(left, ok);
    }
  }

  // close/destructor: every chunk gone, every alias and piece unmapped, the ranges unreserved.
  // Failures are counted, never thrown, and never stop the walk: each refused unalias or unmap
  // leaks that one alias or piece (out of the books, like a refused backing of the default arena:
  // a closed pool's books are empty, so validate() holds), the rest still go back, and a range
  // that keeps a mapping stays reserved, leaked with it. Adjacent mappings go as runs (a pool of
  // many pieces closes in a few driver calls where the device takes runs).
  void release_all();

  std::uintptr_t va_base_ = 0, sva_base_ = 0;
  std::size_t va_bytes_ = 0, sva_bytes_ = 0, granule_ = 0, piece_ = 0, mapped_ = 0;
  bool stitch_ = false, stitch_area_refused_ = false;
  std::size_t stale_ = 0;  // Stale parts over every stitched range (validate() recounts them)
  std::map<std::uintptr_t, Piece> pieces_;      // every mapped piece, by address
  std::map<std::uintptr_t, Stitch> stitches_;  // stitched ranges, by address in the stitch area
  std::uint64_t map_calls_ = 0, unmap_calls_ = 0, unmap_failures_ = 0, hole_unmaps_ = 0, hole_refills_ = 0;
  std::uint64_t moved_parts_ = 0, stitch_extends_ = 0, top_ups_ = 0, homecomings_ = 0, fragments_lent_ = 0;
  std::uint64_t stitches_made_ = 0, teardowns_ = 0, alias_calls_ = 0, unalias_calls_ = 0, alias_failures_ = 0;
  // unmap_pieces / unalias_pieces calls (runs of adjacent pieces; one cuMemUnmap each where the
  // device takes runs), refused ones included; close's teardown (runs too) is not counted.
  std::uint64_t unmap_runs_ = 0, unalias_runs_ = 0;
};

}  // namespace poolkeeper::detail
