// The hook behind POOLKEEPER_SEAM (detail/test_seam.hpp); native test builds only.
#include "poolkeeper/detail/test_seam.hpp"

#ifdef POOLKEEPER_TEST_SEAMS
namespace poolkeeper::detail {
std::atomic<void (*)(Seam)> g_seam_hook{nullptr};
}  // namespace poolkeeper::detail
#endif
