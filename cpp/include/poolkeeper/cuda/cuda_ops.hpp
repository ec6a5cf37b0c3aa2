// Small driver operations the Python helpers (poolkeeper.cuda.driver), the staging pool and the
// GPU tests need: streams, events, copies, memset. Handles and pointers travel as integers.
//
// Contracts:
// - Context: an operation on a stream runs in the context that owns the stream; one without a
//   stream runs in the calling thread's current context, or device 0's primary context when the
//   thread has none (the CUDA runtime's rule). The thread's current context is left as it was.
// - Blocking: memcpy_htod / memcpy_dtoh return once the copy has completed (ordered on the legacy
//   default stream); *_async ones only enqueue. memset_d8 without a stream is ordered on the
//   legacy default stream and may return before it completes (the driver's memset semantics).
// - Errors: UpstreamFailure with the CUDA error's name; CudaUnavailable without a driver.
// - After process exit has begun, destroy calls are no-ops.
#pragma once
#include <cstddef>
#include <cstdint>

namespace poolkeeper::cuda {

// A new non-blocking stream on device's primary context.
std::uintptr_t stream_create(int device, bool non_blocking = true);
void stream_destroy(std::uintptr_t stream);
void stream_synchronize(std::uintptr_t stream);

// A new event (timing disabled) recorded on stream, in the stream's context.
std::uintptr_t event_record_new(std::uintptr_t stream);
// Record an existing event again on stream.
void event_record(std::uintptr_t event, std::uintptr_t stream);
// true: completed; false: not yet (CUDA_ERROR_NOT_READY is an answer, not an error).
bool event_query(std::uintptr_t event);
void event_synchronize(std::uintptr_t event);
void event_destroy(std::uintptr_t event);

void memcpy_htod(std::uintptr_t dst, const void* src, std::size_t n);
void memcpy_htod_async(std::uintptr_t dst, const void* src, std::size_t n, std::uintptr_t stream);
void memcpy_dtoh(void* dst, std::uintptr_t src, std::size_t n);
void memcpy_dtoh_async(void* dst, std::uintptr_t src, std::size_t n, std::uintptr_t stream);
void memset_d8(std::uintptr_t dst, unsigned char value, std::size_t n);
void memset_d8_async(std::uintptr_t dst, unsigned char value, std::size_t n, std::uintptr_t stream);

// Synchronize device's primary context (all work on the device).
void device_synchronize(int device);
// (free, total) bytes of device memory.
void mem_get_info(int device, std::size_t& free, std::size_t& total);

}  // namespace poolkeeper::cuda
