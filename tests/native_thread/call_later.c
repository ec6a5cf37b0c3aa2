/* A thread Python does not know, as PyTorch's or a C library's are. call_later(fn, ptr, device,
 * stream, delay_ms) starts a detached pthread that sleeps delay_ms and then calls
 * fn(ptr, device, stream) (a C ABI free); call_later_ptr(fn, ptr, delay_ms) calls fn(ptr) (a
 * DLPack deleter); loop_forever(malloc, free, device, stream, size) starts one that does C ABI
 * malloc/free pairs until the process ends, as a framework's allocator thread would;
 * fork_then_call_ptr(fn, ptr, ticks) forks from a new thread, once *ticks (a counter a Python
 * thread keeps raising) has moved, calls fn(ptr) in the child (a DLPack deleter there) and returns
 * the child's wait status. Built by the exit tests of
 * test_framework_parity.py. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*free_fn)(void*, int, uint64_t);
typedef void (*ptr_fn)(void*);
struct call {
  free_fn free_call;  /* one of the two */
  ptr_fn ptr_call;
  void* ptr;
  int device;
  uint64_t stream;
  int delay_ms;
};

static void* run(void* arg) {
  struct call* c = arg;
  usleep((useconds_t)c->delay_ms * 1000u);
  if (c->free_call)
    c->free_call(c->ptr, c->device, c->stream);
  else
    c->ptr_call(c->ptr);
  free(c);
  return NULL;
}

/* A detached thread running body(arg); arg (malloc'd) is freed here if the thread cannot start. */
static int start_detached(void* (*body)(void*), void* arg) {
  pthread_t t;
  int rc = pthread_create(&t, NULL, body, arg);
  if (rc) {
    free(arg);
    return rc;
  }
  pthread_detach(t);
  return 0;
}

static int start(struct call* c) { return start_detached(run, c); }

int call_later(void* fn, void* ptr, int device, uint64_t stream, int delay_ms) {
  struct call* c = calloc(1, sizeof *c);
  if (!c) return -1;
  c->free_call = (free_fn)fn;
  c->ptr = ptr;
  c->device = device;
  c->stream = stream;
  c->delay_ms = delay_ms;
  return start(c);
}

int call_later_ptr(void* fn, void* ptr, int delay_ms) {
  struct call* c = calloc(1, sizeof *c);
  if (!c) return -1;
  c->ptr_call = (ptr_fn)fn;
  c->ptr = ptr;
  c->delay_ms = delay_ms;
  return start(c);
}

typedef void* (*malloc_fn)(size_t, int, uint64_t);
struct loop {
  malloc_fn m;
  free_fn f;
  int device;
  uint64_t stream;
  size_t size;
};

static void* run_loop(void* arg) {
  struct loop* l = arg;
  for (unsigned i = 0;; ++i) {
    void* p = l->m(l->size + (size_t)(i % 7) * 4096u, l->device, l->stream);
    if (p) l->f(p, l->device, l->stream);
  }
  return NULL;
}

int loop_forever(void* m, void* f, int device, uint64_t stream, size_t size) {
  struct loop* l = calloc(1, sizeof *l);
  if (!l) return -1;
  l->m = (malloc_fn)m;
  l->f = (free_fn)f;
  l->device = device;
  l->stream = stream;
  l->size = size;
  return start_detached(run_loop, l);
}

struct forked {
  ptr_fn fn;
  void* ptr;
  volatile long* ticks;
  int status;
};

static void* fork_and_wait(void* arg) {
  struct forked* f = arg;
  /* The counting thread holds the GIL from the moment the counter moves: no other thread asks for
   * it (the caller let it go for this call), so it never lets it go before the fork. */
  long t0 = *f->ticks;
  for (int i = 0; *f->ticks == t0; ++i) {
    if (i == 5000) return NULL; /* 5 s: status stays -1 */
    usleep(1000);
  }
  pid_t pid = fork();
  if (pid == 0) {
    alarm(20); /* a call that hangs in the child ends it by SIGALRM, which the status shows */
    f->fn(f->ptr);
    _exit(0);
  }
  if (pid < 0) return NULL;
  if (waitpid(pid, &f->status, 0) < 0) f->status = -1;
  return NULL;
}

int fork_then_call_ptr(void* fn, void* ptr, volatile long* ticks) {
  struct forked f = {(ptr_fn)fn, ptr, ticks, -1};
  pthread_t t;
  if (pthread_create(&t, NULL, fork_and_wait, &f)) return -1;
  pthread_join(t, NULL);
  return f.status;
}
