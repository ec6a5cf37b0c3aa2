// Test seams: named points inside lock-free steps where a native test can hold a thread, so a
// race that needs one thread stopped between two instructions is shown on every run rather than
// once in thousands. Only the native test builds define POOLKEEPER_TEST_SEAMS (CMake's
// POOLKEEPER_NATIVE_TESTS); in every other build a seam compiles to nothing.
// Thread safety: the hook is one atomic pointer, set by the test before the threads start.
#pragma once

#ifdef POOLKEEPER_TEST_SEAMS
#include <atomic>

namespace poolkeeper::detail {
enum class Seam {
  RemoteClaimed,  // SizeClassPool::free_remote: the block is claimed (Remote), not yet pushed
  LockedFreeClaimed,  // a locked free (ArenaPool, SizeClassPool): the block claimed, not yet filed
  ArenaRemoteFound,  // ArenaPool::push_remote: the record found lock-free, not yet claimed
  ArenaCacheFound,   // ArenaPool::try_deallocate_fast: the record found lock-free, not yet claimed
  ArenaCarveMarked,  // ArenaPool::carve_locked: the chunk marked taken, its rest not yet split off
};
extern std::atomic<void (*)(Seam)> g_seam_hook;
}  // namespace poolkeeper::detail

#define POOLKEEPER_SEAM(name)                                                                \
  do {                                                                                       \
    if (auto poolkeeper_seam_f = ::poolkeeper::detail::g_seam_hook.load(std::memory_order_acquire)) \
      poolkeeper_seam_f(::poolkeeper::detail::Seam::name);                                   \
  } while (0)
#else
#define POOLKEEPER_SEAM(name) \
  do {                        \
  } while (0)
#endif
