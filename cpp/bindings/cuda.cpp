// CUDA bindings. Filled by the CUDA upstreams work; until then the device is reported absent.
#include "bindings.hpp"

namespace poolkeeper::py {

void bind_cuda(nb::module_& m) {
  m.def("cuda_is_available", []() { return false; }, "Is a CUDA driver with at least one device present?");
}

}  // namespace poolkeeper::py
