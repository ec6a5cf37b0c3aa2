// PointerTable<V>: open addressing with linear probing and tombstones, mapping a block address to
// its record (a pointer-sized value). Load (live + tombstones) stays <= 1/2, so probes are short,
// and insert/erase touch no allocator once the slot array has grown to the working set.
//
// Concurrency: ONE writer at a time (the owning pool's lock), any number of lock-free readers.
// A lock-free find() may miss a key that is present (while the writer sweeps tombstones in
// place); callers treat a miss as "take the locked path", where the lookup is authoritative.
// A hit is never wrong: the reader re-reads the key after the value and retries on a change.
// - Growth (doubling) moves to a new array and retires the old one, kept until the table dies:
//   a reader still walking it reads valid memory. Retired arrays total less than the live one.
// - Tombstone sweeps rehash in place through a scratch buffer sized with the array, so churn at a
//   steady size never allocates and never grows the table.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace poolkeeper::detail {

template <class V>
class PointerTable {
  static constexpr std::uintptr_t kEmpty = 0;
  static constexpr std::uintptr_t kTomb = 1;  // addresses are >= 2-aligned, never 1

  struct Slot {
    std::atomic<std::uintptr_t> key{kEmpty};
    std::atomic<V> value{};
  };
  struct Array {
    explicit Array(std::size_t cap) : cap(cap), mask(cap - 1), slots(new Slot[cap]) {}
    std::size_t cap, mask;
    std::unique_ptr<Slot[]> slots;
  };

 public:
  explicit PointerTable(std::size_t initial_capacity = 64) {
    std::size_t c = 16;
    while (c < initial_capacity) c <<= 1;
    install(std::make_unique<Array>(c));
  }

  static std::size_t hash(std::uintptr_t k) {
    // Addresses share low zero bits and high prefix bits; a multiplicative mix spreads them.
    k ^= k >> 29;
    k *= 0xbf58476d1ce4e5b9ULL;
    k ^= k >> 32;
    return static_cast<std::size_t>(k);
  }

  // Lock-free. True and out set when key is present; may report a present key as absent while a
  // sweep runs (see above). Exact when called under the writer's lock.
  bool find(std::uintptr_t key, V& out) const {
    if (key <= kTomb) return false;  // 0 and 1 mark empty slots and tombstones: never real keys
    const Array* a = cur_.load(std::memory_order_acquire);
    std::size_t i = hash(key) & a->mask;
    for (std::size_t probes = 0; probes < a->cap; ++probes) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_acquire);
      if (k == key) {
        const V v = a->slots[i].value.load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (a->slots[i].key.load(std::memory_order_relaxed) != key) return false;
        out = v;
        return true;
      }
      if (k == kEmpty) return false;
      i = (i + 1) & a->mask;
    }
    return false;
  }

  // Writer only. key must not be present, and must be > 1 (addresses always are).
  void insert(std::uintptr_t key, V value) {
    if ((used_ + 1) * 2 > cur()->cap) rehash();
    place(cur(), key, value);
    ++size_;
  }

  // Writer only. Returns false when absent.
  bool erase(std::uintptr_t key) {
    if (key <= kTomb) return false;
    Array* a = cur();
    std::size_t i = hash(key) & a->mask;
    for (;;) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_relaxed);
      if (k == key) {
        a->slots[i].key.store(kTomb, std::memory_order_release);
        --size_;
        ++tombs_;
        return true;
      }
      if (k == kEmpty) return false;
      i = (i + 1) & a->mask;
    }
  }

  // Writer only (or quiescent).
  template <class F>
  void for_each(F&& f) const {
    const Array* a = cur_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < a->cap; ++i) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_acquire);
      if (k != kEmpty && k != kTomb) f(k, a->slots[i].value.load(std::memory_order_relaxed));
    }
  }

  void clear() {
    Array* a = cur();
    for (std::size_t i = 0; i < a->cap; ++i) a->slots[i].key.store(kEmpty, std::memory_order_release);
    used_ = size_ = tombs_ = 0;
  }

  std::size_t size() const { return size_; }
  std::size_t capacity() const { return cur_.load(std::memory_order_acquire)->cap; }
  std::size_t tombstones() const { return tombs_; }
  std::size_t grows() const { return grows_; }
  std::size_t sweeps() const { return sweeps_; }
  // Invariant: size + tombstones == used slots, and used <= capacity / 2.
  bool consistent() const {
    std::size_t live = 0, tomb = 0;
    const Array* a = cur_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < a->cap; ++i) {
      const auto k = a->slots[i].key.load(std::memory_order_relaxed);
      live += (k != kEmpty && k != kTomb);
      tomb += (k == kTomb);
    }
    return live == size_ && tomb == tombs_ && size_ + tombs_ == used_ && used_ * 2 <= a->cap;
  }

 private:
  Array* cur() const { return cur_.load(std::memory_order_relaxed); }

  void install(std::unique_ptr<Array> a) {
    scratch_.assign(a->cap, {0, V{}});
    cur_.store(a.get(), std::memory_order_release);
    arrays_.push_back(std::move(a));
  }

  void place(Array* a, std::uintptr_t key, V value) {
    std::size_t i = hash(key) & a->mask;
    for (;;) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_relaxed);
      if (k == kEmpty || k == kTomb) {
        a->slots[i].value.store(value, std::memory_order_relaxed);
        a->slots[i].key.store(key, std::memory_order_release);
        if (k == kEmpty) ++used_;
        else --tombs_;
        return;
      }
      i = (i + 1) & a->mask;
    }
  }

  void rehash() {
    Array* a = cur();
    if ((size_ + 1) * 4 > a->cap) {
      // Live keys fill a quarter: double. The old array is retired, never freed under a reader.
      auto b = std::make_unique<Array>(a->cap * 2);
      Array* nb = b.get();
      std::size_t n = 0;
      for (std::size_t i = 0; i < a->cap; ++i) {
        const auto k = a->slots[i].key.load(std::memory_order_relaxed);
        if (k == kEmpty || k == kTomb) continue;
        scratch_[n++] = {k, a->slots[i].value.load(std::memory_order_relaxed)};
      }
      used_ = tombs_ = 0;
      for (std::size_t j = 0; j < n; ++j) place(nb, scratch_[j].first, scratch_[j].second);
      install(std::move(b));
      ++grows_;
      return;
    }
    // Mostly tombstones: sweep in place. Concurrent readers may miss keys meanwhile and fall back
    // to the locked path; none can read freed memory.
    std::size_t n = 0;
    for (std::size_t i = 0; i < a->cap; ++i) {
      const auto k = a->slots[i].key.load(std::memory_order_relaxed);
      if (k != kEmpty && k != kTomb) scratch_[n++] = {k, a->slots[i].value.load(std::memory_order_relaxed)};
      a->slots[i].key.store(kEmpty, std::memory_order_release);
    }
    used_ = tombs_ = 0;
    for (std::size_t j = 0; j < n; ++j) place(a, scratch_[j].first, scratch_[j].second);
    ++sweeps_;
  }

  std::atomic<Array*> cur_{nullptr};
  std::vector<std::unique_ptr<Array>> arrays_;
  std::vector<std::pair<std::uintptr_t, V>> scratch_;
  std::size_t used_ = 0, size_ = 0, tombs_ = 0, grows_ = 0, sweeps_ = 0;
};

}  // namespace poolkeeper::detail
