// Bindings of the native upload engine (poolkeeper._core.UploadEngine); the documented Python
// entry point is poolkeeper.staging.Uploader(engine="native"). start() and wait() release the GIL:
// the whole upload runs on native threads while the Python caller polls wait() for progress.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.hpp"
#include "poolkeeper/staging/upload_engine.hpp"

namespace poolkeeper::py {

namespace {
CopyBackend parse_backend(const std::string& s) {
  if (s == "host") return CopyBackend::Host;
  if (s == "cuda") return CopyBackend::Cuda;
  throw InvalidArgument("backend must be 'host' or 'cuda'; got '" + s + "'");
}

nb::dict outcome_to_dict(const UploadOutcome& o) {
  const UploadCounters& c = o.counters;
  nb::list lost, per;
  for (auto i : o.lost) lost.append(i);
  for (auto b : o.buffer_bytes) per.append(b);
  return dict_of("chunks", c.chunks, "bytes", c.bytes, "overlapped_fills", c.overlapped_fills, "fill_ns", c.fill_ns,
                 "wait_ns", c.wait_ns, "enqueue_ns", c.enqueue_ns, "wall_ns", c.wall_ns, "first_enqueue_ns",
                 c.first_enqueue_ns, "last_start_ns", c.last_start_ns, "last_fill_end_ns", c.last_fill_end_ns,
                 "workers", c.workers, "nt_fill", c.nt_fill, "lost", lost, "buffer_bytes", per, "failed",
                 static_cast<bool>(o.error));
}
}  // namespace

void bind_upload_engine(nb::module_& m) {
  m.def("upload_ramp", &upload_ramp, "chunk"_a, "total"_a,
        "The ramp-up head of an upload's schedule (chunk sizes before the full chunks), as both engines follow it.");
  m.attr("UPLOAD_RAMP_MIN") = kUploadRampMin;
  m.def("stream_copy_isa", []() { return std::string(stream_copy_isa()); },
        "The non-temporal store ISA the engine's NT fill uses here ('avx2', 'sse2', or '' for memcpy).");
  m.def("stream_copy", [](std::uintptr_t dst, std::uintptr_t src, std::size_t n) {
    ReleaseGil nogil;
    stream_copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  }, "dst"_a, "src"_a, "nbytes"_a, "The engine's non-temporal copy, exposed for tests.");

  nb::class_<UploadEngine>(m, "UploadEngine")
      .def("__init__", [](UploadEngine* self, unsigned threads) {
        ReleaseGil nogil;
        new (self) UploadEngine(threads);
      }, "threads"_a)
      .def("start",
           [](UploadEngine& e, std::uintptr_t src, std::size_t nbytes, std::uintptr_t dst,
              const std::vector<std::pair<std::uintptr_t, std::size_t>>& buffers, std::size_t chunk, bool ramp,
              const std::string& backend, nb::handle stream, bool nt, long long fail_fill_at, long long fail_copy_at,
              long long fail_record_at, bool tail_ramp) {
             UploadRequest r;
             r.src = reinterpret_cast<const void*>(src);
             r.total = nbytes;
             r.dst = dst;
             for (auto& [p, cap] : buffers) r.buffers.push_back({reinterpret_cast<void*>(p), cap});
             r.chunk = chunk;
             r.ramp = ramp;
             r.tail_ramp = tail_ramp;
             r.nt_fill = nt;
             r.backend = parse_backend(backend);
             const Stream s = parse_stream(stream);
             r.stream = s == kNoStream ? 0 : static_cast<std::uintptr_t>(s);
             r.fail_fill_at = fail_fill_at;
             r.fail_copy_at = fail_copy_at;
             r.fail_record_at = fail_record_at;
             ReleaseGil nogil;
             e.start(std::move(r));
           },
           "src"_a, "nbytes"_a, "dst"_a, "buffers"_a, "chunk"_a, "ramp"_a = true, "backend"_a = "host",
           "stream"_a = nb::none(), "nt"_a = false, "fail_fill_at"_a = -1, "fail_copy_at"_a = -1,
           "fail_record_at"_a = -1, "tail_ramp"_a = false,
           "Start an upload and return at once. buffers: [(ptr, capacity)], at least 2.")
      .def("wait", [](UploadEngine& e, double timeout_s) {
        ReleaseGil nogil;
        return e.wait(timeout_s);
      }, "timeout_s"_a, "Wait up to timeout_s (negative: until finished); return the bytes landed so far.")
      .def_prop_ro("finished", &UploadEngine::finished)
      .def_prop_ro("bytes_done", &UploadEngine::bytes_done)
      .def_prop_ro("threads", &UploadEngine::threads)
      .def_prop_ro("uploads", &UploadEngine::uploads)
      .def_prop_ro("threads_created", &UploadEngine::threads_created)
      .def_prop_ro("closed", &UploadEngine::closed)
      .def("cancel", &UploadEngine::cancel)
      .def("result", [](const UploadEngine& e) { return outcome_to_dict(e.outcome()); },
           "Counters of the finished upload, 'lost' buffer indices and whether it failed.")
      .def("rethrow", [](const UploadEngine& e) {
        const UploadOutcome o = e.outcome();
        if (o.error) std::rethrow_exception(o.error);
      }, "Raise the finished upload's error (a typed poolkeeper error), if it failed.")
      .def("close", [](UploadEngine& e) {
        ReleaseGil nogil;
        e.close();
      }, "Cancel a running upload, wait for it, join the threads. Idempotent.");
}

}  // namespace poolkeeper::py

void bind_upload_engine(nanobind::module_& m) { poolkeeper::py::bind_upload_engine(m); }
