// Budget: the limit's books for a pool that grows one upstream call at a time (DirectPool,
// SizeClassPool). The arena's backing sources apply the same rule to their growth steps.
//
// Bytes of an upstream call in flight are claimed before the call and count against the limit
// until it answers, so concurrent callers cannot pass the limit together; they become reserved
// when the upstream gives them, and are dropped when it refuses.
// Not thread-safe: the owning pool's lock guards it (named beside the member).
#pragma once
#include <algorithm>
#include <cstddef>

namespace poolkeeper::detail {

struct Budget {
  std::size_t limit = 0;  // 0: none
  std::size_t reserved = 0, claimed = 0, peak_reserved = 0;

  // Claims n bytes for an upstream call; false (nothing claimed) if the limit would be passed.
  bool claim(std::size_t n) {
    if (limit && reserved + claimed + n > limit) return false;
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
};

}  // namespace poolkeeper::detail
