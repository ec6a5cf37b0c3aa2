/* Extra C entry points for PyTorch's CUDAPluggableAllocator hooks, whose signatures differ from the
 * general C ABI in poolkeeper_capi.h. Exported from poolkeeper/_core*.so.
 *
 * - poolkeeper_torch_malloc_raising(size, device, stream): poolkeeper_torch_malloc, except that a
 *   failure (size > 0) throws std::runtime_error with the pool's diagnosis instead of returning
 *   NULL: PyTorch's pluggable allocator (2.11) does not check malloc's result and would hand out a
 *   tensor at address 0, while it turns a C++ exception into a Python RuntimeError. The one entry
 *   point here that lets an exception out; only for PyTorch's own call sites (install()).
 * - poolkeeper_torch_record_stream_hook(ptr, stream): the signature of
 *   CUDAPluggableAllocator::set_record_stream_fn (no device argument). The block's pool is found by
 *   asking each installed pool whether ptr is one of its live blocks (a handful of devices at most).
 *   A pointer no pool owns is ignored and counted (see poolkeeper_torch_hook_counters).
 * - poolkeeper_torch_empty_cache_hook(): the signature of set_reset_fn, which PyTorch calls from
 *   torch.cuda.empty_cache(): synchronizes and trims every installed pool (blocks released on streams
 *   are waited for, as PyTorch's own empty_cache waits for its events).
 * - poolkeeper_torch_hook_counters(out[3]): record_stream calls served, record_stream calls whose
 *   pointer no pool owned, empty_cache calls (so tests can see that PyTorch reached the hooks).
 *
 * - poolkeeper_torch_begin_allocate_to_pool / _end_allocate_to_pool / _release_pool: the CUDA-graph
 *   hooks of CUDAPluggableAllocator (set_begin_allocate_to_pool, set_end_allocate_to_pool_fn,
 *   set_release_pool). Their signatures are C++ (PyTorch's MempoolId_t is a pair of unsigned long
 *   long, its filter a std::function<bool(cudaStream_t)>), declared in torch_graph_hooks.cpp with
 *   C linkage so Python can find them by name. They drive the device's GraphPools
 *   (graph_pools.hpp); an error (no pool for the device) is thrown as std::runtime_error, which
 *   PyTorch turns into a RuntimeError at capture time.
 *
 * Apart from poolkeeper_torch_malloc_raising and the graph hooks, no C++ exception crosses this
 * boundary. Thread-safe.
 */
#ifndef POOLKEEPER_TORCH_HOOKS_H
#define POOLKEEPER_TORCH_HOOKS_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void* poolkeeper_torch_malloc_raising(size_t size, int device, void* stream);
void poolkeeper_torch_record_stream_hook(void* ptr, void* stream);
void poolkeeper_torch_empty_cache_hook(void);
void poolkeeper_torch_hook_counters(uint64_t* out3);

#ifdef __cplusplus
}
#endif
#endif
