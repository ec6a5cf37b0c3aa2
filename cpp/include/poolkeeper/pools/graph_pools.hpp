// GraphPools: CUDA-graph private pools over one device pool (docs/integrations.md, "CUDA graphs").
//
// A captured graph bakes the addresses of every buffer it touches into its kernels. Memory the
// graph allocated while it was captured must therefore keep its address, and never be handed to
// other work, for as long as the graph can be replayed -- even where the capture freed it (the
// replay writes there again). PyTorch names such memory a graph's private pool and tells an
// allocator when to use one: begin(id, filter) before the capture starts, end(id) when it is
// over, release(id) when the graph (or torch.cuda.MemPool) that held the pool is gone.
//
// The rules here:
// - Between begin(id, filter) and end(id), an allocation whose stream passes filter comes from
//   the private pool `id` (several scopes may be open at once, on several threads; the latest
//   opened wins, as in PyTorch). Every other allocation goes to the device pool (`main`).
// - A private pool is an ArenaPool with no thread cache and no automatic shrink, whose backings
//   are blocks of the device pool: graph memory is drawn from (and given back to) the device
//   pool's cache, so a capture usually needs no cuMemAlloc at all, and `main`'s trim() or
//   torch.cuda.empty_cache() can never hand graph memory to the driver (to `main`, it is live).
// - A block freed during a capture returns to its private pool, where only allocations of the
//   same pool (later in the same capture, or a later capture sharing the pool) can reuse it --
//   the order of one graph, or the replay order the user promised when sharing a pool handle.
// - A block of a private pool freed at any later time goes back to that private pool.
// - release(id) drops one use (begin(id) added one; a second capture into a shared handle adds
//   another). At zero uses, once the pool has no live blocks and no capture scope is open on the
//   device, the device is synchronized (a replay may still be in flight) and the private pool is
//   closed: its backings go back to the device pool. With live blocks left (a graph's static
//   output the caller still holds), that happens when the last of them is freed. "No capture
//   scope" counts every GraphPools over the same upstream (a pool swap behind the C ABI, or two
//   callers' GraphPools over one pool): the synchronize would invalidate a capture under way
//   there, so the end of the last such scope closes the pool.
//
// Invariants (validate()): each private pool validates; what each private pool reserves equals
// the bytes its backing upstream has outstanding (each backing holds one alignment unit more in
// the device pool: graph blocks never start where a device-pool block does); the owner table holds
// exactly the live blocks of the private pools; open scopes name existing pools.
// Thread safety: every member may be called from any thread; one mutex (mu_) guards the scope
// list, the pool table and the owner table, and private-pool calls are made under it (they are
// rare: captures and the frees of graph-owned blocks). routing() and holds_private_blocks() are
// lock-free reads for the C ABI's fast path. Filters are user code (a Python callable takes the
// GIL, and may call back into this object): they run, and are destroyed, with mu_ not held --
// allocate() reads the open scopes under mu_, asks their filters outside it, then takes mu_ again
// to allocate from the chosen pool, or from `main` when that scope ended in between.
// Errors: allocate/deallocate/record_stream throw what the pools throw (OutOfMemory,
// InvalidPointer, ...); begin/end/release of an unknown id throw InvalidArgument.
// fork(): in a child, a GraphPools over an inherited pool (Pool::forked) refuses every call with
// PoolClosed before touching a lock (a thread the fork left behind may have held mu_, or the
// device pool's lock, during a capture's growth), and its destructor touches nothing.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "poolkeeper/core/pool.hpp"

namespace poolkeeper {

using GraphPoolId = std::pair<std::uint64_t, std::uint64_t>;  // PyTorch's MempoolId_t
using CaptureFilter = std::function<bool(Stream)>;

// A filter that throws this stops the allocation: it propagates from allocate() unchanged (the
// Python bindings carry KeyboardInterrupt and SystemExit in it). Any other exception a filter
// throws is counted in filter_errors and the filter does not claim the allocation.
// `redeliver`, when set, is what a caller that cannot raise `original` (the C ABI, called by a
// framework's allocator) calls instead, so that the interrupt is not lost: it raises it again
// later (for KeyboardInterrupt, PyErr_SetInterrupt; safe from any thread).
struct CaptureFilterAbort : std::exception {
  std::exception_ptr original;
  void (*redeliver)() = nullptr;
  CaptureFilterAbort(std::exception_ptr e, void (*again)()) : original(std::move(e)), redeliver(again) {}
  const char* what() const noexcept override { return "a capture filter stopped the allocation"; }
};

struct GraphPoolInfo {
  GraphPoolId id{};
  int uses = 0;             // begin() calls not yet matched by release()
  int open_scopes = 0;      // begin() calls not yet matched by end()
  bool released = false;    // uses reached zero: closes once nothing is live
  std::size_t live_blocks = 0;
  PoolStats stats;
};

class GraphPools {
 public:
  explicit GraphPools(std::shared_ptr<Pool> main);
  ~GraphPools();
  GraphPools(const GraphPools&) = delete;
  GraphPools& operator=(const GraphPools&) = delete;

  void begin(GraphPoolId id, CaptureFilter filter);
  void end(GraphPoolId id);
  void release(GraphPoolId id);

  // Lock-free: is any scope open (or a reclaim_next() waiting) / does any private pool hold a
  // live block?
  bool routing() const {
    return open_.load(std::memory_order_acquire) > 0 || reclaims_->load(std::memory_order_acquire) > 0;
  }
  bool holds_private_blocks() const { return private_blocks_.load(std::memory_order_acquire) > 0; }

  void* allocate(std::size_t nbytes, Stream s);
  // A private block goes back to its private pool; any other to `main`.
  void deallocate(void* p, Stream s);
  void record_stream(void* p, Stream s);
  // Only when p is a live private block: true when it was (the C ABI sends the rest to the
  // device's current pool, which after a pool swap is not `main`).
  bool deallocate_private(void* p, Stream s);
  bool record_stream_private(void* p, Stream s);
  // Is p a live block of a private pool?
  bool owns_private(std::uintptr_t p);

  std::vector<GraphPoolInfo> info();
  std::shared_ptr<Pool> private_pool(GraphPoolId id);  // nullptr when there is none
  bool has_open_scope(GraphPoolId id);                 // begin(id) not yet matched by end(id)
  bool has_private_pools();                            // any private pool not closed yet
  // Addresses of the live blocks of private pool id (empty when there is no such pool).
  std::vector<std::uintptr_t> live_blocks(GraphPoolId id);
  // The same with each block's size as asked and the stream it was allocated on.
  struct LiveBlock {
    std::uintptr_t addr = 0;
    std::size_t nbytes = 0;
    Stream stream = kNoStream;
  };
  std::vector<LiveBlock> live_block_info(GraphPoolId id);

  // Checkpoint restore (torch.compile's CUDA-graph trees; docs/integrations.md): the trees put a
  // private pool back to the live blocks it had when a graph was recorded, freeing what was
  // allocated since and handing out again, at their own addresses, blocks freed since (a graph
  // writes there on replay). Both must go through the framework's allocator, which keeps its own
  // record (size, stream) of every block: so the caller names the block here, then allocates.
  // reclaim_next(id, addr, n): the next allocate() of exactly n bytes *on this thread* is served
  // by [addr, addr + n) of private pool id, which must be free there then (InvalidPointer at that
  // allocate otherwise; InvalidArgument here when pool id does not exist). One at a time per
  // thread, whichever GraphPools it names: a second call (on this or another GraphPools) replaces
  // the first, and a thread that exits gives its own up. reclaim_cancel(): forget this thread's,
  // if it names this GraphPools. Thread safety: any thread; each touches only its own.
  void reclaim_next(GraphPoolId id, std::uintptr_t addr, std::size_t nbytes);
  void reclaim_cancel();
  void validate();
  const std::shared_ptr<Pool>& main() const { return main_; }

  struct Counters {
    std::uint64_t private_allocations = 0, private_deallocations = 0, pools_created = 0, pools_closed = 0,
                  filter_errors = 0;
  };
  Counters counters();

  // Closes, in every GraphPools whose upstream has no capture scope open any more, the released
  // pools that could not close when they were released: another GraphPools's capture was under
  // way on the upstream, or the driver refused the synchronize or the close. Runs at the end of
  // every capture scope and at empty_cache (the C ABI's and PyTorch's hooks). Never with a mu_ held.
  static void close_deferred_everywhere();

 private:
  struct Private {
    std::shared_ptr<Upstream> up;  // a view of main_ as an upstream
    std::shared_ptr<Pool> pool;
    int uses = 0, open_scopes = 0;
    bool released = false;
    std::size_t live_blocks = 0;
  };
  struct Scope {
    GraphPoolId id;
    std::shared_ptr<const CaptureFilter> filter;  // shared: allocate() copies the list to ask outside mu_
  };
  Private& create_or_use_locked(GraphPoolId id);
  // Closes pool `it` when it is released, unused and nothing stops it (see the rules above);
  // throws what the synchronize or the close throws, leaving the pool open and deferred_ set.
  void maybe_close_locked(std::map<GraphPoolId, Private>::iterator it);
  // maybe_close_locked for every pool; a failure leaves that pool for a later sweep.
  void close_released_locked() noexcept;
  // allocate() for this thread's reclaim_next(): the named block, whatever the scopes say.
  void* allocate_reclaimed(std::size_t nbytes, Stream s);
  // The pool the newest scope whose filter takes s names; asks the filters with mu_ not held.
  std::optional<GraphPoolId> route(Stream s);

  std::shared_ptr<Pool> main_;
  std::mutex mu_;
  std::vector<Scope> scopes_;                                   // guarded by mu_
  std::map<GraphPoolId, Private> pools_;                        // guarded by mu_
  struct Owned {
    GraphPoolId id;
    std::size_t nbytes = 0;  // as asked: a checkpoint restore hands the block out again at this size
    Stream stream = kNoStream;
  };
  std::unordered_map<std::uintptr_t, Owned> owner_;             // guarded by mu_
  Counters counters_;                                           // guarded by mu_
  std::atomic<int> open_{0};
  // Threads with a reclaim_next() here not yet served, replaced or cancelled. Shared with each
  // such thread's record (graph_pools.cpp), which outlives this object and gives its count back
  // when the thread exits; a plain member let a dead thread's reclaim keep routing() true for
  // good, and let a record left by a destroyed GraphPools take the count of a new one made at the
  // same address below zero.
  std::shared_ptr<std::atomic<int>> reclaims_ = std::make_shared<std::atomic<int>>(0);
  std::atomic<std::size_t> private_blocks_{0};
  std::atomic<bool> deferred_{false};  // a pool waits for another GraphPools's capture to end
};

}  // namespace poolkeeper
