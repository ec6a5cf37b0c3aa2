// Pool bindings. allocate/deallocate first try the pool's non-blocking path while holding the GIL
// (no thread switch: a hit costs tens of nanoseconds, a locked reuse about a microsecond); only a
// request that would wait -- the pool lock held elsewhere, an upstream call of hundreds of
// microseconds, the device -- releases the GIL, since taking it back behind busy threads is slow.
#include <nanobind/stl/shared_ptr.h>

#include "bindings.hpp"
#include "options.hpp"
#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/pools/direct_pool.hpp"
#include "poolkeeper/pools/size_class_pool.hpp"

namespace poolkeeper::py {

void bind_pools(nb::module_& m) {
  {
    nb::list names;
    for (const char* k : expandable_options()) names.append(k);
    m.attr("EXPANDABLE_OPTIONS") = nb::tuple(names);
  }
  auto pool_cls = nb::class_<Pool>(m, "Pool", "A memory pool (abstract): see poolkeeper.pools for the documented classes.");
  pool_cls
      .def(
          "record_stream",
          [](Pool& p, nb::handle ptr, nb::handle stream) {
            p.check_not_forked();
            const auto a = parse_ptr(ptr);
            const Stream s = parse_stream(stream);
            if (s == kNoStream) throw InvalidArgument("record_stream needs a stream, not None", true);
            ReleaseGil nogil;
            p.record_stream(reinterpret_cast<void*>(a), s);
          },
          "ptr"_a.none(), "stream"_a.none())
      .def("stats",
           [](Pool& p) { return stats_to_dict(pool_call_nogil(p, [](Pool& q) { return q.stats(); })); })
      .def("reset_peaks", [](Pool& p) { pool_call_nogil(p, [](Pool& q) { q.reset_peaks(); }); },
           "Restart peak_reserved_bytes and peak_live_bytes from the current reserved and live bytes.")
      .def("validate", [](Pool& p) { pool_call_nogil(p, [](Pool& q) { q.validate(); }); })
      .def("trim", [](Pool& p) { return pool_call_nogil(p, [](Pool& q) { return q.trim(); }); })
      .def("process_pending", [](Pool& p) { return pool_call_nogil(p, [](Pool& q) { return q.process_pending(); }); })
      .def("synchronize", [](Pool& p) { pool_call_nogil(p, [](Pool& q) { q.synchronize(); }); })
      .def("close",
           [](Pool& p) {
             if (p.forked()) return;  // already closed (in a forked child): closing again is a no-op
             ReleaseGil nogil;
             p.close();
           })
      .def("_snapshot_dict",
           [](Pool& p) { return snapshot_to_dict(pool_call_nogil(p, [](Pool& q) { return q.snapshot(); })); })
      .def("owns", [](Pool& p, nb::handle ptr) {
             p.check_not_forked();
             return p.owns_live(parse_ptr(ptr));
           }, "ptr"_a.none())
      .def_prop_ro("closed", &Pool::closed)
      .def_prop_ro("upstream", [](Pool& p) { return p.upstream(); })
      .def_prop_ro("id", &Pool::id)
      .def_prop_ro("name", &Pool::name)
      .def_prop_ro("alignment", &Pool::alignment);

  install_fast_methods(pool_cls);
  install_exit_guard(m);
  m.def("_slow_allocate", &py_allocate, "pool"_a, "nbytes"_a.none(), "stream"_a.none() = nb::none(),
        "The nanobind-dispatched allocate, kept to measure what the raw descriptor saves.");
  m.def("_slow_deallocate", &py_deallocate, "pool"_a, "ptr"_a.none(), "stream"_a.none() = nb::none());

  nb::class_<DirectPool, Pool>(m, "DirectPool")
      .def("__init__", [](DirectPool* self, std::shared_ptr<Upstream> up, nb::handle opts) {
        new (self) DirectPool(std::move(up), direct_options(opts));
      }, "upstream"_a, "options"_a = nb::none());

  nb::class_<SizeClassPool, Pool>(m, "SizeClassPool")
      .def("__init__", [](SizeClassPool* self, std::shared_ptr<Upstream> up, nb::handle opts) {
        new (self) SizeClassPool(std::move(up), size_class_options(opts));
      }, "upstream"_a, "options"_a = nb::none())
      .def("release_cached",
           [](SizeClassPool& p) { return pool_call_nogil(p, [](SizeClassPool& q) { return q.release_cached(); }); })
      .def_static("class_size", &SizeClassPool::class_size_for, "nbytes"_a, "alignment"_a = 256,
                  "classes_per_doubling"_a = 4);

  nb::class_<ArenaPool, Pool>(m, "ArenaPool")
      .def("__init__", [](ArenaPool* self, std::shared_ptr<Upstream> up, nb::handle opts) {
        new (self) ArenaPool(std::move(up), arena_options(opts));
      }, "upstream"_a, "options"_a = nb::none())
      .def("shrink_scan", [](ArenaPool& p) { return pool_call_nogil(p, [](ArenaPool& q) { return q.shrink_scan(); }); },
           "Run one automatic shrink scan now; returns bytes released.")
      .def("flush_thread_cache", [](ArenaPool& p) { pool_call_nogil(p, [](ArenaPool& q) { q.flush_thread_cache(); }); },
           "Return the calling thread's cached blocks to the pool.")
      .def("_allocate_at",
           [](ArenaPool& p, nb::handle ptr, nb::handle n, nb::handle stream) {
             void* a = reinterpret_cast<void*>(parse_ptr(ptr));
             const std::size_t nbytes = parse_size(n);
             const Stream s = parse_stream(stream);
             void* r = pool_call_nogil(p, [&](ArenaPool& q) { return q.allocate_at(a, nbytes, s); });
             return keep_unless_interrupted(r, [&](void* q) { p.deallocate(q, s); });
           },
           "ptr"_a.none(), "nbytes"_a.none(), "stream"_a.none() = nb::none(),
           "Internal (CUDA-graph checkpoint restore): hand out exactly [ptr, ptr + nbytes), which must be free.");
}

}  // namespace poolkeeper::py
