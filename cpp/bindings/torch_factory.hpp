// The per-device pool factory behind the C ABI (used by the PyTorch integration).
#pragma once
#include "bindings.hpp"

namespace poolkeeper::py {
void bind_torch_factory(nb::module_& m);

// The one "upstream by name" of the C++ side: a new upstream of `name` for `device`
// ('device': CudaDevice, 'async': CudaAsync, 'virtual': CudaVirtual, 'simulated': a simulated
// device, for tests). Unknown names: InvalidArgument listing the valid ones. Bound to Python as
// _core.upstream_by_name.
std::shared_ptr<Upstream> upstream_by_name(const std::string& name, int device);
}
