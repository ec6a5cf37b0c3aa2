// VirtualRange: one reserved virtual range with physical pieces mapped into it (backing_source.hpp,
// docs/expandable.md).
//
// Books: `pieces_` lists every mapped piece (one earlier map each, by address); every backing of
// the arena is a *segment*: a maximal run of consecutive mapped pieces, tiled by chunks. The gaps
// between segments are the holes: unmapped, with no chunk over them, so nothing there can be
// handed out. validate() proves that the segments cover exactly the pieces (reserved == mapped,
// no byte reachable twice).
//
// Stitching (option `stitch`, upstreams with aliases): when no free chunk and no hole can serve a
// request without mapping more, wholly free pieces are mapped a second time (upstream alias), one
// after another, into a stretch of a second reserved range (the stitch area): a *stitched range*,
// whose parts are those aliases. Its pieces are *lent*: their chunks leave the main range (they
// lie between segments, like holes, but stay mapped). Each run of a range's Active parts is a
// backing of its own, so each physical byte is tiled by exactly one chunk: in its segment, or in
// the one stitched backing whose Active part holds it. reserved counts each piece once.
// - A wholly free Active part may move on to a later stitch at once: it is aliased again there
//   and its old alias goes Stale (mapped, out of the books). In single-stream mode (install()'s
//   default) the home stream hardly ever settles, and pieces that stayed locked in free stitched
//   ranges made large requests map more.
// - Stale aliases stay mapped until one must go (Sweep, unmap_free()): an alias holds no memory, only
//   addresses of the stitch area and a mapping of the driver's, while unmapping one is a driver
//   call that rewrites the device's page tables. One goes once queued work can no longer reach it
//   (a settled home stream, or a shrink scan past its settle point) and its piece is about to be
//   unmapped, the pool is trimmed or recovers from OOM, more than half the stitch area is spoken
//   for, or more than stale_alias_cap are left.
// - A stitched range whose stretch ends in a free chunk grows in place when the area after it is
//   free: only what that chunk lacks is aliased (extend_stitch()).
// - Top-up (option `stitch_top_up`): when the wholly free pieces fall short of a request by less
//   than a growth would map, only what they lack is mapped (fresh pieces, lent at once) and
//   stitched with them.
// - Fragments (option `stitch_fragments`): when whole free pieces fall short, a stitched range
//   may begin with the free end of a piece whose start is still in use and end with the free
//   start of another. Such a piece is lent in part: its alias maps all of it, the stitched backing
//   tiles only the lent bytes, its segment keeps the rest (a segment may end or begin inside a
//   piece), and it cannot move on or be unmapped until its bytes come home.
// - Before a growth that no stitch served, every wholly free stitched backing goes home without
//   waiting: its parts go Stale, its pieces rejoin the main range (send_home()).
// - A wholly free stitched backing is torn down (aliases unmapped, pieces back in the main range,
//   merged with their neighbours) at the next growth, trim, shrink scan, OOM recovery or close,
//   whenever home's releases are settled; a range slides forward past its leading unmapped parts
//   and goes once none is left.
#include <algorithm>
#include <initializer_list>
#include <map>
#include <set>

#include "poolkeeper/pools/arena_pool.hpp"

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
    stitch_ = opt.stitch && up.supports_alias();
    va_base_ = up.reserve(va_bytes_);  // throws the upstream's typed error; nothing to undo
  }

  // Map memory into the lowest hole where it joins free neighbours into a run that fits (the
  // space after the last segment is the last hole). The step is what the request lacks beyond
  // the free chunk ending at the hole, or a fraction of what is mapped (fewer map calls as the
  // footprint grows), whichever is larger, clamped to max_step and to the hole. It is mapped in
  // pieces of at most map_piece bytes.
  // Maps under the lock (`g` stays held): the range's holes and pieces are its books.
  ArenaChunk* grow(std::size_t rounded, std::unique_lock<SpinMutex>&, Stream s) override {
    const ArenaOptions& opt = a_.opt_;
    const bool quiet = a_.upstream_->captures_underway() == 0;
    // Stitching serves the request from memory already mapped. Never while a capture scope is
    // open (a teardown unmaps; a graph may keep addresses it saw).
    const bool stitching = stitch_ && quiet;
    // A free stitched backing with a fragment goes home at once: neither its fragment nor the rest
    // of that piece could serve anything else meanwhile (the Llama-style log held 18 MiB more at
    // its peak while they waited for a teardown).
    const Sweep sweep = stitching ? passing_sweep() : Sweep{};
    if (stitching && (dissolve_free_stitches(sweep) | send_home(true)))
      if (ArenaChunk* c = a_.index_.take_best_fit(rounded)) return c;
    std::vector<ArenaBacking*> segs = main_segments();
    const std::uintptr_t va_end = va_base_ + va_bytes_;
    std::uintptr_t gs = 0, ge = 0;
    ArenaBacking *prev = nullptr, *next = nullptr;
    std::size_t lead = 0, trail = 0;
    bool found = false;
    // The room at a segment's edge that a growth there joins: its chunks free, or pending on the
    // request's stream alone (that stream may use its own releases at once; the arena merges
    // such a run with the growth, take_stream_run_locked). On a lagging device most of a
    // single-stream framework's freed memory is pending, and counting only a free tail mapped
    // the whole request again beside a pending one (docs/stream_order.md).
    auto edge = [&](const ArenaChunk* c, bool backward) {
      std::size_t n = 0;
      for (; c && a_.stream_room_locked(c, s); c = backward ? c->prev_addr : c->next_addr) n += c->size;
      return n;
    };
    // The lowest unmapped stretch that, with the free room at its edges (`edges`), holds `want`.
    auto find_hole = [&](std::size_t want, bool edges) {
      segs = main_segments();
      found = false;
      for (std::size_t i = 0; i <= segs.size() && !found; ++i) {
        const std::uintptr_t from = i ? segs[i - 1]->addr + segs[i - 1]->size : va_base_;
        const std::uintptr_t to = i < segs.size() ? segs[i]->addr : va_end;
        // Between two segments lie unmapped holes and lent pieces (mapped, used through a
        // stitched range): only the unmapped stretches can take memory. A segment may end where
        // the lent free end of its last piece begins, and the next begin where the lent free
        // start of its first ends.
        auto lent = pieces_.lower_bound(from);
        std::uintptr_t hs = from;
        if (lent != pieces_.begin() && std::prev(lent)->first + std::prev(lent)->second.size > from)
          hs = std::prev(lent)->first + std::prev(lent)->second.size;
        for (; !found;) {
          const std::uintptr_t he = lent != pieces_.end() && lent->first < to ? lent->first : to;
          if (he > hs) {
            gs = hs;
            ge = he;
            prev = i && hs == from ? segs[i - 1] : nullptr;
            next = i < segs.size() && he == to ? segs[i] : nullptr;
            lead = prev && edges ? edge(prev->last, true) : 0;
            trail = next && edges ? edge(next->first, false) : 0;
            found = lead + (ge - gs) + trail >= want;
          }
          if (found || he == to) break;
          hs = he + lent->second.size;
          ++lent;
        }
      }
    };
    // What a growth into the hole found maps at least: what the request lacks beyond the free run
    // before the hole, at most the hole (the free run after it covers the rest).
    auto growth_need = [&] { return std::min(ge - gs, align_up(rounded > lead ? rounded - lead : granule_, granule_)); };
    find_hole(rounded, true);
    // The free chunks the growth would extend stay out of the stitch: growing into them maps only
    // what they lack, while stitching them away would leave that growth's memory unused. A request
    // under stitch_from grows (the free stitched ranges above were torn down all the same).
    if (stitching && rounded >= opt.stitch_from) {
      // Any alias that went through moved pieces, even when a later one was refused: the hole,
      // its neighbours and the segments may have changed (a review found a partly refused
      // growth in place left them stale, and the growth absorbed into a split segment).
      const std::uint64_t aliased = alias_calls_;
      const bool edge_in = opt.stitch_edge_from && rounded >= opt.stitch_edge_from;
      if (ArenaChunk* c = found && !edge_in ? stitch(rounded, gs - lead, ge + trail) : stitch(rounded, 0, 0)) return c;
      if (alias_calls_ != aliased) find_hole(rounded, true);
      // Top-up: the wholly free pieces fall short of the request, by fewer bytes than a growth
      // would map. Map just what they lack and stitch it with them: a growth instead maps the
      // request beside free pieces that then sit idle at the peak (the BERT serving trace: an 82
      // MiB request grew the range by 82 MiB beside 44 MiB of free pieces; docs/expandable.md,
      // "Top-ups and homecomings"). Below stitch_edge_from the free run at the growth's edge
      // stays out, as in the stitch above, and the fresh memory must refill a hole below the
      // growth's: one mapped into the growth's own hole would only extend that run in two steps,
      // and topping up small requests there cost more than it saved (random_lifetime 1.085x ->
      // 1.152x peak / live).
      if (found && opt.stitch_top_up) {
        const std::uintptr_t grow_at = gs;
        // (The hole's size bounds it: a top-up beside a hole that a free run after it completes
        // mapped twice what the growth does, found by hostile testing.)
        const std::size_t grows = growth_need();
        const std::uintptr_t keep_lo = edge_in ? 0 : gs - lead, keep_hi = edge_in ? 0 : ge + trail;
        std::size_t total = 0;
        std::size_t parts = stitch_candidates(keep_lo, keep_hi, 0, 0, total).size();
        std::size_t fresh = total < rounded ? align_up(rounded - total, granule_) : 0;
        // Fragments (stitch_fragments) count when they spare a granule of the fresh memory.
        const std::size_t whole_total = total;
        std::size_t spared_fresh = 0;
        const Fragments fr = fresh ? pick_fragments(keep_lo, keep_hi, rounded - total, spared_fresh) : Fragments{};
        const bool spared = fr.parts() != 0;
        if (spared) {
          fresh = spared_fresh;
          total += fr.bytes();
          parts += fr.parts();
        }
        // Within stitch_max_parts: the fresh memory in larger pieces where map_piece's would be
        // too many (and fewer calls: a 989 MiB request beside 326 MiB of free pieces, the
        // Llama-style trace, would need 332 more pieces of 2 MiB).
        const std::size_t room = parts < opt.stitch_max_parts ? opt.stitch_max_parts - parts : 0;
        if (total && fresh && fresh < grows && room && a_.budget_.grant(fresh, fresh, granule_)) {
          const std::size_t piece = piece_ ? std::max(piece_, align_up((fresh + room - 1) / room, granule_)) : fresh;
          find_hole(fresh, false);
          // Fresh memory that fragments make do with may go into the growth's own hole when no
          // whole free piece takes part (the top-up is then the growth, less what the fragments
          // give) or when it maps at most 1/kOwnHoleSaving of what the growth would. It extends
          // the run kept out of the stitch, so the stitch may then take that run too.
          const bool own = found && gs == grow_at;
          const bool own_ok = spared && (!whole_total || fresh * kOwnHoleSaving <= grows);
          if (found && (edge_in || !own || own_ok)) {
            map_free(gs, fresh, piece, prev, next);
            if (ArenaChunk* c = own ? stitch(rounded, 0, 0) : stitch(rounded, keep_lo, keep_hi)) {
              ++top_ups_;
              return c;
            }
          }
          find_hole(rounded, true);
        }
      }
      if (send_home()) {
        if (ArenaChunk* c = a_.index_.take_best_fit(rounded)) return c;
        find_hole(rounded, true);
      }
    }
    // The free tail stays: this growth extends it. Only when the pieces to go add up to a growth
    // step's worth (mapped * step_fraction, at least a granule): smaller releases would cost an
    // unmap now and a map later for little.
    if (opt.release_on_grow && opt.reclaim_holes && quiet &&
        unmap_free(false, false, true, std::max(granule_, static_cast<std::size_t>(double(mapped_) * opt.step_fraction)),
                   sweep.all_stale))
      find_hole(rounded, true);
    const std::size_t tail_gap = segs.empty() ? va_bytes_ : va_end - (segs.back()->addr + segs.back()->size);
    if (!found)
      throw UpstreamOutOfMemory("ArenaPool #" + std::to_string(a_.id_) + ": its reserved range of " + format_bytes(va_bytes_) +
                                    " is full (" + format_bytes(mapped_) + " mapped, " + format_bytes(tail_gap) +
                                    " left at its end, " + format_bytes(rounded) + " needed; raise va_bytes)",
                                a_.upstream_->name(), "POOLKEEPER_RANGE_FULL", 0);
    const std::size_t hole = ge - gs;
    const std::size_t need = growth_need();
    std::size_t step;
    if (!mapped_) {
      step = std::max(need, align_up(opt.initial_backing, granule_));
    } else {
      const std::size_t frac = align_up(static_cast<std::size_t>(double(mapped_) * opt.step_fraction), granule_);
      step = std::max(need, std::min(std::max(frac, granule_), std::max(align_up(opt.max_step, granule_), granule_)));
    }
    if (!(step = a_.budget_.grant(need, step, granule_))) throw LimitHit{need, granule_};
    step = std::min(step, hole);
    std::size_t target = step, done = 0;
    bool shrunk = false;
    while (done < target) {
      std::size_t got = 0;
      try {
        map_pieces(gs + done, target - done, piece_, got);
      } catch (const UpstreamOutOfMemory&) {
        done += got;
        // The step asked for more than needed: ask for just the request, once (when the refused
        // piece reaches past it).
        const std::size_t refused = piece_ ? std::min(piece_, target - done) : target - done;
        if (!shrunk && std::max(need, done) < done + refused) {
          shrunk = true;
          target = std::max(need, done);
          continue;
        }
        if (ArenaChunk* r = absorb(gs, done, prev, next)) a_.file_free_locked(r);
        throw;
      } catch (...) {
        if (ArenaChunk* r = absorb(gs, done + got, prev, next)) a_.file_free_locked(r);
        throw;
      }
      done += got;
    }
    if (!a_.ev_.backings_created) ++a_.ev_.backings_created;
    return absorb(gs, done, prev, next);
  }

  // A shrink scan (hysteresis) takes only the stale aliases that must go (those of the pieces it
  // unmaps: unmap_free()); trim takes every one it may.
  std::size_t release_free(Detached&, bool hysteresis) override {
    const Sweep sweep = hysteresis ? passing_sweep() : Sweep{true};
    dissolve_free_stitches(sweep);  // their pieces return to the range, where they can be unmapped
    return unmap_free(hysteresis, false, false, 0, sweep.all_stale);
  }

  // The free memory that no request could use lies in pieces the failed growth did not extend:
  // unmapping them frees physical memory for the retry's map.
  // The free tail stays: the retry's growth extends it, and unmapping it would only make that map
  // larger.
  std::size_t release_for_oom(Detached&) override {
    dissolve_free_stitches({true});
    return a_.opt_.reclaim_holes ? unmap_free(false, false, true, 0, true) : 0;
  }

  ArenaChunk* readopt(void*, std::size_t) override {
    throw InvariantViolation("ArenaPool #" + std::to_string(a_.id_) + ": an expandable range never detaches backings");
  }

  void close(Detached&) override { release_all(); }

  // Live blocks remain: only wholly free pieces go (never memory under the user); the range stays
  // reserved unless nothing is left mapped.
  void release_unused(Detached&) override {
    if (a_.upstream_->captures_underway() > 0) return;
    dissolve_free_stitches({true});
    unmap_free(false, true, false, 0, true);
    if (pieces_.empty()) release_all();
  }

  // The last block of a stitched range freed: the range goes now (its pieces rejoin their
  // neighbours in the main range), not at the next growth.
  void released(std::uintptr_t backing_addr) override {
    if (!stitch_ || in_main(backing_addr) || a_.upstream_->captures_underway() > 0) return;
    auto it = stitch_of(backing_addr);
    if (it != stitches_.end()) dissolve(it, passing_sweep());
  }

  bool wants_release(const ArenaChunk* c) const override {
    const ArenaBacking* b = c->backing;
    if (!stitch_ || in_main(b->addr)) return false;
    for (const ArenaChunk* d = b->first; d; d = d->next_addr)
      if (d != c && d->st() != ChunkState::Free) return false;
    return true;
  }

  void validate(const std::function<void(const std::string&)>& fail) const override {
    std::size_t mapped = 0, lent = 0;
    // What the main range holds of each piece: all of it, nothing (lent whole), or the bytes before
    // or after its lent ones. Laid side by side and merged where they touch, these are exactly the
    // segments: every segment is mapped, holds no lent byte, and ends where a hole or lent bytes
    // begin (segments never touch), and every mapped byte not lent lies in a segment.
    std::vector<std::pair<std::uintptr_t, std::size_t>> held;
    for (const auto& [at, p] : pieces_) {
      if (!p.size || p.size % granule_ || (at - va_base_) % granule_) fail("mapped piece at " + format_ptr(at) + " is not granule-aligned");
      if (at < va_base_ || at + p.size > va_base_ + va_bytes_) fail("mapped piece outside the reserved range");
      mapped += p.size;
      std::uintptr_t hs = at, he = at + p.size;
      if (p.lent_to) {
        ++lent;
        if (!stitches_.count(p.lent_to)) fail("piece at " + format_ptr(at) + " is lent to no stitched range");
        if (!(p.lent_lo < p.lent_hi && p.lent_hi <= p.size && (p.lent_lo == 0 || p.lent_hi == p.size)) || p.lent_lo % a_.opt_.alignment ||
            p.lent_hi % a_.opt_.alignment)
          fail("piece at " + format_ptr(at) + " lends bytes that are not one aligned end of it");
        if (at == va_base_ && p.lent_lo == 0) fail("the resident first piece's start is lent");
        if (p.lent_lo) he = at + p.lent_lo;
        else hs = at + p.lent_hi;
      }
      if (hs == he) continue;
      if (!held.empty() && held.back().first + held.back().second == hs) held.back().second += he - hs;
      else held.emplace_back(hs, he - hs);
    }
    if (mapped != mapped_) fail("mapped-byte count is off");
    if (mapped != a_.budget_.reserved) fail("mapped " + std::to_string(mapped) + " != reserved " + std::to_string(a_.budget_.reserved));
    std::vector<std::pair<std::uintptr_t, std::size_t>> segments;
    std::vector<std::pair<std::uintptr_t, std::size_t>> stitched;  // stitched backings (addr, size), by address
    for (const ArenaBacking* b : a_.backings_) {
      if (b->oversize) fail("an expandable range holds an oversize backing");
      if (!in_main(b->addr)) {
        // A stitched backing: exactly the used bytes of one run of Active parts (checked below).
        stitched.emplace_back(b->addr, b->size);
        if (b->resident) fail("a stitched range is resident");
        continue;
      }
      if (b->resident != (b->addr == va_base_)) fail("only the segment at the range's base is resident");
      segments.emplace_back(b->addr, b->size);
    }
    if (segments != held)
      fail("the segments are not exactly the mapped bytes the main range holds (a segment over unmapped or lent bytes, two "
           "segments touching, or a mapped byte in none)");
    if (!pieces_.empty() && pieces_.begin()->first != va_base_) fail("the resident first piece is not mapped");
    // Stitched ranges: each is its parts laid end to end over its stretch of the stitch area. A
    // piece is Active in at most one range, the one lent_to names, using the bytes the piece
    // lends, and a range's backings are exactly the used bytes of its maximal runs of Active parts
    // (a fragment only at a run's edge); with the segments above, every mapped byte is tiled by
    // exactly one chunk and reachable through one address while live. Stale parts are mapped
    // aliases out of the books: each piece's alias count is its Active and Stale parts.
    std::size_t active = 0, stale = 0;
    std::uintptr_t s_end = 0;
    std::map<std::uintptr_t, std::size_t> alias_count;
    std::vector<std::pair<std::uintptr_t, std::size_t>> runs;
    for (const auto& [dst, st] : stitches_) {
      if (dst < sva_base_ || dst + st.size > sva_base_ + sva_bytes_ || dst < s_end) fail("stitched range at " + format_ptr(dst) + " outside the stitch area or overlapping another");
      s_end = dst + st.size;
      std::size_t sum = 0;
      bool any = false, in_run = false;
      for (const Part& part : st.parts) {
        sum += part.n;
        in_run = in_run && part.st == PartState::Active;
        if (part.st == PartState::Gone) continue;  // its piece may be unmapped since, or mapped anew
        auto p = pieces_.find(part.src);
        if (p == pieces_.end() || p->second.size != part.n) fail("stitched range at " + format_ptr(dst) + " names a part that is no mapped piece");
        ++alias_count[part.src];
        stale += part.st == PartState::Stale;
        any = true;
        if (part.st == PartState::Active) {
          if (p->second.lent_to != dst) fail("stitched range at " + format_ptr(dst) + " has an Active part whose piece is lent elsewhere");
          if (part.lo != p->second.lent_lo || part.hi != p->second.lent_hi)
            fail("stitched range at " + format_ptr(dst) + " uses other bytes of a piece than the piece lends");
          // A fragment's unused bytes are the main range's: no run may reach into them.
          if (in_run && (part.lo || runs.back().first + runs.back().second != dst + sum - part.n))
            fail("stitched range at " + format_ptr(dst) + " has a fragment inside a run of Active parts");
          ++active;
          if (in_run) runs.back().second += part.hi - part.lo;
          else runs.emplace_back(dst + sum - part.n + part.lo, part.hi - part.lo);
          in_run = true;
        }
      }
      if (sum != st.size || !any) fail("stitched range at " + format_ptr(dst) + " is not its parts end to end, or has none mapped");
    }
    if (runs != stitched) fail("stitched backings are not exactly the runs of Active parts");
    for (const auto& [at, p] : pieces_) {
      auto c = alias_count.find(at);
      if (p.aliases != (c == alias_count.end() ? 0 : c->second)) fail("piece at " + format_ptr(at) + ": alias count is off");
    }
    if (active != lent) fail("lent pieces and Active stitched parts differ");
    if (stale != stale_) fail("stale alias count is off");
  }

  void stats(PoolStats& st) const override {
    std::size_t holes = 0, hole_bytes = 0, lent_bytes = 0;
    const std::vector<ArenaBacking*> segs = main_segments();
    for (std::size_t i = 1; i < segs.size(); ++i) {
      ++holes;
      hole_bytes += segs[i]->addr - (segs[i - 1]->addr + segs[i - 1]->size);
    }
    const std::uintptr_t last_end = segs.empty() ? va_base_ : segs.back()->addr + segs.back()->size;
    for (const auto& [at, p] : pieces_)
      if (p.lent_to) {
        lent_bytes += p.lent_hi - p.lent_lo;
        // Mapped, not a hole; but a lent free end of the last segment's last piece lies after it.
        if (at + p.lent_lo < last_end) hole_bytes -= p.lent_hi - p.lent_lo;
      }
    st.extra.emplace_back("expandable", 1);
    st.extra.emplace_back("mapped_bytes", mapped_);
  for (const auto& [k, v] : std::initializer_list<std::pair<const char*, std::size_t>>{
           {"va_bytes", static_cast<std::size_t>(va_bytes_)},
           {"map_calls", static_cast<std::size_t>(map_calls_)},
           {"unmap_calls", static_cast<std::size_t>(unmap_calls_)},
           {"mapped_pieces", static_cast<std::size_t>(pieces_.size())},
           {"unmap_failures", static_cast<std::size_t>(unmap_failures_)},
           {"holes", static_cast<std::size_t>(holes)},
           {"hole_bytes", static_cast<std::size_t>(hole_bytes)},
           {"hole_unmaps", static_cast<std::size_t>(hole_unmaps_)},
           {"hole_refills", static_cast<std::size_t>(hole_refills_)},
           {"stitch", static_cast<std::size_t>(stitch_ ? 1 : 0)},
           {"stitched_ranges", static_cast<std::size_t>(stitches_.size())},
           {"stitched_bytes", static_cast<std::size_t>(lent_bytes)},
           {"stale_aliases", static_cast<std::size_t>(stale_)},
           {"moved_parts", static_cast<std::size_t>(moved_parts_)},
           {"stitch_extends", static_cast<std::size_t>(stitch_extends_)},
           {"stitch_top_ups", static_cast<std::size_t>(top_ups_)},
           {"stitched_fragments", static_cast<std::size_t>(fragments_lent_)},
           {"stitch_homecomings", static_cast<std::size_t>(homecomings_)},
           {"stitch_area_bytes", static_cast<std::size_t>(stitch_area_used())},
           {"stitched_backings", static_cast<std::size_t>(a_.backings_.size() - segs.size())},
           {"stitches", static_cast<std::size_t>(stitches_made_)},
           {"stitch_teardowns", static_cast<std::size_t>(teardowns_)},
           {"alias_calls", static_cast<std::size_t>(alias_calls_)},
           {"unalias_calls", static_cast<std::size_t>(unalias_calls_)},
           {"unmap_runs", static_cast<std::size_t>(unmap_runs_)},
           {"unalias_runs", static_cast<std::size_t>(unalias_runs_)},
           {"alias_failures", static_cast<std::size_t>(alias_failures_)},
       })
    st.extra.emplace_back(k, v);
  }

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
  std::vector<ArenaBacking*> main_segments() const {
    std::vector<ArenaBacking*> out;
    out.reserve(a_.backings_.size());
    for (ArenaBacking* b : a_.backings_)
      if (in_main(b->addr)) out.push_back(b);
    return out;
  }

  // [at, at + n) backed by fresh physical memory in pieces of at most `piece` bytes, one upstream
  // call for the run (its pieces are granted access at once: upstream.hpp, "Runs"), pieces of
  // the books (not yet of a segment: absorb() takes them in). `done` gets the bytes mapped; a
  // refusal rethrows with the pieces mapped before it in the books.
  void map_pieces(std::uintptr_t at, std::size_t n, std::size_t piece, std::size_t& done) {
    piece = piece ? std::min(piece, n) : n;
    done = 0;
    auto book = [&] {
      for (std::size_t off = 0; off < done; off += piece) {
        const std::size_t k = std::min(piece, done - off);
        pieces_.emplace(at + off, Piece{k});
        ++map_calls_;
        a_.up_allocs_.fetch_add(1, std::memory_order_relaxed);
      }
      mapped_ += done;
    };
    try {
      a_.upstream_->map_pieces(at, n, piece, done);
    } catch (...) {
      book();
      throw;
    }
    book();
  }

  // Map [at, at + n) (the start of the gap between prev and next) in pieces of at most `piece`
  // bytes and file it free, merged with its free neighbours. A refusal files what was mapped
  // before it and rethrows.
  void map_free(std::uintptr_t at, std::size_t n, std::size_t piece, ArenaBacking* prev, ArenaBacking* next) {
    std::size_t done = 0;
    try {
      map_pieces(at, n, piece, done);
    } catch (...) {
      if (ArenaChunk* r = absorb(at, done, prev, next)) a_.file_free_locked(r);
      throw;
    }
    a_.file_free_locked(absorb(at, n, prev, next));
  }

  // Take [at, at + n) (just mapped, or a lent piece coming back, at the start of the gap between
  // prev and next) into the books: it extends prev (merging with a free last chunk) or starts a
  // segment, and joins next when it fills the gap. Returns the free chunk holding the new
  // memory, out of the index (nullptr when n == 0).
  ArenaChunk* absorb(std::uintptr_t at, std::size_t n, ArenaBacking* prev, ArenaBacking* next, bool refill = true) {
    if (!n) return nullptr;
    const bool middle = next != nullptr;
    if (middle && refill) ++hole_refills_;
    ArenaBacking* seg;
    ArenaChunk* run;
    if (prev) {
      seg = prev;
      ArenaChunk* tail = seg->last;
      seg->size += n;
      a_.budget_.grow(n);
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
    if (next && at + n == next->addr) {  // the gap is filled: next joins this segment
      ArenaChunk* h = next->first;
      run->next_addr = h;  // run ends the segment: h follows it now
      h->prev_addr = run;
      if (h->st() == ChunkState::Free) {
        unindex(a_, h);
        run->size += h->size;
        seg->last = next->last == h ? run : next->last;
        a_.join_next_locked(run);  // keeps h's last hand-out for the shrink scans (a review found it lost)
      } else {
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
  std::size_t unmap_free(bool hysteresis, bool any, bool keep_tail = false, std::size_t min_bytes = 0, bool stale_swept = false) {
    // See dissolve(): home's queued work may still use free memory. A shrink scan counts anyway and
    // releases only what the arena's settle point covers (scan_may_release).
    if (a_.home_dirty_ && !hysteresis) return 0;
    std::vector<std::uintptr_t> victims;
    const bool holes = a_.opt_.reclaim_holes || any;
    const std::vector<ArenaBacking*> segs = main_segments();
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
      for (auto it = std::prev(pieces_.upper_bound(b->addr)); it != pieces_.end() && it->first < end; ++it) {
        const std::uintptr_t ps = it->first, pe = ps + it->second.size;
        while (c->addr + c->size <= ps) c = c->next_addr;
        std::uint64_t used = 0;
        // The upstream refuses to unmap a piece while an alias of it is mapped. A piece in the
        // main range (not lent) has only Stale aliases, if any: they go first, below.
        bool free = chunks_free(c, ps, pe, used) && !it->second.lent_to;
        const bool in_tail = si + 1 == segs.size() && ps >= tail_start;
        if ((!holes && !in_tail) || (keep_tail && in_tail)) free = false;
        if (hysteresis) {
          Piece& p = it->second;
          p.idle_scans = idle_scans_after(free, used, a_.scan_epoch_, p.idle_scans);
          free = a_.scan_may_release(p.idle_scans);
        }
        if (free && ps != va_base_) victims.push_back(ps);
      }
    }
    auto bytes = [&] {
      std::size_t total = 0;
      for (std::uintptr_t v : victims) total += pieces_.at(v).size;
      return total;
    };
    if (min_bytes && bytes() < min_bytes) return 0;  // before any unalias: none is made for nothing
    // The victims' Stale aliases go now, where queued work can no longer reach them; a victim that
    // keeps one stays mapped (a later pass unmaps it).
    std::set<std::uintptr_t> aliased;
    for (std::uintptr_t v : victims)
      if (pieces_.at(v).aliases) aliased.insert(v);
    if (!aliased.empty()) {
      if (!stale_swept) dissolve_free_stitches({false, &aliased, true});
      victims.erase(std::remove_if(victims.begin(), victims.end(), [&](std::uintptr_t v) { return pieces_.at(v).aliases != 0; }),
                    victims.end());
      if (min_bytes && bytes() < min_bytes) return 0;
    }
    std::size_t released = 0;
    // Adjacent victims go as one run (one driver call where the device takes runs: upstream.hpp,
    // "Runs"). Last first, runs and the pieces in each: a tail given back piece by piece leaves
    // the books as the old tail-only path did, and a refusal keeps a run's first pieces mapped.
    std::vector<std::size_t> sizes;
    for (std::size_t hi = victims.size(); hi > 0;) {
      std::size_t lo = hi - 1;
      while (lo > 0 && victims[lo - 1] + pieces_.at(victims[lo - 1]).size == victims[lo]) --lo;
      sizes.clear();
      for (std::size_t i = lo; i < hi; ++i) sizes.push_back(pieces_.at(victims[i]).size);
      std::size_t done = 0;
      bool refused = false;
      ++unmap_runs_;
      try {
        a_.upstream_->unmap_pieces(victims[lo], sizes.data(), sizes.size(), done);
      } catch (...) {
        ++unmap_failures_;
        ++a_.ev_.upstream_free_failures;
        refused = true;
      }
      for (std::size_t i = hi; i-- > hi - done;) {
        ++unmap_calls_;
        a_.up_frees_.fetch_add(1, std::memory_order_relaxed);
        cut(victims[i], sizes[i - lo]);
        released += sizes[i - lo];
      }
      if (refused) break;
      hi = lo;
    }
    return released;
  }

  // [ps, ps + n): one piece, just unmapped, every chunk over it Free: out of the books.
  void cut(std::uintptr_t ps, std::size_t n) {
    if (detach(ps, n)) ++hole_unmaps_;
    pieces_.erase(ps);
    mapped_ -= n;
  }

  // [ps, ps + n): one piece of a segment, every chunk over it Free. Its chunks go (edge chunks
  // are split at the piece's bounds; reserved drops by n); the segment keeps what lies before it
  // and a new segment takes what lies after it. Returns whether it was not the range's free tail.
  bool detach(std::uintptr_t ps, std::size_t n) {
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
    const bool last_seg = sit + 1 == segs.end() || !in_main((*(sit + 1))->addr);
    const bool hole = !last_seg || pe != seg_end;  // not the range's free tail
    a_.budget_.release(n);
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
    return hole;
  }

  // A backing whose chunks are all Free leaves the books (chunks out of the index; reserved drops).
  void drop_backing(ArenaBacking* b) {
    for (ArenaChunk* c = b->first; c;) {
      ArenaChunk* n = c->next_addr;
      unindex(a_, c);
      a_.chunk_nodes_.destroy(c);
      c = n;
    }
    auto& segs = a_.backings_;
    segs.erase(std::find(segs.begin(), segs.end(), b));
    a_.budget_.release(b->size);
    if (b->dirty) --a_.dirty_backings_;
    delete b;
  }

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
  void give_back(std::uintptr_t src) {
    Piece& piece = pieces_.at(src);
    const std::uintptr_t ps = src + piece.lent_lo;
    const std::size_t n = piece.lent_hi - piece.lent_lo;
    piece.lent_to = piece.lent_lo = piece.lent_hi = 0;
    const auto& segs = a_.backings_;
    auto it = std::upper_bound(segs.begin(), segs.end(), ps, [](std::uintptr_t x, const ArenaBacking* b) { return x < b->addr; });
    ArenaBacking* prev = it != segs.begin() && in_main((*(it - 1))->addr) && (*(it - 1))->addr + (*(it - 1))->size == ps ? *(it - 1) : nullptr;
    // Only a segment of the main range: the stitch area may begin right where the main range ends
    // (Simulated reserves them back to back), and a piece at the main range's end once merged
    // with the stitched range after it into one "segment" across both (found by fuzzing).
    ArenaBacking* next = it != segs.end() && in_main((*it)->addr) && (*it)->addr == ps + n ? *it : nullptr;
    a_.file_free_locked(absorb(ps, n, prev, next, false));
  }

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
  bool dissolve_free_stitches(const Sweep& how) {
    if (stitches_.empty() || a_.upstream_->captures_underway() > 0) return false;
    bool any = false;
    for (auto it = stitches_.begin(); it != stitches_.end();) any |= dissolve(it, how);
    return any;
  }

  // Every wholly free stitched backing goes home at once, without waiting for queued work: its
  // parts go Stale (their aliases stay mapped until dissolve() may unmap them, so work queued on
  // them still reaches the same memory) and its pieces rejoin the main range, merged with their
  // free neighbours, where a growth at their edge maps only what they lack. For a request that no
  // stitch can serve (more than stitch_max_parts pieces): else the free pieces sit in stitched
  // ranges while it maps the whole request beside them (the Llama-style trace with top-ups: 326
  // MiB of free stitched ranges beside a 989 MiB growth). Returns whether any piece came back.
  // With only_fragments, only the backings that hold a fragment go.
  bool send_home(bool only_fragments = false) {
    bool any = false;
    if (only_fragments && !a_.opt_.stitch_fragments) return false;
    for (auto& [dst, st] : stitches_) {
      const std::vector<std::size_t> offs = part_offsets(st);
      for (ArenaBacking* b : stitch_backings(dst, st.size)) {
        const auto [j0, j1] = parts_over(offs, st, dst, b);
        if ((only_fragments && !st.parts[j0].partial() && !st.parts[j1 - 1].partial()) || !wholly_free(b)) continue;
        drop_backing(b);
        for (std::size_t j = j0; j < j1; ++j) {
          go_stale(st.parts[j]);
          give_back(st.parts[j].src);
          ++homecomings_;
        }
        any = true;
      }
    }
    return any;
  }

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
  std::vector<ArenaBacking*> stitch_backings(std::uintptr_t dst, std::size_t size) const {
    std::vector<ArenaBacking*> out;
    const auto& segs = a_.backings_;
    for (auto it = std::lower_bound(segs.begin(), segs.end(), dst, [](const ArenaBacking* b, std::uintptr_t x) { return b->addr < x; });
         it != segs.end() && (*it)->addr < dst + size; ++it)
      out.push_back(*it);
    return out;
  }

  // The stitched range whose stretch holds `at`, or end().
  std::map<std::uintptr_t, Stitch>::iterator stitch_of(std::uintptr_t at) {
    auto it = stitches_.upper_bound(at);
    if (it == stitches_.begin()) return stitches_.end();
    --it;
    return at < it->first + it->second.size ? it : stitches_.end();
  }

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
  bool dissolve(std::map<std::uintptr_t, Stitch>::iterator& it, const Sweep& how) {
    const bool settled = !a_.home_dirty_;
    auto stale_may_go = [&](const Part& p) {
      return p.st == PartState::Stale && (how.all_stale || (how.stale_of && how.stale_of->count(p.src))) &&
             (settled || (a_.fence_passed_ && p.stale_epoch < a_.scan_epoch_));
    };
    if ((!settled || how.keep_free) && std::none_of(it->second.parts.begin(), it->second.parts.end(), stale_may_go)) {
      ++it;
      return false;
    }
    const std::uintptr_t dst = it->first;
    Stitch& st = it->second;
    const std::vector<std::size_t> offs = part_offsets(st);
    // The parts [j0, j1) unaliased as one run (one driver call where the device takes runs), last
    // first; returns where the parts still aliased end (j1 - those down): a refusal keeps the
    // first ones.
    std::vector<std::size_t> sizes;
    auto unalias = [&](std::size_t j0, std::size_t j1) {
      if (j0 == j1) return j1;
      sizes.clear();
      for (std::size_t j = j0; j < j1; ++j) sizes.push_back(st.parts[j].n);
      std::size_t done = 0;
      ++unalias_runs_;
      try {
        a_.upstream_->unalias_pieces(dst + offs[j0], sizes.data(), sizes.size(), done);
      } catch (...) {
        ++alias_failures_;
        ++a_.ev_.upstream_free_failures;
      }
      for (std::size_t j = j1 - done; j < j1; ++j) {
        ++unalias_calls_;
        --pieces_.at(st.parts[j].src).aliases;
      }
      return j1 - done;
    };
    for (std::size_t j = 0, e = 0; j < st.parts.size(); j = std::max(e, j + 1)) {
      for (e = j; e < st.parts.size() && stale_may_go(st.parts[e]);) ++e;
      if (e > j)
        for (std::size_t g = unalias(j, e); g < e; ++g) {
          st.parts[g].st = PartState::Gone;
          --stale_;
        }
    }
    bool any = false;
    if (settled && !how.keep_free) for (ArenaBacking* b : stitch_backings(dst, st.size)) {
      if (!wholly_free(b)) continue;
      const std::uintptr_t ba = b->addr;
      const auto [j0, j1] = parts_over(offs, st, dst, b);
      const std::size_t keep = unalias(j0, j1);
      if (keep == j1) continue;
      drop_backing(b);
      for (std::size_t j = keep; j < j1; ++j) {
        st.parts[j].st = PartState::Gone;
        give_back(st.parts[j].src);
      }
      if (keep > j0) a_.file_free_locked(a_.adopt_locked(ba, dst + offs[keep] - ba, false, false)->first);
      any = true;
    }
    std::size_t gone = 0, gone_bytes = 0;
    while (gone < st.parts.size() && st.parts[gone].st == PartState::Gone) gone_bytes += st.parts[gone++].n;
    if (gone == st.parts.size()) {
      ++teardowns_;
      it = stitches_.erase(it);
    } else if (gone) {
      // A range that grows in place at its end and loses its first parts slides along the stitch
      // area; its stretch starts at its first part still mapped, so the area behind it is free
      // again (else a long-running range would hold ever more of the area).
      Stitch rest;
      rest.parts.assign(st.parts.begin() + gone, st.parts.end());
      rest.size = st.size - gone_bytes;
      const std::uintptr_t moved = dst + gone_bytes;
      for (const Part& x : rest.parts)
        if (x.st == PartState::Active) pieces_.at(x.src).lent_to = moved;
      it = stitches_.erase(it);
      it = std::next(stitches_.emplace_hint(it, moved, std::move(rest)));
    } else {
      ++it;
    }
    return any;
  }

  // The stitch area, reserved on first use. False when the upstream refused it (not asked again:
  // every growth would pay a refused call).
  bool stitch_area() {
    if (sva_base_) return true;
    if (stitch_area_refused_) return false;
    try {
      sva_base_ = a_.upstream_->reserve(va_bytes_);
      sva_bytes_ = va_bytes_;
    } catch (...) {
      stitch_area_refused_ = true;
      return false;
    }
    return true;
  }

  // The free stitch-area bytes right after the stitched range at `it`.
  std::size_t room_after(std::map<std::uintptr_t, Stitch>::const_iterator it) const {
    const std::uintptr_t end = it->first + it->second.size;
    auto nx = std::next(it);
    return (nx == stitches_.end() ? sva_base_ + sva_bytes_ : nx->first) - end;
  }

  // Where a new stitched range of n bytes goes: the lowest free stretch of the stitch area that
  // leaves the range before it room to grow in place by its own size and the new one room to grow
  // by n (extend_stitch()), else the lowest stretch that holds n; 0 when none does. Addresses cost
  // nothing: the area is as large as the main range.
  std::uintptr_t stitch_slot(std::size_t n) {
    if (!stitch_area()) return 0;
    for (const bool roomy : {true, false}) {
      std::uintptr_t at = sva_base_;
      std::size_t keep = 0;  // the room left to the range before the gap
      auto fits = [&](std::uintptr_t end) { return roomy ? end - at >= keep + 2 * n : end - at >= n; };
      for (const auto& [dst, st] : stitches_) {
        if (fits(dst)) return roomy ? at + keep : at;
        at = dst + st.size;
        keep = st.size;
      }
      if (fits(sva_base_ + sva_bytes_)) return roomy ? at + keep : at;
    }
    return 0;
  }

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
                                      std::size_t& total) const {
    std::vector<Cand> cand;
    total = 0;
    each_main_piece(keep_lo, keep_hi, [&](std::uintptr_t ps, std::size_t n, const ArenaChunk* c) {
      std::uint64_t used = 0;
      if (chunks_free(c, ps, ps + n, used)) cand.push_back({ps, ps, n, 0, 0, 0, n}), total += n;
    });
    for (const auto& [dst, st] : stitches_) {
      std::uintptr_t at = dst;
      for (std::size_t j = 0; j < st.parts.size(); at += st.parts[j++].n) {
        // A fragment stays where it is: its piece's other bytes are still the main range's.
        if (st.parts[j].st != PartState::Active || st.parts[j].partial() || (dst == skip && at + st.parts[j].n > skip_from)) continue;
        const ArenaBacking* b = containing(at);
        std::uint64_t used = 0;
        if (chunks_free(b->first, at, at + st.parts[j].n, used))
          cand.push_back({at, st.parts[j].src, st.parts[j].n, dst, j, 0, st.parts[j].n}), total += st.parts[j].n;
      }
    }
    return cand;
  }

  // Candidates adding up to `need` bytes, by address, or none (short, or more than `max_parts`).
  // Runs of address-adjacent free pieces, smallest first: fragments no contiguous request can use
  // go into the stitch, long free runs stay whole for the requests that fit them. Pieces already
  // lent go first: moving them on leaves the main range as it is, where taking main-range pieces
  // cuts holes into it (measured: the Llama-style trace 1.309x -> 1.126x peak / live, the other
  // committed traces the same; docs/expandable.md).
  static std::vector<Cand> choose(const std::vector<Cand>& cand, std::size_t need, std::size_t max_parts) {
    std::vector<std::pair<std::size_t, std::size_t>> runs;  // (bytes, first index into cand)
    for (std::size_t i = 0; i < cand.size(); ++i) {
      if (i && cand[i - 1].from == cand[i].from && cand[i - 1].at + cand[i - 1].n == cand[i].at) runs.back().first += cand[i].n;
      else runs.emplace_back(cand[i].n, i);
    }
    auto lent_first = [&](const auto& r) { return cand[r.second].from ? 0 : 1; };
    std::stable_sort(runs.begin(), runs.end(), [&](const auto& x, const auto& y) {
      return std::make_pair(lent_first(x), x.first) < std::make_pair(lent_first(y), y.first);
    });
    std::vector<Cand> chosen;
    for (const auto& [bytes, i0] : runs) {
      std::size_t left = bytes;
      for (std::size_t i = i0; need && left; ++i) {
        chosen.push_back(cand[i]);
        need -= std::min(need, cand[i].n);
        left -= cand[i].n;
      }
      if (!need) break;
    }
    if (need || chosen.size() > max_parts) return {};
    std::sort(chosen.begin(), chosen.end(), [](const Cand& x, const Cand& y) { return x.at < y.at; });
    return chosen;
  }

  // Alias the chosen pieces end to end from `dst` in one upstream call (one access grant for the
  // run; stopping at the first refusal, counted) and move the bytes they give there in the books:
  // out of their segment or stitched backing (an earlier stitched range's part goes Stale), lent
  // to the range at `owner`, appended to its parts. A fragment gives only its free end (the first
  // chosen) or its free start (the last); the rest of its piece stays in its segment. Returns the
  // bytes given, which lie end to end from `dst` plus the first part's `lo`; the caller adds them
  // to a backing (reserved dropped by them here).
  std::size_t alias_in(std::uintptr_t dst, std::vector<Cand>& chosen, std::uintptr_t owner, Stitch& into) {
    std::vector<Upstream::AliasSource> srcs;
    srcs.reserve(chosen.size());
    for (const Cand& c : chosen) srcs.push_back({c.src, c.n});
    std::size_t k = 0;
    try {
      a_.upstream_->alias_pieces(dst, srcs.data(), srcs.size(), k);
    } catch (...) {
      ++alias_failures_;
    }
    alias_calls_ += k;
    chosen.resize(k);
    std::size_t given = 0;
    for (const Cand& p : chosen) {
      detach(p.at, p.bytes());
      given += p.bytes();
      if (p.from) {
        ++moved_parts_;
        go_stale(stitches_.at(p.from).parts[p.part]);
      }
      Piece& piece = pieces_.at(p.src);
      piece.lent_to = owner;
      piece.lent_lo = p.lo;
      piece.lent_hi = p.hi;
      fragments_lent_ += p.lo != 0 || p.hi != p.n;
      ++piece.aliases;
      into.parts.push_back({p.src, p.n, PartState::Active, 0, p.lo, p.hi});
      into.size += p.n;
    }
    return given;
  }

  // A stitched range whose stretch ends in a free chunk (its last part Active) and that has free
  // stitch-area room after it takes the request by growing in place: only what that chunk lacks
  // is aliased after it. Serving a request a little larger than the last from the same range
  // then costs a few alias calls, not one per piece of the whole request (measured on the BERT
  // serving log: most of a stitch's pieces were an earlier free stitched range's, moved on).
  // Returns the grown free chunk, out of the index, or nullptr (nothing fit; or a refused alias,
  // then what was aliased stays, filed free).
  ArenaChunk* extend_stitch(std::size_t rounded, std::uintptr_t keep_lo, std::uintptr_t keep_hi) {
    auto best = stitches_.end();
    ArenaChunk* tail = nullptr;
    for (auto it = stitches_.begin(); it != stitches_.end(); ++it) {
      const Stitch& st = it->second;
      // (A range ending in a fragment ends inside its last part: the rest is the main range's.)
      if (st.parts.back().st != PartState::Active || st.parts.back().partial()) continue;
      ArenaChunk* c = containing(it->first + st.size - 1)->last;
      if (c->st() != ChunkState::Free || c->size >= rounded || room_after(it) < rounded - c->size) continue;
      if (!tail || c->size > tail->size) best = it, tail = c;
    }
    if (!tail) return nullptr;
    std::size_t total = 0;
    const std::vector<Cand> cand = stitch_candidates(keep_lo, keep_hi, best->first, tail->addr, total);
    // The extension may end in a tail fragment (stitch_fragments) when the whole pieces fall short.
    const std::size_t need = rounded - tail->size;
    std::size_t wholes = 0;
    Fragments fr;
    if (total < need) {
      fr = pick_fragments(keep_lo, keep_hi, need, wholes, false);
      if (wholes > total) return nullptr;
    }
    std::vector<Cand> chosen = choose_around(cand, fr, need);
    std::size_t bytes = 0;
    // Whole pieces may add up to more than the chunk lacks (pieces of different sizes): all of
    // them must fit before the next range (a review found aliases running into it).
    for (const Cand& c : chosen) bytes += c.n;
    if (chosen.empty() || bytes > room_after(best)) return nullptr;
    const std::uintptr_t dst = best->first;
    Stitch& st = best->second;
    const std::size_t done = alias_in(dst + st.size, chosen, dst, st);
    if (!done) return nullptr;
    unindex(a_, tail);
    tail->size += done;
    tail->backing->size += done;
    a_.budget_.grow(done);
    ++stitch_extends_;
    if (tail->size < rounded) {
      a_.file_free_locked(tail);
      return nullptr;
    }
    return tail;
  }

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
  void fragments(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::vector<Cand>& heads, std::vector<Cand>& tails) const {
    heads.clear();
    tails.clear();
    if (!a_.opt_.stitch_fragments) return;
    each_main_piece(keep_lo, keep_hi, [&](std::uintptr_t ps, std::size_t n, const ArenaChunk* c) {
      const std::uintptr_t pe = ps + n;
      std::uintptr_t used_lo = pe, used_hi = ps;  // the piece's bytes from its first to its last in use
      for (const ArenaChunk* d = c; d && d->addr < pe; d = d->next_addr)
        if (d->st() != ChunkState::Free) {
          used_lo = std::min(used_lo, std::max(d->addr, ps));
          used_hi = std::max(used_hi, std::min(d->addr + d->size, pe));
        }
      if (used_lo == pe) return;  // wholly free: a whole candidate
      if (used_hi < pe) heads.push_back({used_hi, ps, n, 0, 0, used_hi - ps, n});
      if (used_lo > ps) tails.push_back({ps, ps, n, 0, 0, 0, used_lo - ps});
    });
    for (auto* v : {&heads, &tails}) {
      std::stable_sort(v->begin(), v->end(), [](const Cand& x, const Cand& y) { return x.bytes() > y.bytes(); });
      if (v->size() > kFragments) v->resize(kFragments);
    }
  }

  // Whole pieces from `cand` (choose()) and the fragments `fr` around them (the head first, the
  // tail last) that together give `need` bytes, within stitch_max_parts; none when they cannot.
  // Each fragment gives only what the whole pieces lack, the head first, and the rest of each
  // stays in the main range, free for the requests that fit there.
  std::vector<Cand> choose_around(const std::vector<Cand>& cand, Fragments fr, std::size_t need) const {
    std::vector<Cand> chosen;
    if (fr.parts() > a_.opt_.stitch_max_parts) return chosen;
    if (need > fr.bytes()) {
      chosen = choose(cand, need - fr.bytes(), a_.opt_.stitch_max_parts - fr.parts());
      if (chosen.empty()) return chosen;
    }
    std::size_t whole = 0;
    for (const Cand& c : chosen) whole += c.n;
    const std::size_t lack = need > whole ? need - whole : 0;
    const std::size_t from_head = std::min(lack, fr.head.bytes());
    if (from_head) {
      fr.head.lo = fr.head.hi - from_head;
      fr.head.at = fr.head.src + fr.head.lo;
      chosen.insert(chosen.begin(), fr.head);
    }
    if (lack > from_head) {
      fr.tail.hi = lack - from_head;
      chosen.push_back(fr.tail);
    }
    return chosen;
  }

  // The head and tail (either may be missing) for whole pieces that fall `short_by` bytes short:
  // the fewest fresh granules still to map (0: the pair makes up the shortfall), then the fewest
  // bytes, so larger fragments stay for later requests. None when no pair spares a granule.
  // `fresh` gets the granules' bytes still to map.
  Fragments pick_fragments(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::size_t short_by, std::size_t& fresh,
                           bool with_head = true) const {
    std::vector<Cand> heads, tails;
    fragments(keep_lo, keep_hi, heads, tails);
    if (!with_head) heads.clear();
    heads.push_back({});
    tails.push_back({});
    Fragments best;
    fresh = align_up(short_by, granule_);
    for (const Cand& h : heads)
      for (const Cand& t : tails) {
        if (h.bytes() && t.bytes() && h.src == t.src) continue;  // one piece lends one end
        const std::size_t f = h.bytes() + t.bytes();
        const std::size_t left = f >= short_by ? 0 : align_up(short_by - f, granule_);
        if (left < fresh || (left == fresh && best.parts() && f < best.bytes())) best = {h, t}, fresh = left;
      }
    return best;
  }

  // Serve `rounded` bytes from wholly free pieces (never the resident first one) mapped a second
  // time, end to end, into the stitch area: by growing a stitched range in place
  // (extend_stitch()), else as a fresh stitched range. A piece may come from the main range or
  // from an earlier stitched range whose part over it is wholly free: that part's alias stays
  // mapped (Stale, Sweep), so moving it on costs one alias and no wait. With stitch_fragments, when the whole pieces fall short, the fresh range
  // may begin with one piece's free end and end with another's free start (fragments()), the
  // fewest of them that make up the shortfall. At most stitch_max_parts pieces (each is an
  // upstream call); never a piece of the main range in [keep_lo, keep_hi). Returns the stitched
  // chunk, out of the index, or nullptr (then the caller maps more). Pieces aliased before a
  // refusal stay stitched, filed free.
  ArenaChunk* stitch(std::size_t rounded, std::uintptr_t keep_lo, std::uintptr_t keep_hi) {
    const std::uint64_t failures = alias_failures_;
    if (ArenaChunk* c = extend_stitch(rounded, keep_lo, keep_hi)) return c;
    if (alias_failures_ != failures) return nullptr;
    std::size_t total = 0;
    std::vector<Cand> cand = stitch_candidates(keep_lo, keep_hi, 0, 0, total);
    Fragments fr;
    if (total < rounded) {
      std::size_t fresh = 0;
      fr = pick_fragments(keep_lo, keep_hi, rounded - total, fresh);
      if (fresh || !fr.parts()) return nullptr;
    }
    std::vector<Cand> chosen = choose_around(cand, fr, rounded);
    if (chosen.empty()) return nullptr;
    std::size_t size = 0;
    for (const Cand& p : chosen) size += p.n;
    const std::uintptr_t dst = stitch_slot(size);
    if (!dst) return nullptr;
    Stitch made;
    const std::size_t done = alias_in(dst, chosen, dst, made);
    if (!done) return nullptr;
    ArenaBacking* b = a_.adopt_locked(dst + made.parts.front().lo, done, false, false);
    stitches_.emplace(dst, std::move(made));
    ++stitches_made_;
    if (done < rounded) {
      a_.file_free_locked(b->first);
      return nullptr;
    }
    return b->first;
  }

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
  void release_all() {
    bool aliases_left = false;
    std::vector<std::size_t> sizes;
    std::vector<Part*> run;
    auto unalias_run = [&](std::uintptr_t at) {
      close_run(at, sizes, &Upstream::unalias_pieces, [&](std::size_t i, bool ok) {
        Part* p = run[i];
        if (ok) {
          ++unalias_calls_;
          Piece& piece = pieces_.at(p->src);
          --piece.aliases;
          if (p->st == PartState::Active) piece.lent_to = piece.lent_lo = piece.lent_hi = 0;
        } else {
          ++alias_failures_;
          ++a_.ev_.upstream_free_failures;
          aliases_left = true;  // the piece stays lent: mapped twice, its unmap would be refused
        }
      });
      sizes.clear();
      run.clear();
    };
    for (auto& [dst, st] : stitches_) {
      std::size_t at = 0, from = 0;
      for (Part& p : st.parts) {
        if (p.st == PartState::Gone) {
          if (!run.empty()) unalias_run(dst + from);
        } else {
          if (run.empty()) from = at;
          run.push_back(&p);
          sizes.push_back(p.n);
        }
        at += p.n;
      }
      if (!run.empty()) unalias_run(dst + from);
    }
    stitches_.clear();
    stale_ = 0;
    auto& segs = a_.backings_;
    for (ArenaBacking* b : segs) {
      for (ArenaChunk* c = b->first; c;) {
        ArenaChunk* n = c->next_addr;
        unindex(a_, c);
        a_.chunk_nodes_.destroy(c);
        c = n;
      }
      a_.budget_.release(b->size);
      if (b->dirty) --a_.dirty_backings_;
      delete b;
    }
    if (!segs.empty()) ++a_.ev_.backings_released;
    segs.clear();
    if (sva_base_ && !aliases_left) {
      try {
        a_.upstream_->unreserve(sva_base_, sva_bytes_);
      } catch (...) {
        ++a_.ev_.upstream_free_failures;
      }
    }
    sva_base_ = 0;  // released, or leaked with the aliases left in it: never tried again
    bool pieces_left = false;
    // A piece still aliased is not asked (the upstream refuses to unmap it): it ends a run.
    auto unmap_run = [&](std::uintptr_t at) {
      close_run(at, sizes, &Upstream::unmap_pieces, [&](std::size_t i, bool ok) {
        if (ok) {
          ++unmap_calls_;
          a_.up_frees_.fetch_add(1, std::memory_order_relaxed);
        } else {
          ++unmap_failures_;
          ++a_.ev_.upstream_free_failures;
          pieces_left = true;
        }
      });
      sizes.clear();
    };
    std::uintptr_t from = 0, end = 0;
    for (const auto& [at, piece] : pieces_) {
      if (!sizes.empty() && (piece.aliases || at != end)) unmap_run(from);
      mapped_ -= piece.size;
      if (piece.aliases) {
        ++unmap_failures_;  // its refused unalias was counted as the upstream's failure
        pieces_left = true;
        continue;
      }
      if (sizes.empty()) from = at;
      sizes.push_back(piece.size);
      end = at + piece.size;
    }
    if (!sizes.empty()) unmap_run(from);
    pieces_.clear();
    if (va_base_ && !pieces_left) {
      try {
        a_.upstream_->unreserve(va_base_, va_bytes_);
      } catch (...) {
        ++a_.ev_.upstream_free_failures;
      }
    }
    va_base_ = 0;
  }

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

std::unique_ptr<BackingSource> make_virtual_range(ArenaPool& arena) { return std::make_unique<VirtualRange>(arena); }

}  // namespace poolkeeper::detail
