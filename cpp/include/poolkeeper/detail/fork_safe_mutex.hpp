// ForkSafeMutex: a std::mutex that fork() never catches held.
//
// fork() copies only the forking thread; a lock another thread held at that moment stays held in
// the child forever, and the child's first call that takes it hangs. Pools avoid this by being
// closed in the child (Pool::forked). Upstreams cannot be: a forked child documentedly goes on
// using the one it inherited (the staging pool's child allocates from its Host), and a new pool in
// the child over the parent's upstream object is ordinary code. So the upstreams' locks are these:
// pthread_atfork's prepare handler takes every live ForkSafeMutex (fork waits for the calls under
// way, which are short and never wait for anything else), and the parent and the child release
// them, so the child inherits each one free and the state it guards whole.
//
// Only for leaf locks: code holding one must never take another ForkSafeMutex (the prepare handler
// takes them in address order; a holder waiting for a second one could deadlock the fork), nor
// call fork(). Satisfies Lockable: use with std::lock_guard / std::unique_lock.
#pragma once
#include <mutex>

namespace poolkeeper::detail {

class ForkSafeMutex {
 public:
  ForkSafeMutex();   // joins the set the fork handlers take; thread safe
  ~ForkSafeMutex();  // leaves it; must not be held
  ForkSafeMutex(const ForkSafeMutex&) = delete;
  ForkSafeMutex& operator=(const ForkSafeMutex&) = delete;

  void lock() { mu_.lock(); }
  bool try_lock() { return mu_.try_lock(); }
  void unlock() { mu_.unlock(); }

 private:
  friend struct ForkSafeMutexes;
  std::mutex mu_;
};

}  // namespace poolkeeper::detail
