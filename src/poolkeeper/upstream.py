"""Upstreams: where a pool's backing memory comes from.

Every upstream counts its calls (``counters()``: allocations, deallocations, bytes, outstanding
bytes, cumulative ns). On a device the call count *is* the cost, and it carries no machine noise.

- :class:`Host`: aligned host memory.
- :class:`Simulated`: a fake device (never-touched addresses, calibrated latency, virtual streams
  and events), so CI tests device logic without a GPU.
- ``CudaDevice``, ``CudaAsync``, ``CudaPinned``, ``CudaVirtual``: the CUDA driver API, loaded at run time
  (see :mod:`poolkeeper.cuda`). Importing this module never needs CUDA.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from poolkeeper import _core

Upstream = _core.Upstream


class Host(_core.HostUpstream):
    """Aligned host memory from the C heap.

    It remembers its live allocations: a raw ``deallocate`` of a pointer it does not hold (unknown,
    already freed, inside a pool's block) or with another size is an ``UpstreamError`` and changes
    nothing.

    Args:
        alignment: power of two, at least the pointer size (default 256).
    """

    def __init__(self, alignment: int = 256) -> None:
        super().__init__(alignment)

    def __repr__(self) -> str:
        return f"Host(alignment={self.alignment})"


class Simulated(_core.SimulatedUpstream):
    """A simulated device for testing device logic without a GPU.

    Addresses come from a 1 TiB fake range of its own and are never touched, so a GB-scale high-water mark
    costs nothing; ``capacity`` (default 140 GiB, an H200) is enforced.

    Latency: ``latency="h200"`` (default) busy-waits the H200-calibrated cost of cudaMalloc /
    cudaFree (a pair costs 86.1 us + 0.787 us per MiB, fitted on a native C++ loop on an H200 host, see ``benchmarks/results/cuda_alloc_h200.txt``);
    ``latency_us=x`` makes every call cost ``x`` microseconds (``0`` for fast tests);
    ``latency="none"`` is the same as ``latency_us=0``. A request above the capacity fails before any
    latency is paid, and one call never busy-waits more than one second (``latency_us`` above
    ``1e6`` is refused), so a hostile size cannot hold a thread, or Ctrl-C, for long.

    The virtual device (deterministic, in microseconds):

    - ``stream()`` returns a new stream handle (an int); any int is accepted as a stream.
    - ``enqueue(stream, work_us)``: the stream is busy until ``max(now, busy) + work_us``.
    - ``record_event(stream)``: an event completing when the clock reaches the stream's busy time.
    - ``query_event(event)``, ``wait_event(event)``, ``advance(us)``, ``synchronize()``, ``now``.
    - ``destroy_stream(stream)``: as ``cuStreamDestroy``; work already enqueued still completes, but
      ``record_event``/``enqueue`` on it raise ``UpstreamError`` (``CUDA_ERROR_INVALID_HANDLE``), as the
      driver answers for a dead handle. ``events_recorded`` counts event records (all streams).

    Times must be finite and >= 0 (``InvalidArgumentError`` otherwise: a NaN or infinite time would
    never complete).
    """

    def __init__(
        self,
        latency: Optional[str] = "h200",
        latency_us: Optional[float] = None,
        capacity: Optional[int] = None,
        alignment: int = 256,
    ) -> None:
        super().__init__(latency, latency_us, capacity, alignment)

    def __repr__(self) -> str:
        m = self.latency_model
        return f"Simulated(alloc={m['alloc_base_us']:.1f}us+{m['alloc_per_mib_us']:.3f}us/MiB, capacity={self.capacity})"


# Upstreams by the name every entry point takes (``install(upstream=...)``, the Dask and Ray
# worker pools, ``poolkeeper bench --backend``, the C ABI factory): name -> class name here.
UPSTREAMS: Dict[str, str] = {
    "device": "CudaDevice",
    "async": "CudaAsync",
    "virtual": "CudaVirtual",
    "host": "Host",
    "simulated": "Simulated",
}
# The names that draw device memory from a GPU (the pool lands on a device).
CUDA_UPSTREAMS = ("device", "async", "virtual")


def make_upstream(name: str, device: int = 0, **options: Any) -> _core.Upstream:
    """A fresh upstream by name: ``"device"`` (:class:`CudaDevice`), ``"async"``
    (:class:`CudaAsync`), ``"virtual"`` (:class:`CudaVirtual`), ``"host"`` (:class:`Host`) or
    ``"simulated"`` (:class:`Simulated`). ``device`` applies to the CUDA ones; ``options`` go to
    the class (``latency_us=0`` for a fast simulated device, ``warm=False`` for ``"async"``).

    Raises :class:`~poolkeeper.errors.InvalidArgumentError` for an unknown name, a device that is
    not an ordinal, or an option the class does not take (or of the wrong type), and what the
    class raises (``CudaUnavailableError`` without a driver or device).
    """
    try:
        cls_name = UPSTREAMS[name]
    except (KeyError, TypeError):
        from poolkeeper.errors import InvalidArgumentError

        raise InvalidArgumentError(f"unknown upstream {name!r} (valid: {', '.join(UPSTREAMS)})") from None
    from poolkeeper.errors import InvalidArgumentError

    if name in CUDA_UPSTREAMS and (isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < 2**31):
        raise InvalidArgumentError(f"upstream {name!r}: device must be a CUDA ordinal (an int >= 0); got {device!r}")
    cls = globals()[cls_name] if cls_name in globals() else __getattr__(cls_name)
    try:
        return cls(device, **options) if name in CUDA_UPSTREAMS else cls(**options)
    except TypeError as e:  # an option the class does not take, or of the wrong type
        raise InvalidArgumentError(f"upstream {name!r}: {e}") from e


def __getattr__(name: str):
    # CUDA upstreams live in poolkeeper.cuda; resolved lazily so importing this module never
    # touches the driver.
    if name in ("CudaDevice", "CudaAsync", "CudaPinned", "CudaVirtual"):
        from poolkeeper.cuda import upstreams as _cu

        return getattr(_cu, name)
    if name == "Faulty":
        from poolkeeper.faulty import Faulty

        return Faulty
    raise AttributeError(f"module 'poolkeeper.upstream' has no attribute {name!r}")


__all__ = ["Upstream", "UPSTREAMS", "CUDA_UPSTREAMS", "make_upstream", "Host", "Simulated", "CudaDevice", "CudaAsync", "CudaPinned", "CudaVirtual", "Faulty"]
