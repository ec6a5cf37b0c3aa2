#include "poolkeeper/upstreams/simulated_upstream.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <type_traits>

namespace poolkeeper {

void busy_wait_us(double us) {
  if (!(us > 0)) return;
  us = std::min(us, kMaxSimulatedCallUs);
  // A busy-wait, not a sleep: a sleep of 40 us costs 50-100 us on a loaded 2-core machine, and
  // cudaMalloc itself keeps its thread busy.
  const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(static_cast<long long>(us * 1000.0));
  while (std::chrono::steady_clock::now() < end) {
  }
}

namespace {
constexpr std::uintptr_t kFirst = std::uintptr_t{0x2000} << 32;  // 0x2000_0000_0000
constexpr std::uintptr_t kRange = std::uintptr_t{1} << 40;       // 1 TiB per instance
std::atomic<std::uintptr_t> g_instances{0};
// Each simulated device gets its own range, so two never hand out the same address (a pointer
// freed into the wrong pool is then told apart, as on real devices). 4096 ranges keep every
// address below 2^53, exact as a JavaScript number (the HTML memory map).
std::uintptr_t next_base() { return kFirst + (g_instances.fetch_add(1) % 4096) * kRange; }
}  // namespace

SimulatedUpstream::SimulatedUpstream(LatencyModel model, std::size_t capacity, std::size_t alignment)
    : model_(model), capacity_(capacity), alignment_(alignment), base_(next_base()), next_addr_(base_) {
  if (!is_pow2(alignment)) throw InvalidArgument("Simulated alignment must be a power of two");
  const double worst = std::max(model.alloc_us(0), model.free_us(0));
  if (!std::isfinite(worst) || worst < 0 || worst > kMaxSimulatedCallUs)
    throw InvalidArgument("Simulated latency must be finite, >= 0 and at most one second per call");
  if (capacity == 0) throw InvalidArgument("Simulated capacity must be positive");
}

void* SimulatedUpstream::do_allocate(std::size_t nbytes) {
  // Refuse what can never fit before paying its latency: the modelled cost of a 2^62-byte request
  // is days of busy-waiting. (Racing allocations are checked again below, under the lock.)
  if (nbytes == 0 || nbytes > kMaxRequest || align_up(nbytes, alignment_) > capacity_) {
    std::lock_guard<detail::ForkSafeMutex> g(mu_);
    throw_oom_locked(nbytes);
  }
  busy_wait_us(model_.alloc_us(nbytes));
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("allocate (cuMemAlloc)", false);
  const std::size_t n = align_up(nbytes, alignment_);
  if (used_ + n > capacity_) throw_oom_locked(nbytes);
  const std::uintptr_t a = place_locked(align_up(n, 4096), 4096);
  live_.emplace(a, nbytes);
  used_ += n;
  return reinterpret_cast<void*>(a);
}

void SimulatedUpstream::throw_oom_locked(std::size_t nbytes) const {
  const std::size_t used = used_;
  throw UpstreamOutOfMemory("simulated device out of memory: asked " + format_bytes(nbytes) + ", " +
                                format_bytes(capacity_ - std::min(capacity_, used)) + " of " + format_bytes(capacity_) +
                                " left",
                            "Simulated", "CUDA_ERROR_OUT_OF_MEMORY", 2);
}

std::uintptr_t SimulatedUpstream::place_locked(std::size_t span, std::size_t align) {
  // Addresses are not reused while the range lasts, so a stale pointer cannot alias a new block
  // by accident. After 1 TiB of traffic the cursor wraps and skips over blocks still live.
  std::uintptr_t a = align_up(next_addr_, align);
  for (int lap = 0;; ++lap) {
    if (a + span > base_ + kRange || a + span < a) {
      if (lap > 1) throw UpstreamOutOfMemory("simulated device: no free address range of " + format_bytes(span), "Simulated",
                                             "CUDA_ERROR_OUT_OF_MEMORY", 2);
      a = base_;
    }
    auto it = live_.lower_bound(a);
    if (it != live_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + align_up(prev->second, 4096) > a) {
        a = align_up(prev->first + align_up(prev->second, 4096), align);
        continue;
      }
    }
    if (it != live_.end() && it->first < a + span) {
      a = align_up(it->first + align_up(it->second, 4096), align);
      continue;
    }
    break;
  }
  next_addr_ = a + span;
  return a;
}

std::size_t SimulatedUpstream::mapped_bytes() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  std::size_t n = 0;
  for (auto& [a, r] : ranges_)
    for (auto& [pa, pn] : r.pieces) n += pn;
  return n;
}

static void vm_fail(const std::string& what) {
  throw UpstreamFailure("simulated device: " + what, "Simulated", "CUDA_ERROR_INVALID_VALUE", 1);
}

std::uintptr_t SimulatedUpstream::do_reserve(std::size_t bytes) {
  if (bytes == 0 || bytes % kGranule) vm_fail("reserve of " + format_bytes(bytes) + " is not a positive multiple of 2 MiB");
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  const std::uintptr_t a = place_locked(bytes, kGranule);
  live_.emplace(a, bytes);
  ranges_[a].size = bytes;
  return a;
}

SimulatedUpstream::Range* SimulatedUpstream::range_of_locked(std::uintptr_t addr, std::size_t bytes) {
  auto it = ranges_.upper_bound(addr);
  if (it == ranges_.begin()) return nullptr;
  --it;
  if (addr + bytes > it->first + it->second.size || addr + bytes < addr) return nullptr;
  return &it->second;
}

void SimulatedUpstream::do_map(std::uintptr_t addr, std::size_t bytes) {
  if (bytes > capacity_) {
    std::lock_guard<detail::ForkSafeMutex> g(mu_);
    throw_oom_locked(bytes);
  }
  busy_wait_us(model_.alloc_us(bytes));
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("map (cuMemMap)", false);
  if (bytes == 0 || bytes % kGranule || addr % kGranule)
    vm_fail("map of " + format_bytes(bytes) + " at " + format_ptr(addr) + " is not 2 MiB-aligned");
  Range* r = range_of_locked(addr, bytes);
  if (!r) vm_fail("map at " + format_ptr(addr) + " (" + format_bytes(bytes) + ") is outside every reserved range");
  if (occupied_locked(*r, addr, bytes)) vm_fail("map at " + format_ptr(addr) + " overlaps a mapped piece or alias");
  if (used_ + bytes > capacity_)
    throw UpstreamOutOfMemory("simulated device out of memory: map of " + format_bytes(bytes) + ", " +
                                  format_bytes(capacity_ - std::min(capacity_, used_)) + " of " +
                                  format_bytes(capacity_) + " left",
                              "Simulated", "CUDA_ERROR_OUT_OF_MEMORY", 2);
  r->pieces.emplace(addr, bytes);
  used_ += bytes;
}

void SimulatedUpstream::do_unmap(std::uintptr_t addr, std::size_t bytes) {
  busy_wait_us(model_.free_us(bytes));
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("unmap (cuMemUnmap)", true);
  Range* r = range_of_locked(addr, bytes);
  auto it = r ? r->pieces.find(addr) : decltype(r->pieces.end()){};
  if (!r || it == r->pieces.end() || it->second != bytes)
    vm_fail("unmap at " + format_ptr(addr) + " (" + format_bytes(bytes) + ") is not one mapped piece");
  if (alias_refs_.count(addr))
    vm_fail("unmap at " + format_ptr(addr) + " while " + std::to_string(alias_refs_[addr]) + " alias(es) of it are mapped");
  r->pieces.erase(it);
  used_ -= bytes;
}

void SimulatedUpstream::do_unreserve(std::uintptr_t addr, std::size_t bytes) {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  auto it = ranges_.find(addr);
  if (it == ranges_.end() || it->second.size != bytes)
    vm_fail("unreserve of " + format_ptr(addr) + " (" + format_bytes(bytes) + ") is not a reserved range");
  if (!it->second.aliases.empty())
    vm_fail("unreserve of " + format_ptr(addr) + " while " + std::to_string(it->second.aliases.size()) +
            " alias(es) are still mapped");
  if (!it->second.pieces.empty())
    vm_fail("unreserve of " + format_ptr(addr) + " while " + std::to_string(it->second.pieces.size()) +
            " piece(s) are still mapped");
  ranges_.erase(it);
  live_.erase(addr);
}

bool SimulatedUpstream::occupied_locked(const Range& r, std::uintptr_t addr, std::size_t bytes) const {
  auto hit = [&](const auto& m) {
    auto it = m.lower_bound(addr);
    if (it != m.end() && it->first < addr + bytes) return true;
    if (it == m.begin()) return false;
    --it;
    const std::size_t n = [&] {
      if constexpr (std::is_same_v<std::decay_t<decltype(it->second)>, std::size_t>) return it->second;
      else return it->second.second;
    }();
    return it->first + n > addr;
  };
  return hit(r.pieces) || hit(r.aliases);
}

void SimulatedUpstream::do_alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) {
  busy_wait_us(model_.alloc_us(bytes));
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("alias (cuMemMap)", false);
  if (bytes == 0 || bytes % kGranule || dst % kGranule)
    vm_fail("alias of " + format_bytes(bytes) + " at " + format_ptr(dst) + " is not 2 MiB-aligned");
  Range* sr = range_of_locked(src, bytes);
  auto sp = sr ? sr->pieces.find(src) : decltype(sr->pieces.end()){};
  if (!sr || sp == sr->pieces.end() || sp->second != bytes)
    vm_fail("alias source " + format_ptr(src) + " (" + format_bytes(bytes) + ") is not one mapped piece");
  Range* r = range_of_locked(dst, bytes);
  if (!r) vm_fail("alias at " + format_ptr(dst) + " (" + format_bytes(bytes) + ") is outside every reserved range");
  if (occupied_locked(*r, dst, bytes)) vm_fail("alias at " + format_ptr(dst) + " overlaps a mapped piece or alias");
  r->aliases.emplace(dst, std::make_pair(src, bytes));
  ++alias_refs_[src];
}

void SimulatedUpstream::do_unalias(std::uintptr_t dst, std::size_t bytes) {
  busy_wait_us(model_.free_us(bytes));
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("unalias (cuMemUnmap)", true);
  Range* r = range_of_locked(dst, bytes);
  auto it = r ? r->aliases.find(dst) : decltype(r->aliases.end()){};
  if (!r || it == r->aliases.end() || it->second.second != bytes)
    vm_fail("unalias at " + format_ptr(dst) + " (" + format_bytes(bytes) + ") is not one alias");
  auto ref = alias_refs_.find(it->second.first);
  if (--ref->second == 0) alias_refs_.erase(ref);
  r->aliases.erase(it);
}

std::size_t SimulatedUpstream::aliased_bytes() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  std::size_t n = 0;
  for (auto& [a, r] : ranges_)
    for (auto& [pa, src] : r.aliases) n += src.second;
  return n;
}

std::uintptr_t SimulatedUpstream::physical(std::uintptr_t addr) const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  auto it = ranges_.upper_bound(addr);
  if (it == ranges_.begin()) return 0;
  const Range& r = (--it)->second;
  if (addr >= it->first + r.size) return 0;
  auto in = [&](const auto& m) {
    auto x = m.upper_bound(addr);
    return x == m.begin() ? m.end() : std::prev(x);
  };
  if (auto p = in(r.pieces); p != r.pieces.end() && addr < p->first + p->second) return addr;
  if (auto a = in(r.aliases); a != r.aliases.end() && addr < a->first + a->second.second) return a->second.first + (addr - a->first);
  return 0;
}

void SimulatedUpstream::do_deallocate(void* p, std::size_t nbytes) {
  busy_wait_us(model_.free_us(nbytes));
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("deallocate (cuMemFree)", true);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == live_.end() || it->second != nbytes || ranges_.count(it->first))
    throw UpstreamFailure("simulated device: invalid free of " + format_ptr(reinterpret_cast<std::uintptr_t>(p)) +
                              " (" + format_bytes(nbytes) + ")",
                          "Simulated", "CUDA_ERROR_INVALID_VALUE", 1);
  used_ -= align_up(it->second, alignment_);
  live_.erase(it);
}

Stream SimulatedUpstream::new_stream() {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  const Stream s = next_stream_++;
  busy_[s] = now_;
  return s;
}

void SimulatedUpstream::destroy_stream(Stream s) {
  if (s == kNoStream || s == 0) throw InvalidArgument("destroy_stream: the default stream cannot be destroyed");
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (!destroyed_.insert(s).second) throw InvalidArgument("destroy_stream: stream " + format_stream(s) + " is already destroyed");
  if (s >= next_stream_) next_stream_ = s + 1;  // new_stream() never hands a dead id out again
}

std::uint64_t SimulatedUpstream::events_recorded() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return events_recorded_;
}

static void dead_stream(Stream s, const char* what) {
  throw UpstreamFailure(std::string("simulated device: ") + what + " on destroyed stream " + format_stream(s) +
                            ": CUDA_ERROR_INVALID_HANDLE (invalid resource handle)",
                        "Simulated", "CUDA_ERROR_INVALID_HANDLE", 400);
}

double SimulatedUpstream::busy_locked(Stream s) const {
  auto it = busy_.find(s);
  return it == busy_.end() ? 0.0 : it->second;
}

void SimulatedUpstream::enqueue(Stream s, double work_us) {
  if (!std::isfinite(work_us) || work_us < 0) throw InvalidArgument("enqueue: work_us must be finite and >= 0");
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (destroyed_.count(s)) dead_stream(s, "enqueue");
  busy_[s] = std::max(busy_locked(s), now_) + work_us;
}

void SimulatedUpstream::advance(double us) {
  if (!std::isfinite(us) || us < 0)
    throw InvalidArgument("advance: the virtual clock only moves forward, by a finite step");
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  now_ += us;
}

double SimulatedUpstream::now() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return now_;
}

double SimulatedUpstream::stream_busy_until(Stream s) const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return std::max(busy_locked(s), now_);
}

std::size_t SimulatedUpstream::live_events() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return event_time_.size() - free_events_.size();
}

EventId SimulatedUpstream::record_event(Stream s) {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (destroyed_.count(s)) dead_stream(s, "event record");
  if (auto it = captures_.find(s); it != captures_.end()) {
    ++capture_violations_;
    last_violation_ = "record_event on capturing stream " + format_stream(s);
    for (auto& [cs, c] : captures_) c.valid = false;
  }
  ++events_recorded_;
  const double t = std::max(busy_locked(s), now_);
  if (!free_events_.empty()) {
    const EventId e = free_events_.back();
    free_events_.pop_back();
    event_time_[e - 1] = t;
    return e;
  }
  event_time_.push_back(t);
  return event_time_.size();
}

bool SimulatedUpstream::query_event(EventId e) {
  if (e == kNullEvent) return true;
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (e > event_time_.size() || event_time_[e - 1] < 0) throw InvalidArgument("query of an unknown simulated event");
  check_capture_locked("query_event (cuEventQuery)", false);
  return now_ >= event_time_[e - 1];
}

void SimulatedUpstream::wait_event(EventId e) {
  if (e == kNullEvent) return;
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (e > event_time_.size() || event_time_[e - 1] < 0) throw InvalidArgument("wait on an unknown simulated event");
  check_capture_locked("wait_event (cuEventSynchronize)", false);
  now_ = std::max(now_, event_time_[e - 1]);
}

void SimulatedUpstream::release_event(EventId e) {
  if (e == kNullEvent) return;
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (e > event_time_.size() || event_time_[e - 1] < 0) return;
  event_time_[e - 1] = -1;
  free_events_.push_back(e);
}

void SimulatedUpstream::synchronize() {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  check_capture_locked("synchronize (cuCtxSynchronize)", true);
  for (auto& [s, t] : busy_) now_ = std::max(now_, t);
}

// ---- graph capture model ----

namespace {
thread_local int t_capture_mode = 0;  // CUDA keeps the mode per thread, whatever the device
}

int SimulatedUpstream::exchange_capture_mode(int mode) {
  const int prev = t_capture_mode;
  t_capture_mode = mode;
  return prev;
}

void SimulatedUpstream::begin_capture(Stream s, int mode) {
  if (s == kNoStream) throw InvalidArgument("begin_capture: the legacy stream cannot be captured");
  if (mode < 0 || mode > 2) throw InvalidArgument("begin_capture: mode must be 0 (global), 1 (thread-local) or 2 (relaxed)");
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  if (captures_.count(s)) throw InvalidArgument("begin_capture: stream " + format_stream(s) + " is already capturing");
  captures_[s] = Capture{mode, true};
}

bool SimulatedUpstream::end_capture(Stream s) {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  auto it = captures_.find(s);
  if (it == captures_.end()) throw InvalidArgument("end_capture: stream " + format_stream(s) + " is not capturing");
  const bool valid = it->second.valid;
  captures_.erase(it);
  return valid;
}

bool SimulatedUpstream::stream_capturing(Stream s) {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return captures_.count(s) != 0;
}

std::uint64_t SimulatedUpstream::capture_violations() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return capture_violations_;
}

std::string SimulatedUpstream::last_capture_violation() const {
  std::lock_guard<detail::ForkSafeMutex> g(mu_);
  return last_violation_;
}

void SimulatedUpstream::check_capture_locked(const char* call, bool synchronizes) {
  if (captures_.empty()) return;
  bool global = false;
  for (auto& [s, c] : captures_) global |= c.mode == 0;
  const bool relaxed = t_capture_mode == 2;
  if (!synchronizes && (relaxed || !global)) return;
  ++capture_violations_;
  last_violation_ = std::string(call) + (synchronizes ? " synchronizes the device during a capture"
                                                       : " during a global-mode capture, thread not in relaxed mode");
  for (auto& [s, c] : captures_) c.valid = false;
}

}  // namespace poolkeeper
