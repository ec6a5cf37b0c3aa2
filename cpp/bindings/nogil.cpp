// ReleaseGil and the interpreter-exit guard behind it.
//
// Why: at interpreter exit CPython (before 3.14) ends a daemon thread that tries to take the GIL
// back by unwinding it with pthread_exit. A thread inside a pool call takes the GIL back in a
// C++ destructor (nothrow), so that unwinding ends in std::terminate: the process aborted at exit
// whenever a daemon thread was inside allocate/deallocate. The guard below makes such a thread
// wait forever instead (the process is ending; it holds no pool lock by then), and makes sure no
// thread is caught between "not exiting yet" and holding the GIL when finalization starts.
#include <pthread.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "bindings.hpp"

namespace poolkeeper::py {

namespace {
// Exit happens in two phases (begin_exit). While it *waits* (g_exiting set), guarded Python work
// another thread began before (GilFromAnyThread: a capture filter, a DLPack deleter) runs to its
// end, new guarded work on other threads is refused, and threads leaving a pool call take the
// GIL as usual: such a thread may hold a Python lock that the guarded work waits for, so parking
// it then hung the exit. Once that work is done it *parks* (g_parking set): from then on a thread
// leaving a pool call, other than the exiting one, waits forever instead of asking for the GIL.
std::atomic<bool> g_exiting{false};
std::atomic<bool> g_parking{false};
// Guarded Python work under way (GilFromAnyThread): begin_exit waits until there is none.
std::atomic<int> g_guarded{0};
// Threads past the parking check and not yet holding the GIL (ReleaseGil): begin_exit waits, after
// setting g_parking, until there are none, so no thread is inside PyEval_RestoreThread when
// finalization begins.
std::atomic<int> g_restoring{0};
std::atomic<unsigned long> g_exit_thread{0};
std::atomic<bool> g_exit_begun{false};  // begin_exit runs twice (the exit hook, then its own atexit entry)
// A thread other than the exiting one refused Python work once exit had begun: what it would have
// released goes with the process. Applied to nanobind's leak report by at_exit_last, not here:
// after finalization nanobind's internals are freed, and its flag with them.
std::atomic<bool> g_refused{false};
// A forked child whose fork did not go through os.fork() (a native thread's fork, or a C library's
// fork called from Python): CPython's own after-fork work never runs there, so the GIL may belong
// to a thread that did not survive the fork, and asking for it waits forever (a consumer's DLPack
// free in such a child hung while a Python thread had held the GIL at the fork). Python work is
// refused there for good.
std::atomic<bool> g_python_unusable{false};
// The thread inside os.fork() (or a C extension's PyOS_BeforeFork/PyOS_AfterFork pair) between its
// before hook and its after hook, 0 otherwise. Those hooks run only around forks CPython follows
// with its own after-fork work, so a child forked by any other thread is one Python cannot run in.
// (Not PyGILState_Check(): it is forced to 1 for good once a subinterpreter exists, and says 0
// for a thread whose state PyThreadState_New made, though os.fork() is whole there.)
std::atomic<unsigned long> g_python_forking{0};
// GilFromAnyThread guards this thread holds: begin_exit is waiting for this thread to finish, so
// a ReleaseGil inside it (a release that takes a pool's slow path) takes the GIL back, never parks.
thread_local int t_guarded = 0;

[[noreturn]] void park_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// Sleeps until `count` is 0, the GIL let go. Not bounded: Python work cut off by finalization
// ends its thread by CPython's forced unwind through ~GilFromAnyThread (a fatal error: an earlier
// 2 s bound let a filter that took 3 s abort the exit). A wait longer than 2 s says what it waits
// for, so that a filter or deleter that never returns is a hang one can diagnose.
void wait_until_none(const std::atomic<int>& count, const char* what) {
  const auto told = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  bool said = false;
  while (count.load(std::memory_order_seq_cst) != 0) {
    if (!said && std::chrono::steady_clock::now() >= told) {
      said = true;
      std::fprintf(stderr, "poolkeeper: interpreter exit is waiting for %s on another thread to end\n", what);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Runs as the first atexit callback to matter (registered when _core loads): the interpreter is
// still whole, only the exiting thread will run Python from here on.
void begin_exit() {
  if (g_exit_begun.exchange(true)) return;
  g_exit_thread.store(PyThread_get_thread_ident(), std::memory_order_relaxed);
  g_exiting.store(true, std::memory_order_seq_cst);
  PyThreadState* st = PyEval_SaveThread();
  wait_until_none(g_guarded, "Python work (a capture filter or a DLPack deleter)");
  // seq_cst pairs with ~ReleaseGil: either that thread sees g_parking, or this sees it counted.
  g_parking.store(true, std::memory_order_seq_cst);
  wait_until_none(g_restoring, "a thread taking the GIL back");
  PyEval_RestoreThread(st);
}

// In a forked child only the forking thread exists: nothing else is counted any more (a count
// inherited from a thread that did not survive the fork hung the child's exit forever).
// A child forked while the parent exits is, nearly always, a fresh process doing work: a worker
// that a daemon thread's multiprocessing pool refills, or one an exit handler starts on the
// exiting thread itself. Its threads must neither park nor be refused Python work (they parked
// their first pool call, and every filter was refused, before). So the child never inherits the
// waiting or parking phase. Forked by the exiting thread it keeps only "exit has begun" and that
// thread: should the child go on through the exit (a bare fork inside an exit handler), guarded
// work it refuses during its finalization is left to the process, not reported as leaked.
void after_fork_in_child() {
  if (g_python_forking.load(std::memory_order_seq_cst) != PyThread_get_thread_ident())
    g_python_unusable.store(true, std::memory_order_seq_cst);
  g_python_forking.store(0, std::memory_order_seq_cst);
  g_guarded.store(t_guarded, std::memory_order_seq_cst);
  g_restoring.store(0, std::memory_order_seq_cst);
  if (!g_exit_begun.load(std::memory_order_seq_cst)) return;
  g_parking.store(false, std::memory_order_seq_cst);
  g_exiting.store(false, std::memory_order_seq_cst);
  forget_filters_undone_in_child();
  if (PyThread_get_thread_ident() != g_exit_thread.load(std::memory_order_relaxed)) {
    g_exit_thread.store(0, std::memory_order_relaxed);
    g_refused.store(false, std::memory_order_seq_cst);
    g_exit_begun.store(false, std::memory_order_seq_cst);
  }
}

// The last thing before nanobind's own cleanup (Py_AtExit callbacks run last registered first, and
// nanobind registered its own before this module's body ran): the interpreter is finalized, so an
// export whose deleter has not run by now is held by a consumer that may free after the process
// ends -- its buffer outlives the interpreter on purpose -- and a refusal left its object to the
// process. Neither is a leak to report. (A capsule the program itself leaked looks the same
// here and turns the report off too: documented in docs/hardening.md.)
void at_exit_last() {
  if (g_refused.load(std::memory_order_seq_cst) || dlpack_exports_left() > 0) nb::set_leak_warnings(false);
}
}  // namespace

ReleaseGil::ReleaseGil() : state_(PyEval_SaveThread()) {}

ReleaseGil::~ReleaseGil() {
  g_restoring.fetch_add(1, std::memory_order_seq_cst);
  if (t_guarded == 0 && g_parking.load(std::memory_order_seq_cst) &&
      PyThread_get_thread_ident() != g_exit_thread.load(std::memory_order_relaxed)) {
    g_restoring.fetch_sub(1, std::memory_order_seq_cst);
    park_forever();
  }
  PyEval_RestoreThread(state_);
  g_restoring.fetch_sub(1, std::memory_order_seq_cst);
}

// Counted in g_guarded until the Python work is done, not only until the GIL is held (as
// ReleaseGil is): that work may let the GIL go (a Python callback does every few milliseconds),
// and begin_exit taking it then would leave the work to be ended by finalization half-way (a
// DLPack deleter's release never ran: nanobind's leak report).
GilFromAnyThread::GilFromAnyThread() {
  g_guarded.fetch_add(1, std::memory_order_seq_cst);
  // seq_cst pairs with begin_exit: either this thread sees g_exiting, or begin_exit sees it counted.
  const bool exiting = g_exiting.load(std::memory_order_seq_cst);
  const bool elsewhere = exiting && PyThread_get_thread_ident() != g_exit_thread.load(std::memory_order_relaxed);
  // The exiting thread runs Python through finalization (as __del__ methods do) when it holds the
  // GIL (and takes it while Py_IsInitialized() holds: an exit handler's call into a C library
  // that let it go); Py_IsInitialized() is false through finalization. Not once the interpreter is gone (nanobind's
  // is_alive: a C++ static destroyed by exit(); PyGILState_Check() says yes then and asking for
  // the GIL segfaulted). Any other thread only before exit begins.
  const bool usable = !elsewhere && !g_python_unusable.load(std::memory_order_seq_cst);
  if (usable && (exiting ? nb::is_alive() && (PyGILState_Check() != 0 || Py_IsInitialized() != 0)
                         : Py_IsInitialized() != 0)) {
    state_ = PyGILState_Ensure();
    held_ = true;
    ++t_guarded;
    return;
  }
  // What this thread would have released goes with the process: not a leak to report. (The
  // exiting thread is refused only without the GIL during finalization -- a C library's free
  // that let it go -- or once the interpreter is gone; any thread in a child whose fork did not
  // go through os.fork().)
  if (exiting || g_exit_begun.load(std::memory_order_seq_cst)) g_refused.store(true, std::memory_order_seq_cst);
  g_guarded.fetch_sub(1, std::memory_order_seq_cst);
}

GilFromAnyThread::~GilFromAnyThread() {
  if (!held_) return;
  --t_guarded;
  PyGILState_Release(state_);
  g_guarded.fetch_sub(1, std::memory_order_seq_cst);
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
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
  // Python's own at-fork hooks, which os.fork() runs around its fork() (and the GIL serializes):
  // after_fork_in_child, which runs between them, tells such a fork from any other.
  m.def("_python_fork_begins", [] { g_python_forking.store(PyThread_get_thread_ident(), std::memory_order_seq_cst); },
        "os.register_at_fork's before hook: the calling thread is about to fork through os.fork().");
  m.def("_python_fork_ends", [] { g_python_forking.store(0, std::memory_order_seq_cst); },
        "os.register_at_fork's after hooks: the fork through os.fork() is over.");
  nb::module_::import_("os").attr("register_at_fork")("before"_a = m.attr("_python_fork_begins"),
                                                      "after_in_parent"_a = m.attr("_python_fork_ends"),
                                                      "after_in_child"_a = m.attr("_python_fork_ends"));
  Py_AtExit(at_exit_last);
}

}  // namespace poolkeeper::py
