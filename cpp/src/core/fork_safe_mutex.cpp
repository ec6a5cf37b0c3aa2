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
  static void install() {
    static const int once = pthread_atfork(prepare, release, release);
    (void)once;
  }
};

ForkSafeMutex::ForkSafeMutex() {
  ForkSafeMutexes::install();
  std::lock_guard<std::mutex> g(ForkSafeMutexes::set_mu());
  ForkSafeMutexes::all().insert(this);
}

ForkSafeMutex::~ForkSafeMutex() {
  std::lock_guard<std::mutex> g(ForkSafeMutexes::set_mu());
  ForkSafeMutexes::all().erase(this);
}

}  // namespace poolkeeper::detail
