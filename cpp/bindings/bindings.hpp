// Shared helpers of the nanobind module poolkeeper._core.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>

#include "poolkeeper/pool.hpp"

namespace poolkeeper::py {
namespace nb = nanobind;
using namespace nb::literals;

// Python argument conversion with typed poolkeeper errors (never a bare TypeError/OverflowError).
std::size_t parse_size(nb::handle h, const char* what = "nbytes");
std::uintptr_t parse_ptr(nb::handle h);
// None -> kNoStream; int; objects with __cuda_stream__ (CUDA stream protocol), .cuda_stream
// (torch.cuda.Stream) or .ptr (cupy.cuda.Stream).
Stream parse_stream(nb::handle h);
nb::object stream_to_py(Stream s);
nb::dict stats_to_dict(const PoolStats& st);
nb::dict snapshot_to_dict(const Snapshot& snap);
nb::dict upstream_counters_to_dict(const UpstreamCounters& c);

// Set the Python error for a caught C++ exception (our typed errors -> poolkeeper.errors).
void set_python_error(const std::exception_ptr& p);

// Set by poolkeeper's interpreter-exit hook (poolkeeper._exit), before Python finalizes.
extern std::atomic<bool> g_interpreter_exiting;
// True on any thread but the exiting one once the exit hook ran.
bool interpreter_exiting() noexcept;
[[noreturn]] void park_forever() noexcept;

// Releases the GIL around a blocking native call, like nb::gil_scoped_release, except that a
// thread finishing its call once the interpreter is exiting never takes the GIL back: it parks
// until the process ends. Why: during finalization CPython (3.11-3.13) ends a thread that asks
// for the GIL with pthread_exit, whose forced unwind through a destructor (noexcept) calls
// std::terminate -- a daemon thread inside a pool call at exit would abort the process.
class GilRelease {
 public:
  GilRelease() noexcept : state_(PyEval_SaveThread()) {}
  ~GilRelease() {
    if (interpreter_exiting()) park_forever();
    PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

void bind_errors(nb::module_& m);
void bind_upstreams(nb::module_& m);
void bind_pools(nb::module_& m);
// Replace Pool.allocate/deallocate with raw vectorcall descriptors (fast_methods.cpp).
void install_fast_methods(nb::handle pool_type);
void bind_cuda(nb::module_& m);
void bind_capi(nb::module_& m);

}  // namespace poolkeeper::py
