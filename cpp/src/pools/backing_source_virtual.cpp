// VirtualRange: one reserved virtual range with physical pieces mapped into it (backing_source.hpp,
// docs/expandable.md).
//
// Books: `pieces_` lists every mapped piece (one earlier map each, by address); every backing of
// the arena is a *segment*: a maximal run of consecutive mapped pieces, tiled by chunks. The gaps
// between segments are the holes: unmapped, with no chunk over them, so nothing there can be
// handed out. validate() proves that the segments cover exactly the pieces (reserved == mapped,
// no byte reachable twice).
#include <initializer_list>

#include "backing_source_virtual.hpp"

namespace poolkeeper::detail {

VirtualRange::VirtualRange(ArenaPool& arena) : BackingSource(arena) {
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

ArenaChunk* VirtualRange::grow(std::size_t rounded, std::unique_lock<SpinMutex>&, Stream s) {
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

std::size_t VirtualRange::release_free(Detached&, bool hysteresis) {
  const Sweep sweep = hysteresis ? passing_sweep() : Sweep{true};
  dissolve_free_stitches(sweep);  // their pieces return to the range, where they can be unmapped
  return unmap_free(hysteresis, false, false, 0, sweep.all_stale);
}

std::size_t VirtualRange::release_for_oom(Detached&) {
  dissolve_free_stitches({true});
  return a_.opt_.reclaim_holes ? unmap_free(false, false, true, 0, true) : 0;
}

void VirtualRange::release_unused(Detached&) {
  if (a_.upstream_->captures_underway() > 0) return;
  dissolve_free_stitches({true});
  unmap_free(false, true, false, 0, true);
  if (pieces_.empty()) release_all();
}

void VirtualRange::released(std::uintptr_t backing_addr) {
  if (!stitch_ || in_main(backing_addr) || a_.upstream_->captures_underway() > 0) return;
  auto it = stitch_of(backing_addr);
  if (it != stitches_.end()) dissolve(it, passing_sweep());
}

bool VirtualRange::wants_release(const ArenaChunk* c) const {
  const ArenaBacking* b = c->backing;
  if (!stitch_ || in_main(b->addr)) return false;
  for (const ArenaChunk* d = b->first; d; d = d->next_addr)
    if (d != c && d->st() != ChunkState::Free) return false;
  return true;
}

void VirtualRange::validate(const std::function<void(const std::string&)>& fail) const {
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

void VirtualRange::stats(PoolStats& st) const {
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
  // The keys of stats() the docs list (docs/expandable.md, "`stats()` extras").
  const auto put = [&st](const char* key, std::uint64_t value) { st.extra.emplace_back(key, value); };
  put("expandable", 1);
  put("mapped_bytes", mapped_);
  put("va_bytes", va_bytes_);
  put("map_calls", map_calls_);
  put("unmap_calls", unmap_calls_);
  put("mapped_pieces", pieces_.size());
  put("unmap_failures", unmap_failures_);
  put("holes", holes);
  put("hole_bytes", hole_bytes);
  put("hole_unmaps", hole_unmaps_);
  put("hole_refills", hole_refills_);
  put("stitch", stitch_ ? 1u : 0u);
  put("stitched_ranges", stitches_.size());
  put("stitched_bytes", lent_bytes);
  put("stale_aliases", stale_);
  put("moved_parts", moved_parts_);
  put("stitch_extends", stitch_extends_);
  put("stitch_top_ups", top_ups_);
  put("stitched_fragments", fragments_lent_);
  put("stitch_homecomings", homecomings_);
  put("stitch_area_bytes", stitch_area_used());
  put("stitched_backings", a_.backings_.size() - segs.size());
  put("stitches", stitches_made_);
  put("stitch_teardowns", teardowns_);
  put("alias_calls", alias_calls_);
  put("unalias_calls", unalias_calls_);
  put("unmap_runs", unmap_runs_);
  put("unalias_runs", unalias_runs_);
  put("alias_failures", alias_failures_);
}

std::vector<ArenaBacking*> VirtualRange::main_segments() const {
  std::vector<ArenaBacking*> out;
  out.reserve(a_.backings_.size());
  for (ArenaBacking* b : a_.backings_)
    if (in_main(b->addr)) out.push_back(b);
  return out;
}

void VirtualRange::map_pieces(std::uintptr_t at, std::size_t n, std::size_t piece, std::size_t& done) {
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

void VirtualRange::map_free(std::uintptr_t at, std::size_t n, std::size_t piece, ArenaBacking* prev, ArenaBacking* next) {
  std::size_t done = 0;
  try {
    map_pieces(at, n, piece, done);
  } catch (...) {
    if (ArenaChunk* r = absorb(at, done, prev, next)) a_.file_free_locked(r);
    throw;
  }
  a_.file_free_locked(absorb(at, n, prev, next));
}

ArenaChunk* VirtualRange::absorb(std::uintptr_t at, std::size_t n, ArenaBacking* prev, ArenaBacking* next, bool refill) {
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

std::size_t VirtualRange::unmap_free(bool hysteresis, bool any, bool keep_tail, std::size_t min_bytes, bool stale_swept) {
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

void VirtualRange::cut(std::uintptr_t ps, std::size_t n) {
  if (detach(ps, n)) ++hole_unmaps_;
  pieces_.erase(ps);
  mapped_ -= n;
}

bool VirtualRange::detach(std::uintptr_t ps, std::size_t n) {
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

void VirtualRange::drop_backing(ArenaBacking* b) {
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

void VirtualRange::release_all() {
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


std::unique_ptr<BackingSource> make_virtual_range(ArenaPool& arena) { return std::make_unique<VirtualRange>(arena); }

}  // namespace poolkeeper::detail
