// LoggingPool binding: the RMM-CSV logging adaptor (cpp/include/poolkeeper/pools/logging_pool.hpp).
#include <nanobind/stl/shared_ptr.h>

#include "bindings.hpp"
#include "poolkeeper/pools/logging_pool.hpp"

namespace poolkeeper::py {

void bind_logging(nb::module_& m) {
  nb::class_<LoggingPool, Pool>(m, "LoggingPool")
      .def("__init__",
           [](LoggingPool* self, std::shared_ptr<Pool> inner, const std::string& path, nb::handle buffer_bytes) {
             const std::size_t cap = buffer_bytes.is_none() ? (std::size_t{1} << 20) : parse_size(buffer_bytes, "buffer_bytes");
             new (self) LoggingPool(std::move(inner), path, cap);
           },
           "inner"_a, "path"_a, "buffer_bytes"_a.none() = nb::none())
      .def("flush", [](LoggingPool& p) {
        pool_call_nogil(p, [](LoggingPool& q) { q.flush(); });  // not nb::gil_scoped_release: see ReleaseGil
      })
      .def_prop_ro("inner", [](LoggingPool& p) { return p.inner(); })
      .def_prop_ro("path", &LoggingPool::path)
      .def_prop_ro("events", [](LoggingPool& p) {
        p.check_not_forked();  // its lock may have been held at the fork
        return p.events();
      });
}

}  // namespace poolkeeper::py
void bind_logging(nanobind::module_& m) { poolkeeper::py::bind_logging(m); }
