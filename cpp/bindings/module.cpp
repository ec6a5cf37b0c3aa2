// poolkeeper._core: the hot path of poolkeeper. Everything else is Python.
#include "bindings.hpp"
#include "torch_factory.hpp"

NB_MODULE(_core, m) {
  using namespace poolkeeper::py;
  m.doc() = "poolkeeper's native core: upstreams, pools, stream order, accounting, C ABI.";
  bind_errors(m);
  // The one reading of a stream argument (what every pool method does), for Python callers too.
  m.def("stream_handle", [](nanobind::handle s) { return stream_to_py(parse_stream(s)); },
        nanobind::arg("stream").none(),
        "The raw handle a pool uses for `stream` (None for no stream); InvalidStreamError otherwise.");
  bind_upstreams(m);
  bind_pools(m);
  bind_cuda(m);
  bind_capi(m);
  bind_graph_pools(m);
  bind_torch_factory(m);
  { void bind_faulty(nanobind::module_&); bind_faulty(m); }  // fault injection: cpp/bindings/faulty.cpp
  { void bind_logging(nanobind::module_&); bind_logging(m); }  // cpp/bindings/logging.cpp
  { void bind_upload_engine(nanobind::module_&); bind_upload_engine(m); }  // cpp/bindings/upload_engine.cpp
  { void bind_buffer_core(nanobind::module_&); bind_buffer_core(m); }  // cpp/bindings/buffer_core.cpp
  { void bind_buffer_protocol(nanobind::module_&); bind_buffer_protocol(m); }  // cpp/bindings/buffer_protocol.cpp
  { void bind_dlpack(nanobind::module_&); bind_dlpack(m); }  // cpp/bindings/dlpack.cpp
  { void bind_cupy_allocator(nanobind::module_&); bind_cupy_allocator(m); }  // cpp/bindings/cupy_allocator.cpp
}
