// ForwardingUpstream: the base of an upstream that adds behaviour to another upstream's memory
// calls (a decorator: Faulty refusing chosen calls, a graph's private pool taking its backings
// from the device pool) while being the same device for everything else. Streams, events and the
// capture state are the inner upstream's: a decorator that answered them itself would record
// events the device never sees, or tell a pool that no stream is capturing while one is (Faulty
// did, and broke captures its inner device kept valid). Declared once here so that no decorator
// can forget one of them.
//
// Capture scopes may be opened on either object (a pool opens them on its own upstream, which may
// be the decorator): both count them on the inner upstream's device (capture_counter), so a pool
// over the inner upstream sees a scope opened through the decorator, and the other way round.
// Thread safety: as the inner upstream's (every member may be called concurrently).
#pragma once
#include <memory>
#include <utility>

#include "poolkeeper/core/upstream.hpp"

namespace poolkeeper {

class ForwardingUpstream : public Upstream {
 public:
  bool streams_supported() const override { return inner_->streams_supported(); }
  EventId record_event(Stream s) override { return inner_->record_event(s); }
  bool query_event(EventId e) override { return inner_->query_event(e); }
  void wait_event(EventId e) override { inner_->wait_event(e); }
  void release_event(EventId e) override { inner_->release_event(e); }
  void synchronize() override { inner_->synchronize(); }
  bool stream_capturing(Stream s) override { return inner_->stream_capturing(s); }
  int exchange_capture_mode(int mode) override { return inner_->exchange_capture_mode(mode); }

  const std::shared_ptr<Upstream>& inner() const { return inner_; }

 protected:
  std::atomic<int>& capture_counter() const override { return counter_of(*inner_); }
  // `inner` must not be null (each decorator checks, with its own message, before any call).
  explicit ForwardingUpstream(std::shared_ptr<Upstream> inner) : inner_(std::move(inner)) {}

  std::shared_ptr<Upstream> inner_;
};

}  // namespace poolkeeper
