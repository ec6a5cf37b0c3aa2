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
// A block whose release must wait on several streams -- record_stream streams, or its allocating
// stream when released on another one -- gets its events recorded at release time, one per
// stream, and waits on a separate list until all have completed.
//
// Not thread-safe: every member runs under the owning pool's lock.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "poolkeeper/pool.hpp"
#include "poolkeeper/upstream.hpp"

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
  void drop_used_on() {
    delete used_on;
    used_on = nullptr;
  }
};

class StreamOrder {
  static constexpr std::uint32_t kMultiLane = 0xffffffffu;
  struct Fence {
    EventId event;
    std::uint64_t last_seq;
  };
  struct List {
    BlockRecord* head = nullptr;
    BlockRecord* tail = nullptr;
  };
  struct Lane {
    Stream stream = kNoStream;
    BlockRecord* head = nullptr;  // FIFO in release order
    BlockRecord* tail = nullptr;
    std::size_t bytes = 0, blocks = 0;
    std::uint64_t next_seq = 1, fenced_seq = 0, completed_seq = 0;  // releases up to completed_seq are safe
    std::deque<Fence> fences;
    std::map<std::size_t, List> by_size;  // same-stream reuse: exact size, or best fit to split
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
  Stream lane_stream(const BlockRecord* b) const { return b->lane == kMultiLane ? kNoStream : lanes_[b->lane].stream; }

  std::size_t pending_bytes() const { return bytes_; }
  std::size_t pending_blocks() const { return blocks_; }
  std::vector<std::pair<Stream, std::size_t>> by_stream() const;
  // The streams a pending block waits on, and its fence event if one is recorded yet.
  void describe(const BlockRecord* b, std::vector<Stream>& waits_on, EventId& event) const;
  std::uint64_t fences_recorded() const { return fences_recorded_; }
  std::uint64_t same_stream_reuses() const { return same_stream_reuses_; }

  // Structural self-check: list links, byte and block totals. Throws InvariantViolation.
  void validate() const;

 private:
  void start_pending(BlockRecord* b, Stream s);  // state, links and totals of a block entering pending
  Lane& lane_for(Stream s);
  void unlink(Lane& l, BlockRecord* b);
  void size_push(Lane& l, BlockRecord* b);
  void size_drop(Lane& l, BlockRecord* b);
  void unlink_multi(BlockRecord* b);
  bool multi_ready(BlockRecord* b, bool wait);
  void release_multi_events(BlockRecord* b);

  Upstream* up_;
  std::vector<Lane> lanes_;
  BlockRecord* multi_head_ = nullptr;
  std::size_t bytes_ = 0, blocks_ = 0;
  std::uint64_t fences_recorded_ = 0, same_stream_reuses_ = 0;
};

template <class F>
std::size_t StreamOrder::drain(F&& on_ready, bool wait) {
  std::size_t moved = 0;
  for (Lane& l : lanes_) {
    if (l.tail && l.tail->pend_seq > l.fenced_seq) {
      l.fences.push_back({up_->record_event(l.stream), l.tail->pend_seq});
      l.fenced_seq = l.tail->pend_seq;
      ++fences_recorded_;
    }
    auto settle_completed = [&] {
      while (l.head && l.head->pend_seq <= l.completed_seq) {
        BlockRecord* b = l.head;
        unlink(l, b);
        moved += b->size;
        on_ready(b);
      }
    };
    settle_completed();  // a split remainder may carry a position whose fence already completed
    while (!l.fences.empty()) {
      Fence& f = l.fences.front();
      if (wait) up_->wait_event(f.event);
      if (!up_->query_event(f.event)) break;
      l.completed_seq = f.last_seq;
      settle_completed();
      up_->release_event(f.event);
      l.fences.pop_front();
    }
  }
  for (BlockRecord* b = multi_head_; b;) {
    BlockRecord* next = b->pend_next;
    if (multi_ready(b, wait)) {
      release_multi_events(b);
      unlink_multi(b);
      moved += b->size;
      on_ready(b);
    }
    b = next;
  }
  return moved;
}

template <class F>
void StreamOrder::clear(F&& on_each) {
  for (Lane& l : lanes_) {
    for (auto& f : l.fences) up_->release_event(f.event);
    l.fences.clear();
    while (l.head) {
      BlockRecord* b = l.head;
      unlink(l, b);
      on_each(b);
    }
  }
  while (multi_head_) {
    BlockRecord* b = multi_head_;
    release_multi_events(b);
    unlink_multi(b);
    on_each(b);
  }
}

}  // namespace poolkeeper
