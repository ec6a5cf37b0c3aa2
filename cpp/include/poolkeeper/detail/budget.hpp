// Budget: the limit and reserved-bytes books of every pool (DirectPool, SizeClassPool, ArenaPool):
// the one place the limit rule lives.
//
// held = reserved + claimed + releasing never passes the limit:
// - claimed: bytes of an upstream call in flight (pools that call the upstream outside their lock
//   claim before the call, so concurrent callers cannot pass the limit together); they become
//   reserved when the upstream gives them, and are dropped when it refuses;
// - releasing: bytes handed back whose upstream free has not returned yet (a refused free comes
//   back, so they still count).
// A pool that grows under its own lock (ArenaPool) asks grant() for the size of a growth step.
// Not thread-safe: the owning pool's lock guards it (named beside the member).
#pragma once
#include <algorithm>
#include <cstddef>

namespace poolkeeper::detail {

struct Budget {
  std::size_t limit = 0;  // 0: none
  std::size_t reserved = 0, claimed = 0, releasing = 0, peak_reserved = 0;

  std::size_t held() const { return reserved + claimed + releasing; }

  // Claims n bytes for an upstream call; false (nothing claimed) if the limit would be passed.
  bool claim(std::size_t n) {
    if (limit && held() + n > limit) return false;
    claimed += n;
    return true;
  }
  void cancel(std::size_t n) { claimed -= n; }  // the call failed
  void commit(std::size_t n) {                  // the call gave the bytes
    claimed -= n;
    reserved += n;
    peak_reserved = std::max(peak_reserved, reserved);
  }
  void release(std::size_t n) { reserved -= n; }
  void reset_peak() { peak_reserved = reserved; }

  // A growth step under the pool's lock: `want` bytes, of which `need` (<= want) are required, cut
  // down to a multiple of `unit` at the limit. 0: even `need` would pass it.
  std::size_t grant(std::size_t need, std::size_t want, std::size_t unit) const {
    if (!limit) return want;
    if (held() + need > limit) return 0;
    if (held() + want > limit) want = std::max(need, (limit - held()) / unit * unit);
    return want;
  }
  void grow(std::size_t n) {  // bytes the upstream gave (no claim: the lock was held throughout)
    reserved += n;
    peak_reserved = std::max(peak_reserved, reserved);
  }
  void start_release(std::size_t n) {  // out of reserved, held until the upstream's free returns
    reserved -= n;
    releasing += n;
  }
  void end_release(std::size_t n) { releasing -= n; }
};

}  // namespace poolkeeper::detail
