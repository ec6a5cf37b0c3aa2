// PointerTable<V>: open addressing with linear probing and tombstones, mapping a block address to
// its record (a pointer-sized value). Load (live + tombstones) stays <= 1/2, so probes are short,
// and insert/erase touch no allocator once the slot array has grown to the working set.
//
// Concurrency: ONE writer at a time (the owning pool's lock), any number of lock-free readers.
// - A key is published with a release store after its value is written; readers load it acquire.
// - Slots only ever go empty -> key -> tombstone -> key; never back to empty in a live array, so a
//   reader's probe chain for a key present before it started is never cut short.
// - Growth rehashes into a new array and retires the old one (kept until the table dies), so a
//   reader still walking the old array reads valid memory holding the same live keys.
// A reader racing an erase of the very key it looks up is a user race (a double free), not ours.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace poolkeeper::detail {

template <class V>
class PointerTable {
  static_assert(sizeof(V) <= sizeof(std::uintptr_t));
  static constexpr std::uintptr_t kEmpty = 0;
  static constexpr std::uintptr_t kTomb = 1;  // addresses are >= 256-aligned, never 1

  struct Slot {
    std::atomic<std::uintptr_t> key{kEmpty};
    V value{};
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
    auto a = std::make_unique<Array>(c);
    cur_.store(a.get(), std::memory_order_release);
    arrays_.push_back(std::move(a));
  }

  static std::size_t hash(std::uintptr_t k) {
    // Addresses share low zero bits and high prefix bits; a multiplicative mix spreads them.
    k ^= k >> 29;
    k *= 0xbf58476d1ce4e5b9ULL;
    k ^= k >> 32;
    return static_cast<std::size_t>(k);
  }

  // Lock-free. Returns true and sets out when key is present.
  bool find(std::uintptr_t key, V& out) const {
    const Array* a = cur_.load(std::memory_order_acquire);
    std::size_t i = hash(key) & a->mask;
    for (;;) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_acquire);
      if (k == key) {
        out = a->slots[i].value;
        return true;
      }
      if (k == kEmpty) return false;
      i = (i + 1) & a->mask;
    }
  }

  // Writer only. key must not be present.
  void insert(std::uintptr_t key, V value) {
    if ((used_ + 1) * 2 > cur()->cap) grow();
    Array* a = cur();
    std::size_t i = hash(key) & a->mask;
    for (;;) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_relaxed);
      if (k == kEmpty || k == kTomb) {
        a->slots[i].value = value;
        a->slots[i].key.store(key, std::memory_order_release);
        if (k == kEmpty) ++used_;
        else --tombs_;
        ++size_;
        return;
      }
      i = (i + 1) & a->mask;
    }
  }

  // Writer only. Returns false when absent.
  bool erase(std::uintptr_t key) {
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

  template <class F>
  void for_each(F&& f) const {
    const Array* a = cur_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < a->cap; ++i) {
      const std::uintptr_t k = a->slots[i].key.load(std::memory_order_acquire);
      if (k != kEmpty && k != kTomb) f(k, a->slots[i].value);
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
  // Invariant: size + tombstones == used slots, and used <= capacity / 2.
  bool consistent() const { return size_ + tombs_ == used_ && used_ * 2 <= cur_.load()->cap; }

 private:
  Array* cur() const { return cur_.load(std::memory_order_relaxed); }

  void grow() {
    // Rehash; double only when live keys (not tombstones) fill a quarter, so insert/erase churn at
    // a steady size just sweeps tombstones and the array stops growing.
    const Array* old = cur();
    std::size_t cap = old->cap;
    if ((size_ + 1) * 4 > cap) cap <<= 1;
    auto a = std::make_unique<Array>(cap);
    for (std::size_t i = 0; i < old->cap; ++i) {
      const std::uintptr_t k = old->slots[i].key.load(std::memory_order_relaxed);
      if (k == kEmpty || k == kTomb) continue;
      std::size_t j = hash(k) & a->mask;
      while (a->slots[j].key.load(std::memory_order_relaxed) != kEmpty) j = (j + 1) & a->mask;
      a->slots[j].value = old->slots[i].value;
      a->slots[j].key.store(k, std::memory_order_relaxed);
    }
    used_ = size_;
    tombs_ = 0;
    ++grows_;
    cur_.store(a.get(), std::memory_order_release);
    // Retired arrays stay alive for lock-free readers that may still walk them. Same-size sweeps
    // reuse nothing, so bound the list: beyond 8 retired arrays of the current size, the oldest
    // same-size ones are long unreachable (readers hold an array only for one probe).
    arrays_.push_back(std::move(a));
    if (arrays_.size() > 16) arrays_.erase(arrays_.begin(), arrays_.begin() + 8);
  }

  std::atomic<Array*> cur_{nullptr};
  std::vector<std::unique_ptr<Array>> arrays_;
  std::size_t used_ = 0, size_ = 0, tombs_ = 0, grows_ = 0;
};

}  // namespace poolkeeper::detail
