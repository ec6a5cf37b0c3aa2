// ReleaseGil and the interpreter-exit guard behind it.
//
// Why: at interpreter exit CPython (before 3.14) ends a daemon thread that tries to take the GIL
// back by unwinding it with pthread_exit. A thread inside a pool call takes the GIL back in a
// C++ destructor (nothrow), so that unwinding ends in std::terminate: the process aborted at exit
// whenever a daemon thread was inside allocate/deallocate. The guard below makes such a thread
// wait forever instead (the process is ending; it holds no pool lock by then), and makes sure no
// thread is caught between "not exiting yet" and holding the GIL when finalization starts.
#include <chrono>
#include <cstdio>
#include <thread>

#include "bindings.hpp"

namespace poolkeeper::py {

namespace {
std::atomic<bool> g_exiting{false};
// Threads past the exit check and not yet holding the GIL (ReleaseGil), or inside guarded Python
// work (GilFromAnyThread, exit_safe): begin_exit waits until there are none.
std::atomic<int> g_restoring{0};
std::atomic<unsigned long> g_exit_thread{0};
std::atomic<bool> g_exit_begun{false};  // begin_exit runs twice (the exit hook, then its own atexit entry)
// GilFromAnyThread guards this thread holds: its Python work is counted in g_restoring, so a
// ReleaseGil inside it (a release that takes a pool's slow path) must take the GIL back rather
// than park -- begin_exit is waiting for this thread to finish.
thread_local int t_guarded = 0;

[[noreturn]] void park_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// Runs as the first atexit callback to matter (registered when _core loads): the interpreter is
// still whole, only the exiting thread will run Python from here on.
void begin_exit() {
  if (g_exit_begun.exchange(true)) return;
  g_exit_thread.store(PyThread_get_thread_ident(), std::memory_order_relaxed);
  g_exiting.store(true, std::memory_order_seq_cst);
  // Let every thread already between its check and the GIL finish taking it, and every guarded
  // piece of Python work (a capture filter, a DLPack deleter) finish, so none is running Python
  // when finalization begins. Not bounded: such work cut off by finalization ends its thread by
  // CPython's forced unwind through ~GilFromAnyThread (a fatal error: an earlier 2 s bound let a
  // filter that took 3 s abort the exit). A wait longer than 2 s says what it waits for, so that
  // a filter or deleter that never returns is a diagnosable hang.
  PyThreadState* st = PyEval_SaveThread();
  const auto told = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  bool said = false;
  while (g_restoring.load(std::memory_order_seq_cst) != 0) {
    if (!said && std::chrono::steady_clock::now() >= told) {
      said = true;
      std::fputs("poolkeeper: interpreter exit is waiting for Python work on another thread to end "
                 "(a capture filter or a DLPack deleter)\n",
                 stderr);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  PyEval_RestoreThread(st);
}
}  // namespace

ReleaseGil::ReleaseGil() : state_(PyEval_SaveThread()) {}

ReleaseGil::~ReleaseGil() {
  // seq_cst pairs with begin_exit: either this thread sees g_exiting, or begin_exit sees it in
  // g_restoring and waits until it holds the GIL.
  g_restoring.fetch_add(1, std::memory_order_seq_cst);
  if (t_guarded == 0 && g_exiting.load(std::memory_order_seq_cst) &&
      PyThread_get_thread_ident() != g_exit_thread.load(std::memory_order_relaxed)) {
    g_restoring.fetch_sub(1, std::memory_order_seq_cst);
    park_forever();
  }
  PyEval_RestoreThread(state_);
  g_restoring.fetch_sub(1, std::memory_order_seq_cst);
}

namespace {
// Under g_restoring: exit has begun and this is not the exiting thread (it must not ask for the GIL).
bool exit_begun_elsewhere(bool& exiting) {
  exiting = g_exiting.load(std::memory_order_seq_cst);
  return exiting && PyThread_get_thread_ident() != g_exit_thread.load(std::memory_order_relaxed);
}
}  // namespace

// Counted in g_restoring until the Python work is done, not only until the GIL is held (as
// ReleaseGil is): that work may let the GIL go (a Python callback does every few milliseconds),
// and begin_exit taking it then would leave the work to be ended by finalization half-way (a
// DLPack deleter's release never ran: nanobind's leak report).
GilFromAnyThread::GilFromAnyThread() {
  g_restoring.fetch_add(1, std::memory_order_seq_cst);
  bool exiting = false;
  const bool elsewhere = exit_begun_elsewhere(exiting);
  // The exiting thread runs Python through finalization (as __del__ methods do) when it holds the
  // GIL; Py_IsInitialized() is false all that time. Not once the interpreter is gone (nanobind's
  // is_alive: a C++ static destroyed by exit(), such as a GraphPools the graph registry kept with
  // a Python filter; PyGILState_Check() says yes then and asking for the GIL segfaulted). Any other
  // thread only before exit begins.
  if (!elsewhere && (exiting ? nb::is_alive() && PyGILState_Check() != 0 : Py_IsInitialized() != 0)) {
    state_ = PyGILState_Ensure();
    held_ = true;
    ++t_guarded;
    return;
  }
  // What this thread would have released goes with the process: not a leak to report. Only in
  // that case: on the exiting thread a refusal would hide the program's real leaks.
  if (elsewhere) nb::set_leak_warnings(false);  // a plain bool nanobind reads at its cleanup
  g_restoring.fetch_sub(1, std::memory_order_seq_cst);
}

GilFromAnyThread::~GilFromAnyThread() {
  if (!held_) return;
  --t_guarded;
  PyGILState_Release(state_);
  g_restoring.fetch_sub(1, std::memory_order_seq_cst);
}

// The holder is nanobind's own shared_ptr: destroying it releases the Python reference, under
// the guard (a pool made in Python may run Python as it goes): on another thread once exit has
// begun, or once the interpreter is gone, the pool goes with the process instead.
std::shared_ptr<Pool> exit_safe(std::shared_ptr<Pool> pool) {
  if (!pool || !nb::find(pool.get()).is_valid()) return pool;
  Pool* raw = pool.get();
  auto* holder = new std::shared_ptr<Pool>(std::move(pool));
  return std::shared_ptr<Pool>(raw, [holder](Pool*) noexcept {
    if (GilFromAnyThread gil; gil) delete holder;
  });
}

void install_exit_guard(nb::module_& m) {
  m.def("_begin_exit", &begin_exit, "Interpreter exit: threads leaving a core call from now on wait instead.");
  nb::module_::import_("atexit").attr("register")(m.attr("_begin_exit"));
}

}  // namespace poolkeeper::py
