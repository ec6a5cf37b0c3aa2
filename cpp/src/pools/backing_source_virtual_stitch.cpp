// VirtualRange's stitched ranges (backing_source_virtual.hpp; the main range's books are in
// backing_source_virtual.cpp).
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
#include "backing_source_virtual.hpp"

namespace poolkeeper::detail {

void VirtualRange::give_back(std::uintptr_t src) {
  Piece& piece = pieces_.at(src);
  const std::uintptr_t ps = src + piece.lent_lo;
  const std::size_t n = piece.lent_hi - piece.lent_lo;
  piece.lent_to = piece.lent_lo = piece.lent_hi = 0;
  piece.idle_scans = 0;
  const auto& segs = a_.backings_;
  auto it = std::upper_bound(segs.begin(), segs.end(), ps, [](std::uintptr_t x, const ArenaBacking* b) { return x < b->addr; });
  ArenaBacking* prev = it != segs.begin() && in_main((*(it - 1))->addr) && (*(it - 1))->addr + (*(it - 1))->size == ps ? *(it - 1) : nullptr;
  // Only a segment of the main range: the stitch area may begin right where the main range ends
  // (Simulated reserves them back to back), and a piece at the main range's end once merged
  // with the stitched range after it into one "segment" across both (found by fuzzing).
  ArenaBacking* next = it != segs.end() && in_main((*it)->addr) && (*it)->addr == ps + n ? *it : nullptr;
  a_.file_free_locked(absorb(ps, n, prev, next, false));
}

bool VirtualRange::dissolve_free_stitches(const Sweep& how) {
  if (stitches_.empty() || a_.upstream_->captures_underway() > 0) return false;
  bool any = false;
  for (auto it = stitches_.begin(); it != stitches_.end();) any |= dissolve(it, how);
  return any;
}

bool VirtualRange::send_home(bool only_fragments) {
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

std::vector<ArenaBacking*> VirtualRange::stitch_backings(std::uintptr_t dst, std::size_t size) const {
  std::vector<ArenaBacking*> out;
  const auto& segs = a_.backings_;
  for (auto it = std::lower_bound(segs.begin(), segs.end(), dst, [](const ArenaBacking* b, std::uintptr_t x) { return b->addr < x; });
       it != segs.end() && (*it)->addr < dst + size; ++it)
    out.push_back(*it);
  return out;
}

auto VirtualRange::stitch_of(std::uintptr_t at) -> std::map<std::uintptr_t, Stitch>::iterator {
  auto it = stitches_.upper_bound(at);
  if (it == stitches_.begin()) return stitches_.end();
  --it;
  return at < it->first + it->second.size ? it : stitches_.end();
}

bool VirtualRange::dissolve(std::map<std::uintptr_t, Stitch>::iterator& it, const Sweep& how) {
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

bool VirtualRange::stitch_area() {
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

std::size_t VirtualRange::room_after(std::map<std::uintptr_t, Stitch>::const_iterator it) const {
  const std::uintptr_t end = it->first + it->second.size;
  auto nx = std::next(it);
  return (nx == stitches_.end() ? sva_base_ + sva_bytes_ : nx->first) - end;
}

std::uintptr_t VirtualRange::stitch_slot(std::size_t n) {
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

auto VirtualRange::stitch_candidates(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::uintptr_t skip, std::uintptr_t skip_from, std::size_t& total) const -> std::vector<Cand> {
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

auto VirtualRange::choose(const std::vector<Cand>& cand, std::size_t need, std::size_t max_parts) -> std::vector<Cand> {
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

std::size_t VirtualRange::alias_in(std::uintptr_t dst, std::vector<Cand>& chosen, std::uintptr_t owner, Stitch& into) {
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

ArenaChunk* VirtualRange::extend_stitch(std::size_t rounded, std::uintptr_t keep_lo, std::uintptr_t keep_hi) {
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

void VirtualRange::fragments(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::vector<Cand>& heads, std::vector<Cand>& tails) const {
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

auto VirtualRange::choose_around(const std::vector<Cand>& cand, Fragments fr, std::size_t need) const -> std::vector<Cand> {
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

auto VirtualRange::pick_fragments(std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::size_t short_by, std::size_t& fresh, bool with_head) const -> Fragments {
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

ArenaChunk* VirtualRange::stitch(std::size_t rounded, std::uintptr_t keep_lo, std::uintptr_t keep_hi) {
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

}  // namespace poolkeeper::detail
