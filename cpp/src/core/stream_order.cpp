#include "poolkeeper/core/stream_order.hpp"

#include <algorithm>
#include <map>
#include <memory>

namespace poolkeeper {

StreamOrder::~StreamOrder() {
  for (Lane* l : live_)
    if (l->fenced) up_->release_event(l->fence);
}

namespace {
// The driver's answer for a stream handle that no longer exists (cuStreamDestroy'd; the simulated
// device's destroy_stream answers the same).
// On an H200 (driver 580, CUDA 13) an event record on a destroyed stream answered
// CUDA_ERROR_CONTEXT_IS_DESTROYED in one run and CUDA_ERROR_INVALID_CONTEXT in another, not
// INVALID_HANDLE: for an explicit stream handle (the special handles 0-2 name the current
// context, which the upstream makes current) all three mean the handle is gone. If the context
// itself were gone, the device synchronize that follows fails and that error propagates.
bool stream_gone(const UpstreamFailure& e, Stream s) {
  if (e.error_name == "CUDA_ERROR_INVALID_HANDLE" || e.error_name == "CUDA_ERROR_CONTEXT_IS_DESTROYED") return true;
  return e.error_name == "CUDA_ERROR_INVALID_CONTEXT" && s > 2 && s != kNoStream;
}
}  // namespace

EventId StreamOrder::record_or_settle(Stream s) {
  try {
    return up_->record_event(s);
  } catch (const UpstreamOutOfMemory&) {
    throw;
  } catch (const UpstreamFailure& e) {
    // While a graph capture scope is open a device synchronize would invalidate the capture:
    // the failure stands (the releases stay pending) until the scope has ended.
    if (!stream_gone(e, s) || up_->captures_underway() > 0) throw;
  }
  // A destroyed stream's work still runs to completion; once the device is synchronized it is
  // done, and every release on the stream is safe to reuse.
  up_->synchronize();
  ++dead_stream_settles_;
  return kNullEvent;
}

void StreamOrder::wait_for_stream(Stream s) {
  RelaxedCapture relaxed(*up_);
  const EventId e = record_or_settle(s);
  if (e == kNullEvent) return;  // a dead stream: settled by a device synchronize
  struct Release {
    Upstream* up;
    EventId e;
    ~Release() { up->release_event(e); }
  } release{up_, e};
  up_->wait_event(e);
}

void StreamOrder::fence_lane(Lane& l) {
  if (l.fenced || !l.tail || l.tail->pend_seq <= l.completed_seq) return;
  // Never fence a capturing stream: the event would be a node of the graph, never completing for
  // us. Its blocks wait (reusable on the stream itself) until the capture has ended. The driver is
  // asked only while a capture scope is open: asking about a destroyed stream's handle crashed in
  // the driver on the H200, and with no scope open no allocation of ours is being captured.
  if (up_->captures_underway() > 0 && up_->stream_capturing(l.stream)) return;
  const std::uint64_t upto = l.tail->pend_seq;
  const std::uint64_t dead_before = dead_stream_settles_;
  const EventId e = record_or_settle(l.stream);
  if (dead_stream_settles_ != dead_before) {
    l.completed_seq = upto;
    l.idle_passes = kIdlePasses;  // retire as soon as it is empty: the handle is dead
    return;
  }
  l.fenced = true;
  l.fence = e;
  l.fence_seq = upto;
  ++fences_recorded_;
  ++fences_outstanding_;
}

void StreamOrder::drop_fence(Lane& l) {
  if (!l.fenced) return;
  up_->release_event(l.fence);
  l.fenced = false;
  l.fence = kNullEvent;
  --fences_outstanding_;
}

bool StreamOrder::lane_complete(Lane& l, bool wait) {
  if (wait) up_->wait_event(l.fence);
  if (!up_->query_event(l.fence)) return false;
  l.completed_seq = l.fence_seq;
  drop_fence(l);
  return true;
}

// The by-size index of a lane (same-stream reuse): append b to its size's list / take it out.
void StreamOrder::size_push(Lane& l, BlockRecord* b) {
  List& sl = l.by_size[b->size];
  b->size_prev = sl.tail;
  b->size_next = nullptr;
  if (sl.tail) sl.tail->size_next = b;
  else sl.head = b;
  sl.tail = b;
}

void StreamOrder::size_drop(Lane& l, BlockRecord* b) {
  auto it = l.by_size.find(b->size);
  List& sl = it->second;
  if (b->size_prev) b->size_prev->size_next = b->size_next;
  else sl.head = b->size_next;
  if (b->size_next) b->size_next->size_prev = b->size_prev;
  else sl.tail = b->size_prev;
  b->size_prev = b->size_next = nullptr;
  // Keep empty size lists while few, so a steady workload never touches the heap here.
  if (!sl.head && l.by_size.size() > 256) l.by_size.erase(it);
}

StreamOrder::Lane* StreamOrder::find_lane(Stream s) {
  if (last_ && last_->stream == s) return last_;
  auto it = index_.find(s);
  if (it == index_.end()) return nullptr;
  return last_ = it->second;
}

StreamOrder::Lane& StreamOrder::lane_for(Stream s) {
  if (Lane* l = find_lane(s)) return *l;
  if (live_.size() >= sweep_at_ && !draining_) {
    // Amortized: a sweep runs each time the lane count doubles, so streams that went quiet give
    // their lanes back even when no settling pass runs.
    sweep_idle();
    sweep_at_ = std::max<std::size_t>(64, 2 * live_.size());
  }
  std::uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<std::uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  slots_[slot] = std::make_unique<Lane>();
  Lane* l = slots_[slot].get();
  l->stream = s;
  l->slot = slot;
  l->live_pos = static_cast<std::uint32_t>(live_.size());
  live_.push_back(l);
  index_.emplace(s, l);
  return *(last_ = l);
}

void StreamOrder::retire(Lane& l) {
  drop_fence(l);
  index_.erase(l.stream);
  if (last_ == &l) last_ = nullptr;
  Lane* moved = live_.back();
  live_[l.live_pos] = moved;
  moved->live_pos = l.live_pos;
  live_.pop_back();
  // The slot table keeps its high-water length (8 bytes a slot); the Lane itself is freed.
  free_slots_.push_back(l.slot);
  slots_[l.slot].reset();  // l is gone from here on
  ++lanes_retired_;
}

void StreamOrder::sweep_idle() {
  for (std::size_t i = 0; i < live_.size();) {
    if (live_[i]->idle()) retire(*live_[i]);  // the last lane moves into position i
    else ++i;
  }
}

void StreamOrder::start_pending(BlockRecord* b, Stream s) {
  b->set(ChunkState::Pending);
  b->last_stream = s;
  b->pend_prev = b->pend_next = b->size_prev = b->size_next = nullptr;
  bytes_ += b->size;
  ++blocks_;
}

bool StreamOrder::touches_capture(const BlockRecord* b, Stream s) {
  if (up_->captures_underway() == 0) return false;  // see fence_lane: no scope, nothing captured of ours
  if (up_->stream_capturing(s)) return true;
  if (b->alloc_stream != kNoStream && b->alloc_stream != s && up_->stream_capturing(b->alloc_stream)) return true;
  if (b->used_on)
    for (Stream u : *b->used_on)
      if (u != s && u != b->alloc_stream && up_->stream_capturing(u)) return true;
  return false;
}

void StreamOrder::record_multi(BlockRecord* b, Stream s) {
  // Used on several streams: record one event per stream now, at release, where stream order
  // guarantees each covers that stream's use of the block. All of them before anything changes.
  const bool cross = b->alloc_stream != kNoStream && b->alloc_stream != s;
  auto events = std::make_unique<std::vector<EventId>>();
  events->reserve((b->used_on ? b->used_on->size() : 0) + 2);
  try {
    // A gone stream gives kNullEvent (its work is done): the block waits on the others only.
    events->push_back(record_or_settle(s));
    if (cross) events->push_back(record_or_settle(b->alloc_stream));
    if (b->used_on)
      for (Stream u : *b->used_on)
        if (u != s && u != b->alloc_stream) events->push_back(record_or_settle(u));
  } catch (...) {
    for (EventId e : *events) up_->release_event(e);
    throw;
  }
  start_pending(b, s);
  b->lane = kMultiLane;
  b->events = events.release();
  b->pend_next = multi_head_;
  if (multi_head_) multi_head_->pend_prev = b;
  multi_head_ = b;
}

void StreamOrder::link_capture(BlockRecord* b) {
  b->lane = kCaptureLane;
  b->pend_prev = nullptr;
  b->pend_next = capture_head_;
  if (capture_head_) capture_head_->pend_prev = b;
  capture_head_ = b;
  ++capture_blocks_;
}

void StreamOrder::unlink_capture(BlockRecord* b) {
  if (b->pend_prev) b->pend_prev->pend_next = b->pend_next;
  else capture_head_ = b->pend_next;
  if (b->pend_next) b->pend_next->pend_prev = b->pend_prev;
  b->pend_prev = b->pend_next = nullptr;
  bytes_ -= b->size;
  --blocks_;
  --capture_blocks_;
}

void StreamOrder::resume_captured() {
  for (BlockRecord* b = capture_head_; b;) {
    BlockRecord* next = b->pend_next;
    const Stream s = b->last_stream;
    if (!touches_capture(b, s)) {
      unlink_capture(b);
      try {
        record_multi(b, s);  // strong guarantee: on failure nothing was recorded
      } catch (...) {
        start_pending(b, s);  // back where it was, retried at the next drain
        link_capture(b);
        throw;
      }
    }
    b = next;
  }
}

void StreamOrder::defer(BlockRecord* b, Stream s) {
  // The allocating stream is always a user: a release on another stream must also wait for it
  // (as PyTorch's allocator does), unless the block was allocated with no stream.
  if (defer_records_events(b, s)) {
    RelaxedCapture relaxed(*up_);
    if (touches_capture(b, s)) {
      // An event on a capturing stream would belong to the graph: wait, event-less, for the
      // capture to end (drain() retries), like PyTorch's deferred events.
      start_pending(b, s);
      link_capture(b);
      return;
    }
    record_multi(b, s);
    return;
  }
  start_pending(b, s);
  Lane& l = lane_for(s);  // a lane keeps its slot while it holds a block
  b->lane = l.slot;
  b->pend_seq = l.next_seq++;
  b->pend_prev = l.tail;
  if (l.tail) l.tail->pend_next = b;
  else l.head = b;
  l.tail = b;
  size_push(l, b);
  l.bytes += b->size;
  ++l.blocks;
}

void StreamOrder::unlink(Lane& l, BlockRecord* b) {
  if (b->pend_prev) b->pend_prev->pend_next = b->pend_next;
  else l.head = b->pend_next;
  if (b->pend_next) b->pend_next->pend_prev = b->pend_prev;
  else l.tail = b->pend_prev;
  size_drop(l, b);
  b->pend_prev = b->pend_next = nullptr;
  l.bytes -= b->size;
  --l.blocks;
  bytes_ -= b->size;
  --blocks_;
}

void StreamOrder::unlink_multi(BlockRecord* b) {
  if (b->pend_prev) b->pend_prev->pend_next = b->pend_next;
  else multi_head_ = b->pend_next;
  if (b->pend_next) b->pend_next->pend_prev = b->pend_prev;
  b->pend_prev = b->pend_next = nullptr;
  bytes_ -= b->size;
  --blocks_;
}

bool StreamOrder::multi_ready(BlockRecord* b, bool wait) {
  for (EventId e : *b->events) {
    if (wait) up_->wait_event(e);
    if (!up_->query_event(e)) return false;
  }
  return true;
}

void StreamOrder::release_multi_events(BlockRecord* b) {
  for (EventId e : *b->events) up_->release_event(e);
  delete b->events;
  b->events = nullptr;
}

BlockRecord* StreamOrder::take_for_stream(Stream s, std::size_t size) {
  Lane* l = blocks_ ? find_lane(s) : nullptr;
  if (!l || !l->blocks) return nullptr;
  auto it = l->by_size.find(size);
  if (it == l->by_size.end() || !it->second.tail) return nullptr;
  BlockRecord* b = it->second.tail;  // most recent: likeliest still warm
  unlink(*l, b);
  ++same_stream_reuses_;
  return b;
}

void StreamOrder::defer_as(BlockRecord* b, Stream s, std::uint64_t seq) {
  Lane& l = lane_for(s);
  if (!l.tail || l.tail->pend_seq <= seq || seq == 0) {
    defer(b, s);
    if (seq && seq < b->pend_seq) b->pend_seq = seq;  // at the tail, order still holds
    return;
  }
  b->set(ChunkState::Pending);
  b->last_stream = s;
  b->lane = l.slot;
  b->pend_seq = seq;
  BlockRecord* after = l.tail;  // walk back to the last block released no later than seq
  while (after && after->pend_seq > seq) after = after->pend_prev;
  b->pend_prev = after;
  b->pend_next = after ? after->pend_next : l.head;
  if (b->pend_next) b->pend_next->pend_prev = b;
  if (after) after->pend_next = b;
  else l.head = b;
  size_push(l, b);
  l.bytes += b->size;
  ++l.blocks;
  bytes_ += b->size;
  ++blocks_;
}

void StreamOrder::absorb(BlockRecord* keep, BlockRecord* gone) {
  Lane& l = *slots_[keep->lane];

  auto drop_fifo = [&](BlockRecord* b) {
    if (b->pend_prev) b->pend_prev->pend_next = b->pend_next;
    else l.head = b->pend_next;
    if (b->pend_next) b->pend_next->pend_prev = b->pend_prev;
    else l.tail = b->pend_prev;
  };
  size_drop(l, keep);
  size_drop(l, gone);
  if (gone->pend_seq > keep->pend_seq) {
    // keep moves into gone's place in release order.
    drop_fifo(keep);
    keep->pend_prev = gone->pend_prev;
    keep->pend_next = gone->pend_next;
    if (keep->pend_prev) keep->pend_prev->pend_next = keep;
    else l.head = keep;
    if (keep->pend_next) keep->pend_next->pend_prev = keep;
    else l.tail = keep;
    keep->pend_seq = gone->pend_seq;
  } else {
    drop_fifo(gone);
  }
  gone->pend_prev = gone->pend_next = nullptr;
  keep->size += gone->size;
  size_push(l, keep);
  --l.blocks;
  --blocks_;
}

void StreamOrder::remove(BlockRecord* b) {
  if (b->lane == kCaptureLane) {
    unlink_capture(b);
  } else if (b->lane == kMultiLane) {
    release_multi_events(b);
    unlink_multi(b);
  } else {
    unlink(*slots_[b->lane], b);
  }
}

BlockRecord* StreamOrder::peek_for_stream_fit(Stream s, std::size_t size) {
  Lane* l = blocks_ ? find_lane(s) : nullptr;
  if (!l || !l->blocks) return nullptr;
  for (auto it = l->by_size.lower_bound(size); it != l->by_size.end(); ++it)
    if (it->second.tail) return it->second.tail;  // (empty lists are kept while few)
  return nullptr;
}

void StreamOrder::take_peeked(BlockRecord* b) {
  unlink(*slots_[b->lane], b);
  ++same_stream_reuses_;
}

BlockRecord* StreamOrder::take_for_stream_fit(Stream s, std::size_t size) {
  BlockRecord* b = peek_for_stream_fit(s, size);
  if (b) take_peeked(b);
  return b;
}

std::vector<std::pair<Stream, std::size_t>> StreamOrder::by_stream() const {
  std::map<Stream, std::size_t> m;
  for (const Lane* l : live_)
    if (l->bytes) m[l->stream] += l->bytes;
  for (BlockRecord* b = multi_head_; b; b = b->pend_next) m[b->last_stream] += b->size;
  for (BlockRecord* b = capture_head_; b; b = b->pend_next) m[b->last_stream] += b->size;
  return {m.begin(), m.end()};
}

void StreamOrder::describe(const BlockRecord* b, std::vector<Stream>& waits_on, EventId& event) const {
  waits_on.clear();
  event = kNullEvent;
  if (b->lane >= kCaptureLane) {
    waits_on.push_back(b->last_stream);
    if (b->alloc_stream != kNoStream && b->alloc_stream != b->last_stream) waits_on.push_back(b->alloc_stream);
    if (b->used_on)
      for (Stream u : *b->used_on)
        if (u != b->last_stream && u != b->alloc_stream) waits_on.push_back(u);
    if (b->events && !b->events->empty()) event = b->events->front();
    return;
  }
  const Lane& l = *slots_[b->lane];
  waits_on.push_back(l.stream);
  if (l.fenced && b->pend_seq <= l.fence_seq) event = l.fence;
}

void StreamOrder::validate() const {
  std::size_t bytes = 0, blocks = 0, fenced = 0;
  if (index_.size() != live_.size()) throw InvariantViolation("stream order: lane index out of step with the lanes");
  for (std::size_t i = 0; i < live_.size(); ++i) {
    const Lane& l = *live_[i];
    if (l.live_pos != i || l.slot >= slots_.size() || slots_[l.slot].get() != &l)
      throw InvariantViolation("stream order: lane slot or position broken");
    auto it = index_.find(l.stream);
    if (it == index_.end() || it->second != &l) throw InvariantViolation("stream order: lane missing from the index");
    fenced += l.fenced;
    std::size_t lb = 0, ln = 0;
    const BlockRecord* prev = nullptr;
    std::uint64_t seq = 0;
    for (const BlockRecord* b = l.head; b; b = b->pend_next) {
      if (b->pend_prev != prev) throw InvariantViolation("stream order: broken lane links");
      if (b->lane != l.slot) throw InvariantViolation("stream order: block names another lane");
      if (b->st() != ChunkState::Pending) throw InvariantViolation("stream order: non-pending block in a lane");
      if (b->pend_seq <= seq) throw InvariantViolation("stream order: lane out of release order");
      seq = b->pend_seq;
      lb += b->size;
      ++ln;
      prev = b;
    }
    if (prev != l.tail) throw InvariantViolation("stream order: lane tail mismatch");
    if (lb != l.bytes || ln != l.blocks) throw InvariantViolation("stream order: lane totals mismatch");
    std::size_t sn = 0;
    for (auto& [sz, sl] : l.by_size)
      for (const BlockRecord* b = sl.head; b; b = b->size_next) {
        if (b->size != sz) throw InvariantViolation("stream order: block in the wrong size list");
        ++sn;
      }
    if (sn != ln) throw InvariantViolation("stream order: size index does not match the lane");
    bytes += lb;
    blocks += ln;
  }
  for (const BlockRecord* b = multi_head_; b; b = b->pend_next) {
    if (b->st() != ChunkState::Pending || !b->events)
      throw InvariantViolation("stream order: bad multi-stream pending block");
    bytes += b->size;
    ++blocks;
  }
  std::size_t captured = 0;
  for (const BlockRecord* b = capture_head_; b; b = b->pend_next) {
    if (b->st() != ChunkState::Pending || b->events || b->lane != kCaptureLane)
      throw InvariantViolation("stream order: bad capture-deferred pending block");
    bytes += b->size;
    ++blocks;
    ++captured;
  }
  if (captured != capture_blocks_) throw InvariantViolation("stream order: capture-deferred count mismatch");
  if (fenced != fences_outstanding_) throw InvariantViolation("stream order: outstanding fence count mismatch");
  if (bytes != bytes_ || blocks != blocks_)
    throw InvariantViolation("stream order: pending totals " + std::to_string(bytes_) + " B / " +
                             std::to_string(blocks_) + " blocks, lanes hold " + std::to_string(bytes) + " B / " +
                             std::to_string(blocks) + " blocks");
}

}  // namespace poolkeeper
