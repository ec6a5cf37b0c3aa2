// CUDA-graph capture, the part every upstream and pool shares.
//
// Why: a process that captures CUDA graphs (torch.cuda.graph, torch.compile's "reduce-overhead",
// CuPy's Stream.begin_capture) keeps allocating while a stream is captured. In the default
// "global" capture mode any call that may synchronize -- cuMemAlloc, cuMemFree, cuEventQuery,
// cuEventSynchronize, cuCtxSynchronize -- made by a thread that has not relaxed its own mode
// invalidates the capture, and an event recorded on the capturing stream becomes a node of the
// graph that can never be queried. So:
// - every upstream call a pool makes runs in relaxed mode on its thread (RelaxedCapture);
// - stream order never records an event on a capturing stream: such releases stay pending until
//   the capture has ended (stream_order.hpp);
// - pools hand no memory back to the upstream while a capture scope is open (a free may
//   synchronize the device): Upstream::captures_underway().
// Allocations a graph makes must also keep their addresses for the graph's lifetime: that is
// GraphPools (graph_pools.hpp).
#pragma once
#include "poolkeeper/core/upstream.hpp"

namespace poolkeeper {

// CUstreamCaptureMode values.
inline constexpr int kCaptureModeGlobal = 0, kCaptureModeThreadLocal = 1, kCaptureModeRelaxed = 2;

// This thread's capture mode is relaxed for the guard's lifetime, then restored. Costs two
// thread-local driver calls on CUDA upstreams and nothing elsewhere. Never throws.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(Upstream& up) : up_(up), prev_(up.exchange_capture_mode(kCaptureModeRelaxed)) {}
  ~RelaxedCapture() {
    if (prev_ != kCaptureModeRelaxed) up_.exchange_capture_mode(prev_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  Upstream& up_;
  int prev_;
};

}  // namespace poolkeeper
