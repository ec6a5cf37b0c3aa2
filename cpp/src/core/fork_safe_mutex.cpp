// The set of live ForkSafeMutex objects and the fork handlers that take them (see the header).
#include "poolkeeper/detail/fork_safe_mutex.hpp"

#include <pthread.h>

#include <set>

namespace poolkeeper::detail {

struct ForkSafeMutexes {
  // set_mu guards the set; the prepare handler holds it across the fork, so no mutex joins or
  // leaves while the handlers walk it.
  static std::mutex& set_mu() {
    static auto* m = new std::mutex();  // never destroyed: upstreams may outlive static destructors
    return *m;
  }
  // Ordered by address, not creation: any fixed order serves, since a holder never takes a second.
  static std::set<ForkSafeMutex*>& all() {
    static auto* s = new std::set<ForkSafeMutex*>();
    return *s;
  }
  static void prepare() {
    set_mu().lock();
    for (ForkSafeMutex* m : all()) m->mu_.lock();
  }
  static void release() {
    for (ForkSafeMutex* m : all()) m->mu_.unlock();
    set_mu().unlock();
  }
};

// Registered before any other fork handler of the library (priority 101 runs ahead of every static
// initializer and of the handlers pools register when the first one is made). pthread_atfork runs
// prepare handlers in reverse order of registration, so these leaf locks are taken last, after the
// pool directory's and the registries' locks: the order a thread takes them in (a thread exiting
// folds its cache into a pool under the directory lock, and that pool may call its upstream).
// Taken first, a fork could wait for an upstream lock whose holder waits for the directory lock
// the fork already held.
namespace {
__attribute__((constructor(101))) void register_fork_handlers() {
  pthread_atfork(ForkSafeMutexes::prepare, ForkSafeMutexes::release, ForkSafeMutexes::release);
}
}  // namespace

ForkSafeMutex::ForkSafeMutex() {
  std::lock_guard<std::mutex> g(ForkSafeMutexes::set_mu());
  ForkSafeMutexes::all().insert(this);
}

ForkSafeMutex::~ForkSafeMutex() {
  std::lock_guard<std::mutex> g(ForkSafeMutexes::set_mu());
  ForkSafeMutexes::all().erase(this);
}

}  // namespace poolkeeper::detail
