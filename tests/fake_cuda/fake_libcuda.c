/* A fake CUDA driver (libcuda.so.1 stand-in) for CPU-only tests of poolkeeper's driver layer.
 *
 * It implements the driver functions poolkeeper resolves, with host memory as "device" memory,
 * per-thread current contexts, one primary context and one default memory pool per device. The
 * pool models only what the warm-pool policy observes: a release threshold, reserved and used
 * bytes, frees returned at a synchronize while reserved exceeds the threshold, and TrimTo.
 * It models no real concurrency: every operation completes at once, except that an event can be
 * told to answer CUDA_ERROR_NOT_READY for its first N queries after each record.
 *
 * Environment (read at cuInit):
 *   FAKE_CUDA_INIT_RESULT   cuInit's return code (default 0)
 *   FAKE_CUDA_DEVICES       device count (default 1, at most 8)
 *   FAKE_CUDA_NO_POOLS      1: devices report no memory-pool support
 *   FAKE_CUDA_EVENT_NOT_READY  N: each recorded event is "not ready" for its first N queries
 *   FAKE_CUDA_CAPACITY      bytes of memory per device (default 80 GiB)
 *   FAKE_CUDA_LOG           path: append one line per pool/context-sensitive call, naming the
 *                           device of the context current at the call ("cur=-1": none)
 *   FAKE_CUDA_NO_VMM        1: devices report no virtual memory management support
 *   FAKE_CUDA_DEFER_COPIES  1: cuMemcpyHtoDAsync only queues the copy (one FIFO for all streams);
 *                           queued copies run, in order, when an event recorded after them is
 *                           synchronized or answers a query with success, or at a stream/context
 *                           synchronize. A staging buffer overwritten before its copy was waited
 *                           for then corrupts the destination, as with a real DMA.
 *   FAKE_CUDA_FAIL_HTOD_ASYNC_AT   N: the N-th cuMemcpyHtoDAsync call (from 1) fails, copying nothing
 *   FAKE_CUDA_FAIL_EVENT_RECORD_AT N: the N-th cuEventRecord call (from 1) fails
 *   FAKE_CUDA_FAIL_MEM_RELEASE_AT  N: the N-th cuMemRelease call (from 1) fails (the handle leaks)
 *   FAKE_CUDA_FAIL_SET_ACCESS_AT   N: the N-th cuMemSetAccess call (from 1) fails, granting nothing
 *   FAKE_CUDA_UNMAP_RUNS    1: cuMemUnmap also takes a range that whole adjacent mappings cover
 *                           exactly (the driver's documentation leaves open whether it may)
 *   FAKE_CUDA_FAIL_UNMAP_AT N: the N-th cuMemUnmap call (from 1) fails, unmapping nothing;
 *                           fake_cuda_unmap_calls() counts the calls (refused ones too)
 * fake_cuda_pending() (not a driver function) returns the number of queued, unexecuted copies;
 * fake_cuda_fail_ctx_set(n) makes the next n cuCtxSetCurrent calls to a context fail.
 * Stream capture (a model of CUDA's rules, driven by test helpers that are not driver functions):
 * fake_cuda_begin_capture(stream, mode) / fake_cuda_end_capture(stream) -> 1 if the capture stayed
 * valid; cuStreamIsCapturing and cuThreadExchangeStreamCaptureMode (per-thread mode) are real.
 * While a capture is active: cuMemAlloc, cuEventQuery and cuEventSynchronize from a thread not in
 * relaxed mode during a global-mode capture, cuMemFree and cuCtxSynchronize in any mode, and
 * cuEventRecord on a capturing stream invalidate every capture and return
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900); fake_cuda_capture_violations() counts them.
 * Destroyed streams: cuStreamDestroy keeps the handle's memory but marks it dead, so a later call
 * naming it answers CUDA_ERROR_INVALID_HANDLE, as the real driver typically does for a stale handle
 * (instead of reading freed memory).
 * Virtual memory management: cuMemAddressReserve takes PROT_NONE address space (mmap), cuMemCreate
 * counts a handle's bytes against the device's capacity, cuMemMap backs the range with the handle's
 * memory but grants no access (checked: inside a reservation, not mapped yet; touching it before
 * cuMemSetAccess faults, as a kernel would on the GPU), cuMemSetAccess makes a range read/write when
 * mappings cover every byte of it (one call may span several, as on the driver;
 * fake_cuda_set_access_calls() counts the calls), cuMemUnmap must name exactly one
 * mapping and drops its pages, cuMemRelease frees the handle (refused while it is mapped). A handle
 * is a memfd: mapping it at a second address (as stitching does) shows the same bytes at both. cuMemAddressFree refuses a range
 * with mappings left. Granularity 2 MiB.
 * Compile with -DFAKE_NO_POOL_API for a driver without the stream-ordered allocator, and
 * -DFAKE_NO_VMM_API for one without the virtual memory management entry points.
 * Not thread-safe beyond what the tests need (one mutex around the shared state).
 */
#define _GNU_SOURCE 1  /* memfd_create */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#define OK 0
#define E_INVALID_VALUE 1
#define E_OOM 2
#define E_NOT_INITIALIZED 3
#define E_INVALID_CONTEXT 201
#define E_INVALID_HANDLE 400
#define E_NOT_READY 600
#define MAXDEV 8

struct ctx { int dev; int refs; };
struct pool { int dev; uint64_t threshold, reserved, used, reserved_high, used_high; };
struct stream { struct ctx* ctx; int dead; int capturing, capture_mode, capture_valid; };
struct event { struct ctx* ctx; int not_ready_left; uint64_t upto; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int inited = 0, ndev = 1, no_pools = 0, no_vmm = 0, event_not_ready = 0;
static uint64_t capacity = 80ull << 30;
static int defer_copies = 0, fail_htod_async_at = 0, fail_event_record_at = 0, htod_async_calls = 0, event_record_calls = 0;
static int fail_mem_release_at = 0, mem_release_calls = 0;
static int fail_set_access_at = 0, set_access_calls = 0, unmap_runs = 0, fail_unmap_at = 0, unmap_calls = 0;
int fake_cuda_set_access_calls(void) { return __atomic_load_n(&set_access_calls, __ATOMIC_SEQ_CST); }
int fake_cuda_unmap_calls(void) { return __atomic_load_n(&unmap_calls, __ATOMIC_SEQ_CST); }
struct qcopy { void* dst; const void* src; size_t n; };
static struct qcopy* cq = NULL;
static uint64_t cq_len = 0, cq_cap = 0, cq_done = 0;  /* copies queued ever, capacity, executed */
static uint64_t direct_used[MAXDEV];
static struct ctx ctxs[MAXDEV];
static struct pool pools[MAXDEV];
static __thread struct ctx* current = NULL;
static __thread int capture_mode_tls = 0;  /* CUstreamCaptureMode of this thread */
static int captures_active = 0, capture_violations = 0;
static struct stream* capturing_streams[16];

/* A call that would invalidate active captures: returns 900 (and counts) or 0. */
static CUresult capture_check(int synchronizes) {
  pthread_mutex_lock(&mu);
  CUresult r = OK;
  if (captures_active) {
    int global = 0;
    for (int i = 0; i < 16; i++)
      if (capturing_streams[i] && capturing_streams[i]->capture_mode == 0) global = 1;
    if (synchronizes || (global && capture_mode_tls != 2)) {
      capture_violations++;
      for (int i = 0; i < 16; i++)
        if (capturing_streams[i]) capturing_streams[i]->capture_valid = 0;
      r = 900;
    }
  }
  pthread_mutex_unlock(&mu);
  return r;
}
int fake_cuda_capture_violations(void) { return capture_violations; }
int fake_cuda_begin_capture(struct stream* s, int mode) {
  if ((uintptr_t)s <= 2) return 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 16; i++)
    if (!capturing_streams[i]) { capturing_streams[i] = s; break; }
  s->capturing = 1; s->capture_mode = mode; s->capture_valid = 1; captures_active++;
  pthread_mutex_unlock(&mu);
  return 1;
}
int fake_cuda_end_capture(struct stream* s) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 16; i++)
    if (capturing_streams[i] == s) capturing_streams[i] = NULL;
  int valid = s->capture_valid;
  s->capturing = 0; captures_active--;
  pthread_mutex_unlock(&mu);
  return valid;
}
CUresult cuThreadExchangeStreamCaptureMode(int* mode) { int prev = capture_mode_tls; capture_mode_tls = *mode; *mode = prev; return OK; }
CUresult cuStreamIsCapturing(struct stream* s, int* status) {
  *status = ((uintptr_t)s > 2 && s->capturing) ? (s->capture_valid ? 1 : 2) : 0;
  return OK;
}

static void logf_(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char* fmt, ...) {
  const char* path = getenv("FAKE_CUDA_LOG");
  if (!path || !*path) return;
  FILE* f = fopen(path, "a");
  if (!f) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fprintf(f, " cur=%d\n", current ? current->dev : -1);
  fclose(f);
}

static int env_int(const char* n, int d) { const char* v = getenv(n); return v && *v ? atoi(v) : d; }

CUresult cuInit(unsigned flags) {
  (void)flags;
  int r = env_int("FAKE_CUDA_INIT_RESULT", 0);
  if (r) return r;
  pthread_mutex_lock(&mu);
  if (!inited) {
    ndev = env_int("FAKE_CUDA_DEVICES", 1);
    if (ndev < 0) ndev = 0;
    if (ndev > MAXDEV) ndev = MAXDEV;
    no_pools = env_int("FAKE_CUDA_NO_POOLS", 0);
    no_vmm = env_int("FAKE_CUDA_NO_VMM", 0);
    event_not_ready = env_int("FAKE_CUDA_EVENT_NOT_READY", 0);
    defer_copies = env_int("FAKE_CUDA_DEFER_COPIES", 0);
    fail_htod_async_at = env_int("FAKE_CUDA_FAIL_HTOD_ASYNC_AT", 0);
    fail_event_record_at = env_int("FAKE_CUDA_FAIL_EVENT_RECORD_AT", 0);
    fail_mem_release_at = env_int("FAKE_CUDA_FAIL_MEM_RELEASE_AT", 0);
    fail_set_access_at = env_int("FAKE_CUDA_FAIL_SET_ACCESS_AT", 0);
    unmap_runs = env_int("FAKE_CUDA_UNMAP_RUNS", 0);
    fail_unmap_at = env_int("FAKE_CUDA_FAIL_UNMAP_AT", 0);
    const char* c = getenv("FAKE_CUDA_CAPACITY");
    if (c && *c) capacity = strtoull(c, NULL, 10);
    for (int i = 0; i < MAXDEV; i++) { ctxs[i].dev = i; pools[i].dev = i; }
    inited = 1;
  }
  pthread_mutex_unlock(&mu);
  return OK;
}

static const char* names[][2] = {
  {"0", "CUDA_SUCCESS"}, {"1", "CUDA_ERROR_INVALID_VALUE"}, {"2", "CUDA_ERROR_OUT_OF_MEMORY"},
  {"3", "CUDA_ERROR_NOT_INITIALIZED"}, {"34", "CUDA_ERROR_STUB_LIBRARY"}, {"100", "CUDA_ERROR_NO_DEVICE"},
  {"101", "CUDA_ERROR_INVALID_DEVICE"}, {"201", "CUDA_ERROR_INVALID_CONTEXT"}, {"400", "CUDA_ERROR_INVALID_HANDLE"},
  {"600", "CUDA_ERROR_NOT_READY"},
};
CUresult cuGetErrorName(CUresult r, const char** out) {
  char buf[16];
  snprintf(buf, sizeof buf, "%d", r);
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (!strcmp(names[i][0], buf)) { *out = names[i][1]; return OK; }
  *out = NULL;
  return E_INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult r, const char** out) {
  *out = r == E_OOM ? "out of memory" : "fake driver error";
  return OK;
}

#define NEED_INIT() do { if (!inited) return E_NOT_INITIALIZED; } while (0)
#define NEED_DEV(d) do { if ((d) < 0 || (d) >= ndev) return 101; } while (0)
#define NEED_CTX() do { if (!current) return E_INVALID_CONTEXT; } while (0)

CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int* n) { NEED_INIT(); *n = ndev; return OK; }
CUresult cuDeviceGet(int* d, int i) { NEED_INIT(); NEED_DEV(i); *d = i; return OK; }
CUresult cuDeviceGetName(char* b, int len, int d) { NEED_DEV(d); snprintf(b, (size_t)len, "Fake GPU %d", d); return OK; }
CUresult cuDeviceGetPCIBusId(char* b, int len, int d) { NEED_DEV(d); snprintf(b, (size_t)len, "0000:%02x:00.0", d + 1); return OK; }
CUresult cuDeviceTotalMem_v2(size_t* t, int d) { NEED_DEV(d); *t = capacity; return OK; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) {
  NEED_DEV(d);
  switch (attr) {
    case 16: *v = 132; break;
    case 75: *v = 9; break;
    case 76: *v = 0; break;
    case 115: *v = no_pools ? 0 : 1; break;
    case 102: *v = no_vmm ? 0 : 1; break;
    default: *v = 0;
  }
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(struct ctx** c, int d) {
  NEED_INIT(); NEED_DEV(d);
  pthread_mutex_lock(&mu); ctxs[d].refs++; pthread_mutex_unlock(&mu);
  *c = &ctxs[d];
  logf_("retain dev=%d", d);
  return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int d) { NEED_DEV(d); pthread_mutex_lock(&mu); ctxs[d].refs--; pthread_mutex_unlock(&mu); return OK; }
CUresult cuCtxGetCurrent(struct ctx** c) { NEED_INIT(); *c = current; return OK; }
static int fail_ctx_set = 0;
/* Test helper (not a driver function): the next n switches to a context fail (INVALID_CONTEXT). */
void fake_cuda_fail_ctx_set(int n) { __atomic_store_n(&fail_ctx_set, n, __ATOMIC_SEQ_CST); }
CUresult cuCtxSetCurrent(struct ctx* c) {
  NEED_INIT();
  if (c && __atomic_load_n(&fail_ctx_set, __ATOMIC_SEQ_CST) > 0) { __atomic_sub_fetch(&fail_ctx_set, 1, __ATOMIC_SEQ_CST); return E_INVALID_CONTEXT; }
  current = c;
  return OK;
}
CUresult cuCtxGetDevice(int* d) { NEED_CTX(); *d = current->dev; return OK; }

static uint64_t used_on(int d) { return direct_used[d] + pools[d].reserved; }

/* A synchronize observes pending frees: the pool gives back what exceeds its threshold. */
static void pool_sync(int d) {
  struct pool* p = &pools[d];
  if (p->reserved > p->threshold) {
    uint64_t cached = p->reserved - p->used;
    uint64_t excess = p->reserved - p->threshold;
    p->reserved -= cached < excess ? cached : excess;
  }
}
/* Run queued copies up to number `upto` (under mu). */
static void run_copies(uint64_t upto) {
  while (cq_done < upto && cq_done < cq_len) {
    struct qcopy* c = &cq[cq_done % cq_cap];
    memcpy(c->dst, c->src, c->n);
    cq_done++;
  }
}
int fake_cuda_pending(void) { pthread_mutex_lock(&mu); int n = (int)(cq_len - cq_done); pthread_mutex_unlock(&mu); return n; }

CUresult cuCtxSynchronize(void) {
  if (capture_check(1)) return 900;
  NEED_CTX();
  logf_("cuCtxSynchronize dev=%d", current->dev);
  pthread_mutex_lock(&mu); pool_sync(current->dev); run_copies(cq_len); pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { NEED_CTX(); *t = capacity; *f = capacity - used_on(current->dev); return OK; }

/* Allocations carry a 16-byte header holding their size and device (host memory stands in). */
static void* fake_alloc(size_t n, int dev) {
  char* p = aligned_alloc(256, 256 + ((n + 255) & ~(size_t)255));
  if (!p) return NULL;
  ((uint64_t*)p)[0] = n;
  ((uint64_t*)p)[1] = (uint64_t)dev;
  return p + 256;
}
static uint64_t hdr_size(void* p) { return ((uint64_t*)((char*)p - 256))[0]; }
static void fake_free(void* p) { free((char*)p - 256); }

CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t n) {
  if (capture_check(0)) return 900;
  NEED_CTX();
  int d = current->dev;
  pthread_mutex_lock(&mu);
  if (n == 0 || used_on(d) + n > capacity) { pthread_mutex_unlock(&mu); return E_OOM; }
  direct_used[d] += n;
  pthread_mutex_unlock(&mu);
  *out = (CUdeviceptr)(uintptr_t)fake_alloc(n, d);
  return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  if (capture_check(1)) return 900;
  NEED_CTX();
  if (!p) return E_INVALID_VALUE;
  int d = (int)((uint64_t*)((char*)(uintptr_t)p - 256))[1];
  pthread_mutex_lock(&mu); direct_used[d] -= hdr_size((void*)(uintptr_t)p); pthread_mutex_unlock(&mu);
  fake_free((void*)(uintptr_t)p);
  return OK;
}
CUresult cuMemHostAlloc(void** p, size_t n, unsigned flags) { (void)flags; NEED_CTX(); *p = fake_alloc(n, -1); return *p ? OK : E_OOM; }
CUresult cuMemFreeHost(void* p) { NEED_CTX(); fake_free(p); return OK; }

static struct ctx* stream_ctx(struct stream* s) { return (uintptr_t)s <= 2 ? current : s->ctx; }
static int stream_dead(struct stream* s) { return (uintptr_t)s > 2 && s->dead; }

#ifndef FAKE_NO_POOL_API  /* build with -DFAKE_NO_POOL_API to mimic a pre-11.2 driver */
/* As documented: an explicit stream names its context; only the default stream needs a current one. */
CUresult cuMemAllocAsync(CUdeviceptr* out, size_t n, struct stream* s) {
  if (stream_dead(s)) return E_INVALID_HANDLE;
  struct ctx* c = stream_ctx(s);
  if (!c) return E_INVALID_CONTEXT;
  struct pool* p = &pools[c->dev];
  pthread_mutex_lock(&mu);
  uint64_t cached = p->reserved - p->used;
  if (cached < n) {
    if (used_on(c->dev) + (n - cached) > capacity) { pthread_mutex_unlock(&mu); return E_OOM; }
    p->reserved += n - cached;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
  }
  p->used += n;
  if (p->used > p->used_high) p->used_high = p->used;
  pthread_mutex_unlock(&mu);
  *out = (CUdeviceptr)(uintptr_t)fake_alloc(n, c->dev);
  return OK;
}
CUresult cuMemFreeAsync(CUdeviceptr ptr, struct stream* s) {
  if (stream_dead(s)) return E_INVALID_HANDLE;
  if (!stream_ctx(s)) return E_INVALID_CONTEXT;
  void* h = (void*)(uintptr_t)ptr;
  int d = (int)((uint64_t*)((char*)h - 256))[1];
  pthread_mutex_lock(&mu); pools[d].used -= hdr_size(h); pthread_mutex_unlock(&mu);
  fake_free(h);
  return OK;
}
CUresult cuDeviceGetDefaultMemPool(struct pool** p, int d) { NEED_DEV(d); if (no_pools) return 801; *p = &pools[d]; return OK; }
CUresult cuMemPoolGetAttribute(struct pool* p, int attr, void* v) {
  logf_("cuMemPoolGetAttribute dev=%d attr=%d", p->dev, attr);
  uint64_t* o = v;
  switch (attr) {
    case 4: *o = p->threshold; break;
    case 5: *o = p->reserved; break;
    case 6: *o = p->reserved_high; break;
    case 7: *o = p->used; break;
    case 8: *o = p->used_high; break;
    default: return E_INVALID_VALUE;
  }
  return OK;
}
CUresult cuMemPoolSetAttribute(struct pool* p, int attr, void* v) {
  /* The high watermarks accept only 0, which resets them to the current value (as the driver does). */
  if (attr == 6 || attr == 8) {
    if (*(uint64_t*)v != 0) return E_INVALID_VALUE;
    if (attr == 6) p->reserved_high = p->reserved; else p->used_high = p->used;
    logf_("cuMemPoolSetAttribute dev=%d reset attr=%d", p->dev, attr);
    return OK;
  }
  if (attr != 4) return E_INVALID_VALUE;
  p->threshold = *(uint64_t*)v;
  logf_("cuMemPoolSetAttribute dev=%d threshold=%llu", p->dev, (unsigned long long)p->threshold);
  return OK;
}
CUresult cuMemPoolTrimTo(struct pool* p, size_t keep) {
  logf_("cuMemPoolTrimTo dev=%d keep=%zu", p->dev, keep);
  pthread_mutex_lock(&mu);
  if (p->reserved > keep) {
    uint64_t floor = keep > p->used ? keep : p->used;
    p->reserved = floor;
  }
  pthread_mutex_unlock(&mu);
  return OK;
}
#endif

CUresult cuStreamCreate(struct stream** s, unsigned flags) {
  (void)flags; NEED_CTX();
  *s = calloc(1, sizeof **s);
  (*s)->ctx = current;
  return OK;
}
CUresult cuStreamDestroy_v2(struct stream* s) {
  if (stream_dead(s)) return E_INVALID_HANDLE;
  if ((uintptr_t)s > 2) s->dead = 1;  /* kept allocated: a stale handle is answered, not read after free */
  return OK;
}
CUresult cuStreamGetCtx(struct stream* s, struct ctx** c) {
  if (stream_dead(s)) return E_INVALID_HANDLE;
  if ((uintptr_t)s <= 2) { if (!current) return E_INVALID_CONTEXT; *c = current; return OK; }
  *c = s->ctx;
  return OK;
}
CUresult cuStreamSynchronize(struct stream* s) {
  if (stream_dead(s)) return E_INVALID_HANDLE;
  struct ctx* c = stream_ctx(s);
  if (!c) return E_INVALID_CONTEXT;
  pthread_mutex_lock(&mu); pool_sync(c->dev); run_copies(cq_len); pthread_mutex_unlock(&mu);
  return OK;
}

CUresult cuEventCreate(struct event** e, unsigned flags) {
  (void)flags; NEED_CTX();
  *e = calloc(1, sizeof **e);
  (*e)->ctx = current;
  return OK;
}
CUresult cuEventDestroy_v2(struct event* e) { free(e); return OK; }
CUresult cuEventRecord(struct event* e, struct stream* s) {
  if (stream_dead(s)) return E_INVALID_HANDLE;
  if ((uintptr_t)s > 2 && s->capturing) {  /* would become a node of the graph */
    pthread_mutex_lock(&mu); capture_violations++; s->capture_valid = 0; pthread_mutex_unlock(&mu);
    return 900;
  }
  struct ctx* c = stream_ctx(s);
  if (!c) return E_INVALID_CONTEXT;
  if (c != e->ctx) return E_INVALID_HANDLE;  /* event and stream must share a context */
  pthread_mutex_lock(&mu);
  int fail = ++event_record_calls == fail_event_record_at;
  if (!fail) { e->not_ready_left = event_not_ready; e->upto = cq_len; }
  pthread_mutex_unlock(&mu);
  return fail ? E_INVALID_VALUE : OK;
}
CUresult cuEventQuery(struct event* e) {
  if (capture_check(0)) return 900;
  pthread_mutex_lock(&mu);
  CUresult r = OK;
  if (e->not_ready_left > 0) { e->not_ready_left--; r = E_NOT_READY; }
  else run_copies(e->upto);
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuEventSynchronize(struct event* e) {
  if (capture_check(0)) return 900;
  pthread_mutex_lock(&mu); e->not_ready_left = 0; run_copies(e->upto); pthread_mutex_unlock(&mu);
  return OK;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { NEED_CTX(); memcpy((void*)(uintptr_t)d, s, n); return OK; }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { NEED_CTX(); memcpy(d, (void*)(uintptr_t)s, n); return OK; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, struct stream* st) {
  (void)st;
  NEED_CTX();
  pthread_mutex_lock(&mu);
  if (++htod_async_calls == fail_htod_async_at) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
  if (!defer_copies) { pthread_mutex_unlock(&mu); return cuMemcpyHtoD_v2(d, s, n); }
  if (cq_len - cq_done == cq_cap) {  /* grow the ring, keeping the unexecuted copies in order */
    uint64_t ncap = cq_cap ? 2 * cq_cap : 64;
    struct qcopy* nq = malloc(ncap * sizeof *nq);
    for (uint64_t i = cq_done; i < cq_len; i++) nq[i % ncap] = cq[i % cq_cap];
    free(cq); cq = nq; cq_cap = ncap;
  }
  cq[cq_len % cq_cap] = (struct qcopy){(void*)(uintptr_t)d, s, n};
  cq_len++;
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, struct stream* st) { (void)st; return cuMemcpyDtoH_v2(d, s, n); }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { NEED_CTX(); memset((void*)(uintptr_t)d, v, n); return OK; }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, struct stream* st) { (void)st; return cuMemsetD8_v2(d, v, n); }

#ifndef FAKE_NO_VMM_API
#include <sys/mman.h>
#include <unistd.h>
#define GRAN ((size_t)2 << 20)
#define MAXV 4096
struct vhandle { size_t size; int dev; int mapped; int fd; };  /* mapped: how many mappings now */
struct vrange { uintptr_t a; size_t n; };
struct vmap { uintptr_t a; size_t n; struct vhandle* h; };
static struct vrange vranges[MAXV];
static struct vmap vmaps[MAXV];
static int nvr = 0, nvm = 0;

CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
  (void)prop; (void)option; NEED_INIT(); *g = GRAN; return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr* out, size_t n, size_t align, CUdeviceptr addr, unsigned long long flags) {
  (void)addr; (void)flags; NEED_INIT();
  if (!n || n % GRAN || (align && align % GRAN)) return E_INVALID_VALUE;
  char* p = mmap(NULL, n + GRAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return E_OOM;
  uintptr_t a = ((uintptr_t)p + GRAN - 1) & ~(uintptr_t)(GRAN - 1);
  if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
  if ((uintptr_t)p + GRAN > a) munmap((void*)(a + n), (uintptr_t)p + GRAN - a);
  pthread_mutex_lock(&mu);
  if (nvr == MAXV) { pthread_mutex_unlock(&mu); munmap((void*)a, n); return E_OOM; }
  vranges[nvr].a = a; vranges[nvr].n = n; nvr++;
  pthread_mutex_unlock(&mu);
  *out = a;
  return OK;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t n) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nvr; i++) {
    if (vranges[i].a != ptr || vranges[i].n != n) continue;
    for (int j = 0; j < nvm; j++)
      if (vmaps[j].a >= ptr && vmaps[j].a < ptr + n) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
    vranges[i] = vranges[--nvr];
    pthread_mutex_unlock(&mu);
    munmap((void*)(uintptr_t)ptr, n);
    return OK;
  }
  pthread_mutex_unlock(&mu);
  return E_INVALID_VALUE;
}
CUresult cuMemCreate(unsigned long long* h, size_t n, const int* prop, unsigned long long flags) {
  (void)flags; NEED_INIT();
  /* prop: type, requestedHandleTypes, location.type, location.id (the ABI's first four ints) */
  if (prop[0] != 1 || prop[2] != 1) return E_INVALID_VALUE;
  int d = prop[3];
  NEED_DEV(d);
  if (!n || n % GRAN) return E_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  if (used_on(d) + n > capacity) { pthread_mutex_unlock(&mu); return E_OOM; }
  direct_used[d] += n;
  pthread_mutex_unlock(&mu);
  struct vhandle* v = calloc(1, sizeof *v);
  v->size = n; v->dev = d;
  v->fd = memfd_create("fake_cuda_handle", 0);
  if (v->fd < 0 || ftruncate(v->fd, (off_t)n) != 0) {
    if (v->fd >= 0) close(v->fd);
    free(v);
    pthread_mutex_lock(&mu); direct_used[d] -= n; pthread_mutex_unlock(&mu);
    return E_OOM;
  }
  *h = (unsigned long long)(uintptr_t)v;
  logf_("create dev=%d n=%zu", d, n);
  return OK;
}
CUresult cuMemRelease(unsigned long long h) {
  struct vhandle* v = (struct vhandle*)(uintptr_t)h;
  if (!v || v->mapped) return E_INVALID_VALUE;
  if (__atomic_add_fetch(&mem_release_calls, 1, __ATOMIC_SEQ_CST) == fail_mem_release_at) return E_INVALID_VALUE;
  pthread_mutex_lock(&mu); direct_used[v->dev] -= v->size; pthread_mutex_unlock(&mu);
  close(v->fd);
  free(v);
  return OK;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t n, size_t off, unsigned long long h, unsigned long long flags) {
  (void)flags;
  struct vhandle* v = (struct vhandle*)(uintptr_t)h;
  if (!v || off || n != v->size || ptr % GRAN) return E_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int inside = 0;
  for (int i = 0; i < nvr; i++) inside |= ptr >= vranges[i].a && ptr + n <= vranges[i].a + vranges[i].n;
  for (int j = 0; j < nvm && inside; j++) inside = !(vmaps[j].a < ptr + n && ptr < vmaps[j].a + vmaps[j].n);
  if (!inside || nvm == MAXV) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
  if (mmap((void*)(uintptr_t)ptr, n, PROT_NONE, MAP_SHARED | MAP_FIXED, v->fd, 0) == MAP_FAILED) {
    pthread_mutex_unlock(&mu);
    return E_OOM;
  }
  vmaps[nvm].a = ptr; vmaps[nvm].n = n; vmaps[nvm].h = v; nvm++;
  v->mapped++;
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t n) {
  if (__atomic_add_fetch(&unmap_calls, 1, __ATOMIC_SEQ_CST) == fail_unmap_at) return E_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  for (int j = 0; j < nvm; j++) {
    if (vmaps[j].a != ptr || vmaps[j].n != n) continue;
    vmaps[j].h->mapped--;
    vmaps[j] = vmaps[--nvm];
    mmap((void*)(uintptr_t)ptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    pthread_mutex_unlock(&mu);
    return OK;
  }
  if (unmap_runs) {  /* whole adjacent mappings covering [ptr, ptr+n) exactly: all of them go */
    CUdeviceptr at = ptr;
    for (int found = 1; at < ptr + n && found;) {
      found = 0;
      for (int j = 0; j < nvm && !found; j++)
        if (vmaps[j].a == at && at + vmaps[j].n <= ptr + n) { at += vmaps[j].n; found = 1; }
    }
    if (at == ptr + n) {
      for (int j = 0; j < nvm;)
        if (vmaps[j].a >= ptr && vmaps[j].a < ptr + n) { vmaps[j].h->mapped--; vmaps[j] = vmaps[--nvm]; }
        else j++;
      mmap((void*)(uintptr_t)ptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  return E_INVALID_VALUE;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t n, const int* desc, size_t count) {
  /* desc: location.type, location.id, flags */
  if (count != 1 || desc[0] != 1 || desc[2] != 3) return E_INVALID_VALUE;
  NEED_DEV(desc[1]);
  if (!n || ptr % GRAN || n % GRAN) return E_INVALID_VALUE;
  if (__atomic_add_fetch(&set_access_calls, 1, __ATOMIC_SEQ_CST) == fail_set_access_at) return E_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  /* every granule of the range inside some mapping */
  for (CUdeviceptr g = ptr; g < ptr + n; g += GRAN) {
    int in = 0;
    for (int j = 0; j < nvm && !in; j++) in = g >= vmaps[j].a && g < vmaps[j].a + vmaps[j].n;
    if (!in) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
  }
  int r = mprotect((void*)(uintptr_t)ptr, n, PROT_READ | PROT_WRITE) == 0 ? OK : E_INVALID_VALUE;
  pthread_mutex_unlock(&mu);
  logf_("setaccess n=%zu", n);
  return r;
}
#endif
