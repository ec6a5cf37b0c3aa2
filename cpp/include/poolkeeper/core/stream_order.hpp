// Stream-ordered release, implemented once for every pool (docs/stream_order.md).
//
// The rule: a block released on stream s is reusable at once by allocations on s (stream order
// already puts them after every use), and by any other stream only after an event recorded on s
// -- and on every stream added with record_stream -- has completed. Until then it is *pending*:
// never counted as free, never handed to another stream.
//
// How it stays cheap: a release on s records no event. It joins s's lane (a FIFO) with a sequence
// number. Only when memory is needed elsewhere (allocation pressure, process_pending,
// synchronize) does the lane get *fenced*: one event recorded on s now covers every block
// released on s before it, because s executes in order. Recording later than the release is
// conservative (it may wait for more work, never for less), and it turns one event per free into
// one event per pressure pass. Fences complete in lane order, so draining a lane stops at the
// first fence that has not completed.
//
// One fence per lane at a time: while a lane's fence is outstanding (a stream lagging behind),
// settling passes only query it; when it completes, the blocks it covers are settled and one new
// fence is recorded for the releases made since. A lagging stream so holds one event, however
// many passes run (recording a fresh event at every pass once cost 20,000 live events).
//
// Lanes are retired when empty: one with no pending block and no fence is dropped after
// kIdlePasses settling passes found it idle (at once when it belongs to a destroyed stream), and
// creating a lane sweeps idle ones whenever the lane count doubles. Lanes are found through a hash
// index, so a pool that has seen 40,000 streams costs what its busy streams cost.
//
// Dead streams: recording an event on a destroyed stream fails with CUDA_ERROR_INVALID_HANDLE.
// The stream's work then cannot be fenced, but it still runs to completion on the device, so the
// order synchronizes the upstream's device once (Upstream::synchronize) and treats every release
// on that stream as done. A release on several streams does the same for each dead one. Any other
// failure to record leaves that lane's blocks pending and is rethrown only after every other lane
// was settled, so one bad stream never blocks the rest.
//
// CUDA-graph capture (capture.hpp): no event is ever recorded on a stream that is being captured.
// A lane whose stream is capturing is not fenced (its blocks stay pending, reusable at once on
// that stream, which is exactly the graph's own order); a multi-stream release touching a
// capturing stream waits, with no events, on a list of its own until no stream it names is
// capturing, and only then records its events (PyTorch's allocator defers the same way). Capture
// status is asked only while a capture scope is open on the upstream (Upstream::captures_underway:
// torch's graph hooks, GraphPools, CuPy's graph_capture). Every
// driver call here runs with the thread in relaxed capture mode, and a dead stream found while a
// capture scope is open is not settled by a device synchronize (that would invalidate the
// capture): its releases wait for the scope to end.
//
// A block whose release must wait on several streams -- record_stream streams, or its allocating
// stream when released on another one -- gets its events recorded at release time, one per
// stream, and waits on a separate list until all have completed.
//
// Not thread-safe: every member runs under the owning pool's lock.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "poolkeeper/core/capture.hpp"
#include "poolkeeper/core/pool.hpp"
#include "poolkeeper/core/upstream.hpp"

namespace poolkeeper {

// The part of a block's record that stream order and accounting need; pools extend it.
struct BlockRecord {
  std::uintptr_t addr = 0;
  std::size_t size = 0;       // bytes the block occupies (rounded to the pool's granularity)
  std::size_t requested = 0;  // bytes the caller asked for (meaningful while live)
  Stream alloc_stream = kNoStream;
  Stream last_stream = kNoStream;      // stream of final use (the releasing stream)
  std::vector<Stream>* used_on = nullptr;  // record_stream extras (rare path; heap)
  std::atomic<ChunkState> state{ChunkState::Free};

  // --- owned by StreamOrder while pending ---
  BlockRecord* pend_prev = nullptr;
  BlockRecord* pend_next = nullptr;
  BlockRecord* size_prev = nullptr;
  BlockRecord* size_next = nullptr;
  std::uint64_t pend_seq = 0;
  std::uint32_t lane = 0;
  std::vector<EventId>* events = nullptr;  // multi-stream release: its own events

  ChunkState st() const { return state.load(std::memory_order_relaxed); }
  void set(ChunkState s) { state.store(s, std::memory_order_relaxed); }
  // A free's claim: from -> to in one compare-exchange. Every way out of Live goes through it (the
  // lock-free cache free and remote pushes, and under the owner's lock claim_live), so of two
  // threads freeing one block at once exactly one goes on. Acquire: the claimer may read the
  // record after it (release: a remote push publishes it). False: the state was not `from`.
  bool claim(ChunkState from, ChunkState to) {
    return state.compare_exchange_strong(from, to, std::memory_order_acq_rel, std::memory_order_relaxed);
  }
  // A locked free's claim, under the owner's lock: Live -> Freeing. False: not Live (freed before,
  // or just now by a lock-free free on another thread).
  bool claim_live() { return claim(ChunkState::Live, ChunkState::Freeing); }
  // The claimed free went no further (a refused event record, a non-blocking path declining):
  // live again. Only the claimer calls it, under the lock it claimed under.
  void unclaim() {
    if (st() == ChunkState::Freeing) set(ChunkState::Live);
  }
  void drop_used_on() {
    delete used_on;
    used_on = nullptr;
  }
  // record_stream's step (the owner's lock held): its release also waits for s from now on.
  void add_use(Stream s) {
    if (s == alloc_stream || s == kNoStream) return;
    if (!used_on) used_on = new std::vector<Stream>();
    for (Stream x : *used_on)
      if (x == s) return;
    used_on->push_back(s);
  }
};

// A block that is its own backing (DirectPool, SizeClassPool), for a snapshot: one chunk.
inline BackingInfo block_backing(const BlockRecord& b) {
  BackingInfo bi;
  bi.address = b.addr;
  bi.size = b.size;
  ChunkInfo& c = bi.chunks.emplace_back();
  c.size = b.size;
  c.state = b.st();
  c.requested = b.requested;
  c.alloc_stream = b.alloc_stream;
  c.last_stream = b.last_stream;
  return bi;
}

class StreamOrder {
  static constexpr std::uint32_t kMultiLane = 0xffffffffu;
  static constexpr std::uint32_t kCaptureLane = 0xfffffffeu;  // waits for a capture to end
  struct List {
    BlockRecord* head = nullptr;
    BlockRecord* tail = nullptr;
  };
  struct Lane {
    Stream stream = kNoStream;
    BlockRecord* head = nullptr;  // FIFO in release order
    BlockRecord* tail = nullptr;
    std::size_t bytes = 0, blocks = 0;
    std::uint64_t next_seq = 1, completed_seq = 0;  // releases up to completed_seq are safe
    bool fenced = false;          // a fence is outstanding: `fence`, covering releases up to fence_seq
    EventId fence = kNullEvent;
    std::uint64_t fence_seq = 0;
    std::uint32_t slot = 0;       // index in slots_ (what BlockRecord::lane holds)
    std::uint32_t live_pos = 0;   // index in live_
    std::uint32_t idle_passes = 0;
    std::map<std::size_t, List> by_size;  // same-stream reuse: exact size, or best fit to split
    bool idle() const { return !head && !fenced; }
  };

 public:
  explicit StreamOrder(Upstream* up) : up_(up) {}
  ~StreamOrder();

  // b is being released on s. Records events now only when b was also used on other streams.
  // Sets b's state to Pending. Strong guarantee: if recording an event throws (a bad stream, the
  // driver out of resources), b and this order are unchanged -- callers release before counting.
  void defer(BlockRecord* b, Stream s);
  // Would defer(b, s) record events (an upstream call)? Non-blocking callers leave those
  // releases to the blocking path.
  static bool defer_records_events(const BlockRecord* b, Stream s) {
    return (b->alloc_stream != kNoStream && b->alloc_stream != s) || (b->used_on && !b->used_on->empty());
  }

  // A pending block released on s with exactly `size` bytes, reusable on s at once; nullptr if
  // none. The block is removed from pending (state left Pending: the caller makes it Live).
  BlockRecord* take_for_stream(Stream s, std::size_t size);
  // The smallest pending block released on s with at least `size` bytes (best fit, for a pool
  // that can split it: the caller returns the remainder with defer(rest, s)); nullptr if none.
  BlockRecord* take_for_stream_fit(Stream s, std::size_t size);
  // The block take_for_stream_fit would return, left in place; take_peeked(b) then takes it.
  BlockRecord* peek_for_stream_fit(Stream s, std::size_t size);
  void take_peeked(BlockRecord* b);
  // Blocks the calling thread until s has run everything enqueued on it before this call (one
  // event recorded and waited for; a destroyed stream: a device synchronize, as fences do). Not for
  // a stream being captured (the event would be a node of the graph). Runs in relaxed capture mode.
  void wait_for_stream(Stream s);

  // Fence every lane with unfenced releases, then hand each block whose events have completed to
  // on_ready(BlockRecord*) (state still Pending). wait=true blocks on each event first, so nothing
  // stays pending. Returns the bytes handed over.
  template <class F>
  std::size_t drain(F&& on_ready, bool wait = false);

  // Forget everything (pool close): events released, on_each(b) called for every pending block.
  template <class F>
  void clear(F&& on_each);

  // Take b out of pending (any lane, or the multi-stream list), releasing its own events; its
  // state is left Pending for the caller to change. For a pool merging neighbours.
  void remove(BlockRecord* b);
  // defer() at an earlier release position `seq` (the remainder of a split pending block keeps its
  // place: re-releasing it at the tail on every split could starve other streams of it).
  void defer_as(BlockRecord* b, Stream s, std::uint64_t seq);
  // Merge pending `gone` into its address neighbour `keep` (same lane): keep->size grows by
  // gone's, and keep takes the later of the two release positions, so the merged block waits for
  // exactly the fences either part waited for (no fresh position: repeated merges never starve).
  void absorb(BlockRecord* keep, BlockRecord* gone);
  // The stream whose lane holds b, or kNoStream when b waits on several streams.
  Stream lane_stream(const BlockRecord* b) const {
    return b->lane >= kCaptureLane ? kNoStream : slots_[b->lane]->stream;
  }
  // Releases waiting for a capture to end before their events can be recorded.
  std::size_t capture_deferred_blocks() const { return capture_blocks_; }

  std::size_t pending_bytes() const { return bytes_; }
  std::size_t pending_blocks() const { return blocks_; }
  std::vector<std::pair<Stream, std::size_t>> by_stream() const;
  // The streams a pending block waits on, and its fence event if one is recorded yet.
  void describe(const BlockRecord* b, std::vector<Stream>& waits_on, EventId& event) const;
  std::uint64_t fences_recorded() const { return fences_recorded_; }
  std::uint64_t same_stream_reuses() const { return same_stream_reuses_; }
  // Lanes alive now, lanes retired so far, fences outstanding now (at most one per lane), and
  // releases settled because their stream was gone (see "Dead streams" above).
  std::size_t lanes() const { return live_.size(); }
  std::uint64_t lanes_retired() const { return lanes_retired_; }
  std::size_t fences_outstanding() const { return fences_outstanding_; }
  std::uint64_t dead_stream_settles() const { return dead_stream_settles_; }
  // Settling passes an empty lane survives before it is retired (a steady stream keeps its lane
  // and its size index between passes; a stream that went quiet gives them back).
  static constexpr std::uint32_t kIdlePasses = 2;

  // Structural self-check: list links, byte and block totals. Throws InvariantViolation.
  void validate() const;

 private:
  void start_pending(BlockRecord* b, Stream s);  // state, links and totals of a block entering pending
  Lane& lane_for(Stream s);
  Lane* find_lane(Stream s);
  void retire(Lane& l);
  void sweep_idle();
  void unlink(Lane& l, BlockRecord* b);
  void size_push(Lane& l, BlockRecord* b);
  void size_drop(Lane& l, BlockRecord* b);
  void unlink_multi(BlockRecord* b);
  bool multi_ready(BlockRecord* b, bool wait);
  bool touches_capture(const BlockRecord* b, Stream s);  // would defer(b, s) record on a capturing stream?
  void record_multi(BlockRecord* b, Stream s);            // the multi-stream part of defer()
  void resume_captured();                                 // capture ended: record what waited for it
  void unlink_capture(BlockRecord* b);
  void link_capture(BlockRecord* b);
  void release_multi_events(BlockRecord* b);
  // An event on s, or kNullEvent (complete) when s is gone: then the device was synchronized
  // first, so the gone stream's work is done. Other failures propagate.
  EventId record_or_settle(Stream s);
  // Fence the lane if it has unfenced releases and no fence outstanding; false: the stream is gone
  // (its releases were marked complete).
  void fence_lane(Lane& l);
  void drop_fence(Lane& l);
  bool lane_complete(Lane& l, bool wait);  // the outstanding fence has completed (waiting if asked)

  Upstream* up_;
  std::vector<std::unique_ptr<Lane>> slots_;  // BlockRecord::lane indexes here; null = free slot
  std::vector<std::uint32_t> free_slots_;
  std::vector<Lane*> live_;                   // every lane, for passes over all of them
  std::unordered_map<Stream, Lane*> index_;
  Lane* last_ = nullptr;                      // the lane found last: a steady stream skips the hash
  std::size_t sweep_at_ = 64;                 // lane count at which lane_for sweeps idle lanes
  bool draining_ = false;                     // no sweep while drain() walks the lanes
  BlockRecord* multi_head_ = nullptr;
  BlockRecord* capture_head_ = nullptr;  // kCaptureLane blocks (no events yet)
  std::size_t capture_blocks_ = 0;
  std::size_t bytes_ = 0, blocks_ = 0, fences_outstanding_ = 0;
  std::uint64_t fences_recorded_ = 0, same_stream_reuses_ = 0, lanes_retired_ = 0, dead_stream_settles_ = 0;
};

template <class F>
std::size_t StreamOrder::drain(F&& on_ready, bool wait) {
  RelaxedCapture relaxed(*up_);
  std::size_t moved = 0;
  std::exception_ptr first_error;
  if (capture_head_) {
    try {
      resume_captured();
    } catch (...) {
      first_error = std::current_exception();
    }
  }
  draining_ = true;  // on_ready may release into a new lane: no sweep may move lanes under us
  struct Walking {
    bool& f;
    ~Walking() { f = false; }
  } walking{draining_};
  for (std::size_t i = 0; i < live_.size();) {
    Lane& l = *live_[i];
    auto settle_completed = [&] {
      while (l.head && l.head->pend_seq <= l.completed_seq) {
        BlockRecord* b = l.head;
        unlink(l, b);
        moved += b->size;
        on_ready(b);
      }
    };
    try {
      settle_completed();  // a split remainder may carry a position whose fence already completed
      // At most two rounds: the outstanding fence, then one covering the releases made since.
      if (l.fenced && !l.head) drop_fence(l);  // same-stream reuse took every block it covered
      for (int round = 0; round < 2 && l.head; ++round) {
        fence_lane(l);
        if (l.fenced && !lane_complete(l, wait)) break;
        settle_completed();
      }
    } catch (...) {
      if (!first_error) first_error = std::current_exception();  // the other lanes still settle
    }
    if (l.idle() && ++l.idle_passes >= kIdlePasses) {
      retire(l);  // moves the last live lane into position i
      continue;
    }
    if (!l.idle()) l.idle_passes = 0;
    ++i;
  }
  for (BlockRecord* b = multi_head_; b;) {
    BlockRecord* next = b->pend_next;
    bool ready = false;
    try {
      ready = multi_ready(b, wait);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
    if (ready) {
      release_multi_events(b);
      unlink_multi(b);
      moved += b->size;
      on_ready(b);
    }
    b = next;
  }
  if (first_error) std::rethrow_exception(first_error);
  return moved;
}

template <class F>
void StreamOrder::clear(F&& on_each) {
  for (Lane* l : live_) {
    drop_fence(*l);
    while (l->head) {
      BlockRecord* b = l->head;
      unlink(*l, b);
      on_each(b);
    }
  }
  while (multi_head_) {
    BlockRecord* b = multi_head_;
    release_multi_events(b);
    unlink_multi(b);
    on_each(b);
  }
  while (capture_head_) {
    BlockRecord* b = capture_head_;
    unlink_capture(b);
    on_each(b);
  }
}

// StreamOrder's counters as a pool's stats() reports them (summed over a sharded pool's orders).
struct StreamOrderCounters {
  std::uint64_t same_stream_reuses = 0, fences_recorded = 0, fences_outstanding = 0, lanes = 0, lanes_retired = 0,
                dead_stream_settles = 0;
  void add(const StreamOrder& o) {
    same_stream_reuses += o.same_stream_reuses(), fences_recorded += o.fences_recorded();
    fences_outstanding += o.fences_outstanding(), lanes += o.lanes();
    lanes_retired += o.lanes_retired(), dead_stream_settles += o.dead_stream_settles();
  }
  void report(PoolStats& st) const {
    add_extras(st, {{"same_stream_reuses", same_stream_reuses}, {"fences_recorded", fences_recorded},
                    {"fences_outstanding", fences_outstanding}, {"stream_lanes", lanes},
                    {"stream_lanes_retired", lanes_retired}, {"dead_stream_settles", dead_stream_settles}});
  }
};

}  // namespace poolkeeper
