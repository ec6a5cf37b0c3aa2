"""Reading device memory back in the GPU tests (what a block holds is checked by content)."""
from __future__ import annotations

import numpy as np

from poolkeeper.cuda import driver


def read(ptr: int, n: int) -> np.ndarray:
    """``n`` bytes at device address ``ptr``, copied to the host."""
    out = np.empty(n, np.uint8)
    driver.memcpy_dtoh(out.ctypes.data, ptr, n)
    return out
