// The per-device pool factory behind the C ABI (used by the PyTorch integration).
#pragma once
#include "bindings.hpp"

namespace poolkeeper::py {
void bind_torch_factory(nb::module_& m);
}
