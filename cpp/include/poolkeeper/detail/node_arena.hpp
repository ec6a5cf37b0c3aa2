// NodeArena<T>: fixed-size bookkeeping nodes from slabs, with a free list. A pool that called the
// general heap to describe its own state would have a dependency whose latency it cannot control,
// and under its lock that latency is every thread's. Slabs are only freed with the arena.
// Not thread-safe: used under the owning pool's lock.
#pragma once
#include <cstddef>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace poolkeeper::detail {

template <class T>
class NodeArena {
  union Cell {
    Cell* next;
    alignas(T) unsigned char storage[sizeof(T)];
  };

 public:
  explicit NodeArena(std::size_t slab_nodes = 256) : slab_nodes_(slab_nodes) {}
  ~NodeArena() = default;  // nodes are trivially abandoned; owners destroy what they created
  NodeArena(const NodeArena&) = delete;
  NodeArena& operator=(const NodeArena&) = delete;

  template <class... A>
  T* create(A&&... args) {
    void* p = raw();
    ++live_;
    return new (p) T(std::forward<A>(args)...);
  }
  void destroy(T* t) {
    t->~T();
    Cell* c = reinterpret_cast<Cell*>(t);
    c->next = free_;
    free_ = c;
    --live_;
  }
  // Raw storage for allocator use (std::set nodes).
  void* raw() {
    if (!free_) refill();
    Cell* c = free_;
    free_ = c->next;
    return c;
  }
  void release_raw(void* p) {
    Cell* c = static_cast<Cell*>(p);
    c->next = free_;
    free_ = c;
  }
  std::size_t live() const { return live_; }
  std::size_t slabs() const { return slabs_.size(); }

 private:
  void refill() {
    slabs_.emplace_back(new Cell[slab_nodes_]);
    Cell* s = slabs_.back().get();
    for (std::size_t i = 0; i < slab_nodes_; ++i) {
      s[i].next = free_;
      free_ = &s[i];
    }
  }
  std::size_t slab_nodes_;
  Cell* free_ = nullptr;
  std::size_t live_ = 0;
  std::vector<std::unique_ptr<Cell[]>> slabs_;
};

// A std::allocator-compatible front for NodeArena, so a std::set's nodes come from the arena
// (one node type per arena; the set asks for exactly one node at a time).
template <class T>
struct ArenaAllocator {
  using value_type = T;
  // Rebinding needs a size-agnostic pool: nodes are served from a per-size free list.
  struct Pool {
    std::vector<std::pair<std::size_t, std::vector<void*>>> free_lists;
    std::vector<std::unique_ptr<unsigned char[]>> slabs;
    void* get(std::size_t n) {
      for (auto& [sz, fl] : free_lists)
        if (sz == n) {
          if (fl.empty()) refill(n, fl);
          void* p = fl.back();
          fl.pop_back();
          return p;
        }
      free_lists.emplace_back(n, std::vector<void*>{});
      return get(n);
    }
    void put(std::size_t n, void* p) {
      for (auto& [sz, fl] : free_lists)
        if (sz == n) return fl.push_back(p);
    }
    void refill(std::size_t n, std::vector<void*>& fl) {
      const std::size_t stride = (n + 15) & ~std::size_t{15};
      const std::size_t count = 256;
      slabs.emplace_back(new unsigned char[stride * count]);
      fl.reserve(fl.size() + count);
      for (std::size_t i = 0; i < count; ++i) fl.push_back(slabs.back().get() + i * stride);
    }
  };
  std::shared_ptr<Pool> pool;

  ArenaAllocator() : pool(std::make_shared<Pool>()) {}
  template <class U>
  ArenaAllocator(const ArenaAllocator<U>& o) : pool(o.pool) {}
  T* allocate(std::size_t n) {
    if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
    return static_cast<T*>(pool->get(sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n != 1) return ::operator delete(p);
    pool->put(sizeof(T), p);
  }
  template <class U>
  bool operator==(const ArenaAllocator<U>& o) const { return pool == o.pool; }
};

}  // namespace poolkeeper::detail
