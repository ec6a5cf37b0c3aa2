// poolkeeper._core: the hot path of poolkeeper. Everything else is Python.
#include "bindings.hpp"
#include "torch_factory.hpp"

#include <chrono>
#include <thread>

namespace poolkeeper::py {
std::atomic<bool> g_interpreter_exiting{false};
namespace {
std::thread::id g_exit_thread;  // written once before the flag is published (release/acquire)
}

bool interpreter_exiting() noexcept {
  // The thread running the exit hook goes on to finalize the interpreter and must keep working.
  return g_interpreter_exiting.load(std::memory_order_acquire) && std::this_thread::get_id() != g_exit_thread;
}

void park_forever() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}
}  // namespace poolkeeper::py

NB_MODULE(_core, m) {
  using namespace poolkeeper::py;
  m.doc() = "poolkeeper's native core: upstreams, pools, stream order, accounting, C ABI.";
  bind_errors(m);
  bind_upstreams(m);
  bind_pools(m);
  bind_cuda(m);
  bind_capi(m);
  bind_torch_factory(m);
  { void bind_faulty(nanobind::module_&); bind_faulty(m); }  // fault injection: cpp/bindings/faulty.cpp
  { void bind_upload_engine(nanobind::module_&); bind_upload_engine(m); }  // cpp/bindings/upload_engine.cpp
  { void bind_buffer_core(nanobind::module_&); bind_buffer_core(m); }  // cpp/bindings/buffer_core.cpp
  m.def("_begin_exit",
        []() {
          g_exit_thread = std::this_thread::get_id();
          g_interpreter_exiting.store(true, std::memory_order_release);
        },
        "Interpreter exit has begun: threads leaving a native call park instead of taking the GIL "
        "(called by poolkeeper._exit).");
}
