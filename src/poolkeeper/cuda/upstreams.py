"""CUDA upstreams: device memory, stream-ordered device memory, virtual-memory device memory and
pinned host memory.

Each is the native upstream itself (so pools call it without Python in between), usable under
every pool. The two device upstreams own real CUDA events for the pools' stream-ordered release:
a block freed on one stream reaches another stream only after an event recorded on the freeing
stream has completed.

All calls run in the device's *primary context* (the one PyTorch, CuPy and the CUDA runtime use),
made current for the call and then put back, so they never change the calling thread's current
device. Failures raise :class:`~poolkeeper.errors.UpstreamError` carrying the CUDA error's name
(``error_name``), or :class:`~poolkeeper.errors.OutOfMemoryError` once a pool's recovery fails;
without a driver or device, construction raises :class:`~poolkeeper.errors.CudaUnavailableError`.
"""
from __future__ import annotations

from typing import Any

from poolkeeper import _core
from poolkeeper.errors import CudaUnavailableError


def _unavailable(what: str, err: CudaUnavailableError) -> CudaUnavailableError:
    return CudaUnavailableError(f"{what} needs a CUDA driver and device: {err}")


class CudaDevice(_core.CudaDeviceUpstream):
    """Device memory from ``cuMemAlloc`` / ``cuMemFree`` (what ``cudaMalloc`` does).

    Each call costs tens to hundreds of microseconds and ``cuMemFree`` may synchronize the device,
    which is what pools over it avoid.

    Args:
        device: device index (default 0).
    """

    def __init__(self, device: int = 0) -> None:
        try:
            super().__init__(device)
        except CudaUnavailableError as e:
            raise _unavailable(f"CudaDevice(device={device})", e) from None

    def __repr__(self) -> str:
        return f"CudaDevice(device={self.device})"


class CudaAsync(_core.CudaAsyncUpstream):
    """Stream-ordered device memory: ``cuMemAllocAsync`` / ``cuMemFreeAsync`` on the device's
    default pool, ordered on ``stream``.

    With ``warm=True`` (default) it holds a handle on the warm-pool manager
    (:mod:`poolkeeper.cuda.warm`) for its lifetime: the default pool's release threshold is raised
    to the maximum while any handle lives, so memory stays in the pool across synchronizes, and
    restored (then the pool trimmed) when the last handle goes. ``warm=False`` leaves the pool as
    it is (the threshold-0 "cold" behaviour unless someone else raised it).

    Its release is *stream-ordered*: the driver reuses a freed block for work ordered after the
    free, without waiting for pending device work on other streams -- a weaker guarantee than the
    pools' event-based release.

    Args:
        device: device index (default 0).
        stream: the stream allocations and frees are ordered on: ``None`` (the legacy default
            stream, handle 0), an int handle, or a stream object (``__cuda_stream__``,
            ``.cuda_stream``, ``.ptr``).
        warm: keep the default pool warm while this upstream lives.
    """

    def __init__(self, device: int = 0, stream: Any = None, *, warm: bool = True) -> None:
        try:
            super().__init__(device, stream, warm)
        except CudaUnavailableError as e:
            raise _unavailable(f"CudaAsync(device={device})", e) from None

    def __repr__(self) -> str:
        return f"CudaAsync(device={self.device}, stream={self.stream:#x}, warm={self.warm})"


class CudaVirtual(_core.CudaVirtualUpstream):
    """Device memory through the driver's virtual memory management: ``reserve`` an address range
    (``cuMemAddressReserve``), ``map`` physical pieces onto it (``cuMemCreate`` pinned on the
    device + ``cuMemMap`` + ``cuMemSetAccess`` read/write) and ``unmap`` them again (``cuMemUnmap``
    + ``cuMemRelease``); ``unreserve`` is ``cuMemAddressFree``. What ``ArenaPool(expandable=True)``
    draws from on a GPU (docs/expandable.md). Each map counts as one upstream allocation and each
    unmap as one deallocation. ``allocate``/``deallocate`` also work (one reserved and mapped piece
    per block, sizes rounded up to ``vm_granularity``), so every pool can use it.

    Args:
        device: device index (default 0).

    Raises:
        CudaUnavailableError: no driver/device, or a driver or device without virtual memory
        management.
    """

    def __init__(self, device: int = 0) -> None:
        try:
            super().__init__(device)
        except CudaUnavailableError as e:
            raise _unavailable(f"CudaVirtual(device={device})", e) from None

    def __repr__(self) -> str:
        return f"CudaVirtual(device={self.device}, granularity={self.vm_granularity})"


class CudaPinned(_core.CudaPinnedUpstream):
    """Page-locked (pinned) host memory from ``cuMemHostAlloc`` (portable to every context) /
    ``cuMemFreeHost``. Kind ``"pinned"``: host-addressable, and copies from it run at full PCIe
    speed and can be asynchronous. Each call is expensive (milliseconds for MiBs), so pool it.

    Args:
        device: the device whose primary context makes the calls (default 0).
    """

    def __init__(self, device: int = 0) -> None:
        try:
            super().__init__(device)
        except CudaUnavailableError as e:
            raise _unavailable("CudaPinned()", e) from None

    def __repr__(self) -> str:
        return "CudaPinned()"


__all__ = ["CudaDevice", "CudaAsync", "CudaPinned", "CudaVirtual"]
