/* poolkeeper's C ABI: plain C entry points over the process-wide pool registry.
 *
 * Exported (default visibility) from the built module poolkeeper/_core*.so, so PyTorch's
 * torch.cuda.memory.CUDAPluggableAllocator(path, "poolkeeper_torch_malloc", "poolkeeper_torch_free")
 * can load them from the module's path.
 *
 * Contract: no C++ exception crosses this boundary. A failure returns NULL / a nonzero code and
 * leaves a message for poolkeeper_last_error() on the calling thread. Thread-safe.
 * Streams: a stream is the raw handle (cudaStream_t); NULL is the legacy default stream and is a
 * real stream (stream-ordered), as it is for PyTorch. poolkeeper_malloc/free take
 * POOLKEEPER_NO_STREAM for "no stream: caller guarantees completion".
 */
#ifndef POOLKEEPER_CAPI_H
#define POOLKEEPER_CAPI_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define POOLKEEPER_NO_STREAM UINT64_MAX

/* PyTorch pluggable-allocator signatures. size 0 returns NULL (PyTorch's convention for empty
 * tensors); free(NULL) is a no-op. */
void* poolkeeper_torch_malloc(size_t size, int device, void* stream);
void poolkeeper_torch_free(void* ptr, size_t size, int device, void* stream);
/* record_stream hook: the block's release also waits for `stream`. Returns 0 or an error code. */
int poolkeeper_torch_record_stream(void* ptr, int device, void* stream);
/* empty_cache hook: trim every installed pool. Returns bytes released (saturated to int64). */
int64_t poolkeeper_empty_cache(void);

/* General entry points. Return 0 on success, nonzero on error (see poolkeeper_last_error). */
void* poolkeeper_malloc(size_t size, int device, uint64_t stream);
int poolkeeper_free(void* ptr, int device, uint64_t stream);
const char* poolkeeper_last_error(void);

/* Call timing: with it on, poolkeeper_malloc and poolkeeper_free (and so every framework hook
 * above, which goes through them) add their wall time, whole call, to process-wide counters. Off by
 * default: two clock reads cost more than a thread-cache hit, and every thread writes the same
 * counters (a diagnostic, not for many-threaded hot paths). set_call_timing(1) turns it on, 0 off,
 * a negative value leaves it, and returns the setting before the call. call_timing fills out4 with
 * malloc calls, malloc ns, free calls, free ns (never reset). A call is counted when timing was on
 * as it began, even if it is turned off before the call returns. Thread-safe. */
int poolkeeper_set_call_timing(int on);
void poolkeeper_call_timing(uint64_t* out4);

/* CUDA-graph private pools (docs/integrations.md, "CUDA graphs"). Between begin and end, every
 * allocation through poolkeeper_malloc / poolkeeper_torch_malloc on `device` whose stream is
 * `stream` comes from the private pool (id0, id1), keeps its address until the pool is released,
 * and goes back to that pool when freed. release drops one use; at zero uses and no live block the
 * device is synchronized and the pool's memory returns to the device pool. Return 0 or an error:
 * 1 (invalid argument) for a device index outside [0, 64), from all three; from end, also for a
 * scope that is not open. release of an id the device never used is 0 (nothing to do). */
int poolkeeper_graph_begin(int device, uint64_t id0, uint64_t id1, uint64_t stream);
int poolkeeper_graph_end(int device, uint64_t id0, uint64_t id1);
int poolkeeper_graph_release(int device, uint64_t id0, uint64_t id1);

#ifdef __cplusplus
}
#endif
#endif
