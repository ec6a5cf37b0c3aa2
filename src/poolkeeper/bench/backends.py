"""Backends: which upstream the pools of a benchmark run draw from.

- ``simulated``: the simulated device, calibrated on the H200 (each cudaMalloc/cudaFree is a
  busy-wait of the measured cost; addresses are fake, so GB-scale high-water marks cost nothing).
- ``host``: aligned host memory (real memory, no device latency).
- ``cuda``: the real device through the CUDA driver (``CudaDevice``).
- ``auto``: ``cuda`` when a CUDA device is present, otherwise ``simulated``.

Every arm run gets a fresh upstream, so call counters and peaks belong to that run alone.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from poolkeeper.bench.errors import UnknownNameError

BACKENDS = ("auto", "simulated", "host", "cuda")


def cuda_available() -> bool:
    try:
        from poolkeeper import _core

        return bool(_core.cuda_is_available())
    except Exception:
        return False


def resolve(backend: str) -> str:
    """``auto`` -> ``cuda`` or ``simulated``; any other valid name is returned as is."""
    if backend not in BACKENDS:
        raise UnknownNameError(f"unknown backend {backend!r} (valid: {', '.join(BACKENDS)})")
    if backend == "auto":
        return "cuda" if cuda_available() else "simulated"
    return backend


def upstream_factory(backend: str, latency_us: float | None = None) -> Callable[[], Any]:
    """A zero-argument factory for fresh upstreams of a resolved backend.

    ``latency_us`` overrides the simulated device's calibrated latency (tests use 0).
    """
    from poolkeeper.upstream import make_upstream

    if backend == "simulated":
        opts: Dict[str, Any] = {"latency": "h200"} if latency_us is None else {"latency_us": latency_us}
        return lambda: make_upstream("simulated", **opts)
    if backend == "host":
        return lambda: make_upstream("host")
    if backend == "cuda":
        from poolkeeper.errors import CudaUnavailableError

        if not cuda_available():
            raise CudaUnavailableError("backend 'cuda' needs a CUDA device; none found (use --backend simulated)")
        return lambda: make_upstream("device")
    raise UnknownNameError(f"backend {backend!r} has no upstream (resolve 'auto' first)")


def describe(backend: str, upstream: Any) -> Dict[str, Any]:
    """What a row records about its upstream (the simulated latency model, when there is one)."""
    out: Dict[str, Any] = {"upstream": getattr(upstream, "name", type(upstream).__name__)}
    model = getattr(upstream, "latency_model", None)
    if model is not None:
        out["latency_model"] = dict(model)
    return out


__all__ = ["BACKENDS", "resolve", "upstream_factory", "describe", "cuda_available"]
