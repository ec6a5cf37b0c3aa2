"""GPU test helpers: a device writer that can be held back by the host.

``gate``: launches a kernel on a stream that first waits for a flag in pinned host memory, then
fills a block with a byte. While the gate is closed the kernel is provably still running (no
timing involved), so "a block still being written on stream A" is a fact the test controls. A
watchdog opens the gate after 60 s so a wrong wait can never hang the run. Needs CuPy (RawKernel);
without it, falls back to torch.cuda._sleep followed by a memset on the stream (timing-based, and
``gated`` is False so tests skip the checks that need a closed gate).
"""
from __future__ import annotations

import ctypes
import threading

import pytest

import poolkeeper as pk

GATE_SRC = r"""
extern "C" __global__ void gate_fill(unsigned char* p, unsigned long long n, unsigned char v, const volatile int* gate) {
  if (threadIdx.x == 0) {
    while (*gate == 0) { __nanosleep(1000); }
  }
  __syncthreads();
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = v;
}
"""


class _Proto:
    """A bare handle speaking the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class Gate:
    def __init__(self) -> None:
        self.pinned = pk.upstream.CudaPinned()
        self.flag = self.pinned.allocate(4096)
        self._set(0)
        self.gated = False
        try:
            import cupy
            import numpy as np

            self._cp, self._np = cupy, np
            self._kern = cupy.RawKernel(GATE_SRC, "gate_fill")
            if hasattr(self._kern, "compile"):
                self._kern.compile()  # surface compile errors here, not inside a test
            self.gated = True
        except Exception as e:  # pragma: no cover - depends on the machine
            self._why = repr(e)
            try:
                import torch

                self._torch = torch
            except Exception:
                pytest.skip(f"needs CuPy (RawKernel) or torch to run a slow writer: {self._why}")
        self._watchdog = threading.Timer(60.0, self.open)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _set(self, v: int) -> None:
        ctypes.c_int.from_address(self.flag).value = v

    def fill_after_gate(self, ptr: int, nbytes: int, value: int, stream: int) -> None:
        """Enqueue on ``stream``: wait for the gate, then fill [ptr, ptr+nbytes) with ``value``."""
        if self.gated:
            np = self._np
            cs = self._cp.cuda.Stream
            ext = cs.from_external(_Proto(stream)) if hasattr(cs, "from_external") else self._cp.cuda.ExternalStream(stream)
            with ext:
                self._kern((64,), (256,), (np.uint64(ptr), np.uint64(nbytes), np.uint8(value), np.uint64(self.flag)))
        else:  # pragma: no cover
            torch = self._torch
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                torch.cuda._sleep(2_000_000_000)  # ~1 s at H200 clocks
            pk.cuda.driver.memset_d8(ptr, value, nbytes, stream)

    def open(self) -> None:
        self._set(1)

    def close(self) -> None:
        self._watchdog.cancel()
        self.open()
        pk.cuda.driver.device_synchronize(0)
        self.pinned.deallocate(self.flag, 4096)


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.close()
