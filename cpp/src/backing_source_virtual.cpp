// VirtualRange: one reserved virtual range, physical pieces mapped onto its end (backing_source.hpp,
// docs/expandable.md).
#include <algorithm>

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
    const std::size_t cap = up.memory_capacity();
    va_bytes_ = align_up(opt.va_bytes ? opt.va_bytes : (cap ? cap : std::size_t{1} << 40), granule_);
    va_base_ = up.reserve(va_bytes_);  // throws the upstream's typed error; nothing to undo
  }

  // Map one piece at the end of the range. The step is what the request lacks beyond a free tail,
  // or a fraction of what is mapped (fewer map calls as the footprint grows), whichever is larger,
  // clamped to max_step. A piece is never smaller than the granularity.
  ArenaChunk* grow(std::size_t rounded) override {
    const ArenaOptions& opt = a_.opt_;
    ArenaChunk* tail = vmb_ ? vmb_->last : nullptr;
    const bool tail_free = tail && tail->st() == ChunkState::Free;
    const std::size_t have = tail_free ? tail->size : 0;
    const std::size_t mapped = vmb_ ? vmb_->size : 0;
    const std::size_t need = align_up(rounded > have ? rounded - have : granule_, granule_);
    std::size_t step;
    if (!mapped) {
      step = std::max(need, align_up(opt.initial_backing, granule_));
    } else {
      const std::size_t frac = align_up(static_cast<std::size_t>(double(mapped) * opt.step_fraction), granule_);
      step = std::max(need, std::min(std::max(frac, granule_), std::max(align_up(opt.max_step, granule_), granule_)));
    }
    if (opt.limit) {
      const std::size_t held = a_.reserved_ + a_.releasing_;
      if (held + need > opt.limit) throw LimitHit{};
      if (held + step > opt.limit) step = std::max(need, (opt.limit - held) / granule_ * granule_);
    }
    if (mapped + need > va_bytes_)
      throw UpstreamOutOfMemory("ArenaPool #" + std::to_string(a_.id_) + ": its reserved range of " + format_bytes(va_bytes_) +
                                    " is full (" + format_bytes(mapped) + " mapped, " + format_bytes(need) +
                                    " more needed; raise va_bytes)",
                                a_.upstream_->name(), "POOLKEEPER_RANGE_FULL", 0);
    step = std::min(step, va_bytes_ - mapped);
    const std::uintptr_t at = va_base_ + mapped;
    try {
      a_.upstream_->map(at, step);
    } catch (const UpstreamOutOfMemory&) {
      if (step == need) throw;
      step = need;  // the step asked for more than needed: ask for just the request
      a_.upstream_->map(at, step);
    }
    ++map_calls_;
    a_.up_allocs_.fetch_add(1, std::memory_order_relaxed);
    pieces_.push_back(step);
    if (!vmb_) {
      ++a_.backings_created_;
      vmb_ = a_.adopt_locked(at, step, false, true);
      return vmb_->first;
    }
    vmb_->size += step;
    a_.reserved_ += step;
    a_.peak_reserved_ = std::max(a_.peak_reserved_, a_.reserved_);
    if (tail_free) {  // the free tail grows in place: one chunk, not two
      a_.index_.remove(tail);
      tail->size += step;
      return tail;
    }
    ArenaChunk* c = a_.chunk_nodes_.create();
    c->addr = at;
    c->size = step;
    c->backing = vmb_;
    c->prev_addr = tail;
    tail->next_addr = c;
    vmb_->last = c;
    return c;
  }

  // Unmap the whole pieces lying in the free tail, last first (the first piece is resident).
  // Under the pool lock: the next map goes exactly where these were. A refused unmap stops the
  // walk with that piece still mapped and counted (the books follow each unmap that succeeded).
  std::size_t release_free(Detached&, bool hysteresis) override {
    ArenaChunk* tail = vmb_ ? vmb_->last : nullptr;
    if (!tail || tail->st() != ChunkState::Free) {
      tail_scans_ = 0;
      return 0;
    }
    std::size_t k = pieces_.size(), end = vmb_->size;
    const std::size_t tail_off = tail->addr - va_base_;
    while (k > 1 && end - pieces_[k - 1] >= tail_off) end -= pieces_[--k];
    if (k == pieces_.size()) {
      tail_scans_ = 0;
      return 0;
    }
    if (hysteresis && ++tail_scans_ < a_.opt_.shrink_hysteresis) return 0;
    tail_scans_ = 0;
    a_.index_.remove(tail);
    std::size_t released = 0;
    while (pieces_.size() > k) {
      const std::size_t n = pieces_.back();
      try {
        a_.upstream_->unmap(va_base_ + vmb_->size - n, n);
      } catch (...) {
        ++unmap_failures_;
        ++a_.upstream_free_failures_;
        break;
      }
      ++unmap_calls_;
      a_.up_frees_.fetch_add(1, std::memory_order_relaxed);
      pieces_.pop_back();
      vmb_->size -= n;
      a_.reserved_ -= n;
      tail->size -= n;
      released += n;
    }
    if (tail->size == 0) {  // the tail was whole pieces: its predecessor ends the range now
      ArenaChunk* p = tail->prev_addr;  // exists: the resident first piece is still mapped
      p->next_addr = nullptr;
      vmb_->last = p;
      a_.chunk_nodes_.destroy(tail);
    } else {
      a_.index_.insert(tail);
    }
    return released;
  }

  // The only free memory that could go is the free tail, which the failed growth was about to
  // extend: unmapping it would only make the next map larger.
  std::size_t release_for_oom(Detached&) override { return 0; }

  ArenaChunk* readopt(void*, std::size_t) override {
    throw InvariantViolation("ArenaPool #" + std::to_string(a_.id_) + ": an expandable range never detaches backings");
  }

  void close(Detached&) override { release_all(); }

  // The range holds live blocks: it stays mapped with the user (never freed under them).
  void release_unused(Detached&) override {
    if (!vmb_ || wholly_free(vmb_)) release_all();
  }

  // reserved == mapped == the one backing's size == the pieces; mapped <= va_bytes.
  void validate(const std::function<void(const std::string&)>& fail) const override {
    std::size_t mapped = 0;
    for (std::size_t n : pieces_) {
      if (!n || n % granule_) fail("mapped piece of " + std::to_string(n) + " bytes is not granule-sized");
      mapped += n;
    }
    const auto& backings = a_.backings_;
    if (backings.size() != (vmb_ ? 1u : 0u) || (vmb_ && backings[0] != vmb_)) fail("expandable pool holds other backings");
    if (vmb_ && (vmb_->addr != va_base_ || vmb_->size != mapped || vmb_->oversize))
      fail("expandable backing does not start at the range or disagrees with the mapped pieces");
    if (mapped != a_.reserved_) fail("mapped " + std::to_string(mapped) + " != reserved " + std::to_string(a_.reserved_));
    if (mapped > va_bytes_) fail("mapped beyond the reserved range");
    if (!vmb_ && !pieces_.empty()) fail("pieces mapped without a backing");
  }

  void stats(PoolStats& st) const override {
    st.extra.emplace_back("expandable", 1);
    st.extra.emplace_back("mapped_bytes", vmb_ ? vmb_->size : 0);
    st.extra.emplace_back("va_bytes", va_bytes_);
    st.extra.emplace_back("map_calls", map_calls_);
    st.extra.emplace_back("unmap_calls", unmap_calls_);
    st.extra.emplace_back("mapped_pieces", pieces_.size());
    st.extra.emplace_back("unmap_failures", unmap_failures_);
  }

 private:
  // close/destructor: everything unmapped and unreserved (failures counted, never thrown).
  void release_all() {
    if (vmb_) {
      for (ArenaChunk* c = vmb_->first; c;) {
        ArenaChunk* n = c->next_addr;
        if (c->where != ArenaChunk::kNowhere) a_.index_.remove(c);
        a_.chunk_nodes_.destroy(c);
        c = n;
      }
      auto& backings = a_.backings_;
      backings.erase(std::find(backings.begin(), backings.end(), vmb_));
      a_.reserved_ -= vmb_->size;
      if (vmb_->dirty) --a_.dirty_backings_;
      ++a_.backings_released_;
      std::size_t end = vmb_->size;
      delete vmb_;
      vmb_ = nullptr;
      while (!pieces_.empty()) {
        const std::size_t n = pieces_.back();
        try {
          a_.upstream_->unmap(va_base_ + end - n, n);
        } catch (...) {
          ++unmap_failures_;
          ++a_.upstream_free_failures_;
          return;  // the rest stays mapped (leaked and counted); the range cannot be unreserved
        }
        ++unmap_calls_;
        a_.up_frees_.fetch_add(1, std::memory_order_relaxed);
        pieces_.pop_back();
        end -= n;
      }
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
  std::size_t va_bytes_ = 0, granule_ = 0, tail_scans_ = 0;
  ArenaBacking* vmb_ = nullptr;  // the one backing; null until the first map
  std::vector<std::size_t> pieces_;  // mapped pieces, in address order from va_base_
  std::uint64_t map_calls_ = 0, unmap_calls_ = 0, unmap_failures_ = 0;
};

std::unique_ptr<BackingSource> make_virtual_range(ArenaPool& arena) { return std::make_unique<VirtualRange>(arena); }

}  // namespace poolkeeper::detail
